# syntax=docker/dockerfile:1
# triton-sidecar image: the package and its runtime dependencies in a venv, nothing else.
#   docker build -t triton-sidecar:dev .
# Pin PYTHON_IMAGE and RUST_IMAGE by digest in CI (python:3.11-slim@sha256:...) for reproducible builds.
ARG PYTHON_IMAGE=python:3.11-slim
# The data plane (dataplane/, a PyO3 crate) is compiled in the builder: the toolchain comes from the
# official Rust image and stays behind with the builder. rust-version in dataplane/Cargo.toml: 1.85.
ARG RUST_IMAGE=rust:1-slim-bookworm

FROM ${RUST_IMAGE} AS rust

# --- builder: resolve, compile and install into /opt/venv; compilers and pip stay behind in this stage.
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:$PATH
COPY --from=rust /usr/local/rustup /usr/local/rustup
COPY --from=rust /usr/local/cargo /usr/local/cargo
# rustc links with the system's C linker, which the slim Python image does not have.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Only what the wheel is built from (see .dockerignore for what never enters the context).
COPY pyproject.toml README.md ./
COPY sidecar/ sidecar/
COPY dataplane/ dataplane/
# A venv without pip of its own; the builder's pip installs into it (maturin, fetched by pip for the
# build only, compiles sidecar._dataplane in release mode and packs it into the wheel). No extras: `test` and
# `triton` (the 370 MB nvidia-pytriton server build) are for development, not for the pod.
# pip compiles the .pyc files here, so the read-only container never needs to write them.
RUN python -m venv --without-pip /opt/venv \
 && pip --python /opt/venv/bin/python install --no-cache-dir . \
 && /opt/venv/bin/triton-sidecar --help > /dev/null

# --- runtime: the same Python base (the venv's interpreter symlinks resolve), plus the venv.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="triton-sidecar" \
      org.opencontainers.image.description="Semantic health checks, self-healing and a guarding proxy for NVIDIA Triton Inference Server" \
      org.opencontainers.image.licenses="Apache-2.0"
# Nothing writes at run time (readOnlyRootFilesystem: true in k8s/base/deployment.yaml).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=builder /opt/venv /opt/venv
# Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd (65532: "nonroot").
USER 65532:65532
# /healthz, /readyz, /status, /metrics and the proxied Triton v2 HTTP API.
EXPOSE 8080
# The sidecar handles SIGTERM itself (fail readiness, drain, exit), so it runs as PID 1 directly.
ENTRYPOINT ["triton-sidecar"]
CMD ["run", "--config", "/etc/triton-sidecar/sidecar.yaml"]
