"""Request telemetry for both fronts: request and trace ids, request metrics, the sampled access log.

The request metrics are counted by the data plane (`SidecarMetrics.requests`, atomics in
sidecar._dataplane, read by the registry's collector at scrape time); the in-flight gauge stays a
prometheus_client child, cached per model: `labels()` costs a lock and a dict lookup on every call.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.serving.admission import SERVER_LABEL

log = structlog.get_logger("sidecar.proxy")


HTTP = "http"


GRPC = "grpc"


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


@dataclass
class RequestContext:
    """One proxied request (or stream), whatever the wire."""

    protocol: str
    request_id: str
    trace_id: str
    #: Bounded model label for metrics: a tracked model's name, SERVER_LABEL or UNKNOWN_LABEL.
    label: str = SERVER_LABEL
    #: The client certificate's subject on a mutual-TLS connection ("" otherwise), for the access log.
    client: str = ""
    started: float = field(default_factory=time.perf_counter)
    #: What the front answered: HTTP status or gRPC status code name; "" until the answer begins.
    code: str = ""
    #: The request's sampled server span (sidecar.tracing), its id in hex, and the traceparent and
    #: tracestate Triton is sent so that its spans are the span's children; unset without tracing.
    span: Any = None
    span_id: str = ""
    upstream_trace: tuple[tuple[str, str], ...] = ()
    #: When the traced request's last phase ended (perf_counter; 0: none yet, the start counts).
    phase_mark: float = 0.0

    def answered(self, code: int | str) -> None:
        """The front's answer has begun with this HTTP status or gRPC code name (a stream calls it
        when it sends its status): from now on an exception can no longer be answered, only logged
        and counted (sidecar.serving.request)."""
        self.code = str(code)


class RequestTelemetry:
    def __init__(self, *, metrics: SidecarMetrics, access_log_sample_rate: float) -> None:
        self._metrics = metrics
        self._sample_rate = access_log_sample_rate
        self._rng = random.Random()  # noqa: S311 - log sampling and request ids, not secrets
        self._counts = metrics.requests
        self._in_flight: dict[tuple[str, ...], Any] = {}

    def request_id(self, sent: str | None) -> str:
        """The client's X-Request-ID when it is sane, else a new one."""
        return sent if sent and _REQUEST_ID.fullmatch(sent) else self.new_request_id()

    def new_request_id(self) -> str:
        """A random 32-hex-digit id (uuid4's shape, without its urandom syscall per request)."""
        return f"{self._rng.getrandbits(128):032x}"

    def finish(self, ctx: RequestContext, code: str, *, method: str, path: str, reason: str = "",
               failed: bool = False) -> None:
        """Count the request and write its access-log line (every failure, a sample of the rest)."""
        duration = time.perf_counter() - ctx.started
        self._counts.finish(ctx.protocol, ctx.label, code, duration)
        if not failed:
            rate = self._sample_rate
            # No random draw when the answer is fixed: rate 0 logs none, rate 1 logs all.
            if rate <= 0 or (rate < 1 and self._rng.random() >= rate):
                return
        fields: dict[str, Any] = {
            "request_id": ctx.request_id, "trace_id": ctx.trace_id, "model": ctx.label,
            "protocol": ctx.protocol, "method": method, "path": cut(path, 200), "status": code,
            "duration_ms": round(duration * 1000, 2),
        }
        if reason:
            fields["reason"] = reason
        if ctx.client:
            fields["client_subject"] = ctx.client
        if ctx.protocol == HTTP:
            fields["status"] = int(code)
        (log.warning if _is_server_side(code) else log.info)("proxy_request", **fields)

    def rejected(self, ctx: RequestContext, reason: str) -> None:
        self._counts.rejected(ctx.protocol, ctx.label, reason)

    def internal_error(self, ctx: RequestContext) -> None:
        self._counts.internal_error(ctx.protocol, ctx.label)

    def in_flight(self, model: str) -> InFlight:
        """The model's proxy_in_flight gauge (a data-plane atomic, shared with the Rust front)."""
        gauge = self._in_flight.get((model,))
        if gauge is None:
            gauge = self._in_flight[(model,)] = InFlight(self._counts.in_flight_add, model)
        return gauge  # type: ignore[no-any-return]

    def queued(self, model: str) -> InFlight:
        """The model's proxy_queued gauge: requests waiting for a breaker slot (shared with the Rust
        front's breakers)."""
        return InFlight(self._counts.queued_add, model)

    def filtered(self, model: str, outputs: list[str]) -> None:
        if outputs:
            self._counts.filtered(model, outputs)


class InFlight:
    """One model's series of a data-plane gauge (in flight, queued), as prometheus_client's child
    offered it (inc, dec)."""

    __slots__ = ("_add", "_model")

    def __init__(self, add: Callable[[str, int], None], model: str) -> None:
        self._add, self._model = add, model
        self._add(model, 0)  # the series exists (at 0) from the model's first request

    def inc(self) -> None:
        self._add(self._model, 1)

    def dec(self) -> None:
        self._add(self._model, -1)


_SERVER_SIDE_GRPC = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "DATA_LOSS"})


def _is_server_side(code: str) -> bool:
    return code[:1] == "5" if code[:1].isdigit() else code in _SERVER_SIDE_GRPC


def trace_id(traceparent: str | None) -> str:
    """The trace id of a W3C traceparent header, or "" (all-zero ids are invalid)."""
    if traceparent:
        match = _TRACEPARENT.fullmatch(traceparent.strip())
        if match and match.group(1) != "0" * 32:
            return match.group(1)
    return ""

