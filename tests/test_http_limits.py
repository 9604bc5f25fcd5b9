"""The fast listener's bounds, against the real shared Triton: early refusals every client can read
(half-close and lingering), pipelined answers that survive a refusal, header and URL limits, header
and keep-alive timeouts, a cap on open connections, and many slow clients that cannot starve a
normal one."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import time
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.harness import wait_for
from tests.proxy_support import credit_json, proxy_config, started_and_healthy, triton_counted, triton_successes

CREDIT = "/v2/models/credit_risk/infer"
LIMIT = 4 * 1024 * 1024
MB = 1024 * 1024
#: One probe round at start and none after: Triton's success counter then counts only what the test sent.
ONE_ROUND = {"interval_s": 3600, "jitter": 0.0}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))



def _head(length: int, *extra: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % (
        CREDIT.encode(), length)) + b"".join(extra) + b"\r\n"


async def _answers(reader: asyncio.StreamReader, count: int, timeout: float = 20) -> list[tuple[int, dict, bytes]]:
    out = []
    async with asyncio.timeout(timeout):
        while len(out) < count:
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            out.append((status, headers, await reader.readexactly(int(headers["content-length"]))))
    return out


# -- the four clients, each writing its whole body before it reads ----------------------------------------

def _with_http_client(port: int, body: bytes) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", CREDIT, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _with_urllib(port: int, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{CREDIT}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _with_tritonclient(port: int, body: bytes) -> tuple[int, dict]:
    client = triton_http.InferenceServerClient(url=f"127.0.0.1:{port}", network_timeout=60)
    tensor = triton_http.InferInput("features", [1, len(body) // 4], "FP32")
    tensor.set_data_from_numpy(np.frombuffer(body, dtype=np.float32).reshape(1, -1), binary_data=True)
    try:
        client.infer("credit_risk", [tensor])
    except InferenceServerException as e:
        return int(e.status()), {"error": e.message()}
    finally:
        client.close()
    return 200, {}


async def _with_aiohttp(port: int, body: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}{CREDIT}", data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("size_mb", [5, 16, 64])
async def test_a_body_over_the_limit_gets_a_413_that_every_client_reads(triton, start, size_mb):
    sidecar = await started_and_healthy(start, proxy_config(triton, validation={"max_body_bytes": LIMIT},
                                                             probes=ONE_ROUND))
    port, body = sidecar.server.port, b"\0" * (size_mb * MB)
    before = triton_successes(triton, "credit_risk")
    answers = {
        "http.client": await asyncio.to_thread(_with_http_client, port, body),
        "urllib": await asyncio.to_thread(_with_urllib, port, body),
        "tritonclient.http": await asyncio.to_thread(_with_tritonclient, port, body),
        "aiohttp": await _with_aiohttp(port, body),
    }
    message = f"request body larger than {LIMIT} bytes (validation.max_body_bytes)"
    for client, (status, doc) in answers.items():
        assert status == 413, client
        assert message in doc["error"], client
        if client != "tritonclient.http":  # tritonclient keeps only the error's text
            assert doc == {"error": message, "reason": "body_too_large", "model": "credit_risk"}, client
    assert triton_successes(triton, "credit_risk") == before
    # Each connection ended once its declared body had been read or the client closed, not by a bound.
    await wait_for(lambda: sidecar.server.open_connections == 0, 5, what="every connection closed")
    ends = {how: sidecar.metric("triton_sidecar_http_lingering_ends_total", how=how) or 0
            for how in ("drained", "client_closed", "time", "idle", "bytes")}
    assert ends["drained"] + ends["client_closed"] == 4 and ends["drained"] >= 3, ends


async def test_a_client_that_stops_sending_after_its_413_reads_it_and_is_closed_when_idle(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(
        triton, validation={"max_body_bytes": LIMIT}, listen={"lingering_timeout_s": 0.5}))
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.server.port)
    writer.write(_head(16 * MB) + b"\0" * (LIMIT + MB))  # a body over the limit, then silence
    [(status, headers, body)] = await _answers(reader, 1)
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["reason"] == "body_too_large"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # half-closed after the answer...
    await wait_for(lambda: sidecar.metric("triton_sidecar_http_lingering_ends_total", how="idle") == 1, 5,
                   what="closed after lingering_timeout_s of silence")  # ...and closed once the client went quiet
    writer.close()


async def test_pipelined_requests_before_a_refused_one_get_their_answers(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, validation={"max_body_bytes": LIMIT},
                                                             probes=ONE_ROUND))
    good = json.dumps(credit_json(seed=3)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.server.port)
    before = triton_successes(triton, "credit_risk")
    # Two inferences and a third too large for the limit, in one write: the third is refused while
    # the first is still at Triton.
    writer.write(_head(len(good)) + good + _head(len(good)) + good + _head(8 * MB) + b"\0" * (6 * MB))
    answers = await _answers(reader, 3)
    writer.write(b"\0" * (2 * MB))  # the rest of the declared body: read and thrown away
    await writer.drain()
    assert [a[0] for a in answers] == [200, 200, 413]
    assert answers[0][2] == answers[1][2] and "outputs" in json.loads(answers[0][2])
    assert json.loads(answers[2][2])["reason"] == "body_too_large"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert await triton_counted(triton, "credit_risk", before + 2) == before + 2
    writer.close()


@pytest.mark.parametrize(("what", "request_bytes", "status", "reason"), [
    ("a long URL", b"GET /v2/models/" + b"m" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "url_too_long"),
    ("too many headers", b"GET /readyz HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n",
     431, "headers_too_large"),
    ("too many header bytes", b"GET /readyz HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 4000)
                                                                      for i in range(10)) + b"\r\n",
     431, "headers_too_large"),
    ("one header that never ends", b"GET /readyz HTTP/1.1\r\nX-Big: " + b"v" * (1 * MB), 431, "headers_too_large"),
    ("Content-Length with Transfer-Encoding", _head(3, b"Transfer-Encoding: chunked\r\n") + b"3\r\nabc\r\n0\r\n\r\n",
     400, "malformed"),
])
async def test_a_request_line_or_headers_over_a_limit_get_a_json_refusal(triton, start, what, request_bytes, status,
                                                                         reason):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    good = json.dumps(credit_json()).encode()
    for first in (b"", _head(len(good)) + good):  # on a fresh connection and after a served request
        reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.server.port)
        writer.write(first + request_bytes)
        answers = await _answers(reader, 2 if first else 1)
        assert answers[-1][0] == status, what
        assert json.loads(answers[-1][2])["reason"] == reason, what
        assert await asyncio.wait_for(reader.read(), 10) == b"", what
        writer.close()


async def test_slow_headers_get_408_an_idle_connection_is_closed_and_keep_alive_ends(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(
        triton, listen={"header_timeout_s": 0.5, "keepalive_timeout_s": 0.8}))
    port = sidecar.server.port
    # Headers begun, never finished: 408 after header_timeout_s, then closed.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST " + CREDIT.encode() + b" HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    [(status, _, body)] = await _answers(reader, 1, timeout=5)
    assert (status, json.loads(body)["reason"]) == (408, "header_timeout")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert 0.4 <= time.monotonic() - started < 3
    writer.close()
    # A connection that never sends a byte is closed at the header timeout too, without an answer.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    # Kept alive after an answer: closed after keepalive_timeout_s of silence.
    good = json.dumps(credit_json()).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head(len(good)) + good)
    [(status, _, _)] = await _answers(reader, 1)
    served = time.monotonic()
    assert status == 200
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert time.monotonic() - served >= 0.7
    writer.close()
    assert sidecar.metric("triton_sidecar_http_connection_timeouts_total", phase="header") == 2
    assert sidecar.metric("triton_sidecar_http_connection_timeouts_total", phase="keepalive") == 1
    # Handed to aiohttp (a probe on a kept-alive connection): aiohttp keeps the same idle bound.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    [(status, _, _)] = await _answers(reader, 1)
    served = time.monotonic()
    assert status == 200 and sidecar.server.handovers >= 1
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert time.monotonic() - served >= 0.7
    writer.close()


async def test_connections_beyond_max_connections_are_closed_at_once_and_counted(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, listen={"max_connections": 4}))
    port = sidecar.server.port
    # Two for aiohttp (a handed-over connection counts too) and two idle on the fast path.
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    for reader, writer in held[:2]:
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        [(status, _, _)] = await _answers(reader, 1)
        assert status == 200
    await wait_for(lambda: sidecar.server.open_connections == 4, 5, what="four connections counted")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""  # accepted and closed at once
    writer.close()
    assert sidecar.metric("triton_sidecar_http_connections_refused_total") == 1
    assert sidecar.metric("triton_sidecar_http_connections") == 4
    for _, w in held:
        w.close()
    await wait_for(lambda: sidecar.server.open_connections == 0, 5, what="the held connections released")
    async with aiohttp.ClientSession() as session, session.get(sidecar.url + "/readyz") as r:
        assert r.status == 200  # room again


#: Slow clients opened in the test below: 1,000 connections work on this 2-core machine (the client
#: side runs in the test's own event loop next to the sidecar).
SLOW_CLIENTS = 1000


async def test_a_thousand_slow_header_clients_do_not_starve_a_normal_one(triton, start):
    header_timeout = 3.0
    # No probe rounds during the test: a probe that opens a connection to Triton would move the count.
    sidecar = await started_and_healthy(start, proxy_config(triton, listen={"header_timeout_s": header_timeout},
                                                             probes=ONE_ROUND))
    port = sidecar.server.port
    good = json.dumps(credit_json()).encode()
    async with aiohttp.ClientSession() as session, session.post(sidecar.url + CREDIT, data=good) as r:
        assert r.status == 200  # the upstream connection this client reuses is open before the baseline
    baseline = _open_fds()
    closed_after: list[float] = []

    async def slow_client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened = time.monotonic()
        try:
            for byte in b"POST " + CREDIT.encode() + b" HTTP/1.1\r\n" + b"X-Slow: yes\r\n" * 20:
                writer.write(bytes([byte]))  # one byte a second until the sidecar answers or closes
                try:
                    answer = await asyncio.wait_for(reader.read(65536), 1.0)
                except TimeoutError:
                    continue
                if answer:
                    while await asyncio.wait_for(reader.read(65536), 10):
                        pass
                break
            closed_after.append(time.monotonic() - opened)
        except (ConnectionError, TimeoutError):
            closed_after.append(time.monotonic() - opened)
        finally:
            writer.close()

    slow = [asyncio.create_task(slow_client()) for _ in range(SLOW_CLIENTS)]
    await wait_for(lambda: sidecar.server.open_connections >= SLOW_CLIENTS, 20, what="the slow clients connected")
    outcomes = []
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + header_timeout
        while time.monotonic() < deadline:
            try:
                async with session.post(sidecar.url + CREDIT, data=good,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    outcomes.append(r.status)
            except aiohttp.ClientError:
                outcomes.append(0)
    await asyncio.gather(*slow)
    assert len(outcomes) >= 20
    assert outcomes.count(200) >= 0.99 * len(outcomes), outcomes
    assert len(closed_after) == SLOW_CLIENTS
    assert min(closed_after) >= header_timeout - 0.2  # none before the timeout...
    assert sorted(closed_after)[int(0.99 * SLOW_CLIENTS)] < header_timeout + 3  # ...and all near it
    assert sidecar.metric("triton_sidecar_http_connection_timeouts_total", phase="header") >= SLOW_CLIENTS
    await wait_for(lambda: sidecar.server.open_connections == 0, 10, what="every slow connection closed")
    await wait_for(lambda: _open_fds() <= baseline, 10, what="descriptors back to their baseline")


async def test_a_chunked_body_over_the_limit_and_an_expect_continue_one_get_their_413(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, validation={"max_body_bytes": LIMIT}))
    port = sidecar.server.port
    # Chunked, no length declared: refused once the limit is passed, drained to its last chunk.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            % CREDIT.encode())
    chunk = b"%x\r\n%s\r\n" % (MB, b"\0" * MB)
    writer.write(head + chunk * 6 + b"0\r\n\r\n")
    [(status, _, body)] = await _answers(reader, 1)
    assert status == 413 and json.loads(body)["reason"] == "body_too_large"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await wait_for(lambda: sidecar.metric("triton_sidecar_http_lingering_ends_total", how="drained") == 1, 5,
                   what="closed where the chunked body ended")
    # Expect: 100-continue with a length over the limit: the 413 instead of "100 Continue", as curl expects.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head(16 * MB, b"Expect: 100-continue\r\n"))
    status_line = await asyncio.wait_for(reader.readline(), 5)
    assert status_line.split()[1] == b"413"
    writer.close()
