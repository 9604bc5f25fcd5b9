"""What the health loop and the serving core ask of tracing, without the OpenTelemetry SDK.

The health loop makes its spans through `HealthSpans` (probe rounds, heals and their steps); with
tracing off it is handed `NO_SPANS`, whose spans do nothing. The serving core asks `RequestSpans` for
one server span per request; with tracing off it holds None and pays one attribute check per request.
Nothing here imports opentelemetry: only `sidecar.tracing.otel` does, and only when tracing is on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

#: What a span attribute may hold (OpenTelemetry's primitive attribute values).
AttributeValue = str | bool | int | float

Attributes = Mapping[str, AttributeValue]


class Span(Protocol):
    """One span, as the health loop writes to it."""

    def set(self, attributes: Attributes) -> None:
        """Attributes known only as the work goes on (an outcome, a count)."""

    def failed(self, description: str) -> None:
        """The span's status is an error, with what went wrong."""

    def event(self, name: str, attributes: Attributes) -> None:
        """A moment inside the span (a probe's result, a retry scheduled)."""


class HealthSpans(Protocol):
    """The health loop's traces: probe rounds (sampled by tracing.sample_rate) and heals (every one,
    a trace of its own, with a child span per step). Each span is current while its block runs, and
    the log events inside it carry its trace_id and span_id."""

    def probe_round(self, model: str, cause: str) -> AbstractContextManager[Span]:
        """A probe round of `model`, started for `cause` (time, traffic, confirmation, event)."""

    def heal(self, model: str, cause: str) -> AbstractContextManager[Span]:
        """A heal episode: a new trace, always sampled, whatever the current context is."""

    def heal_step(self, step: str, model: str, attempt: int) -> AbstractContextManager[Span]:
        """One step of a heal attempt (unload, load, verify), a child of the episode's span.
        An exception leaving the block marks the span failed with its message, and goes on."""

    def current_trace(self) -> tuple[tuple[str, str], ...]:
        """The headers that make Triton's spans children of the current span (a probe round's, a heal
        step's) when it is sampled; () otherwise. The health loop's calls to Triton send them."""


class TracedRequest(Protocol):
    """What a request span reads and writes of the request (sidecar.serving.telemetry.RequestContext)."""

    protocol: str
    request_id: str
    trace_id: str
    label: str
    span: Any
    span_id: str
    upstream_trace: tuple[tuple[str, str], ...]


class RequestSpans(Protocol):
    """One server span per request, for the protocols whose front forwards the span's traceparent."""

    #: The protocols traced (the request scope checks this once per request).
    protocols: frozenset[str]

    def start(self, scope: TracedRequest, traceparent: str | None, tracestate: str | None, *, method: str,
              path: str, route: str) -> None:
        """Start the request's span, a child of the client's context when it sent one: named for the
        RPC (`path`) over gRPC, for `method` and the route template over HTTP (`route`, "" when no
        route matched: the method alone, as OpenTelemetry's HTTP conventions say). When the span is
        sampled, set `scope.span`, `scope.trace_id`, `scope.span_id` and `scope.upstream_trace` (the
        traceparent and tracestate that make Triton's spans its children)."""

    def annotate(self, scope: TracedRequest, attributes: Attributes) -> None:
        """Set attributes of `scope.span` (sampled) as the request goes on: the version routing chose."""

    def event(self, scope: TracedRequest, name: str, attributes: Attributes) -> None:
        """An event of `scope.span` (sampled) now: a phase that ended, with its duration."""

    def end(self, scope: TracedRequest, *, code: str, reason: str, failed: bool, description: str) -> None:
        """End `scope.span` with the request's outcome (model, status, refusal reason)."""


#: gRPC status codes by name: rpc.grpc.status_code is the number (the serving core knows the names).
GRPC_STATUS_CODES = {name: number for number, name in enumerate((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))}


def request_span_name(scope: TracedRequest, *, method: str, path: str, route: str) -> str:
    """A request span's name, as the Rust front names its own: the RPC over gRPC; over HTTP the method
    and the route template (never the path: a model's name would make every span name its own), the
    method alone when no route matched, `HTTP` for a request whose method was never read (a head that
    timed out), as OpenTelemetry's conventions say."""
    if scope.protocol == "grpc":  # sidecar.serving.telemetry.GRPC (the serving core sits above)
        return path.lstrip("/")
    method = method or "HTTP"
    return f"{method} {route}" if route else method


def upstream_trace(traceparent: str, tracestate: str | None) -> tuple[tuple[str, str], ...]:
    """The headers (or gRPC metadata) that make Triton's spans children of a sampled request span."""
    return (("traceparent", traceparent), ("tracestate", tracestate)) if tracestate else (("traceparent", traceparent),)


def request_attributes(scope: TracedRequest, *, method: str, path: str, route: str) -> dict[str, AttributeValue]:
    """A request span's first attributes (what the request is), as the Rust front sets its own."""
    attributes: dict[str, AttributeValue] = {"sidecar.request_id": scope.request_id, "sidecar.protocol": scope.protocol}
    if scope.protocol == "grpc":
        service, _, rpc = path.lstrip("/").rpartition("/")
        attributes.update({"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc})
        return attributes
    attributes["http.request.method"] = method or "HTTP"
    if route:
        attributes["http.route"] = route
    return attributes


def outcome_attributes(scope: TracedRequest, *, code: str, reason: str) -> dict[str, AttributeValue]:
    """A request span's last attributes: the model, the status (number and text), the refusal reason."""
    attributes: dict[str, AttributeValue] = {"sidecar.status": code}
    if scope.label[:1] != "_":  # a guarded model's name, not _server_ or _unknown_
        attributes["sidecar.model"] = scope.label
    if scope.protocol == "grpc":
        attributes["rpc.grpc.status_code"] = GRPC_STATUS_CODES.get(code, GRPC_STATUS_CODES["UNKNOWN"])
    elif code.isdigit():
        attributes["http.response.status_code"] = int(code)
    if reason:
        attributes["sidecar.refusal.reason"] = reason
    return attributes


class _NoSpan:
    def set(self, attributes: Attributes) -> None:
        pass

    def failed(self, description: str) -> None:
        pass

    def event(self, name: str, attributes: Attributes) -> None:
        pass


NO_SPAN = _NoSpan()


@contextmanager
def _no_span() -> Iterator[Span]:
    yield NO_SPAN


class NoSpans:
    """Tracing off: every span is NO_SPAN, and nothing is recorded or imported."""

    def probe_round(self, model: str, cause: str) -> AbstractContextManager[Span]:
        return _no_span()

    def heal(self, model: str, cause: str) -> AbstractContextManager[Span]:
        return _no_span()

    def heal_step(self, step: str, model: str, attempt: int) -> AbstractContextManager[Span]:
        return _no_span()

    def current_trace(self) -> tuple[tuple[str, str], ...]:
        return ()


NO_SPANS: HealthSpans = NoSpans()
