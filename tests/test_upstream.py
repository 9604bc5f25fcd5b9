"""The proxy's connection pool to Triton (sidecar.upstream).

Against the real Triton: keep-alive reuse, Triton killed and restarted under the running sidecar,
a client that leaves mid-request, 8 MB each way. Against tiny loopback servers written here, for the
transport's edge cases Triton cannot be made to show on demand: an idle connection the server
closes or resets, an answer that never comes, chunked and close-delimited answers."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import struct
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from sidecar.devtools.tritonserver import LocalTriton, free_port
from sidecar.fronts.appkeys import UPSTREAM_POOL
from sidecar.fronts.http_front import HttpFront, UpstreamStats
from sidecar.states import ModelState
from sidecar.upstream import UpstreamDropped, UpstreamPool, UpstreamUnreachable
from tests.harness import REPO, RunningSidecar, start_sidecar, stop_sidecar, triton_post, wait_for
from tests.proxy_support import (
    binary_request,
    credit_json,
    decode_answer,
    proxy_config,
    served_by_front,
    started_and_healthy,
)

ECHO_TEMPLATE = REPO / "tests" / "models" / "echo"
CREDIT = "/v2/models/credit_risk/infer"


def _carrying_pool(sidecar: RunningSidecar) -> UpstreamPool | UpstreamStats:
    """The pool that carries the sidecar's infers to Triton: the Rust front's own when it serves
    listen.port (the default), else sidecar.upstream's (SIDECAR_TEST_FRONT=python); both count alike."""
    return sidecar.server.upstream if isinstance(sidecar.server, HttpFront) else sidecar.app[UPSTREAM_POOL]


async def _served_by_the_front(sidecar: RunningSidecar, model: str) -> None:
    """With the Rust front, wait until it serves the model itself (its first requests would
    otherwise be the Python chain's, on the Python pool)."""
    if isinstance(sidecar.server, HttpFront):
        front = sidecar.server
        await served_by_front(front, model, 10, settled=False)


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


# ---- against the real Triton ------------------------------------------------------------------------------


async def test_requests_reuse_kept_alive_connections_and_the_pool_closes_with_the_app(triton):
    sidecar = await start_sidecar(proxy_config(triton))
    try:
        await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 30, what="HEALTHY")
        await _served_by_the_front(sidecar, "credit_risk")
        pool = _carrying_pool(sidecar)
        for seed in range(20):  # one after the other: one connection carries them all
            assert (await _post(sidecar.session, sidecar.url + CREDIT, credit_json(seed=seed)))[0] == 200
        assert (pool.connections_opened, pool.reused, pool.idle) == (1, 19, 1)
        # Four at a time: at most four connections, all kept for the next burst.
        for _ in range(5):
            answers = await asyncio.gather(*(_post(sidecar.session, sidecar.url + CREDIT, credit_json(seed=s))
                                             for s in range(4)))
            assert [status for status, _ in answers] == [200] * 4
        assert pool.connections_opened <= 4 and pool.reused >= 20 + 16 - 4
        assert pool.idle == pool.open_connections == pool.connections_opened
    finally:
        await stop_sidecar(sidecar)
    assert pool.open_connections == 0 and pool.idle == 0
    if isinstance(pool, UpstreamPool):  # a closed Python pool refuses calls (the front's is gone)
        with pytest.raises(UpstreamUnreachable):
            await pool.request("GET", "/v2", {}, timeout_s=1)


async def test_triton_killed_and_restarted_under_the_running_sidecar(own_triton, start):
    sidecar = await started_and_healthy(start, proxy_config(own_triton, models=["credit_risk"]))
    await _served_by_the_front(sidecar, "credit_risk")
    pool = _carrying_pool(sidecar)
    url = sidecar.url + CREDIT
    assert (await _post(sidecar.session, url, credit_json()))[0] == 200
    opened = pool.connections_opened
    own_triton.kill()
    seen: list[tuple[int, str]] = []

    async def answered(status: int) -> bool:
        code, doc = await _post(sidecar.session, url, credit_json())
        seen.append((code, doc.get("reason", "")))
        return code == status

    # Its pooled connection died with it; new ones are refused: 503 with Retry-After, not a hang.
    await wait_for(lambda: answered(503), 10, what="503 while Triton is down")
    assert seen[-1] == (503, "triton_unreachable")
    await asyncio.to_thread(own_triton.start)
    await wait_for(lambda: answered(200), 60, interval=0.2, what="answers again after the restart")
    assert pool.connections_opened > opened
    # On the way: refusals and Triton's own errors only, every one a 5xx with a reason.
    assert {code for code, _ in seen} <= {200, 502, 503}, seen
    assert all(reason for code, reason in seen if code != 200), seen


async def test_a_client_that_leaves_closes_its_upstream_connection(triton, fresh_model, start):
    model = fresh_model.name
    sidecar = await started_and_healthy(start, proxy_config(
        triton, models=[model], golden_dir=fresh_model.golden_dir, probes={"interval_s": 3600, "jitter": 0.0}))
    await _served_by_the_front(sidecar, model)
    pool = _carrying_pool(sidecar)
    url = f"{sidecar.url}/v2/models/{model}/infer"
    assert (await _post(sidecar.session, url, credit_json()))[0] == 200
    assert pool.open_connections == 1
    fresh_model.inject("hang")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(url, json=credit_json(), timeout=aiohttp.ClientTimeout(0.5)):
                pass
    # The connection that carried the abandoned request is closed, not handed to the next request
    # (whose answer would be the hung one's).
    await wait_for(lambda: pool.open_connections == 0, 2.0, what="upstream connection closed")
    assert pool.idle == 0


@pytest.fixture
def echo_model(triton: LocalTriton, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The echo model loaded into the shared Triton under a fresh name, and its golden folder."""
    name = f"echo_{tmp_path.name[-20:]}".replace("-", "_")
    path = triton.model_repository / name
    shutil.copytree(ECHO_TEMPLATE, path)
    (path / "config.pbtxt").write_text((path / "config.pbtxt").read_text().replace('name: "echo"',
                                                                                     f'name: "{name}"'))
    golden = tmp_path / "golden"
    (golden / name).mkdir(parents=True)
    (golden / name / "normal.json").write_text(json.dumps({
        "request": {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
        "expect": {"status": 200, "outputs": {"y": {"datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}}}}))
    status, body = triton_post(triton, f"/v2/repository/models/{name}/load")
    assert status == 200, body
    yield name, golden
    triton_post(triton, f"/v2/repository/models/{name}/unload")


async def test_eight_megabytes_each_way_through_the_sidecar(triton, echo_model, start):
    name, golden = echo_model
    sidecar = await started_and_healthy(start, proxy_config(triton, models=[name], golden_dir=golden))
    x = np.random.default_rng(3).standard_normal(2 * 1024 * 1024).astype(np.float32)  # 8 MiB
    body, headers = binary_request("x", x, outputs=[("y", True)])
    assert len(body) > 8 * 1024 * 1024
    async with sidecar.session.post(f"{sidecar.url}/v2/models/{name}/infer", data=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        answer = await r.read()
        assert len(answer) > 8 * 1024 * 1024
        assert np.array_equal(decode_answer(answer, r.headers)["y"], x)


# ---- against tiny loopback servers: the transport's edge cases ---------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class TinyServer:
    """An asyncio HTTP server whose every connection runs `handler`; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests = 0
        self.closed_by_client = 0
        self.writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> TinyServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for writer in self.writers:
            writer.close()
        self._server.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        await self.handler(reader, writer)

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request's body, None when the client closed the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None  # closed (the pool aborts: a reset) between requests
        self.requests += 1
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        return await reader.readexactly(length)

    async def wait_closed_by_client(self, reader: asyncio.StreamReader) -> None:
        try:
            assert await reader.read() == b""
        except ConnectionResetError:
            pass  # aborted: as closed as it gets
        self.closed_by_client += 1


def _answer(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(extra), body)


@pytest.fixture
async def pools() -> AsyncIterator[list[UpstreamPool]]:
    made: list[UpstreamPool] = []
    yield made
    for pool in made:
        await pool.close()


def _pool(pools: list[UpstreamPool], url: str) -> UpstreamPool:
    pool = UpstreamPool(url, connect_timeout_s=1.0)
    pools.append(pool)
    return pool


async def test_an_idle_connection_the_server_closed_is_never_used(pools):
    async def answer_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await server.read_request(reader)
        writer.write(_answer(body or b"{}"))  # keep-alive answer, then the server's idle timeout
        await writer.drain()
        writer.close()

    async with TinyServer(answer_once_then_close) as server:
        pool = _pool(pools, server.url)
        assert (await pool.request("POST", "/a", {}, b'{"n":1}', timeout_s=5)).body == b'{"n":1}'
        await wait_for(lambda: pool.idle == 0, 2.0, what="the closed connection noticed")
        answer = await pool.request("POST", "/a", {}, b'{"n":2}', timeout_s=5)
        assert (answer.status, answer.body) == (200, b'{"n":2}')
        assert (server.connections, server.requests, pool.retries) == (2, 2, 0)


async def test_a_reset_not_yet_noticed_is_retried_once_because_nothing_was_sent(pools):
    """The server resets an idle connection and the pool writes before its loop could notice: the
    write fails at once, nothing reached the server, so the request goes out once on a new one."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    do_reset, reset_done = threading.Event(), threading.Event()
    seen: list[bytes] = []

    def serve() -> None:  # a plain blocking server: it resets while the test's loop is blocked
        for n in range(2):
            conn, _ = listener.accept()
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            seen.append(data)
            conn.sendall(_answer(b"{}"))
            if n == 0:
                do_reset.wait(10)
                # SO_LINGER 0: close() sends a RST instead of a FIN.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                reset_done.set()
            else:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        pool = _pool(pools, f"http://127.0.0.1:{port}")
        assert (await pool.request("POST", "/a", {}, b"1", timeout_s=5)).status == 200
        assert pool.idle == 1
        do_reset.set()
        # Blocking this loop on purpose: the RST arrives, but the pool's protocol cannot hear of it.
        assert reset_done.wait(5)
        answer = await pool.request("POST", "/a", {}, b"2", timeout_s=5)
        assert answer.status == 200
        assert (pool.retries, pool.connections_opened, len(seen)) == (1, 2, 2)
        assert seen[1].endswith(b"Content-Length: 1\r\n\r\n2")  # the retried request, once
    finally:
        do_reset.set()
        listener.close()
        thread.join(5)


async def test_a_request_that_reached_the_server_is_never_sent_twice(pools):
    async def read_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.close()  # after reading it: the request may have run

    async with TinyServer(read_then_close) as server:
        pool = _pool(pools, server.url)
        with pytest.raises(UpstreamDropped, match="before the answer"):
            await pool.request("POST", "/a", {}, b"{}", timeout_s=5)
        assert (server.connections, server.requests, pool.retries) == (1, 1, 0)


async def test_chunked_close_delimited_informational_and_connection_close_answers(pools):
    big = np.random.default_rng(1).bytes(8 * 1024 * 1024)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await server.read_request(reader)) is not None:
            kind = body[:1]
            if kind == b"c":  # the request's body echoed back in 1 MiB chunks
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(0, len(body), 1 << 20):
                    chunk = body[i:i + (1 << 20)]
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            elif kind == b"k":  # Content-Length, but the server closes after it
                writer.write(_answer(b"bye", b"Connection: close\r\n"))
                await writer.drain()
                writer.close()
                return
            else:  # no length at all: the body ends with the connection
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + body[::-1])
                await writer.drain()
                writer.close()
                return

    async with TinyServer(serve) as server:
        pool = _pool(pools, server.url)
        answer = await pool.request("POST", "/a", {"X-Test": "1"}, b"c" + big, timeout_s=20)
        assert (answer.status, answer.body) == (200, b"c" + big)
        assert pool.idle == 1  # chunked answers keep the connection
        answer = await pool.request("POST", "/a", {}, b"k", timeout_s=5)
        assert answer.body == b"bye" and pool.reused == 1
        assert pool.idle == 0  # Connection: close is honoured
        answer = await pool.request("POST", "/a", {}, b"delimited", timeout_s=5)
        assert (answer.headers["content-type"], answer.body) == ("text/plain", b"detimiled")
        assert pool.idle == 0 and server.connections == 2


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_an_answer_that_never_comes_leaves_its_connection_closed(how, pools):
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        await server.wait_closed_by_client(reader)

    async with TinyServer(never_answer) as server:
        pool = _pool(pools, server.url)
        if how == "timeout":
            with pytest.raises(TimeoutError):
                await pool.request("POST", "/a", {}, b"{}", timeout_s=0.3)
        else:
            task = asyncio.create_task(pool.request("POST", "/a", {}, b"{}", timeout_s=30))
            await wait_for(lambda: server.requests == 1, 5, what="request received")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await wait_for(lambda: server.closed_by_client == 1, 2, what="the server seeing the connection end")
        assert pool.idle == 0 and pool.open_connections == 0


async def test_nobody_listening_is_unreachable(pools):
    pool = _pool(pools, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(UpstreamUnreachable, match="cannot connect"):
        await pool.request("POST", "/a", {}, b"{}", timeout_s=5)


async def test_a_connect_that_hangs_times_out_within_the_connect_bound(pools):
    # A listener whose accept queue is full: Linux drops further SYNs, so connect() hangs.
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        pool = UpstreamPool(f"http://127.0.0.1:{port}", connect_timeout_s=0.3)
        pools.append(pool)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError, match="no connection"):
            await pool.request("POST", "/a", {}, b"{}", timeout_s=30)
        assert loop.time() - started < 2.0  # the connect bound, not the 30 s total
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_idle_connections_are_capped_and_expire(pools):
    async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await server.read_request(reader)) is not None:
            if body == b"slow":
                await gate.wait()
            writer.write(_answer(b"{}"))
        server.closed_by_client += 1

    gate = asyncio.Event()
    async with TinyServer(keep_answering) as server:
        pool = UpstreamPool(server.url, connect_timeout_s=1.0, max_idle=1)
        pools.append(pool)
        burst = [asyncio.create_task(pool.request("POST", "/a", {}, b"slow", timeout_s=5)) for _ in range(3)]
        await wait_for(lambda: server.requests == 3, 5, what="three requests in flight")
        gate.set()
        assert [a.status for a in await asyncio.gather(*burst)] == [200] * 3
        # Three connections carried the burst; one is kept, the other two are closed.
        assert (pool.connections_opened, pool.idle) == (3, 1)
        await wait_for(lambda: server.closed_by_client == 2, 2, what="the two extra connections closed")
        # An idle connection past its time is closed and replaced, never used.
        pool.idle_timeout_s = 0.0
        assert (await pool.request("POST", "/a", {}, b"{}", timeout_s=5)).status == 200
        assert (pool.connections_opened, pool.reused) == (4, 0)
        await wait_for(lambda: server.closed_by_client == 3, 2, what="the expired connection closed")


async def test_idle_connections_close_by_themselves_when_traffic_stops(pools):
    async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader) is not None:
            writer.write(_answer(b"{}"))
        server.closed_by_client += 1

    async with TinyServer(keep_answering) as server:
        pool = UpstreamPool(server.url, connect_timeout_s=1.0, idle_timeout_s=0.3)
        pools.append(pool)
        burst = await asyncio.gather(*(pool.request("POST", "/a", {}, b"{}", timeout_s=5) for _ in range(4)))
        assert [a.status for a in burst] == [200] * 4 and pool.idle == pool.connections_opened
        # No request comes to find them expired: the pool's own timer gives the sockets back.
        await wait_for(lambda: pool.idle == 0 and server.closed_by_client == pool.connections_opened, 3,
                       what="every idle connection closed")
        assert pool.open_connections == 0


# ---- streaming mode (generate_stream) ------------------------------------------------------------------------


async def test_a_streamed_answer_arrives_chunk_by_chunk_and_its_connection_is_reused_once_read_to_the_end(pools):
    release_last = asyncio.Event()

    async def stream_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for event in (b'data: {"n":1}\n\n', b'data: {"n":2}\n\n'):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await release_last.wait()  # the body does not end until the test has read this chunk
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with TinyServer(stream_events) as server:
        pool = _pool(pools, server.url)
        stream = await pool.stream("POST", "/s", {}, b"{}", timeout_s=5)
        assert (stream.status, stream.headers["content-type"]) == (200, "text/event-stream")
        # The first event is here while the server still holds the rest of the body back.
        assert await asyncio.wait_for(stream.read(), 5) == b'data: {"n":1}\n\n'
        assert not stream.complete
        release_last.set()
        rest = b""
        while chunk := await asyncio.wait_for(stream.read(), 5):
            rest += chunk
        assert rest == b'data: {"n":2}\n\n' and stream.complete
        stream.close()
        assert pool.idle == 1
        again = await pool.stream("POST", "/s", {}, b"{}", timeout_s=5)
        assert (await again.read_all(1024)).count(b"data:") == 2
        again.close()
        assert (server.connections, pool.reused, pool.idle) == (1, 1, 1)


async def test_a_stream_cut_mid_body_or_closed_early_never_returns_its_connection(pools):
    async def cut_after_one_event(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        event = b'data: {"n":1}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        if body == b"cut":
            writer.transport.abort()  # Triton dies in the middle of the stream
        else:
            await server.wait_closed_by_client(reader)  # the client ends the stream early

    async with TinyServer(cut_after_one_event) as server:
        pool = _pool(pools, server.url)
        stream = await pool.stream("POST", "/s", {}, b"cut", timeout_s=5)
        assert await stream.read() == b'data: {"n":1}\n\n'
        with pytest.raises(UpstreamDropped, match="middle of the answer"):
            await asyncio.wait_for(stream.read(), 5)
        stream.close()
        assert pool.idle == 0 and pool.open_connections == 0
        early = await pool.stream("POST", "/s", {}, b"early", timeout_s=5)
        assert await early.read() == b'data: {"n":1}\n\n'
        early.close()  # not read to its end: aborted, so the server sees the request end
        await wait_for(lambda: server.closed_by_client == 1, 2, what="the server seeing the stream end")
        assert pool.idle == 0 and pool.open_connections == 0 and server.connections == 2
