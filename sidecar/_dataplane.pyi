"""Types of `sidecar._dataplane`, the Rust data plane (dataplane/, built by maturin)."""

from collections.abc import Callable
from typing import Any

import numpy as np

__version__: str

class RequestRefused(ValueError):
    """A request refused before Triton: args are (reason label, message, input name or "")."""

class RequestRules:
    """A model's rule file compiled once (serving::request_rules): the envelope's JSON Schema and the
    x-tensors value rules, checked by RequestSpec.validate (400 business_rule)."""

    def __init__(self, file_name: str, schema: str) -> None:
        """`schema`: the file's JSON text, already checked at start-up; ValueError if it cannot be compiled."""

class RequestSpec:
    """What a valid request to one model (version) looks like (serving::validation::RequestSpec)."""

    def __init__(
        self,
        model: str,
        inputs: list[tuple[str, str, list[int], bool]],
        outputs: list[str],
        hidden_outputs: list[str],
        max_batch_size: int,
        max_elements: int,
        max_bytes_element: int,
        reject_non_finite: bool,
        is_hidden: Callable[[str], bool] | None = None,
        rules: RequestRules | None = None,
    ) -> None: ...
    def validate(self, body: bytes, header_length: int | None = None) -> CheckedBody:
        """Check one infer request body; raises RequestRefused."""

class CheckedBody:
    """A request that passed."""

    @property
    def elements(self) -> int: ...
    @property
    def requested_outputs(self) -> tuple[str, ...]: ...
    @property
    def binary(self) -> bool: ...
    def layout(self) -> list[tuple[str, str, list[int], int, int, int]]:
        """(name, datatype, shape, json_index or -1, binary_offset, binary_size) per input."""
    def json_numbers(self, index: int) -> tuple[str, bytes] | None:
        """JSON input `index`'s numbers as (numpy dtype, little-endian bytes)."""

class AnswerNotV2(ValueError):
    """Triton's answer is not what the v2 protocol says."""

def screen_infer_response(
    body: bytes, header_length: int | None, is_hidden: Callable[[str], bool] | None, check_non_finite: bool
) -> tuple[bytes | None, int | None, list[str], list[str]]:
    """(new body or None when untouched, header length, dropped outputs, non-finite outputs)."""

def inflate(body: bytes, encoding: str, limit: int) -> bytes | None:
    """The body inflated ("gzip", "deflate" or "zstd"), None past `limit` bytes; ValueError: a corrupt stream."""

class RequestMetrics:
    """Per-request counters kept as atomics; sidecar.metrics.DataPlaneCollector exports them."""

    def __init__(self, latency_bounds: list[float], event_count_bounds: list[float]) -> None: ...
    def finish(self, protocol: str, model: str, code: str, seconds: float) -> None: ...
    def rejected(self, protocol: str, model: str, reason: str) -> None: ...
    def internal_error(self, protocol: str, model: str) -> None: ...
    def filtered(self, model: str, outputs: list[str]) -> None: ...
    def routed(self, model: str, version: str, reason: str) -> None: ...
    def requests(self, protocol: str, model: str, code: str) -> int: ...
    def routed_count(self, model: str, version: str, reason: str) -> int: ...
    def quarantined(self, model: str, outcome: str, n: int = 1) -> None: ...
    def quarantined_count(self, model: str, outcome: str) -> int: ...
    def in_flight_add(self, model: str, delta: int) -> None: ...
    def queued_add(self, model: str, delta: int) -> None: ...
    def connection_opened(self, delta: int) -> None: ...
    def connection_refused(self) -> None: ...
    def connection_timeout(self, phase: str) -> None: ...
    def lingering_end(self, how: str) -> None: ...
    def tls_handshake_failed(self, reason: str, n: int = 1) -> None: ...
    def spans_exported(self, n: int) -> None: ...
    def spans_dropped(self, reason: str, n: int) -> None: ...
    def stream_opened(self, model: str, delta: int) -> None:
        """A stream to `model` took its breaker slot (+1) or gave it back (-1)."""
    def stream_first_event(self, model: str, seconds: float) -> None: ...
    def stream_inter_event(self, model: str, seconds: float) -> None: ...
    def stream_ended(self, model: str, events: int, outcome: str) -> None:
        """A stream that began ended after `events` events; `outcome`: complete, or the ending's reason."""
    def collect(self) -> dict[str, Any]: ...

class GenerateRefused(ValueError):
    """A generate body refused: args are (reason label, message, field or "", field is an input)."""

class GenerateLimits:
    """What a generate request to one model may ask for (serving::generation::GenerateLimits)."""

    def __init__(
        self, max_text_bytes: int, max_tokens: int, token_limit_keys: list[str], parameters: list[str]
    ) -> None: ...
    def check(self, spec: RequestSpec, body: bytes) -> None:
        """Check one generate body against the model's inputs; raises GenerateRefused."""

def screen_generate_event(
    data: bytes, is_hidden: Callable[[str], bool] | None, check_non_finite: bool
) -> tuple[bytes | None, list[str], list[str], str | None]:
    """(new event or None when untouched, dropped outputs, non-finite fields, Triton's error or None);
    raises AnswerNotV2 for an event that is not a JSON object."""

def generate_event_needs_screening(data: bytes, has_filter: bool, check_non_finite: bool) -> bool:
    """False when an event can be passed on unparsed."""

def compare_output(
    name: str,
    datatype: str,
    shape: tuple[int, ...],
    values: bytes | list[Any] | tuple[Any, ...] | np.ndarray,
    atol: float,
    rtol: float,
    got: tuple[str, tuple[int, ...], bytes | list[Any] | tuple[Any, ...] | np.ndarray] | None,
) -> list[str]:
    """Every way output `name` differs from its expectation, as messages (golden::compare). Values:
    float64 little-endian bytes (read_answer's), a flat list or tuple, or a numpy array."""

def decode_answer(
    body: bytes, header_length: int | None
) -> tuple[str | None, list[tuple[str, str, list[int], list[bytes] | list[str] | tuple[str | None, bytes]]]]:
    """(model_version, [(name, datatype, shape, values)]) of a 200 infer answer (protocol::answers);
    raises AnswerNotV2. Values: a list for BYTES, else (dtype or None for a binary section, data)."""

def read_answer(
    body: bytes, header_length: int | None
) -> tuple[str | None, list[tuple[str, str, list[int], bytes | list[bytes] | list[str]]]]:
    """decode_answer's outputs as the health loop compares them, without numpy: BYTES as a list, any
    other datatype's values cast to it and read as float64 (little-endian bytes); raises AnswerNotV2,
    also for a binary section that is not a whole number of its datatype's elements."""

def unknown_health_service(service: str) -> str:
    """grpc.health.v1 Check's NOT_FOUND message for a service that is neither "" nor a guarded model."""

class DriftWindows:
    """The drift windows (dataplane/src/serving/drift.rs): the lanes bin the answers they serve,
    DriftMonitor feeds what the Python chain serves and reads the count tables."""

    def __init__(self) -> None: ...
    def set(self, references: list[tuple[str, str, list[tuple[str, int, int, bytes, list[float], bool]],
                                         list[tuple[str, int, int, bytes, list[float], bool]]]],
            window: int, sample_rate: float) -> None:
        """references: (model, version key or "", inputs, outputs), each tensor (name, features, bins,
        interior edges as float64 little-endian bytes, missing-value sentinels, NaN counts as
        missing). A model whose references changed, or all for a new window, count from empty."""
    def observe(self, model: str, version: str, batched: bool, inputs: list[tuple[str, str, list[int], bytes]],
                outputs: list[tuple[str, str, list[int], bytes]]) -> bool:
        """One answered request: each tensor (name, datatype, shape, float64 little-endian bytes);
        True when it completed a live recording."""
    def observe_exchange(self, model: str, version: str, batched: bool, request: bytes,
                         request_header_length: int | None, answer: bytes,
                         answer_header_length: int | None) -> bool:
        """One HTTP-shaped exchange counted as the lanes count it (bench.drift_cost)."""
    def record(self, model: str, rows: int, version: str) -> Recording:
        """Record the next `rows` answered rows of `model` (of `version` only, when given)."""
    def stop(self, recording: Recording) -> None: ...
    def windows(self, model: str | None = None) -> list[tuple[str, str, str,
                                                            list[tuple[str, int, bytes, bytes, float]],
                                                            list[tuple[str, int, bytes, bytes, float]]]]:
        """(model, version, reference key, inputs, outputs): each tensor (name, rows, the
        (features, bins + 1) table and the per-bin total as uint64 little-endian bytes, sum)."""

class Recording:
    """A live recording (record-reference --live) in DriftWindows."""

    @property
    def seen(self) -> int: ...
    @property
    def done(self) -> bool: ...
    def take(self) -> tuple[list[tuple[str, str, int, bytes]], list[tuple[str, str, int, bytes]]]:
        """(inputs, outputs): each (name, datatype, features, float64 little-endian bytes)."""

class HttpFront:
    """The data plane's HTTP front on listen.port (sidecar/fronts/http_front.py drives it)."""

    def __init__(
        self,
        host: str,
        port: int,
        backlog: int,
        workers: int,
        back_port: int,
        upstream: str,
        limits: dict[str, float],
        metrics: RequestMetrics,
        tls: tuple[bytes, bytes, bytes | None, list[str], str] | None = None,
        tracing: tuple[str, bytes | None, tuple[bytes, bytes] | None, float, bool, str, str, list[tuple[str, str]],
                       int, int, float, float] | None = None,
        drift: DriftWindows | None = None,
    ) -> None:
        """drift: the windows the lanes count measured answers in (DriftMonitor.windows).
        tracing: (endpoint, the CA bundle PEM of an https:// endpoint, the client certificate chain
        and key PEM it is shown or None, sample_rate, parent_based, service_name, service.version,
        resource attributes, queue_size, batch_size, export_delay_s, export_timeout_s): one span per
        request, exported by the front; None: tracing off (no span, no exporter)."""
    @property
    def port(self) -> int: ...
    @property
    def open_connections(self) -> int: ...
    @property
    def handovers(self) -> int: ...
    @property
    def fast_requests(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def holding(self) -> list[tuple[str, int]]:
        """Requests the front holds for a heal now: [(model, count)], models with none left out."""
    @property
    def upstream_pool(self) -> tuple[int, int, int, int]:
        """(connections opened, calls that reused one, idle now, open now) to Triton."""
    @property
    def runtime_silent_for(self) -> float: ...
    @property
    def control_silent_for(self) -> float: ...
    def stall_runtime(self, seconds: float) -> None: ...
    def panic_next(self, model: str) -> None: ...
    def serve_grpc(
        self,
        host: str,
        port: int,
        backlog: int,
        back_port: int,
        triton: str,
        max_concurrent_streams: int,
        max_connections: int,
        max_idle_s: float,
        max_age_s: float,
        min_ping_interval_s: float,
        tls: tuple[bytes, bytes, bytes | None, list[str], str] | None = None,
    ) -> int:
        """listen.grpc_port on this front's runtime (listen.grpc_front: rust); the bound port.
        ModelInfer to a lane, grpc.health.v1 and server reflection are served here, every other call
        passed to 127.0.0.1:back_port. `min_ping_interval_s`: listen.grpc_min_ping_interval_s, gRPC
        core's ping policy (a client past it is sent GOAWAY too_many_pings). `tls`:
        the front's own material (given exactly when the front was started with tls): grpcs, ALPN h2,
        rotated by reload_tls with listen.port."""
    @property
    def grpc_counts(self) -> tuple[int, int]:
        """(calls handed to the Python gRPC server, calls answered without it: ModelInfer to a lane,
        grpc.health.v1, server reflection)."""
    def publish(
        self,
        lanes: list[tuple[str, RequestSpec, list[str] | None, bool, GenerateLimits, float,
                          list[tuple[str, RequestSpec, list[str] | None]], bool]],
        ended: list[tuple[str, int, bytes, int | None, str, bytes, list[str] | None]],
        health: list[tuple[str, int, bytes, int | None, str]] = ...,
        serving: list[tuple[str, bool]] | None = ...,
        guards: list[tuple[str, bool, bool, str]] | None = ...,
        documents: tuple[list[tuple[str, bool, tuple[int, bytes, int | None] | None, list[tuple[str, bool]] | None]],
                         bool, list[str]] | None = ...,
    ) -> None:
        """lanes: (model, spec, hidden outputs or None, look for NaN/Inf, generate limits,
        generation.idle_timeout_s, [(version a client may pin, its spec, its hidden outputs or
        None)], stale: the last lane kept while its spec is fetched again); ended: (model, status,
        JSON body, Retry-After or None, reason label, the same
        refusal as a stream's error event, the versions whose requests at Triton it ends ("" =
        unversioned) or None for every version); health: (path, status, JSON body or b"",
        Retry-After or None, reason label or "") for /v2/health/live and /v2/health/ready; serving:
        grpc.health.v1's status of each service it knows ("" the pod, each guarded model; True for
        SERVING), None while the gRPC front is grpcio's; guards: (model, suspect, may be held for a
        heal, fallback version or "") for every guarded model (None: each lane's and ended model,
        neither suspect nor held nor routed);
        documents: ([(model, named by an output filter, its /ready refusal (status, JSON body,
        Retry-After) or None, the filter's verdict on its declared outputs or None)],
        proxy.allow_statistics, the extensions GET /v2 shows) for the v2 document routes, the
        control API and the router's 404s and 405s."""
    def drain_events(self) -> list[tuple[Any, ...]]:
        """Oldest first: ("answered", model, count), ("failed", model, kind, status, detail),
        ("non_finite", model, outputs), ("ended", model, count), ("log", request_id, trace_id, model,
        method, path, status, duration_ms, reason, client_subject, span_id), ("panic", model, message),
        ("tls_refused", reason, client_subject, protocol: "http" or "grpc"), ("stream_ended", model,
        reason, events, cause), ("grpc_log", request_id, trace_id, model, path, grpc code name,
        duration_ms, reason, client_subject), ("grpc_panic", model, request_id, message)."""
    def wake_fd(self) -> int: ...
    def reload_tls(self, tls: tuple[bytes, bytes, bytes | None, list[str], str]) -> None: ...
    def open_span(self, name: str, traceparent: str | None = None, tracestate: str | None = None
                  ) -> RequestSpan | None:
        """The span of a request Python answers, on the front's sampler and exporter; None when
        tracing is off or it is not sampled."""
    def close(self) -> None: ...

AttributeValue = str | bool | int | float

class RequestSpan:
    """A sampled request span made by the front's tracer (sidecar.tracing.front_spans)."""

    traceparent: str
    tracestate: str | None
    trace_id: str
    span_id: str
    def set(self, attributes: list[tuple[str, AttributeValue]]) -> None: ...
    def event(self, name: str, attributes: list[tuple[str, AttributeValue]]) -> None: ...
    def end(self, attributes: list[tuple[str, AttributeValue]], error: str | None = None) -> None: ...
