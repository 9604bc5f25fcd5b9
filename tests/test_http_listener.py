"""The sidecar's one listener, in front of the real shared Triton: inferences take the httptools path
and answer exactly as the aiohttp handler does; every other request, on a fresh or a kept-alive
connection, pipelined or not, is handed to aiohttp in order."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import aiohttp
import numpy as np

from sidecar.fronts.http_front import HttpFront
from tests.proxy_support import binary_request, credit_json, proxy_config, started_and_healthy

CREDIT = "/v2/models/credit_risk/infer"


async def _exchange(port: int, data: bytes, answers: int, timeout: float = 10.0) -> list[tuple[int, dict, bytes]]:
    """Write `data` on one connection and read `answers` HTTP answers (Content-Length framed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = []
        async with asyncio.timeout(timeout):
            while len(out) < answers:
                status_line = await reader.readline()
                status = int(status_line.split()[1])
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                if status == 100:
                    continue
                out.append((status, headers, await reader.readexactly(int(headers["content-length"]))))
        return out
    finally:
        writer.close()


def _infer_request(body: bytes, *extra: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % (
        CREDIT.encode(), len(body))
    return head + b"".join(extra) + b"\r\n" + body


async def test_infer_answers_on_the_fast_path_equal_the_aiohttp_handlers(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    listener = sidecar.server
    body = json.dumps(credit_json(rows=3, seed=4)).encode()
    binary, headers = binary_request("features", np.random.default_rng(2).uniform(-1, 1, (2, 128)).astype(np.float32))
    answers = []
    # A query string is left to aiohttp's router by the Python listener; the Rust front's lane takes
    # it (its route is the path alone), so there both pairs are the lane's.
    lane_takes_queries = isinstance(listener, HttpFront)
    for query in ("", "?via=aiohttp"):
        before = listener.fast_requests
        async with sidecar.session.post(sidecar.url + CREDIT + query, data=body,
                                        headers={"Content-Type": "application/json"}) as r:
            answers.append((r.status, r.headers["Content-Type"].split(";")[0], await r.read()))
        async with sidecar.session.post(sidecar.url + CREDIT + query, data=binary, headers=headers) as r:
            answers.append((r.status, r.headers.get("Inference-Header-Content-Length"), await r.read()))
        assert listener.fast_requests - before == (2 if not query or lane_takes_queries else 0)
    assert answers[0] == answers[2] and answers[1] == answers[3]
    assert answers[0][0] == 200 and b"income_prob" not in answers[0][2] and b"income_prob" not in answers[1][2]


async def test_a_kept_alive_connection_asking_for_metadata_is_handed_to_aiohttp_in_order(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    listener = sidecar.server
    body = json.dumps(credit_json()).encode()
    # A pinned version's metadata: the Rust front hands a filtered model's to the Python app too.
    metadata = b"GET /v2/models/credit_risk/versions/1 HTTP/1.1\r\nHost: x\r\n\r\n"
    handovers = listener.handovers
    # One after the other on one connection, then all three pipelined in one write.
    for data in (None, _infer_request(body) + metadata + _infer_request(body)):
        if data is None:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            results = []
            for part in (_infer_request(body), metadata, _infer_request(body)):
                writer.write(part)
                status_line = await reader.readline()
                headers = {}
                while (line := await reader.readline()) != b"\r\n":
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                results.append((int(status_line.split()[1]), headers,
                                await reader.readexactly(int(headers["content-length"]))))
            writer.close()
        else:
            results = await _exchange(listener.port, data, 3)
        assert [r[0] for r in results] == [200, 200, 200]
        assert ["platform" in json.loads(r[2]) for r in results] == [False, True, False]  # metadata in the middle
        assert [o["name"] for o in json.loads(results[1][2])["outputs"]] == ["scores"]  # filtered in metadata too
    assert listener.handovers - handovers == 2


async def test_other_first_requests_and_malformed_http_are_answered_by_aiohttp(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    port = sidecar.server.port
    [(status, _, body)] = await _exchange(port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", 1)
    assert status == 200 and json.loads(body)["status"] == "ok"
    [(status, _, body)] = await _exchange(port, b"POST /v2/repository/models/credit_risk/unload HTTP/1.1\r\n"
                                                b"Host: x\r\nContent-Length: 2\r\n\r\n{}", 1)
    assert status == 403 and json.loads(body)["reason"] == "forbidden_endpoint"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    status_line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert status_line.split()[1] == b"400"


async def test_expect_continue_http10_and_compressed_bodies_on_the_fast_path(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    body = json.dumps(credit_json(seed=9)).encode()
    [(plain_status, _, plain)] = await _exchange(sidecar.server.port, _infer_request(body), 1)
    [(status, _, answer)] = await _exchange(sidecar.server.port, _infer_request(body, b"Expect: 100-continue\r\n"), 1)
    assert (status, answer) == (plain_status, plain) == (200, plain)
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        async with sidecar.session.post(sidecar.url + CREDIT, data=packed, headers={
                "Content-Type": "application/json", "Content-Encoding": encoding}) as r:
            assert (r.status, await r.read()) == (200, plain), encoding
    http10 = _infer_request(body).replace(b"HTTP/1.1", b"HTTP/1.0")
    [(status, _, answer)] = await _exchange(sidecar.server.port, http10, 1)
    assert (status, answer) == (200, plain)


async def test_a_trickled_body_gets_408_and_a_declared_huge_one_413_unread(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, proxy={"client_body_timeout_s": 0.5}))
    port = sidecar.server.port
    body = json.dumps(credit_json()).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_infer_request(body)[: -len(body) + 10])  # headers and 10 body bytes, then nothing
    status_line = await asyncio.wait_for(reader.readline(), 5)
    rest = await asyncio.wait_for(reader.read(), 5)  # the connection is closed after the answer
    writer.close()
    assert status_line.split()[1] == b"408"
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1]) == {
        "error": "request body not received within 0.5 s (proxy.client_body_timeout_s)",
        "reason": "body_timeout", "model": "credit_risk"}
    huge = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
        CREDIT.encode(), 10**9)
    [(status, _, answer)] = await _exchange(port, huge, 1)
    assert status == 413 and json.loads(answer)["reason"] == "body_too_large"
    async with aiohttp.ClientSession() as s, s.get(sidecar.url + "/metrics") as r:
        text = await r.text()
    assert ('triton_sidecar_proxy_rejections_total{model="credit_risk",protocol="http",reason="body_timeout"} 1.0'
            in text)
