"""The sidecar's one configuration tree: defaults, YAML file, environment overrides, JSON Schema check.

Loaded and validated once at start-up (`load_config`); everything after that reads frozen dataclasses.
A bad value stops the start with one line naming the file and key (`ConfigError`).
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from sidecar.messages import short_message

ENV_PREFIX = "SIDECAR_"


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file or variable and the key."""


@dataclass(frozen=True)
class TritonSection:
    #: Triton's HTTP endpoint inside the pod (loopback: its ports never leave the pod).
    url: str = "http://127.0.0.1:8000"
    #: Triton's gRPC endpoint inside the pod (host:port, loopback), for the gRPC front and heals'
    #: loads and unloads (a load over HTTP stalls the connections sharing its worker in Triton).
    grpc_url: str = "127.0.0.1:8001"
    #: Upper bound (s) on one metadata/repository call; probes have their own, shorter bound.
    timeout_s: float = 5.0
    #: Triton's metrics endpoint, re-exported on /metrics when `metrics.include_triton` is on.
    metrics_url: str = "http://127.0.0.1:8002/metrics"
    #: Header name Triton demands on the repository API (`--http-restricted-api`); "" = none.
    repository_header: str = ""
    #: Its value; pass it through SIDECAR_TRITON_REPOSITORY_TOKEN from a Secret, not the file.
    repository_token: str = field(default="", repr=False)


#: The event loops `listen.event_loop` may name.
EVENT_LOOPS = ("uvloop", "asyncio")

#: What may serve listen.port (`listen.front`): the Python listener, or the data plane's Rust front.
FRONTS = ("python", "rust")


@dataclass(frozen=True)
class ListenSection:
    host: str = "0.0.0.0"  # noqa: S104 - the pod's one exposed port
    port: int = 8080
    #: The KServe v2 gRPC service (and grpc.health.v1) for clients; 0 = no gRPC front.
    grpc_port: int = 8081
    #: Answer POST .../infer on the httptools path (sidecar/http_listener.py), a fraction of aiohttp's
    #: CPU per request; off = every request through aiohttp (same answers; kept as an escape hatch).
    fast_infer: bool = True
    #: The event loop the sidecar serves on: "uvloop" (libuv; the bare wire costs 30-40 % less CPU per
    #: proxied request than on asyncio's own loop, the whole sidecar up to 18 % less, bench/RESULTS.md
    #: §1f) or "asyncio" (the standard library's; an escape hatch, same answers). With TLS on the
    #: Python front the sidecar serves on asyncio's loop whatever this says (sidecar/cli/run.py:
    #: event_loop_of).
    event_loop: str = "uvloop"
    #: What serves listen.port: "rust" (the data plane's front, sidecar/fronts/http_front.py: infer,
    #: generate and streams to a trusted model and the health endpoints served without Python,
    #: everything else handed to the Python listener behind it on loopback; the default since the
    #: whole suite passes against it) or "python" (the httptools listener and aiohttp alone,
    #: sidecar/fronts/http_listener.py; an escape hatch until it is deleted). Either terminates TLS
    #: (tls.*): the Rust front with rustls, the same files, rotation, mutual TLS and
    #: handshake-failure reasons.
    front: str = "rust"
    #: What serves listen.grpc_port: "rust" (the data plane's gRPC front on the HTTP front's runtime,
    #: the default since 2026-12-07: every call it does not answer itself passed through to the grpcio
    #: server behind it on loopback) or "python" (grpcio alone, sidecar/fronts/grpc_server.py, the
    #: escape hatch until grpcio is gone). rust needs listen.front: rust; with listen.front: python
    #: and no grpc_front written, grpcio serves the port.
    grpc_front: str = "rust"
    #: Threads of the Rust front's runtime (listen.front: rust). 1 serves a few thousand requests a
    #: second on one core (Envoy's --concurrency 1); raise it only with the pod's CPU limit above
    #: 2 cores, since Triton shares them.
    workers: int = 1
    #: > 0: a plaintext port serving only /healthz, /readyz and /metrics. With TLS (and above all
    #: mutual TLS) on, the kubelet and Prometheus cannot present a client certificate; 0 = none.
    probe_port: int = 0
    #: Bound (s) on receiving one request's line and headers, from its first byte (or from the
    #: connection's start): a kubelet or a client sends them in one packet; 10 s is generous for a slow
    #: link and closes a slowloris client that trickles them to hold a descriptor.
    header_timeout_s: float = 10.0
    #: An idle keep-alive connection is closed after this (s): nginx's and aiohttp's 75 s, longer than
    #: the 60 s idle timeout of the common load balancers, so they close first and never race a close.
    keepalive_timeout_s: float = 75.0
    #: Longest request target (bytes), refused with 414; aiohttp's max_line_size.
    max_url_bytes: int = 8190
    #: Largest sum of header names and values (bytes) of one request, refused with 431; nginx's
    #: 4 x 8 KiB large_client_header_buffers.
    max_header_bytes: int = 32768
    #: Most header fields in one request, refused with 431; aiohttp's max_headers.
    max_headers: int = 128
    #: Open client connections on listen.port at once (and, counted apart, on listen.grpc_port); one
    #: more is accepted and closed at once (counted): bounds the descriptors and memory clients can
    #: hold. Keep twice it under the pod's descriptor limit minus what the upstream pools use.
    max_connections: int = 4096
    #: After an early refusal (413, 408, 400, 431) the answer is written, the write side half-closed
    #: and the rest of the request read and thrown away, so the kernel does not reset the
    #: connection and drop the answer before the client (one that writes its whole body before
    #: reading) has read it. Lingering ends when the client closes, when the declared body has been
    #: read, or after these bounds: nginx's lingering_time 30 s and lingering_timeout 5 s...
    lingering_time_s: float = 30.0
    lingering_timeout_s: float = 5.0
    #: ...and a byte cap (twice the default validation.max_body_bytes), past which the connection is
    #: closed even if the client is still sending.
    lingering_max_bytes: int = 128 * 1024 * 1024
    #: gRPC (HTTP/2) limits, read once at start: concurrent streams (calls) one connection may
    #: have open; more wait in the client (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS, 100 as in the RFC's advice).
    grpc_max_concurrent_streams: int = 100
    #: Keepalive enforcement: a client that pings more often than this (s) is sent GOAWAY
    #: (ENHANCE_YOUR_CALM) after two strikes; gRPC's own default of 5 minutes.
    grpc_min_ping_interval_s: float = 300.0
    #: A gRPC connection with no call for this long (s) is sent GOAWAY; clients reconnect on their
    #: next call. 0 = never.
    grpc_max_connection_idle_s: float = 300.0
    #: A gRPC connection older than this (s) is sent GOAWAY, its calls get proxy.upstream_timeout_s to
    #: finish, so clients behind an L4 balancer spread over new pods. 0 = never.
    grpc_max_connection_age_s: float = 0.0


#: The TLS versions `tls.min_version` may name; 1.0 and 1.1 are deprecated (RFC 8996).
TLS_VERSIONS = ("1.2", "1.3")


@dataclass(frozen=True)
class TlsSection:
    """TLS on listen.port and listen.grpc_port (sidecar/fronts/tls.py); the files are watched and a
    new pair serves new connections within about a second (cert-manager renews in place)."""

    #: PEM certificate chain, server certificate first; with key_file set, TLS is on.
    cert_file: str = ""
    #: PEM private key of that certificate (unencrypted: nobody is there to type a passphrase).
    key_file: str = ""
    #: PEM CA bundle; set, every client must present a certificate it signed (mutual TLS).
    client_ca_file: str = ""
    #: DNS or URI subject alternative names a client certificate must carry one of; empty = any
    #: certificate client_ca_file signed.
    client_allowed_sans: tuple[str, ...] = ()
    #: Lowest TLS version accepted on the HTTP port ("1.2" or "1.3"); 1.2 because many clients
    #: (Java 8, older Go, curl on old distributions) still stop there.
    min_version: str = "1.2"

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file and self.key_file)


@dataclass(frozen=True)
class ProbesSection:
    #: Seconds between two probe rounds of one model. A failed round is confirmed at once (a few ms
    #: later), so detection takes up to interval_s to the first failed round + failure_threshold rounds.
    interval_s: float = 5.0
    #: Bound (s) on each probe call; a hung model fails its probe after this, never blocks others.
    timeout_s: float = 2.0
    #: Consecutive failed rounds before a model is UNHEALTHY (fewer leave it DEGRADED).
    failure_threshold: int = 3
    #: Consecutive passed rounds before a DEGRADED model is HEALTHY again.
    success_threshold: int = 1
    #: Each wait is interval_s * (1 ± jitter) so models are not probed in lockstep.
    jitter: float = 0.1
    #: A guarded model without golden files is probed by readiness and metadata only; on, it also
    #: keeps /readyz at 503 (off by default: a model discovered in Triton may have no files yet).
    require_golden: bool = False
    #: Besides the time schedule, start a model's round as soon as it has served this many live
    #: requests since its last round began (0: off, rounds by time only). It bounds a silent fault
    #: (finite but wrong answers) in requests rather than seconds, whatever the load; it costs one
    #: golden inference per case per N live requests (Triton's load x (1 + cases/N)).
    every_requests: int = 0
    #: Floor (s) between the starts of two traffic-paced rounds of one model: under any load a model
    #: gets at most 1/min_interval_s rounds a second from its traffic (20 with 0.05 s), which bounds
    #: what the probes take from Triton. Confirmations and the time schedule do not wait for it.
    min_interval_s: float = 0.05


@dataclass(frozen=True)
class HealingSection:
    enabled: bool = True
    #: Heal attempts per episode before the model is FAILED (and /healthz fails).
    max_attempts: int = 3
    #: Wait (s) before the second attempt; doubled each time up to backoff_max_s.
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    #: Unload is asynchronous in Triton: how long (s) to poll until the model is really gone before
    #: loading anyway. A healthy instance is gone in 1-2 s; one whose stub died or hangs never is
    #: (Triton 2.51), so this bounds the heal time for exactly the faults that need healing.
    unload_timeout_s: float = 10.0
    #: How long (s) a load may take until the model is ready; size it for the slowest model.
    load_timeout_s: float = 120.0
    #: Models healed at the same time; each reload competes for the pod's CPU and memory.
    max_concurrent: int = 2
    #: Flapping guard: more than flap_max_heals successful heals within flap_window_s means the
    #: fault comes back whatever we do, so the model goes FAILED instead of reloading forever.
    flap_window_s: float = 3600.0
    flap_max_heals: int = 5
    #: Regular expressions (case-insensitive) of Triton error text that names a fault of Triton's process,
    #: not of one model, added to the sticky CUDA errors built in
    #: (sidecar.protocol.triton_errors.STICKY_CUDA_ERRORS): such a failure restarts Triton at once.
    process_fault_patterns: tuple[str, ...] = ()
    #: Guarded models failing within one probe interval with the same Triton error (an error answer or
    #: no answer) that make the fault the process's: restart at once instead of reloading each. Two
    #: models broken the same way at the same moment are rarely two faults of their own.
    process_fault_min_models: int = 2
    #: After an escalation to a restart, another one within this many seconds (s) needs the same
    #: evidence (the same sticky error, the same shared error); other evidence goes the reload ladder.
    #: 1800 s covers a restart and a reload of large models, so weaker evidence cannot restart a pod
    #: in a loop.
    escalation_cooldown_s: float = 1800.0
    #: JSON file that keeps the escalations across the sidecar's own restarts: on an emptyDir, which
    #: lives as long as the pod, so /status and the metric count restarts that did not help. "" keeps
    #: them in memory (lost with the process, and with them the cooldown).
    escalation_record_file: str = ""


@dataclass(frozen=True)
class LivenessSection:
    #: Triton unreachable or not live for longer than this (s) fails /healthz: a restart may fix it.
    triton_unreachable_grace_s: float = 30.0
    #: A model's supervisor (or the Triton watch) that completed no round for this long (s) fails
    #: /healthz naming it: the sidecar itself is stuck or crashing; a restart is the remedy.
    watchdog_stall_s: float = 60.0


@dataclass(frozen=True)
class LifecycleSection:
    #: After SIGTERM, how long (s) to let in-flight requests and heals finish before exiting.
    drain_s: float = 10.0


@dataclass(frozen=True)
class ValidationSection:
    #: Largest request body (bytes); refused with 413 while it streams in, never buffered whole.
    max_body_bytes: int = 64 * 1024 * 1024
    #: Largest number of tensor elements in one request, all inputs together.
    max_elements: int = 4_000_000
    #: Longest BYTES element (bytes).
    max_bytes_element: int = 1024 * 1024
    #: NaN and ±Inf in FP16/FP32/FP64 inputs are refused with 400.
    reject_non_finite: bool = True
    #: Model name -> JSON Schema file (Draft 2020-12) with business rules for its requests.
    schemas: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FilterRule:
    #: Regular expression matched against the whole model name.
    model: str
    #: Output names or regular expressions (whole-name match) that never leave the pod.
    drop_outputs: tuple[str, ...]


@dataclass(frozen=True)
class FilteringSection:
    rules: tuple[FilterRule, ...] = ()


@dataclass(frozen=True)
class ProxySection:
    #: Requests one model may have at Triton at once; more wait in the queue below.
    max_in_flight_per_model: int = 64
    #: Requests that may wait for a slot; past that the proxy answers 503 instead of piling up.
    queue_size_per_model: int = 256
    #: Bound (s) on one proxied request to Triton; past it the client gets 504.
    upstream_timeout_s: float = 30.0
    #: Bound (s) on opening a connection to Triton.
    connect_timeout_s: float = 1.0
    #: Hold requests to a healing model up to this long (s) instead of answering 503 at once.
    hold_during_heal_s: float = 0.0
    #: While a failed golden round is being confirmed (the model is suspect: the round after a failed
    #: one runs at once), hold new requests to the model up to this long (ms), then serve or refuse
    #: them by the confirmation's verdict. 0 serves them at once: a drifted model's wrong answers
    #: reach clients until the confirmation quarantines it (a few ms of probes, plus the hold's cost
    #: to healthy traffic when probes are flaky). A confirmation of a small model takes ~3-20 ms.
    hold_while_suspect_ms: float = 0.0
    #: An answer with NaN/Inf where the golden expectations hold none becomes a 502.
    block_non_finite_outputs: bool = True
    #: Proxy Triton's statistics endpoints (read-only: perf_analyzer and Triton's client examples read
    #: them); false denies them (403 / PERMISSION_DENIED): they reveal model names and load.
    allow_statistics: bool = True
    #: Consecutive 5xx answers from Triton for a model that trigger an immediate probe.
    passive_failure_threshold: int = 3
    #: Retry-After (s) sent with 503s for quarantined models.
    retry_after_s: int = 5
    #: Bound (s) on receiving one request body; a client that trickles it slower gets 408.
    client_body_timeout_s: float = 30.0
    #: An unpinned request whose version is quarantined is served by another trusted loaded version
    #: of the same model (counted as `fallback`) instead of a 503: an older answer the golden cases
    #: still vouch for beats none. Off: unpinned requests get the 503 of the version they reach.
    version_fallback: bool = True
    #: Shadow calls (a rollout's compared answers) in flight at once, for the whole sidecar; more are
    #: dropped and counted: comparing is worth less than the traffic it would slow down.
    max_shadow_in_flight: int = 16


#: Names a generate request uses for "how many tokens to produce": as an input or as a parameter,
#: their value is held to `generation.max_tokens` (TensorRT-LLM: max_tokens, vLLM and TGI style
#: servers: max_tokens / max_new_tokens).
DEFAULT_TOKEN_LIMIT_KEYS = ("max_tokens", "max_new_tokens", "max_output_tokens")


#: Request parameters the common LLM backends read (vLLM, TensorRT-LLM, python models); any other key
#: that is not one of the model's inputs is refused: a typo (`temprature`) would otherwise be ignored
#: by Triton and the client would never know its setting had no effect.
DEFAULT_GENERATE_PARAMETERS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "random_seed", "stream", "stop", "stop_words",
    "bad_words", "end_id", "pad_id", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "length_penalty", "beam_width", "num_return_sequences", "min_tokens", "ignore_eos",
    "exclude_input_in_output", "return_log_probs", "return_context_logits", "return_generation_logits",
    "priority", "timeout",
)


@dataclass(frozen=True)
class GenerationSection:
    """Triton's generate extension: POST .../generate and .../generate_stream (LLM backends)."""

    #: Longest silence (s) between two events of a stream once it has begun; past it the stream ends
    #: with an error event (reason stream_idle). LLM backends send a token every 10-100 ms; the first
    #: event (prompt processing) is bounded by proxy.upstream_timeout_s instead.
    idle_timeout_s: float = 10.0
    #: Ceiling on a max_tokens-like input or parameter (`token_limit_keys`), for every model...
    max_tokens: int = 4096
    #: ...and per model, where one model must be held tighter (or looser) than the rest.
    max_tokens_per_model: Mapping[str, int] = field(default_factory=dict)
    token_limit_keys: tuple[str, ...] = DEFAULT_TOKEN_LIMIT_KEYS
    #: Top-level keys (and keys of `parameters`) accepted besides the model's inputs.
    parameters: tuple[str, ...] = DEFAULT_GENERATE_PARAMETERS

    def max_tokens_for(self, model: str) -> int:
        return self.max_tokens_per_model.get(model, self.max_tokens)


@dataclass(frozen=True)
class MetricsSection:
    #: Append Triton's own nv_* metrics to /metrics, so one scrape target serves both.
    include_triton: bool = False
    #: Bound (s) on fetching them at scrape time.
    triton_timeout_s: float = 2.0


@dataclass(frozen=True)
class DriftSection:
    """Live data and prediction drift against recorded references (sidecar.serving.drift, docs/drift.md)."""

    #: Directory of reference files (`<model>.json`, or `<model>@<version>.json` for one version),
    #: written by `triton-sidecar record-reference` and re-read on change like golden files.
    reference_dir: Path = Path("drift_reference")
    #: Share of a measured model's answered requests that are binned (0..1). At 1.0 the cost is about
    #: 12 us of CPU per 1x128 request (bench/drift_cost.py); lower it only for very hot models.
    sample_rate: float = 1.0
    #: Rows (one per request for unbatched traffic) in each model version's sliding window. 1,000 keeps
    #: the PSI noise floor of 10 bins near 0.01 per feature and under 0.05 as a max over 128 features,
    #: far below the 0.1 convention, while a real shift shows within one window (docs/drift.md).
    window: int = 1000
    #: Per-feature PSI series kept per tensor (the most drifted ones): bounds Prometheus cardinality.
    max_features: int = 10
    #: Values that mean "missing" per model and input, e.g. {credit_risk: {features: [0, -1]}}.
    missing_sentinels: Mapping[str, Mapping[str, tuple[float, ...]]] = field(default_factory=dict)
    #: Max PSI above which /status shows the model's drift as degraded (never its state: it is still
    #: served, and no reload can fix a changed world); None = only metrics.
    degrade_above_psi: float | None = None


@dataclass(frozen=True)
class CompareTolerance:
    """How far a candidate's value may be from the stable version's and still count as the same
    (the golden files' rule: |got - expected| <= atol + rtol * |expected|; NaN only equals NaN)."""

    atol: float = 1.0e-5
    rtol: float = 1.0e-4


@dataclass(frozen=True)
class RolloutSettings:
    """One model's version rollout inside the pod (sidecar.serving.rollouts, docs/rollouts.md)."""

    #: The version serving unpinned traffic now, and the one being released.
    stable: str
    candidate: str
    #: The candidate's share of unpinned traffic, stage by stage; the last is normally 1.0. Starting
    #: at 0.1 % limits what a bad candidate costs before its first compared answers can stop it.
    steps: tuple[float, ...] = (0.001, 0.05, 0.3, 1.0)
    #: Answers compared in a stage before it may pass: 200 pairs bound a 0.5 % diff rate to about
    #: +-0.5 % (one differing answer = 0.5 %), the least that can tell 0.5 % from 1 %.
    step_min_requests: int = 200
    #: Minimum duration (s) of a stage, so a burst cannot pass a stage before p99 means something.
    step_min_s: float = 60.0
    #: Share (0..1) of answered requests also sent to the other version and compared. 5 % costs a
    #: twentieth more Triton work and still compares 200 pairs in 4,000 requests.
    shadow_rate: float = 0.05
    #: Tolerances for every output, and per output name where one needs its own.
    compare: CompareTolerance = field(default_factory=CompareTolerance)
    compare_outputs: Mapping[str, CompareTolerance] = field(default_factory=dict)
    #: Compared pairs that differ, as a share; above it the rollout is aborted (the documents this
    #: project comes from: "fewer than 0.5 % of requests").
    max_diff_rate: float = 0.005
    #: The candidate's 5xx and NaN answers, as a share of its answers; above it: abort.
    max_error_rate: float = 0.001
    #: Candidate p99 over stable p99 minus 1, in the stage; above it the stage waits (one more
    #: step_min_s), then the rollout is aborted.
    max_p99_increase: float = 0.10
    #: Request header whose value's hash picks the version, so one user sees one version ("" = random).
    cohort_key: str = ""
    #: auto: the sidecar decides. abort / promote: the operator's decision, applied at once (and kept
    #: across restarts, unlike a decision the sidecar took: see docs/rollouts.md, "The fleet").
    decision: str = "auto"

    def tolerance(self, output: str) -> CompareTolerance:
        return self.compare_outputs.get(output, self.compare)


@dataclass(frozen=True)
class LoggingSection:
    #: json for machines (one object per line), console for people at a terminal.
    format: str = "json"
    level: str = "info"
    #: Share of proxied requests written to the access log (errors are always logged).
    access_log_sample_rate: float = 0.01


#: The samplers OTEL_TRACES_SAMPLER may name (the OpenTelemetry SDKs' own names), mapped to
#: (parent_based, fixed rate or None for "the ratio in OTEL_TRACES_SAMPLER_ARG").
OTEL_SAMPLERS: Mapping[str, tuple[bool, float | None]] = {
    "always_on": (False, 1.0), "always_off": (False, 0.0), "traceidratio": (False, None),
    "parentbased_always_on": (True, 1.0), "parentbased_always_off": (True, 0.0),
    "parentbased_traceidratio": (True, None),
}


@dataclass(frozen=True)
class TracingSection:
    """Distributed tracing over OTLP/HTTP (sidecar.tracing, docs/tracing.md): probe rounds, heals and
    gRPC requests as spans. Off while `endpoint` is empty; the OpenTelemetry SDK is imported only
    when it is set. Keys the file and SIDECAR_TRACING_* leave unset are taken from the standard
    OTEL_* variables, as the SDKs read them (OTEL_EXPORTER_OTLP_ENDPOINT alone turns tracing on)."""

    #: The collector's OTLP/HTTP traces URL (http://collector:4318/v1/traces, or https://); "" = off.
    endpoint: str = ""
    #: PEM bundle of the CAs an https:// collector's certificate must chain to (both exporters);
    #: "" = the bundle Python's exporter trusts by default (certifi's). OTEL_EXPORTER_OTLP_(TRACES_)
    #: CERTIFICATE set it too.
    ca_file: str = ""
    #: PEM certificate chain both exporters present to an https:// collector that asks for a client
    #: certificate (mutual TLS), with client_key_file; "" = none. OTEL_EXPORTER_OTLP_(TRACES_)
    #: CLIENT_CERTIFICATE set it too.
    client_cert_file: str = ""
    #: PEM private key of client_cert_file (unencrypted). OTEL_EXPORTER_OTLP_(TRACES_)CLIENT_KEY.
    client_key_file: str = ""
    #: Share (0..1) of new traces kept: requests without a sampled parent, probe rounds. Every heal is
    #: kept whatever this says (they are rare and what an on-call engineer looks for). 0.01 keeps ten
    #: traces a second at 1,000 requests a second, and a probe round's trace every ~8 minutes per model.
    sample_rate: float = 0.01
    #: Follow the sampling decision of an incoming traceparent (the SDKs' parentbased_* samplers):
    #: a client's sampled trace is continued whatever sample_rate says, an unsampled one is not.
    parent_based: bool = True
    #: The resource's service.name: how the sidecar's spans are labelled in the tracing backend.
    service_name: str = "triton-sidecar"
    #: More resource attributes (k8s.pod.name, k8s.namespace.name, deployment.environment, ...).
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    #: Ended spans waiting for export; when full the oldest is dropped (and counted), never a
    #: request slowed. The SDKs' 2048 is a few seconds of spans at 1,000 sampled requests a second.
    queue_size: int = 2048
    #: Spans in one export request (the SDKs' 512).
    batch_size: int = 512
    #: Longest wait (s) before a partial batch is exported (the SDKs' 5 s).
    export_delay_s: float = 5.0
    #: Bound (s) on one export request to the collector, retries included (the OTLP exporters' 10 s);
    #: it also bounds the last flush at exit.
    export_timeout_s: float = 10.0

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


@dataclass(frozen=True)
class SidecarConfig:
    triton: TritonSection = field(default_factory=TritonSection)
    listen: ListenSection = field(default_factory=ListenSection)
    tls: TlsSection = field(default_factory=TlsSection)
    #: Directory of golden requests: <golden_dir>/<model>/<case>.json|yaml.
    golden_dir: Path = Path("golden_requests")
    #: Models to guard; empty means every model in Triton's repository index.
    models: tuple[str, ...] = ()
    probes: ProbesSection = field(default_factory=ProbesSection)
    healing: HealingSection = field(default_factory=HealingSection)
    liveness: LivenessSection = field(default_factory=LivenessSection)
    lifecycle: LifecycleSection = field(default_factory=LifecycleSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    filtering: FilteringSection = field(default_factory=FilteringSection)
    proxy: ProxySection = field(default_factory=ProxySection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    drift: DriftSection = field(default_factory=DriftSection)
    #: Version rollouts by model (hot reloaded: a config change aborts or promotes).
    rollouts: Mapping[str, RolloutSettings] = field(default_factory=dict)
    logging: LoggingSection = field(default_factory=LoggingSection)
    tracing: TracingSection = field(default_factory=TracingSection)
    #: Where the configuration came from, for messages ("defaults" when no file was given).
    source: str = "defaults"


def _num(minimum: float | None = None, exclusive_min: float | None = None,
         maximum: float | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number"}
    if minimum is not None:
        schema["minimum"] = minimum
    if exclusive_min is not None:
        schema["exclusiveMinimum"] = exclusive_min
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _int(minimum: int, maximum: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


_BOOL = {"type": "boolean"}


_STR = {"type": "string"}


_POSITIVE = _num(exclusive_min=0)


def _section(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties}


_VERSION = {"type": ["string", "integer"], "pattern": "^[0-9]+$", "minimum": 1}


_TOLERANCE = _section(atol=_num(minimum=0), rtol=_num(minimum=0))


_SHARE = _num(minimum=0, maximum=1)


_ROLLOUT = {
    **_section(
        stable=_VERSION,
        candidate=_VERSION,
        steps={"type": "array", "minItems": 1, "items": _SHARE},
        step_min_requests=_int(1),
        step_min_s=_num(minimum=0),
        shadow_rate=_SHARE,
        compare={**_TOLERANCE, "properties": {**_TOLERANCE["properties"],
                                              "outputs": {"type": "object", "additionalProperties": _TOLERANCE}}},
        max_diff_rate=_SHARE,
        max_error_rate=_SHARE,
        max_p99_increase=_num(minimum=0),
        cohort_key={"type": "string", "pattern": "^[A-Za-z0-9-]*$"},
        decision={"enum": ["auto", "abort", "promote"]},
    ),
    "required": ["stable", "candidate"],
}


CONFIG_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "triton": _section(
            url={"type": "string", "pattern": r"^https?://[^/\s]+/?$"},
            grpc_url={"type": "string", "pattern": r"^[^/\s:]+:[0-9]{1,5}$"},
            timeout_s=_POSITIVE,
            metrics_url={"type": "string", "pattern": r"^https?://\S+$"},
            repository_header={"type": "string", "pattern": r"^[A-Za-z0-9-]*$"},
            repository_token=_STR,
        ),
        "listen": _section(host={"type": "string", "minLength": 1}, port=_int(1, 65535),
                           grpc_port=_int(0, 65535), fast_infer={"type": "boolean"},
                           event_loop={"enum": list(EVENT_LOOPS)}, front={"enum": list(FRONTS)},
                           grpc_front={"enum": list(FRONTS)},
                           workers=_int(1, 64), probe_port=_int(0, 65535),
                           header_timeout_s=_POSITIVE, keepalive_timeout_s=_POSITIVE, max_url_bytes=_int(16),
                           max_header_bytes=_int(64), max_headers=_int(1), max_connections=_int(1),
                           lingering_time_s=_num(minimum=0), lingering_timeout_s=_num(minimum=0),
                           lingering_max_bytes=_int(0), grpc_max_concurrent_streams=_int(1),
                           grpc_min_ping_interval_s=_num(minimum=0), grpc_max_connection_idle_s=_num(minimum=0),
                           grpc_max_connection_age_s=_num(minimum=0)),
        "tls": _section(
            cert_file=_STR,
            key_file=_STR,
            client_ca_file=_STR,
            client_allowed_sans={"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
            min_version={"enum": list(TLS_VERSIONS)},
        ),
        "golden_dir": {"type": "string", "minLength": 1},
        "models": {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
        "probes": _section(
            interval_s=_POSITIVE,
            timeout_s=_POSITIVE,
            failure_threshold=_int(1),
            success_threshold=_int(1),
            jitter=_num(minimum=0, maximum=0.5),
            require_golden=_BOOL,
            every_requests=_int(0),
            min_interval_s=_POSITIVE,
        ),
        "healing": _section(
            enabled=_BOOL,
            max_attempts=_int(1),
            backoff_initial_s=_num(minimum=0),
            backoff_max_s=_num(minimum=0),
            unload_timeout_s=_POSITIVE,
            load_timeout_s=_POSITIVE,
            max_concurrent=_int(1),
            flap_window_s=_POSITIVE,
            flap_max_heals=_int(1),
            process_fault_patterns={"type": "array", "items": {"type": "string", "minLength": 1},
                                    "uniqueItems": True},
            process_fault_min_models=_int(2),
            escalation_cooldown_s=_num(minimum=0),
            escalation_record_file=_STR,
        ),
        "liveness": _section(triton_unreachable_grace_s=_num(minimum=0), watchdog_stall_s=_POSITIVE),
        "lifecycle": _section(drain_s=_num(minimum=0)),
        "validation": _section(
            max_body_bytes=_int(1),
            max_elements=_int(1),
            max_bytes_element=_int(1),
            reject_non_finite=_BOOL,
            schemas={"type": "object", "additionalProperties": {"type": "string", "minLength": 1}},
        ),
        "filtering": _section(
            rules={
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["model", "drop_outputs"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "drop_outputs": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "string", "minLength": 1},
                        },
                    },
                },
            }
        ),
        "proxy": _section(
            max_in_flight_per_model=_int(1),
            queue_size_per_model=_int(0),
            upstream_timeout_s=_POSITIVE,
            connect_timeout_s=_POSITIVE,
            hold_during_heal_s=_num(minimum=0),
            hold_while_suspect_ms=_num(minimum=0),
            block_non_finite_outputs=_BOOL,
            allow_statistics=_BOOL,
            passive_failure_threshold=_int(1),
            retry_after_s=_int(1),
            client_body_timeout_s=_POSITIVE,
            version_fallback=_BOOL,
            max_shadow_in_flight=_int(0),
        ),
        "generation": _section(
            idle_timeout_s=_POSITIVE,
            max_tokens=_int(1),
            max_tokens_per_model={"type": "object", "additionalProperties": _int(1)},
            token_limit_keys={"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
            parameters={"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
        ),
        "metrics": _section(include_triton=_BOOL, triton_timeout_s=_POSITIVE),
        "drift": _section(
            reference_dir={"type": "string", "minLength": 1},
            sample_rate=_num(minimum=0, maximum=1),
            window=_int(10),
            max_features=_int(1),
            missing_sentinels={"type": "object", "additionalProperties": {
                "type": "object", "additionalProperties": {"type": "array", "items": {"type": "number"}}}},
            degrade_above_psi={"type": ["number", "null"], "exclusiveMinimum": 0},
        ),
        "rollouts": {"type": "object", "additionalProperties": _ROLLOUT},
        "logging": _section(
            format={"enum": ["json", "console"]},
            level={"enum": ["debug", "info", "warning", "error"]},
            access_log_sample_rate=_num(minimum=0, maximum=1),
        ),
        "tracing": _section(
            endpoint={"type": "string", "pattern": r"^(https?://[^/\s]+(/\S*)?)?$"},
            ca_file={"type": "string"},
            client_cert_file={"type": "string"},
            client_key_file={"type": "string"},
            sample_rate=_SHARE,
            parent_based=_BOOL,
            service_name={"type": "string", "minLength": 1},
            resource_attributes={"type": "object", "additionalProperties": {"type": "string"}},
            queue_size=_int(1),
            batch_size=_int(1),
            export_delay_s=_POSITIVE,
            export_timeout_s=_POSITIVE,
        ),
    },
}


_VALIDATOR = jsonschema.Draft202012Validator(CONFIG_SCHEMA)


#: Sections with fixed keys (SIDECAR_<SECTION>_<KEY> overrides them); `rollouts`, a mapping by model,
#: is set in the file only.
_SECTIONS = {name for name, spec in CONFIG_SCHEMA["properties"].items() if "properties" in spec}


_TOP_LEVEL_SCALARS = {"golden_dir": "GOLDEN_DIR", "models": "MODELS"}


def load_config(path: Path | str | None = None, environ: Mapping[str, str] | None = None) -> SidecarConfig:
    """Read the file (if any), apply SIDECAR_* overrides, validate, and build the frozen config."""
    environ = os.environ if environ is None else environ
    source = str(path) if path is not None else "defaults"
    raw = _read_file(Path(path)) if path is not None else {}
    raw = _apply_environment(raw, environ)
    raw = _apply_otel_environment(raw, environ)
    _validate(raw, source)
    return _build(raw, source)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _apply_environment(raw: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    merged = copy.deepcopy(raw)
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):]
        top = next((k for k, env in _TOP_LEVEL_SCALARS.items() if env == rest), None)
        if top == "models":
            merged["models"] = [m.strip() for m in value.split(",") if m.strip()]
            continue
        if top is not None:
            merged[top] = value
            continue
        section, _, key = rest.partition("_")
        section = section.lower()
        if section not in _SECTIONS or not key:
            # Kubernetes injects <SERVICE>_* variables; a Service called "sidecar" must not
            # stop the start, so only variables naming one of our sections are ours.
            continue
        key = key.lower()
        if key not in CONFIG_SCHEMA["properties"][section]["properties"]:
            raise ConfigError(f"environment variable {name}: unknown key {section}.{key}")
        merged.setdefault(section, {})
        if not isinstance(merged[section], dict):
            continue  # the schema check names the wrong section type
        spec = CONFIG_SCHEMA["properties"][section]["properties"][key]
        # String keys keep the text as given: a token of digits must not turn into a number.
        merged[section][key] = value if spec.get("type") == "string" else _parse_env_value(value)
    return merged


def _apply_otel_environment(raw: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The standard OpenTelemetry variables, read as the SDKs read them, for the `tracing` keys the
    file and SIDECAR_TRACING_* leave unset (as an SDK's constructor arguments win over its
    environment). A value that cannot be used stops the start naming the variable."""
    found: dict[str, Any] = {}
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        url = environ.get(name, "").strip()
        if not url:
            continue
        if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
            raise ConfigError(f"environment variable {name}: not an http:// or https:// URL: {url!r}")
        # OTEL_EXPORTER_OTLP_ENDPOINT is the base URL of every signal: the SDKs append the signal's path.
        found["endpoint"] = url if name == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" else url.rstrip("/") + "/v1/traces"
        break
    for key, suffix in (("ca_file", "CERTIFICATE"), ("client_cert_file", "CLIENT_CERTIFICATE"),
                        ("client_key_file", "CLIENT_KEY")):
        for name in (f"OTEL_EXPORTER_OTLP_TRACES_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"):
            if environ.get(name, "").strip():
                found[key] = environ[name].strip()
                break
    if environ.get("OTEL_SERVICE_NAME"):
        found["service_name"] = environ["OTEL_SERVICE_NAME"].strip()
    attributes = _otel_resource_attributes(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    if "service.name" in attributes and "service_name" not in found:
        found["service_name"] = attributes["service.name"]  # OTEL_SERVICE_NAME wins over it, as in the SDKs
    attributes.pop("service.name", None)
    if attributes:
        found["resource_attributes"] = attributes
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler:
        if sampler not in OTEL_SAMPLERS:
            raise ConfigError(f"environment variable OTEL_TRACES_SAMPLER: unknown sampler {sampler!r} "
                              f"(known here: {', '.join(OTEL_SAMPLERS)})")
        found["parent_based"], rate = OTEL_SAMPLERS[sampler]
        if rate is None:
            rate = _otel_number(environ, "OTEL_TRACES_SAMPLER_ARG", 1.0, maximum=1.0)
        found["sample_rate"] = rate
    for key, name, scale in (("queue_size", "OTEL_BSP_MAX_QUEUE_SIZE", None),
                             ("batch_size", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", None),
                             ("export_delay_s", "OTEL_BSP_SCHEDULE_DELAY", 1000),
                             ("export_timeout_s", "OTEL_BSP_EXPORT_TIMEOUT", 1000)):
        if environ.get(name, "").strip():
            value = _otel_number(environ, name, 0, integer=scale is None)
            if value <= 0:
                raise ConfigError(f"environment variable {name}: must be above 0, got {environ[name]!r}")
            found[key] = value if scale is None else value / scale
    # OTEL_SDK_DISABLED and OTEL_TRACES_EXPORTER=none switch the SDKs' tracing off: so they do here.
    disabled = (environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
                or environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none")
    if not found and not disabled:
        return raw
    merged = dict(raw)
    tracing = merged.get("tracing", {})
    if not isinstance(tracing, dict):
        return raw  # the schema check names the wrong section type
    merged["tracing"] = {**found, **tracing}
    if disabled:
        merged["tracing"]["endpoint"] = ""
    return merged


def _otel_resource_attributes(value: str) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES: key=value pairs separated by commas, percent-encoded (W3C Baggage's
    format); a pair without "=" is refused, as the variable is meant to be read whole or not at all."""
    attributes: dict[str, str] = {}
    for pair in value.split(","):
        if not pair.strip():
            continue
        key, sep, item = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"environment variable OTEL_RESOURCE_ATTRIBUTES: {pair.strip()!r} is not key=value")
        attributes[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(item.strip())
    return attributes


def _otel_number(environ: Mapping[str, str], name: str, default: float, *, integer: bool = False,
                 maximum: float | None = None) -> float:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"environment variable {name}: must be {kind}, got {text!r}") from None
    if value < 0 or (maximum is not None and value > maximum):
        bound = f"0..{maximum:g}" if maximum is not None else "0 or more"
        raise ConfigError(f"environment variable {name}: must be {bound}, got {text!r}")
    return value


def _parse_env_value(value: str) -> Any:
    # YAML scalars give "1" -> 1, "true" -> True, "0.5" -> 0.5, like the file would.
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, (int, float, bool, str)) else value


def _validate(raw: dict[str, Any], source: str) -> None:
    errors = sorted(_VALIDATOR.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if not errors:
        _check_cross_field_rules(raw, source)
        return
    error = errors[0]
    path = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        key = ".".join(p for p in (path, extra[0] if extra else "") if p)
        known = ", ".join(sorted(error.schema.get("properties", {})))
        raise ConfigError(f"{source}: unknown key {key!r} (known here: {known})")
    raise ConfigError(f"{source}: key {path or '(top level)'!r}: {short_message(error.message)}")


def _check_cross_field_rules(raw: dict[str, Any], source: str) -> None:
    healing = raw.get("healing", {})
    if healing.get("backoff_initial_s", 1.0) > healing.get("backoff_max_s", 30.0):
        raise ConfigError(f"{source}: key 'healing.backoff_initial_s' must not exceed healing.backoff_max_s")
    for i, pattern in enumerate(healing.get("process_fault_patterns", [])):
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{source}: key 'healing.process_fault_patterns.{i}': not a regular expression: "
                              f"{e}") from e
    _check_tls_keys(raw.get("tls", {}), raw.get("listen", {}), source)
    ca_file = raw.get("tracing", {}).get("ca_file", "")
    if ca_file and not os.access(ca_file, os.R_OK):
        raise ConfigError(f"{source}: key 'tracing.ca_file': cannot read {ca_file!r} (a PEM bundle of the CAs that "
                          "sign the collector's certificate)")
    tracing = raw.get("tracing", {})
    if bool(tracing.get("client_cert_file")) != bool(tracing.get("client_key_file")):
        given, missing = (("client_cert_file", "client_key_file") if tracing.get("client_cert_file")
                          else ("client_key_file", "client_cert_file"))
        raise ConfigError(f"{source}: key 'tracing.{given}' needs tracing.{missing} too (the collector's client "
                          "certificate and its key; OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE, _CLIENT_KEY)")
    for key in ("client_cert_file", "client_key_file"):
        path = tracing.get(key, "")
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{source}: key 'tracing.{key}': cannot read {path!r}")
    if tracing.get("batch_size", 512) > tracing.get("queue_size", 2048):
        raise ConfigError(f"{source}: key 'tracing.batch_size' must not exceed tracing.queue_size "
                          "(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_BSP_MAX_QUEUE_SIZE)")
    for model, rollout in raw.get("rollouts", {}).items():
        if str(rollout["stable"]) == str(rollout["candidate"]):
            raise ConfigError(f"{source}: key 'rollouts.{model}.candidate': must differ from stable "
                              f"({rollout['stable']}); to end a rollout, remove it")
        steps = rollout.get("steps", [])
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ConfigError(f"{source}: key 'rollouts.{model}.steps': shares must increase, got {steps}")
    for i, rule in enumerate(raw.get("filtering", {}).get("rules", [])):
        for j, pattern in enumerate([rule["model"], *rule["drop_outputs"]]):
            try:
                re.compile(pattern)
            except re.error as e:
                key = "model" if j == 0 else f"drop_outputs.{j - 1}"
                raise ConfigError(
                    f"{source}: key 'filtering.rules.{i}.{key}': not a regular expression: {e}"
                ) from e


def _check_tls_keys(tls: Mapping[str, Any], listen: Mapping[str, Any], source: str) -> None:
    """Half a TLS setup is a mistake, never a choice: refuse it instead of serving plaintext."""
    if bool(tls.get("cert_file")) != bool(tls.get("key_file")):
        given, missing = ("cert_file", "key_file") if tls.get("cert_file") else ("key_file", "cert_file")
        raise ConfigError(f"{source}: key 'tls.{missing}' must be set with tls.{given} (both or neither)")
    if (tls.get("client_ca_file") or tls.get("client_allowed_sans")) and not tls.get("cert_file"):
        raise ConfigError(f"{source}: key 'tls.client_ca_file' (mutual TLS) needs tls.cert_file and tls.key_file")
    if tls.get("client_allowed_sans") and not tls.get("client_ca_file"):
        raise ConfigError(f"{source}: key 'tls.client_allowed_sans' needs tls.client_ca_file (mutual TLS)")
    if listen.get("grpc_front") == "rust" and listen.get("grpc_port", 8081):
        if listen.get("front", "rust") != "rust":
            raise ConfigError(f"{source}: key 'listen.grpc_front': rust runs on the Rust HTTP front's runtime and "
                              "needs listen.front: rust")
    probe_port = listen.get("probe_port", 0)
    if probe_port and probe_port in (listen.get("port", 8080), listen.get("grpc_port", 8081)):
        raise ConfigError(f"{source}: key 'listen.probe_port' must differ from listen.port and listen.grpc_port")


def _generation(raw: Mapping[str, Any]) -> GenerationSection:
    values = dict(raw)
    values["max_tokens_per_model"] = dict(values.get("max_tokens_per_model", {}))
    for key in ("token_limit_keys", "parameters"):
        if key in values:
            values[key] = tuple(values[key])
    return GenerationSection(**values)


def _drift(raw: Mapping[str, Any]) -> DriftSection:
    values = dict(raw)
    if "reference_dir" in values:
        values["reference_dir"] = Path(values["reference_dir"])
    values["missing_sentinels"] = {model: {name: tuple(float(v) for v in sentinels)
                                           for name, sentinels in inputs.items()}
                                   for model, inputs in values.get("missing_sentinels", {}).items()}
    return DriftSection(**values)


def _healing(raw: Mapping[str, Any]) -> HealingSection:
    values = dict(raw)
    values["process_fault_patterns"] = tuple(values.get("process_fault_patterns", ()))
    return HealingSection(**values)


def _tracing(raw: Mapping[str, Any]) -> TracingSection:
    values = dict(raw)
    values["resource_attributes"] = dict(values.get("resource_attributes", {}))
    return TracingSection(**values)


def _tls(raw: Mapping[str, Any]) -> TlsSection:
    values = dict(raw)
    values["client_allowed_sans"] = tuple(values.get("client_allowed_sans", ()))
    return TlsSection(**values)


def _rollouts(raw: Mapping[str, Any]) -> dict[str, RolloutSettings]:
    rollouts = {}
    for model, spec in raw.items():
        values = dict(spec)
        values["stable"], values["candidate"] = str(values["stable"]), str(values["candidate"])
        if "steps" in values:
            values["steps"] = tuple(float(s) for s in values["steps"])
        compare = dict(values.pop("compare", {}))
        values["compare_outputs"] = {name: CompareTolerance(**t) for name, t in compare.pop("outputs", {}).items()}
        values["compare"] = CompareTolerance(**compare)
        rollouts[model] = RolloutSettings(**values)
    return rollouts


def _listen(listen: dict[str, Any]) -> dict[str, Any]:
    """The listen section with grpc_front following front when it is not written: the Rust gRPC front
    runs on the Rust HTTP front's runtime, so the Python listener (the escape hatch) keeps grpcio on
    the gRPC port."""
    if listen.get("front") == "python" and "grpc_front" not in listen:
        return {**listen, "grpc_front": "python"}
    return listen


def _build(raw: dict[str, Any], source: str) -> SidecarConfig:
    filtering = raw.get("filtering", {})
    rules = tuple(
        FilterRule(model=r["model"], drop_outputs=tuple(r["drop_outputs"]))
        for r in filtering.get("rules", [])
    )
    validation = dict(raw.get("validation", {}))
    validation["schemas"] = dict(validation.get("schemas", {}))
    return SidecarConfig(
        triton=TritonSection(**raw.get("triton", {})),
        listen=ListenSection(**_listen(raw.get("listen", {}))),
        tls=_tls(raw.get("tls", {})),
        golden_dir=Path(raw.get("golden_dir", "golden_requests")),
        models=tuple(raw.get("models", ())),
        probes=ProbesSection(**raw.get("probes", {})),
        healing=_healing(raw.get("healing", {})),
        liveness=LivenessSection(**raw.get("liveness", {})),
        lifecycle=LifecycleSection(**raw.get("lifecycle", {})),
        validation=ValidationSection(**validation),
        filtering=FilteringSection(rules=rules),
        proxy=ProxySection(**raw.get("proxy", {})),
        generation=_generation(raw.get("generation", {})),
        metrics=MetricsSection(**raw.get("metrics", {})),
        drift=_drift(raw.get("drift", {})),
        rollouts=_rollouts(raw.get("rollouts", {})),
        logging=LoggingSection(**raw.get("logging", {})),
        tracing=_tracing(raw.get("tracing", {})),
        source=source,
    )

