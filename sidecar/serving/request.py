"""The outer part of every request, whatever its wire, written once.

Every front (the fast HTTP listener, the aiohttp routes, gRPC unary calls and streams) wraps its work
in one `RequestScope`:

    scope = core.request(HTTP, request_id=..., traceparent=..., method=..., path=...)
    async with scope:                      # ids bound to the log context, counted for the drain
        answer = ...decode, call the core...
        scope.answered(status)             # what the front is about to send
    if scope.refusal is not None:          # a Refusal raised inside, or an unexpected exception
        answer = ...encode scope.refusal...

On leaving the scope the request is counted and logged (telemetry), a refusal before Triton is
counted as a rejection, a client that went away (the task cancelled) is 499 / CANCELLED, and an
unexpected exception is decided here and nowhere else: logged with its traceback
(`proxy_internal_error`), counted in `triton_sidecar_proxy_internal_errors_total{protocol,model}`
(a bug of the sidecar's: alert on it apart from the clients' own mistakes) and answered as the
`internal_error` refusal (HTTP 500, gRPC INTERNAL, with the usual JSON body / x-sidecar-reason).
Which status line or gRPC code that is stays the fronts' to write; the `Reason` names both.

The scope is the request's `RequestContext` itself (one object per request, as before) and binds the
log context by token, not with `bound_contextvars()`, which copies the whole context per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import structlog

from sidecar.serving.lifecycle import Lifecycle
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.telemetry import HTTP, RequestContext, RequestTelemetry, trace_id
from sidecar.tracing.spans import Attributes, RequestSpans

log = structlog.get_logger("sidecar.proxy")


#: The code of an answer that went well, per protocol (a scope left without `answered`).
_OK = {HTTP: "200"}


@dataclass(eq=False)
class RequestScope(RequestContext):
    """One request from its first byte to its answer: its context, and the outcome the front fills."""

    method: str = ""
    path: str = ""
    #: The refusal's reason label, when the sidecar answered itself.
    reason: str = ""
    #: The refusal the front must encode once the scope is left (one raised inside, or internal_error).
    refusal: Refusal | None = None
    wrapper: RequestWrapper | None = None
    _tokens: Any = None

    async def __aenter__(self) -> RequestScope:
        assert self.wrapper is not None
        self.wrapper.lifecycle.request_started()
        if self.span_id:
            self._tokens = structlog.contextvars.bind_contextvars(request_id=self.request_id, trace_id=self.trace_id,
                                                                  span_id=self.span_id)
        else:
            self._tokens = structlog.contextvars.bind_contextvars(request_id=self.request_id, trace_id=self.trace_id)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        wrapper = self.wrapper
        assert wrapper is not None
        suppress = False
        try:
            if exc is None:
                pass
            elif isinstance(exc, Refusal):
                # After the answer began (a stream) a refusal can only cut it: the front drops it.
                suppress = not self.code
                wrapper.refused(self, exc)
            elif isinstance(exc, Exception):
                suppress = wrapper.internal_error(self, exc)
            else:
                # CancelledError (the server cancels a gone client's task), GeneratorExit (a stream's
                # consumer closed it): nobody is left to answer.
                self.code, self.reason = wrapper.code_of(self, Reason.CLIENT_GONE), Reason.CLIENT_GONE.value
            wrapper.finish(self)
        finally:
            structlog.contextvars.reset_contextvars(**self._tokens)
            wrapper.lifecycle.request_finished()
        return suppress


class RequestWrapper:
    """Opens request scopes for every front of one sidecar: shared telemetry and drain accounting."""

    def __init__(self, *, telemetry: RequestTelemetry, lifecycle: Lifecycle, spans: RequestSpans | None = None
                 ) -> None:
        self.telemetry = telemetry
        self.lifecycle = lifecycle
        #: One server span per request of `spans.protocols` (sidecar.tracing); None: tracing off.
        self.spans = spans

    def open(self, protocol: str, request_id: str | None, traceparent: str | None, *, method: str,
             path: str, client: str = "", tracestate: str | None = None, route: str = "") -> RequestScope:
        """The request's scope: the client's X-Request-ID when it is sane, else a new one. `client`: the
        subject of a mutual-TLS client certificate, for the access log. With tracing on, the request's
        span starts here, continuing the client's `traceparent` and `tracestate`; `route`: an HTTP
        request's route template (`/v2/models/{model}/infer`), "" when no route matched."""
        scope = RequestScope(protocol, self.telemetry.request_id(request_id), trace_id(traceparent), client=client,
                             method=method, path=path, wrapper=self)
        spans = self.spans
        if spans is not None and protocol in spans.protocols:
            spans.start(scope, traceparent, tracestate, method=method, path=path, route=route)
        return scope

    def annotate(self, scope: RequestContext, attributes: Attributes) -> None:
        """Attributes of a traced request's span (nothing when it is untraced)."""
        if scope.span is not None and self.spans is not None:
            self.spans.annotate(scope, attributes)

    def phase(self, scope: RequestContext, name: str) -> None:
        """A phase of a traced request ended now: an event with `sidecar.duration_ms` since the
        previous one (or the start), named as the Rust lane names its own (docs/tracing.md)."""
        if scope.span is None or self.spans is None:
            return
        now = time.perf_counter()
        elapsed_ms = (now - (scope.phase_mark or scope.started)) * 1000.0
        scope.phase_mark = now
        self.spans.event(scope, name, {"sidecar.duration_ms": round(elapsed_ms, 3)})

    def refuse_at_once(self, protocol: str, refusal: Refusal, *, method: str, path: str, label: str,
                       request_id: str | None = None, traceparent: str | None = None,
                       client: str = "", route: str = "") -> RequestScope:
        """A request refused before it became one (no route, body too large or too slow): counted
        and logged like any other; the front encodes `scope.refusal`."""
        scope = self.open(protocol, request_id, traceparent, method=method, path=path, client=client, route=route)
        scope.label = label
        # Counted for the drain all the same: a straggler shows the pod still gets traffic.
        self.lifecycle.request_started()
        self.lifecycle.request_finished()
        self.refused(scope, refusal)
        self.finish(scope)
        return scope

    # -- outcomes ----------------------------------------------------------------------------------------

    def refused(self, scope: RequestScope, refusal: Refusal) -> None:
        scope.reason = refusal.reason.value
        if not scope.code:
            scope.refusal = refusal
            scope.code = self.code_of(scope, refusal.reason)
        if refusal.before_triton:
            self.telemetry.rejected(scope, scope.reason)

    def internal_error(self, scope: RequestScope, error: Exception) -> bool:
        """The one place that decides what an unexpected exception becomes. True when it can still be
        answered (internal_error refusal); False when the answer had begun and the front must drop
        the connection (the exception goes on)."""
        self.telemetry.internal_error(scope)
        log.error("proxy_internal_error", model=scope.label, protocol=scope.protocol, method=scope.method,
                  path=scope.path, error=type(error).__name__, answer_begun=bool(scope.code), exc_info=error)
        if scope.code:
            scope.reason = Reason.INTERNAL_ERROR.value
            return False
        self.refused(scope, Refusal(
            Reason.INTERNAL_ERROR, f"the sidecar failed while answering this request ({type(error).__name__}); "
                                   f"this is a bug in the sidecar: its log has the traceback under request id "
                                   f"{scope.request_id}", model=scope.label if scope.label[:1] != "_" else "",
            before_triton=False))
        return True

    def finish(self, scope: RequestScope) -> None:
        code = scope.code or _OK.get(scope.protocol, "OK")
        failed = bool(scope.reason) or (code[:1] in "45" if scope.protocol == HTTP else code != "OK")
        self.telemetry.finish(scope, code, method=scope.method, path=scope.path, reason=scope.reason, failed=failed)
        if scope.span is not None:
            assert self.spans is not None
            refusal = scope.refusal
            self.spans.end(scope, code=code, reason=scope.reason, failed=failed,
                           description=f"[{scope.reason}] {refusal.message}" if refusal is not None
                           else scope.reason or code)

    @staticmethod
    def code_of(scope: RequestScope, reason: Reason) -> str:
        return str(reason.http_status) if scope.protocol == HTTP else reason.grpc_code
