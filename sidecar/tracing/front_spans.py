"""Spans of the requests the Python side answers, made by the Rust front's tracer.

gRPC calls on grpcio and the HTTP requests the Rust front hands over are answered in Python, but
their server spans need not be the Python SDK's: one costs about 0.15 ms of the process's CPU
(made, ended, queued, encoded and posted under the GIL), more than the whole Rust lane's request.
Once the front runs, `FrontSpans` asks it for each span instead (`HttpFront.open_span`): the
front samples it with the same settings, and records and exports it on its own threads, so a
request pays a call at its start and one at its end. The Python SDK keeps the health loop's spans
(probe rounds, heals), which are few.

Nothing here imports opentelemetry.
"""

from __future__ import annotations

from typing import Protocol

from sidecar._dataplane import RequestSpan
from sidecar.messages import cut
from sidecar.tracing.spans import (
    Attributes,
    RequestSpans,
    TracedRequest,
    outcome_attributes,
    request_attributes,
    request_span_name,
    upstream_trace,
)


class SpanOpener(Protocol):
    """The front's side (sidecar._dataplane.HttpFront.open_span)."""

    def open_span(self, name: str, traceparent: str | None = None, tracestate: str | None = None
                  ) -> RequestSpan | None:
        ...


class FrontSpans:
    """RequestSpans on the Rust front's tracer. `before`: the spans of the requests opened before the
    front started (the Python SDK's), which end where they began."""

    def __init__(self, front: SpanOpener, *, before: RequestSpans) -> None:
        self._front = front
        self.before = before
        self.protocols = before.protocols

    def start(self, scope: TracedRequest, traceparent: str | None, tracestate: str | None, *, method: str,
              path: str, route: str) -> None:
        span = self._front.open_span(request_span_name(scope, method=method, path=path, route=route),
                                     traceparent, tracestate)
        if span is None:
            return  # not sampled: the client's own traceparent goes on to Triton, as without tracing
        # Attributes for a sampled span alone: the unsampled ones cost the call above and no more.
        span.set(list(request_attributes(scope, method=method, path=path, route=route).items()))
        scope.span = span
        scope.trace_id, scope.span_id = span.trace_id, span.span_id
        scope.upstream_trace = upstream_trace(span.traceparent, span.tracestate)

    def annotate(self, scope: TracedRequest, attributes: Attributes) -> None:
        span = scope.span
        if isinstance(span, RequestSpan):
            span.set(list(attributes.items()))
        else:
            self.before.annotate(scope, attributes)

    def event(self, scope: TracedRequest, name: str, attributes: Attributes) -> None:
        span = scope.span
        if isinstance(span, RequestSpan):
            span.event(name, list(attributes.items()))
        else:
            self.before.event(scope, name, attributes)

    def end(self, scope: TracedRequest, *, code: str, reason: str, failed: bool, description: str) -> None:
        span = scope.span
        if not isinstance(span, RequestSpan):  # the Python SDK's, opened before the front started
            self.before.end(scope, code=code, reason=reason, failed=failed, description=description)
            return
        span.end(list(outcome_attributes(scope, code=code, reason=reason).items()),
                 cut(description, 500) if failed else None)
