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
import zlib
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import httptools
import structlog
from aiohttp import web

from sidecar.fronts.appkeys import CONFIG, SERVING, TLS, UPSTREAM_POOL
from sidecar.fronts.http_routes import (
    HttpInferExchange,
    body_timeout,
    body_too_large,
    check_body_headers,
    cohort_of,
    parse_header_length,
    unreadable_body,
)
from sidecar.fronts.tls import subject_of
from sidecar.serving.core import ServingCore
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.routing import VERSION_HEADER
from sidecar.serving.telemetry import HTTP, RequestContext

log = structlog.get_logger("sidecar.proxy")


_INFER_PATH = re.compile(r"/v2/models/([^/?#%]+)(?:/versions/([^/?#%]+))?/infer")


#: Encodings this path inflates itself; others (br, zstd) are left to aiohttp.
_INFLATED = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


#: Parsed requests a connection may queue (HTTP pipelining) before it stops reading.
MAX_PIPELINED = 8


_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 408: "Request Timeout",
            409: "Conflict", 413: "Payload Too Large", 415: "Unsupported Media Type", 429: "Too Many Requests",
            499: "Client Closed Request", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout"}


_SERVER = b"Server: triton-sidecar\r\n"


class _Abort(Exception):
    """Stops httptools mid-feed: the connection is handed over or answered and closed."""


class _Request:
    __slots__ = ("body", "complete", "fast", "headers", "keep_alive", "method", "model", "raw_headers", "size",
                 "url", "version")

    def __init__(self) -> None:
        self.url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.complete = False
        self.fast = False
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


class _Connection(asyncio.Protocol):
    def __init__(self, listener: SidecarListener) -> None:
        self._listener = listener
        self._core: ServingCore = listener.core
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        #: Every byte received, until the first request proves to be an inference.
        self._raw: bytearray | None = bytearray()
        self._current: _Request | None = None
        self._queue: collections.deque[_Request] = collections.deque()
        self._active: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._closing = False
        self._handing_over = False
        #: The client certificate's subject (mutual TLS), for the access log.
        self._client = ""

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._client = subject_of(transport.get_extra_info("peercert"))
        self._listener.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.connections.discard(self)
        self._closing = True
        self._cancel_timer()
        if self._active is not None:
            self._active.cancel()  # the client left: its upstream call is cancelled, 499 counted

    def data_received(self, data: bytes) -> None:
        if self._raw is not None:
            self._raw += data
        try:
            self._parser.feed_data(data)
        except _Abort:
            return
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _Abort):
                return
            raise
        except httptools.HttpParserError as e:
            # Not HTTP as we read it: aiohttp answers it as it always has, if nothing was answered yet.
            if self._raw is not None:
                self._hand_over(bytes(self._raw))
            elif self._active is None and not self._queue:
                self._refuse_now(self._current or _Request(), Refusal(Reason.MALFORMED, f"not valid HTTP: {e}"))
            else:
                self._close()
            return
        if self._current is not None and self._current.fast and not self._current.complete and self._timer is None:
            timeout_s = self._core.settings.client_body_timeout_s
            self._timer = asyncio.get_running_loop().call_later(timeout_s, self._body_timed_out, timeout_s)
        self._pump()

    def eof_received(self) -> bool | None:
        return None

    # -- httptools callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._current = _Request()

    def on_url(self, url: bytes) -> None:
        assert self._current is not None
        self._current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._current is not None
        self._current.raw_headers.append((name, value))
        self._current.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        request = self._current
        assert request is not None
        request.method = self._parser.get_method()
        request.version = self._parser.get_http_version()
        request.keep_alive = self._parser.should_keep_alive()
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
                self._refuse_now(request, body_too_large(limit, request.model))
                raise _Abort
        if request.headers.get("expect", "").lower() == "100-continue" and self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        request = self._current
        assert request is not None
        request.body.append(body)
        request.size += len(body)
        limit = self._core.config.validation.max_body_bytes
        if request.size > limit:
            self._refuse_now(request, body_too_large(limit, request.model))
            raise _Abort

    def on_message_complete(self) -> None:
        request = self._current
        assert request is not None
        request.complete = True
        self._current = None
        self._cancel_timer()
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

    def _pump(self) -> None:
        """Start the next queued request once the one before it has been answered."""
        if self._active is not None or self._closing:
            return
        while self._queue:
            request = self._queue[0]
            if not request.fast:
                if self._current is None:  # at a message boundary: hand the rest to aiohttp
                    self._hand_over(b"".join(r.rewritten() for r in self._queue))
                return
            self._queue.popleft()
            self._active = asyncio.get_running_loop().create_task(self._serve(request))
            self._active.add_done_callback(self._served)
            return
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def _served(self, task: asyncio.Task[None]) -> None:
        self._active = None
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
        self._cancel_timer()
        self._listener.connections.discard(self)
        protocol = self._listener.aiohttp_protocol()
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
        scope = self._core.request(HTTP, headers.get("x-request-id"), headers.get("traceparent"), method="POST",
                                   path=request.url.decode("latin-1"), client=self._client)
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
        forwarded = {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
        exchange = HttpInferExchange(self._listener.app[UPSTREAM_POOL], core.settings.upstream_timeout_s, ctx, model,
                                     version, body, header_length, forwarded, lambda: self._closing)
        return await core.infer(model, version, exchange, cohort_of(core, model, headers))

    def _write(self, status: int, headers: dict[str, str], body: bytes, request_id: str, keep_alive: bool) -> None:
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
        if not keep_alive:
            self._close()

    def _refuse_now(self, request: _Request, refusal: Refusal) -> None:
        """Answer before the body is read (too large, too slow), then close: the rest is never read."""
        if self._active is not None or self._queue:
            # Earlier pipelined requests are not answered yet: an answer now would come out of order.
            self._abort()
            return
        core = self._core
        scope = core.requests.refuse_at_once(HTTP, refusal, method="POST", path=request.url.decode("latin-1"),
                                             label=core.admission.label(unquote(request.model)),
                                             request_id=request.headers.get("x-request-id"),
                                             traceparent=request.headers.get("traceparent"),
                                             client=self._client)
        status, headers, body = _refusal_parts(refusal)
        self._write(status, headers, body, scope.request_id, keep_alive=False)
        self._close()

    def _body_timed_out(self, timeout_s: float) -> None:
        self._timer = None
        request = self._current
        if request is not None and not request.complete and self._active is None:
            self._refuse_now(request, body_timeout(timeout_s, request.model))
        elif request is not None and not request.complete:
            # An earlier request is still being answered: answer this one when its turn comes.
            self._timer = asyncio.get_running_loop().call_later(0.05, self._body_timed_out, timeout_s)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close(self) -> None:
        self._closing = True
        self._cancel_timer()
        if self._transport is not None:
            self._transport.close()

    def _abort(self) -> None:
        """Close at once; a request being answered is cancelled (its client sees the connection end)."""
        if self._active is not None:
            self._active.cancel()
        self._close()


def _refusal_parts(refusal: Refusal) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json; charset=utf-8"}
    if refusal.retry_after is not None:
        headers["Retry-After"] = str(refusal.retry_after)
    return refusal.status, headers, json.dumps(refusal.body()).encode()


def _inflate(body: bytes, encoding: str, limit: int, model: str) -> bytes:
    """The inflated body, never more than `limit` bytes of it (a zip bomb stops at the limit)."""
    inflater = zlib.decompressobj(_INFLATED[encoding])
    try:
        out = inflater.decompress(body, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise body_too_large(limit, model)
        out += inflater.flush()
    except zlib.error as e:
        raise unreadable_body(encoding, e, model) from e
    if len(out) > limit:
        raise body_too_large(limit, model)
    return out


def app_runner(app: web.Application) -> web.AppRunner:
    """How the sidecar is served. handler_cancellation: aiohttp cancels the handler of a client that
    disconnects, so its upstream call to Triton is cancelled and its breaker slot freed at once.
    Signals are the CLI's (drain first); the proxy writes its own sampled access log."""
    return web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)


class SidecarListener:
    """One listening socket for the whole sidecar: the fast inference path and the aiohttp app."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.runner = app_runner(app)
        self.connections: set[_Connection] = set()
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

    def aiohttp_protocol(self) -> asyncio.Protocol:
        return self._aiohttp_server()  # type: ignore[no-any-return]

    async def start(self, host: str, port: int) -> None:
        await self.runner.setup()
        self._aiohttp_server = self.runner.server
        loop = asyncio.get_running_loop()
        factory: Any = lambda: _Connection(self)  # noqa: E731
        tls = self.app.get(TLS)
        if tls is not None:  # every connection completes a TLS handshake first (sidecar/fronts/tls.py)
            factory = tls.protocol_factory(factory)
        self._server = await loop.create_server(factory, host, port, reuse_address=True)

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

