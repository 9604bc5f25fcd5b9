"""Connections to Triton: a small HTTP/1.1 client pool over asyncio protocols, httptools-parsed. The
proxy has one (sidecar.fronts), the probes another (sidecar.health.triton_client): a probe must get
through while the proxy's pool is saturated.

aiohttp's ClientSession was about a third of the sidecar's CPU per proxied request (bench/RESULTS.md):
request and response objects, header multidicts, a stream reader and a timer per call. A proxy that
holds the whole request body and wants the whole answer needs none of that: one write, one parser,
one future. What a production client must still handle, and how:

- keep-alive: an answered connection goes back to an idle stack (LIFO: the most recently used one is
  the likeliest to be still open and warm), at most `max_idle` of them; one idle for longer than
  `idle_timeout_s` is closed instead of reused.
- a connection Triton closed while it sat idle is noticed by its protocol (EOF, reset) and never
  used again; a request is retried once, on a fresh connection, only when nothing of it was sent
  (the first write failed at once). Once bytes went out it is not retried: an inference is not
  known to be idempotent (sequence models).
- a connect bound and a total bound per request (`TimeoutError`, as aiohttp raised); an answer that
  overran its bound leaves its connection closed, never pooled.
- cancellation (the client went away): the connection is aborted, never pooled, so Triton sees the
  request end and a half-read answer can never be mistaken for the next request's.
- request and response bodies of any size; answers framed by Content-Length, chunked, or by the
  connection's end (close-delimited).
- Triton down or restarting: a refused connection is `UpstreamUnreachable`; the pooled connections of
  the dead server were closed by their protocols, so the first requests after a restart open new ones.
- streams (`UpstreamPool.stream`, for generate_stream's server-sent events): the answer's head is
  returned as soon as it is parsed and its body is read chunk by chunk as Triton sends it. The
  connection goes back to the pool only when its body was read to its end; a stream closed before
  that (the client left, the stream was ended) aborts it. A reader that falls behind stops the
  socket being read (`STREAM_HIGH_WATER`), so a slow client slows Triton down instead of filling
  the sidecar's memory.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

#: Idle keep-alive connections kept per pool. Concurrency is bounded per model by the breaker
#: (proxy.max_in_flight_per_model, 64 by default); this keeps a burst's connections for the next
#: one without holding hundreds of sockets after a spike.
MAX_IDLE = 64


#: An idle connection is closed after this (s): servers and NATs drop idle connections silently
#: after a while, and a request must not be the one to find out; and a pool that grew in a burst
#: gives its sockets back. 15 s is aiohttp's client keep-alive.
IDLE_TIMEOUT_S = 15.0


#: A request body up to this size (bytes) goes out in the same write as its head (one syscall); a
#: larger one is written on its own so it is not copied to be joined.
_JOIN_LIMIT = 64 * 1024


#: Bytes of a streamed body waiting for their reader before the socket stops being read (TCP then
#: pushes back on Triton): a few hundred events, never a burst's worth of memory per slow client.
STREAM_HIGH_WATER = 256 * 1024


#: Answers that carry no body by definition (RFC 9110 6.4.1), whatever their headers say.
_NO_BODY = frozenset({204, 304})


class UpstreamError(Exception):
    """No usable answer from Triton."""


class UpstreamUnreachable(UpstreamError):
    """No connection could be opened: Triton is down or restarting."""


class UpstreamDropped(UpstreamError):
    """The connection broke after (part of) the request was sent, or the answer is not HTTP."""


class UpstreamAnswer:
    """Triton's answer: its status, its headers (names lower-cased, the last value of a repeated
    one) and its whole body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class UpstreamStream:
    """An answer being streamed: its status and headers at once, its body as it arrives.

    `read()` returns the next bytes (b"" at the body's end) and raises UpstreamDropped when the
    connection breaks first. `close()` must be called once done: it hands the connection back to the
    pool when the body was read to its end, and aborts it otherwise (Triton then ends the request)."""

    __slots__ = ("_buffered", "_chunks", "_connection", "_error", "_pool", "_waiter", "complete", "headers",
                 "keep_alive", "status")

    def __init__(self, pool: UpstreamPool, connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self.status = status
        self.headers = headers
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        #: The whole body arrived (its last byte is in `_chunks` or was read).
        self.complete = False
        self.keep_alive = False

    async def read(self) -> bytes:
        """Every byte that arrived since the last read (waiting for at least one), b"" at the end."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._pool.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > STREAM_HIGH_WATER and self._connection is not None:
            self._connection.resume_reading()
        self._buffered = 0
        return data

    async def read_all(self, limit: int) -> bytes:
        """The rest of the body, at most `limit` bytes of it (an error answer: Triton writes one line)."""
        parts, size = [], 0
        while size < limit and (chunk := await self.read()):
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)[:limit]

    def close(self) -> None:
        """Back to the pool when read to its end, else aborted; idempotent."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.stream = None
        if self.complete and not self._chunks and self.keep_alive:
            self._pool._release(connection, self._pool.loop.time())
        else:
            connection.abort()

    # -- the connection's side ----------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > STREAM_HIGH_WATER and self._connection is not None:
            self._connection.pause_reading()
        self._wake()

    def _end(self, *, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive
        self._wake()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One TCP connection to Triton; at most one request on it at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        #: Set once the connection must not carry another request (EOF, error, Connection: close).
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[UpstreamAnswer | UpstreamStream] | None = None
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._headers_done = False
        self._until_eof = False
        self._informational = False
        #: Set by `UpstreamPool.stream`: the head resolves the waiter, the body goes to `stream`.
        self._streaming = False
        self.stream: UpstreamStream | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool._lost(self)
        stream = self.stream
        if stream is not None and not stream.complete:
            if self._until_eof:
                stream._end(keep_alive=False)  # a close-delimited body ends with the connection
            else:
                detail = f" ({exc})" if exc else ""
                stream._fail(UpstreamDropped(f"connection closed in the middle of the answer{detail}"))
            return
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._headers_done and self._until_eof:
            self._answer(keep_alive=False)  # a close-delimited body ends with the connection
        else:
            what = "before the answer" if not self._headers_done else "in the middle of the answer"
            detail = f" ({exc})" if exc else ""
            waiter.set_exception(UpstreamDropped(f"connection closed {what}{detail}"))

    def eof_received(self) -> bool | None:
        self.closed = True  # half-closed by Triton: no further request on it; connection_lost follows
        return None

    def data_received(self, data: bytes) -> None:
        if self.stream is not None and not self.stream.complete:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as e:
                stream, self.stream = self.stream, None
                stream._fail(UpstreamDropped(f"the answer is not HTTP: {e}"))
                self.abort()
            return
        if self._waiter is None or self._waiter.done():
            # Bytes nobody asked for (on an idle connection, or after a complete answer): this
            # connection's framing can no longer be trusted.
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamDropped(f"the answer is not HTTP: {e}"))

    # -- httptools callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # A fresh dict per answer: the one handed out with the previous answer stays as it was.
        self._headers = {}
        self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._informational = True  # 100 Continue and friends: the real answer follows
            return
        self._headers_done = True
        headers = self._headers
        self._until_eof = (status not in _NO_BODY and "content-length" not in headers
                           and "chunked" not in headers.get("transfer-encoding", "").lower())
        if self._streaming:
            waiter = self._waiter
            if waiter is None or waiter.done():
                self.abort()  # a head nobody waits for (timed out): nothing here can be trusted
                return
            self.stream = UpstreamStream(self._pool, self, status, headers)
            waiter.set_result(self.stream)  # type: ignore[arg-type]

    def on_body(self, body: bytes) -> None:
        if self.stream is not None:
            self.stream._feed(body)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self.stream is not None:
            keep_alive = self._parser.should_keep_alive()
            if not keep_alive:
                self.closed = True
            self.stream._end(keep_alive=keep_alive)
            return
        self._answer(keep_alive=self._parser.should_keep_alive())

    # -- the pool's side -------------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, *, streaming: bool = False) -> bool:
        """Write one request; False when nothing of it went out (the first write failed at once)."""
        transport = self.transport
        assert transport is not None and self._waiter is None and self.stream is None
        self._waiter = self._pool.loop.create_future()
        self._headers_done = self._until_eof = False
        self._streaming = streaming
        if len(body) <= _JOIN_LIMIT:
            transport.write(head + body)
            return not transport.is_closing()
        transport.write(head)
        if transport.is_closing():
            return False
        transport.write(body)
        return True

    async def answer(self) -> UpstreamAnswer | UpstreamStream:
        assert self._waiter is not None
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def time_out(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError("Triton did not answer within the time limit"))

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _answer(self, *, keep_alive: bool) -> None:
        if self._waiter is None or self._waiter.done():
            self.abort()  # a second answer to one request: nothing on this connection can be trusted
            return
        if not keep_alive:
            self.closed = True
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._waiter.set_result(UpstreamAnswer(self._parser.get_status_code(), self._headers, body))

    def _fail(self, error: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
        self.abort()


#: Loop iterations close() waits at most for its aborted connections' connection_lost.
_CLOSE_ITERATIONS = 10


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to one Triton (`url`: http[s]://host:port)."""

    def __init__(self, url: str, *, connect_timeout_s: float, max_idle: int = MAX_IDLE,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._base_path = parts.path.rstrip("/")
        self._host_line = b"Host: %s\r\n" % parts.netloc.encode("idna")
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.idle_timeout_s = idle_timeout_s
        #: The loop of the first request; the pool is one loop's (asyncio.get_running_loop() is a
        #: getpid() system call each time, a measurable share of a request).
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open: set[_Connection] = set()
        self._closed = False
        #: The timer that closes connections idle past idle_timeout_s (None while none is idle).
        self._sweeper: asyncio.TimerHandle | None = None
        #: Connections opened, and requests sent on a connection an earlier request used (tests and
        #: benchmarks read them).
        self.connections_opened = 0
        self.reused = 0
        self.retries = 0

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"", *,
                      timeout_s: float) -> UpstreamAnswer:
        """One request and its whole answer within `timeout_s` (connecting included).

        Raises UpstreamUnreachable, UpstreamDropped, or TimeoutError; CancelledError aborts the
        connection."""
        connection, answer = await self._exchange(method, path, headers, body, timeout_s, streaming=False)
        self._release(connection, self.loop.time())
        return answer

    async def stream(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"", *,
                     timeout_s: float) -> UpstreamStream:
        """One request whose answer's head arrives within `timeout_s` (connecting included); its
        body is then read from the returned stream, which the caller must close.

        Raises as `request` does; a cancellation before the head aborts the connection."""
        _, stream = await self._exchange(method, path, headers, body, timeout_s, streaming=True)
        return stream  # type: ignore[return-value]

    async def _exchange(self, method: str, path: str, headers: Mapping[str, str], body: bytes, timeout_s: float,
                        *, streaming: bool) -> tuple[_Connection, UpstreamAnswer | UpstreamStream]:
        """Send the request (retried once only when none of it went out) and wait for the answer, or
        for its head when streaming."""
        if self._closed:
            raise UpstreamUnreachable("the connection pool to Triton is closed")
        head = self._head(method, path, headers, body)
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for attempt in (1, 2):
            connection = self._idle_connection(loop.time())
            if connection is None:
                connection = await self._connect(deadline)
            else:
                self.reused += 1
            timer = loop.call_at(deadline, connection.time_out)
            try:
                if not connection.send(head, body, streaming=streaming):
                    # Nothing of the request went out (Triton had already closed this connection):
                    # the one case where trying again cannot run an inference twice.
                    connection.abort()
                    if attempt == 1:
                        self.retries += 1
                        continue
                    raise UpstreamDropped("connection closed before the request could be sent")
                answer = await connection.answer()
            except BaseException:
                connection.abort()
                raise
            finally:
                timer.cancel()
            return connection, answer
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def close(self) -> None:
        """Close every connection, idle or in use (the app is shutting down)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()
        # connection_lost comes an iteration or two of the loop after abort (asyncio and uvloop
        # both schedule it): return with every connection gone, not with some still counted.
        for _ in range(_CLOSE_ITERATIONS):
            if not self._open:
                break
            await asyncio.sleep(0)

    # -- pieces ------------------------------------------------------------------------------------------

    def _head(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
        target = self._base_path + path or "/"
        lines = [b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), target.encode("ascii")),
                 self._host_line]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} carries a line break")  # never a header injection
            lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), _header_bytes(value)))
        if body or method == "POST":
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        return b"".join(lines)

    def _idle_connection(self, now: float) -> _Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            transport = connection.transport
            if connection.closed or transport is None or transport.is_closing():
                continue  # closed by Triton while idle: found before writing, so not a retry
            if now - connection.idle_since > self.idle_timeout_s:
                connection.abort()
                continue
            return connection
        return None

    async def _connect(self, deadline: float) -> _Connection:
        loop = self.loop
        bound = min(self.connect_timeout_s, max(deadline - loop.time(), 0.0))
        try:
            async with asyncio.timeout(bound):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self), self._host, self._port,
                    ssl=True if self._tls else None, server_hostname=self._host if self._tls else None)
        except TimeoutError:
            raise TimeoutError(f"no connection to Triton at {self._host}:{self._port} within {bound:g} s") from None
        except OSError as e:
            raise UpstreamUnreachable(f"cannot connect to Triton at {self._host}:{self._port}: {e}") from e
        self.connections_opened += 1
        if self._closed:
            protocol.abort()
            raise UpstreamUnreachable("the connection pool to Triton is closed")
        self._open.add(protocol)
        return protocol

    def _release(self, connection: _Connection, now: float) -> None:
        """Back to the idle stack when it may carry another request, else closed."""
        transport = connection.transport
        if (connection.closed or self._closed or transport is None or transport.is_closing()
                or transport.get_write_buffer_size()):
            # Still writing a body Triton answered before reading it all: the next request's bytes
            # would follow the rest of that body, so the connection is not reused.
            connection.abort()
            return
        idle = self._idle
        # The oldest idle connections sit at the bottom of the stack: drop those past their time.
        while idle and now - idle[0].idle_since > self.idle_timeout_s:
            idle.popleft().abort()
        if len(idle) >= self.max_idle:
            connection.abort()
            return
        connection.idle_since = now
        idle.append(connection)
        if self._sweeper is None:
            self._sweeper = self.loop.call_at(idle[0].idle_since + self.idle_timeout_s, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle past their time, so a pool that grew in a burst shrinks back when
        traffic falls, as aiohttp's keep-alive does (Triton never closes an idle connection)."""
        self._sweeper = None
        now, idle = self.loop.time(), self._idle
        while idle and now - idle[0].idle_since >= self.idle_timeout_s:
            idle.popleft().abort()
        if idle:
            self._sweeper = self.loop.call_at(idle[0].idle_since + self.idle_timeout_s, self._sweep)

    def _lost(self, connection: _Connection) -> None:
        self._open.discard(connection)
        try:
            self._idle.remove(connection)
        except ValueError:
            pass


def _header_bytes(value: str) -> bytes:
    # Values parsed by httptools were decoded as latin-1 (exactly their bytes again); aiohttp's
    # parser decodes UTF-8 with surrogate escapes.
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape")

