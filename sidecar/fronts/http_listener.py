"""The sidecar's HTTP listener: inference requests on a lean httptools path, everything else on aiohttp.

Most of a proxied request's CPU went to HTTP machinery, not to the sidecar's checks (bench/RESULTS.md).
So one listening socket serves two ways:

- `POST /v2/models/{m}[/versions/{v}]/infer` is parsed with httptools and answered here: the same
  serving core (`ServingCore.infer`), the same refusals, metrics and access log as the aiohttp
  handler, but no aiohttp request, router, middleware or response objects on the hot path.
- Any other request (kubelet probes, /metrics, metadata, the control API that is refused, malformed
  HTTP) hands the connection to aiohttp's own protocol, which then owns it until it closes. The first
  request of a connection is handed over as the very bytes received; a later one (a keep-alive client
  that asks for metadata after inferring) as the parsed request written out again, always at a
  message boundary and after every earlier answer was written, so order is kept.

Answers on this path match aiohttp's: the JSON refusals, 413 before the body is read, 408 for a
body that trickles in slower than `proxy.client_body_timeout_s`, gzip/deflate inflated with the limit
counted in inflated bytes, 100-continue, keep-alive, a client that disconnects cancels its upstream
call (499 in the metrics).
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import httptools
import structlog
from aiohttp import web

from sidecar._dataplane import inflate
from sidecar.config import ListenSection
from sidecar.fronts.appkeys import CONFIG, SERVING, TLS, UPSTREAM_POOL
from sidecar.fronts.http_routes import (
    HttpInferExchange,
    body_timeout,
    body_too_large,
    check_body_headers,
    cohort_of,
    forwarded_headers,
    parse_header_length,
    unreadable_body,
)
from sidecar.fronts.tls import subject_of
from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import ServingCore
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.routing import VERSION_HEADER
from sidecar.serving.telemetry import HTTP, RequestContext

log = structlog.get_logger("sidecar.proxy")


_INFER_PATH = re.compile(r"/v2/models/([^/?#%]+)(?:/versions/([^/?#%]+))?/infer")

#: The route templates of the requests served here, as aiohttp's router names them (the span's name).
_INFER_ROUTE = "/v2/models/{model}/infer"
_VERSIONED_INFER_ROUTE = "/v2/models/{model}/versions/{version}/infer"


#: Encodings this path inflates itself (the data plane's rule, the Rust front's too); br is left to
#: aiohttp.
_INFLATED = frozenset({"gzip", "deflate", "zstd"})


#: Parsed requests a connection may queue (HTTP pipelining) before it stops reading.
MAX_PIPELINED = 8


_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 408: "Request Timeout",
            409: "Conflict", 413: "Payload Too Large", 414: "URI Too Long", 415: "Unsupported Media Type",
            429: "Too Many Requests", 431: "Request Header Fields Too Large",
            499: "Client Closed Request", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout"}


_SERVER = b"Server: triton-sidecar\r\n"


class _Abort(Exception):
    """Stops httptools mid-feed: the connection is handed over or answered and closed."""


class _Request:
    __slots__ = ("begun_at", "body", "complete", "fast", "headers", "headers_done", "keep_alive", "method", "model",
                 "raw_headers", "refused", "size", "url", "version")

    def __init__(self, begun_at: float) -> None:
        self.begun_at = begun_at
        self.url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.complete = False
        self.headers_done = False
        self.fast = False
        #: Answered early (413, 408): the rest of its body is read and thrown away.
        self.refused = False
        self.keep_alive = True
        self.method = b""
        self.version = "1.1"
        self.model = ""

    def rewritten(self) -> bytes:
        """The request as bytes again (its body already de-chunked), for aiohttp to read."""
        lines = [b"%s %s HTTP/%s\r\n" % (self.method, self.url, self.version.encode())]
        for name, value in self.raw_headers:
            if name.lower() not in (b"content-length", b"transfer-encoding", b"expect"):
                lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(b"Content-Length: %d\r\n\r\n" % self.size)
        return b"".join(lines) + b"".join(self.body)


class _DateHeader:
    """The Date header, formatted once per second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = b"Date: %s\r\n" % formatdate(now, usegmt=True).encode()
        return self._value


#: Bytes of a request line and its headers beyond max_url_bytes + max_header_bytes (the method, the
#: version, the separators): httptools buffers a header inside itself until it is complete, so the
#: bytes received before the headers end are counted here too and bound that buffer.
_HEAD_SLACK = 4096


class _Connection(asyncio.Protocol):
    """One client connection. Its timeouts share one timer (`_watch`), moved lazily: a request only
    stores a time, and the timer, when it fires, works out which bound applies now (headers, keep-alive
    idle, lingering) and closes or re-arms. So a request costs no timer of its own."""

    def __init__(self, listener: SidecarListener) -> None:
        self._listener = listener
        self._core: ServingCore = listener.core
        self._limits = listener.limits
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        #: Every byte received, until the first request proves to be an inference.
        self._raw: bytearray | None = bytearray()
        self._current: _Request | None = None
        self._queue: collections.deque[_Request] = collections.deque()
        self._active: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._paused = False
        self._closing = False
        self._handing_over = False
        self._counted = False
        #: Since when the connection has had nothing to do (None while a request is in progress), and
        #: whether it answered a request yet (then its idle bound is keepalive_timeout_s, else header_timeout_s).
        self._idle_since: float | None = self._loop.time()
        self._answered_any = False
        #: Bytes received for the current request's line and headers (bounded: see _HEAD_SLACK).
        self._head_bytes = 0
        self._header_bytes = 0
        #: An early refusal: the refused request, its answer until earlier pipelined answers are out,
        #: whether the parser still reads it (to find where its body ends) or bytes are only counted.
        self._refused: _Request | None = None
        self._pending: Refusal | None = None
        self._discarding = False
        self._lingering = False
        self._client_done = False
        self._linger_started = 0.0
        self._linger_last = 0.0
        self._linger_bytes = 0
        #: The client certificate's subject (mutual TLS), for the access log.
        self._client = ""

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if not self._listener.admit():
            self._closing = True
            transport.close()  # accepted and closed at once: listen.max_connections are open
            return
        self._counted = True
        self._client = subject_of(transport.get_extra_info("peercert"))
        self._listener.connections.add(self)
        self._watch = self._loop.call_at(self._idle_since + self._limits.header_timeout_s,  # type: ignore[operator]
                                         self._check_deadlines)

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.connections.discard(self)
        if self._counted and not self._handing_over:
            self._listener.released()
        self._closing = True
        self._cancel_timers()
        if self._active is not None:
            self._active.cancel()  # the client left: its upstream call is cancelled, 499 counted

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            self._linger_bytes += len(data)
            self._linger_last = self._loop.time()
            if self._linger_bytes > self._limits.lingering_max_bytes:
                self._end_lingering("bytes")
                return
            if self._discarding:
                return
        if self._raw is not None:
            self._raw += data
        current = self._current
        if current is None or not current.headers_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except _Abort:
            self._pump()  # requests parsed before the one that stopped the parser are served
            return
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _Abort):
                self._pump()
                return
            raise
        except httptools.HttpParserError as e:
            if self._refused is not None:
                self._discarding = True  # the refused request's body does not parse: count, do not read
            else:
                # Not HTTP as we read it (aiohttp's parser is llhttp too and would refuse it alike):
                # the usual JSON 400, and nothing of it is ever handed on.
                self._refuse(self._current or self._new_request(), Refusal(Reason.MALFORMED, f"not valid HTTP: {e}"),
                             drain=False)
            self._pump()
            return
        current = self._current
        if current is not None and not current.headers_done and self._head_bytes > self._head_limit():
            self._refuse(current, _headers_too_large(self._limits), drain=False)
            return
        if current is not None and current.fast and not current.complete and not current.refused and (
                self._timer is None):
            timeout_s = self._core.settings.client_body_timeout_s
            self._timer = self._loop.call_later(timeout_s, self._body_timed_out, timeout_s)
        self._pump()

    def eof_received(self) -> bool | None:
        if self._refused is not None:
            if self._lingering:
                self._end_lingering("client_closed")
                return True
            self._client_done = True  # the refusal is written once earlier answers are out, then closed
            return True
        return None

    # -- httptools callbacks ------------------------------------------------------------------------

    def _new_request(self) -> _Request:
        return _Request(self._loop.time())

    def on_message_begin(self) -> None:
        self._current = self._new_request()
        self._header_bytes = 0
        self._idle_since = None

    def on_url(self, url: bytes) -> None:
        request = self._current
        assert request is not None
        request.url += url
        if len(request.url) > self._limits.max_url_bytes:
            self._refuse(request, Refusal(Reason.URL_TOO_LONG, f"request target longer than "
                                                               f"{self._limits.max_url_bytes} bytes "
                                                               "(listen.max_url_bytes)"), drain=False)
            raise _Abort

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._current
        assert request is not None
        request.raw_headers.append((name, value))
        request.headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        self._header_bytes += len(name) + len(value)
        limits = self._limits
        if self._header_bytes > limits.max_header_bytes or len(request.raw_headers) > limits.max_headers:
            self._refuse(request, _headers_too_large(limits), drain=False)
            raise _Abort

    def on_headers_complete(self) -> None:
        request = self._current
        assert request is not None
        request.headers_done = True
        self._head_bytes = 0
        request.method = self._parser.get_method()
        request.version = self._parser.get_http_version()
        request.keep_alive = self._parser.should_keep_alive()
        smuggling = _smuggling(request.headers)
        if smuggling:
            # Content-Length with Transfer-Encoding, or a coding other than chunked: two servers could
            # frame this body differently (request smuggling); refused as nginx does, never handed on.
            self._refuse(request, Refusal(Reason.MALFORMED, smuggling), drain=False)
            raise _Abort
        request.fast = self._is_fast(request)
        if not request.fast and self._raw is not None:
            # The connection's first request is not an inference: aiohttp reads it from the start.
            self._hand_over(bytes(self._raw))
            raise _Abort
        if request.fast:
            self._raw = None
            declared = request.headers.get("content-length")
            limit = self._core.config.validation.max_body_bytes
            if declared is not None and declared.isdigit() and int(declared) > limit:
                self._refuse(request, body_too_large(limit, request.model), drain=True)
                return  # no 100 Continue: the refusal is the answer
        if request.headers.get("expect", "").lower() == "100-continue" and self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        request = self._current
        assert request is not None
        if request.refused:
            return  # drained: read to find the body's end, never kept
        request.body.append(body)
        request.size += len(body)
        limit = self._core.config.validation.max_body_bytes
        if request.size > limit:
            self._refuse(request, body_too_large(limit, request.model), drain=True)

    def on_message_complete(self) -> None:
        request = self._current
        assert request is not None
        request.complete = True
        self._current = None
        self._cancel_timer()
        if request.refused:
            # The refused body has been read to its end: what follows is never read as requests.
            self._discarding = True
            if self._lingering:
                self._end_lingering("drained")
            raise _Abort
        self._queue.append(request)
        if len(self._queue) >= MAX_PIPELINED and self._transport is not None and not self._paused:
            self._paused = True
            self._transport.pause_reading()

    # -- dispatch -------------------------------------------------------------------------------------

    def _is_fast(self, request: _Request) -> bool:
        if not self._listener.fast_infer:
            return False
        if request.method != b"POST" or request.version != "1.1" or self._parser.should_upgrade():
            return False
        match = _INFER_PATH.fullmatch(request.url.decode("latin-1"))
        if match is None:
            return False
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity") and encoding not in _INFLATED:
            return False
        request.model = match.group(1)
        return True

    def _head_limit(self) -> int:
        return self._limits.max_url_bytes + self._limits.max_header_bytes + _HEAD_SLACK

    def _pump(self) -> None:
        """Start the next queued request once the one before it has been answered."""
        if self._active is not None or self._closing:
            return
        while self._queue:
            request = self._queue[0]
            if not request.fast:
                if self._refused is not None:
                    # A request for aiohttp, then one refused mid-body: aiohttp cannot take the
                    # connection at a message boundary, so it ends here (the rare price of pipelining both).
                    self._close()
                elif self._current is None:  # at a message boundary: hand the rest to aiohttp
                    self._hand_over(b"".join(r.rewritten() for r in self._queue))
                return
            self._queue.popleft()
            self._active = self._loop.create_task(self._serve(request))
            self._active.add_done_callback(self._served)
            return
        if self._pending is not None and self._refused is not None:
            refusal, self._pending = self._pending, None
            self._answer_refusal(self._refused, refusal)
            return
        if self._current is None and self._idle_since is None:
            self._idle_since = self._loop.time()
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def _served(self, task: asyncio.Task[None]) -> None:
        self._active = None
        self._answered_any = True
        if not task.cancelled() and task.exception() is not None:
            # Past the request's scope (writing the answer): the connection cannot be trusted any more.
            log.error("proxy_request_crashed", exc_info=task.exception())
            self._close()
            return
        self._pump()

    def _hand_over(self, data: bytes) -> None:
        """aiohttp's protocol takes over this connection, starting with `data`."""
        transport = self._transport
        if transport is None or self._handing_over:
            return
        self._handing_over = True
        self._listener.handovers += 1
        self._closing = True
        self._cancel_timers()
        self._listener.connections.discard(self)
        protocol = _HandedOver(self._listener.aiohttp_protocol(), self._listener)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data:
            protocol.data_received(data)
        if self._paused:
            transport.resume_reading()

    # -- answering ------------------------------------------------------------------------------------

    async def _serve(self, request: _Request) -> None:
        self._listener.fast_requests += 1
        headers = request.headers
        url = request.url.decode("latin-1")
        scope = self._core.request(HTTP, headers.get("x-request-id"), headers.get("traceparent"), method="POST",
                                   path=url, client=self._client, tracestate=headers.get("tracestate"),
                                   route=_VERSIONED_INFER_ROUTE if "/versions/" in url else _INFER_ROUTE)
        async with scope:
            status, answer_headers, body = await self._infer(request, scope)
            scope.answered(status)
        if scope.refusal is not None:
            status, answer_headers, body = _refusal_parts(scope.refusal)
        self._write(status, answer_headers, body, scope.request_id, request.keep_alive)

    async def _infer(self, request: _Request, ctx: RequestContext) -> tuple[int, dict[str, str], bytes]:
        core = self._core
        match = _INFER_PATH.fullmatch(request.url.decode("latin-1"))
        assert match is not None
        model, path_version = unquote(match.group(1)), unquote(match.group(2) or "")
        core.resolve(ctx, model, path_version)
        headers = request.headers
        version = core.pinned(model, path_version, headers.get(VERSION_HEADER))
        header_length = parse_header_length(headers.get("inference-header-content-length"), model)
        encoding = check_body_headers(headers.get("content-type", ""), headers.get("content-encoding", "identity"),
                                      model)
        body = b"".join(request.body)
        if encoding in _INFLATED:
            body = _inflate(body, encoding, core.config.validation.max_body_bytes, model)
        forwarded = forwarded_headers(headers, ctx)
        exchange = HttpInferExchange(self._listener.app[UPSTREAM_POOL], core.settings.upstream_timeout_s, ctx, model,
                                     version, body, header_length, forwarded, lambda: self._closing)
        return await core.infer(model, version, exchange, cohort_of(core, model, headers), ctx=ctx)

    def _write(self, status: int, headers: dict[str, str], body: bytes, request_id: str, keep_alive: bool,
               close: bool = True) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "Unknown").encode()),
                b"Content-Type: %s\r\n" % headers.get("Content-Type", "application/json").encode("latin-1"),
                b"Content-Length: %d\r\n" % len(body),
                b"X-Request-ID: %s\r\n" % request_id.encode("latin-1")]
        for name in ("Inference-Header-Content-Length", "Retry-After"):
            if name in headers:
                head.append(b"%s: %s\r\n" % (name.encode(), headers[name].encode("latin-1")))
        head.append(self._listener.date.get())
        head.append(_SERVER)
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        transport.write(b"".join(head) + body)
        if not keep_alive and close:
            self._close()

    def _refuse(self, request: _Request, refusal: Refusal, *, drain: bool) -> None:
        """Answer before the request is read (too large, too slow, not HTTP, headers over a limit).
        The answer waits for earlier pipelined answers (they are never cancelled); the rest of the
        request is read and thrown away: through the parser when `drain` (so the connection closes
        where the body ends), else only counted (the bytes cannot be framed any more)."""
        if self._refused is not None:
            return
        if not request.method:  # refused before its headers ended: the request line was read
            try:
                request.method = self._parser.get_method()
            except httptools.HttpParserError:
                pass
        request.refused = True
        request.body = []
        self._refused = request
        self._raw = None
        self._discarding = not drain
        self._cancel_timer()
        self._linger_last = self._loop.time()
        if self._active is None and not self._queue:
            self._answer_refusal(request, refusal)
        else:
            self._pending = refusal

    def _answer_refusal(self, request: _Request, refusal: Refusal) -> None:
        """Write the refusal, half-close, and linger until the client is done (bounded)."""
        core = self._core
        scope = core.requests.refuse_at_once(HTTP, refusal, method=request.method.decode("latin-1"),
                                             path=request.url.decode("latin-1"),
                                             label=core.admission.label(unquote(request.model)),
                                             request_id=request.headers.get("x-request-id"),
                                             traceparent=request.headers.get("traceparent"),
                                             client=self._client)
        status, headers, body = _refusal_parts(refusal)
        self._write(status, headers, body, scope.request_id, keep_alive=False, close=False)
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if request.complete or self._client_done:
            self._end_lingering("drained" if request.complete else "client_closed")
            return
        if transport.can_write_eof():
            transport.write_eof()  # the client reads the answer and then an end, while we go on reading
        self._lingering = True
        self._linger_started = self._linger_last = self._loop.time()
        self._rearm(self._linger_last)

    def _end_lingering(self, how: str) -> None:
        self._listener.metrics.requests.lingering_end(how)
        self._close()

    def _body_timed_out(self, timeout_s: float) -> None:
        self._timer = None
        request = self._current
        if request is not None and not request.complete:
            self._refuse(request, body_timeout(timeout_s, request.model), drain=True)

    # -- timeouts ---------------------------------------------------------------------------------------

    def _rearm(self, now: float) -> None:
        """Make sure the watch fires by the nearest bound from `now` (lingering bounds are shorter
        than the watch may be set for)."""
        limits = self._limits
        at = now + min(limits.lingering_timeout_s, limits.lingering_time_s)
        if self._watch is not None and self._watch.when() <= at:
            return
        if self._watch is not None:
            self._watch.cancel()
        self._watch = self._loop.call_at(at, self._check_deadlines)

    def _check_deadlines(self) -> None:
        """The watch: close the connection whose current bound passed, else re-arm at its deadline."""
        self._watch = None
        if self._closing:
            return
        limits, now = self._limits, self._loop.time()
        current = self._current
        if self._lingering:
            ends = min(self._linger_started + limits.lingering_time_s, self._linger_last + limits.lingering_timeout_s)
            if now >= ends:
                self._end_lingering("time" if ends == self._linger_started + limits.lingering_time_s else "idle")
                return
        elif self._refused is not None:
            ends = now + limits.header_timeout_s  # an earlier request is still being answered
        elif current is not None and not current.headers_done and self._active is None and not self._queue:
            ends = current.begun_at + limits.header_timeout_s
            if now >= ends:
                self._listener.metrics.requests.connection_timeout("header")
                self._header_timed_out(current)
                return
        elif current is None and self._idle_since is not None and self._active is None and not self._queue:
            phase = "keepalive" if self._answered_any else "header"
            ends = self._idle_since + (limits.keepalive_timeout_s if self._answered_any else limits.header_timeout_s)
            if now >= ends:
                self._listener.metrics.requests.connection_timeout(phase)
                self._close()
                return
        else:
            ends = now + limits.header_timeout_s  # busy (a body arriving, an answer pending): look again later
        self._watch = self._loop.call_at(ends, self._check_deadlines)

    def _header_timed_out(self, request: _Request) -> None:
        """408 and close at once: a client that trickles its headers is not one that reads answers
        (lingering would hold its descriptor longer still)."""
        if self._active is None and not self._queue:
            refusal = Refusal(Reason.HEADER_TIMEOUT, f"request headers not received within "
                                                     f"{self._limits.header_timeout_s:g} s (listen.header_timeout_s)")
            status, headers, body = _refusal_parts(refusal)
            scope = self._core.requests.refuse_at_once(HTTP, refusal, method="", path=request.url.decode("latin-1"),
                                                       label=self._core.admission.label(""), client=self._client)
            self._write(status, headers, body, scope.request_id, keep_alive=False, close=False)
        self._abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_timers(self) -> None:
        self._cancel_timer()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _close(self) -> None:
        self._closing = True
        self._cancel_timers()
        if self._transport is not None:
            self._transport.close()

    def _abort(self) -> None:
        """Close at once; a request being answered is cancelled (its client sees the connection end)."""
        if self._active is not None:
            self._active.cancel()
        self._close()


class _HandedOver(asyncio.Protocol):
    """aiohttp's protocol on a connection the listener handed over, so the listener knows when it
    closes (listen.max_connections counts every client connection, whoever serves it)."""

    def __init__(self, inner: asyncio.Protocol, listener: SidecarListener) -> None:
        self._inner = inner
        self._listener = listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.released()
        self._inner.connection_lost(exc)


def _headers_too_large(limits: ListenSection) -> Refusal:
    return Refusal(Reason.HEADERS_TOO_LARGE, f"request headers over {limits.max_header_bytes} bytes or "
                                             f"{limits.max_headers} fields (listen.max_header_bytes, "
                                             "listen.max_headers)")


def _smuggling(headers: dict[str, str]) -> str:
    """Why a request's framing is ambiguous ("" when it is not). httptools has already refused two
    different Content-Lengths; a repeated Transfer-Encoding arrives here joined by the dict (last one)."""
    coding = headers.get("transfer-encoding")
    if coding is None:
        return ""
    if "content-length" in headers:
        return "both Content-Length and Transfer-Encoding: the body's framing is ambiguous"
    if coding.strip().lower() != "chunked":
        return f"Transfer-Encoding {cut(coding)!r}: only chunked is accepted"
    return ""


def _refusal_parts(refusal: Refusal) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json; charset=utf-8"}
    if refusal.retry_after is not None:
        headers["Retry-After"] = str(refusal.retry_after)
    return refusal.status, headers, json.dumps(refusal.body()).encode()


def _inflate(body: bytes, encoding: str, limit: int, model: str) -> bytes:
    """The inflated body, never more than `limit` bytes of it (a zip bomb stops at the limit): the
    Rust front's rule (sidecar._dataplane.inflate), so both fronts refuse the same bodies alike."""
    try:
        out = inflate(body, encoding, limit)
    except ValueError as e:
        raise unreadable_body(encoding, e, model) from e
    if out is None:
        raise body_too_large(limit, model)
    return out


def app_runner(app: web.Application) -> web.AppRunner:
    """How the sidecar is served. handler_cancellation: aiohttp cancels the handler of a client that
    disconnects, so its upstream call to Triton is cancelled and its breaker slot freed at once.
    Signals are the CLI's (drain first); the proxy writes its own sampled access log. A connection
    handed to aiohttp keeps the listener's bounds where aiohttp has one (its own keep-alive default
    is an hour): idle time, header count and size, lingering."""
    limits = app[CONFIG].listen
    return web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                         keepalive_timeout=limits.keepalive_timeout_s, max_headers=limits.max_headers,
                         max_line_size=limits.max_url_bytes + _REQUEST_LINE_SLACK,
                         max_field_size=min(limits.max_header_bytes, 65536),
                         lingering_time=limits.lingering_time_s)


#: The method, spaces and HTTP version around the URL on a request line (aiohttp bounds the line).
_REQUEST_LINE_SLACK = 32


class SidecarListener:
    """One listening socket for the whole sidecar: the fast inference path and the aiohttp app."""

    def __init__(self, app: web.Application, *, behind_front: bool = False) -> None:
        self.app = app
        #: Behind the Rust front (sidecar/fronts/http_front.py) on loopback: the front counts and
        #: bounds the client connections, so this listener does neither.
        self.behind_front = behind_front
        self.runner = app_runner(app)
        self.limits: ListenSection = app[CONFIG].listen
        self.metrics: SidecarMetrics = app[SERVING].metrics
        #: Fast-path connections (closed at shutdown) and every client connection open, handed over or not.
        self.connections: set[_Connection] = set()
        self.open_connections = 0
        self.date = _DateHeader()
        #: Requests answered on the fast path, and connections handed to aiohttp (tests read them).
        self.fast_requests = 0
        self.handovers = 0
        self.fast_infer = app[CONFIG].listen.fast_infer
        self._server: asyncio.Server | None = None
        self._aiohttp_server: Any = None

    @property
    def core(self) -> ServingCore:
        return self.app[SERVING]

    def admit(self) -> bool:
        """A new client connection: counted, or refused when listen.max_connections are open."""
        if self.behind_front:
            self.open_connections += 1
            return True
        if self.open_connections >= self.limits.max_connections:
            self.metrics.requests.connection_refused()
            return False
        self.open_connections += 1
        self.metrics.requests.connection_opened(1)
        return True

    def released(self) -> None:
        self.open_connections -= 1
        if not self.behind_front:
            self.metrics.requests.connection_opened(-1)

    def aiohttp_protocol(self) -> asyncio.Protocol:
        return self._aiohttp_server()  # type: ignore[no-any-return]

    async def start(self, host: str, port: int) -> None:
        await self.runner.setup()
        self._aiohttp_server = self.runner.server
        loop = asyncio.get_running_loop()
        factory: Any = lambda: _Connection(self)  # noqa: E731
        tls = self.app.get(TLS)
        # Every connection completes a TLS handshake first (sidecar/fronts/tls.py); behind the Rust
        # front, which terminated it already, the loopback connections are plaintext.
        if tls is not None and not self.behind_front:
            factory = tls.protocol_factory(factory)
        # The accept queue holds a burst as large as listen.max_connections (the kernel caps it at
        # net.core.somaxconn): asyncio's default of 100 dropped the SYNs of a larger burst, whose
        # clients then waited out TCP's 1-3-7 s retransmissions before they were even accepted.
        self._server = await loop.create_server(factory, host, port, reuse_address=True,
                                                backlog=self.limits.max_connections)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting and close every connection (the CLI drained in-flight requests before)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection._abort()
        await self.runner.cleanup()

