"""The data plane's HTTP front (`listen.front: rust`, sidecar/fronts/http_front.py), against the real
shared Triton: infer to a trusted model is served without entering Python's request chain, answers
equal the Python chain's, the front's passive signals reach the health loop, and what the front does
not serve is handed to the Python app behind it. The listener's bounds are the same tests as the
Python listener's: make test runs test_http_limits, test_http_listener and test_proxy again with
SIDECAR_TEST_FRONT=rust."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import aiohttp

from sidecar.fronts.appkeys import SERVING
from sidecar.fronts.http_front import HttpFront
from tests.harness import wait_for
from tests.proxy_support import credit_json, proxy_config, started_and_healthy, triton_successes

CREDIT = "/v2/models/credit_risk/infer"

#: Requests the no-Python proof sends (the issue's figure), over this many connections at once.
FAST_REQUESTS = 10_000
CONNECTIONS = 4


def _rust(config: Any) -> Any:
    return replace(config, listen=replace(config.listen, front="rust"))


async def _answers(reader: asyncio.StreamReader, count: int) -> list[tuple[int, bytes]]:
    out = []
    for _ in range(count):
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        out.append((status, await reader.readexactly(length)))
    return out


async def test_infer_to_a_trusted_model_never_enters_the_python_chain(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, probes={"interval_s": 3600,
                                                                                  "jitter": 0.0})))
    front = sidecar.server
    assert isinstance(front, HttpFront)
    core = sidecar.app[SERVING]
    body = json.dumps(credit_json(rows=2, seed=5)).encode()
    # The Python chain's own answer to the same body (a query string is left to it), for comparison.
    async with sidecar.session.post(sidecar.url + CREDIT + "?via=python", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
        python_answer = (r.status, await r.read())
    await wait_for(lambda: "credit_risk" in {lane[0] for lane in front.lanes()[0]}, 5, what="credit_risk a lane")
    entries = 0
    opened, refused, infer = core.request, core.requests.refuse_at_once, core.infer

    def counting(inner: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal entries
            entries += 1
            return inner(*args, **kwargs)
        return call

    core.request, core.requests.refuse_at_once, core.infer = counting(opened), counting(refused), counting(infer)
    before_fast, before_triton = front.fast_requests, triton_successes(triton, "credit_risk")
    request = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % (CREDIT.encode(), len(body))) + body
    per_connection = FAST_REQUESTS // CONNECTIONS

    async def one_connection() -> set[tuple[int, bytes]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        seen: set[tuple[int, bytes]] = set()
        try:
            for _ in range(per_connection // 10):  # ten pipelined at a time
                writer.write(request * 10)
                seen.update(await _answers(reader, 10))
        finally:
            writer.close()
        return seen

    try:
        results = await asyncio.gather(*(one_connection() for _ in range(CONNECTIONS)))
    finally:
        core.request, core.requests.refuse_at_once, core.infer = opened, refused, infer
    assert set().union(*results) == {python_answer}  # every answer the Python chain's, filtered alike
    assert python_answer[0] == 200 and b"income_prob" not in python_answer[1]
    assert front.fast_requests - before_fast == FAST_REQUESTS
    assert triton_successes(triton, "credit_risk") - before_triton == FAST_REQUESTS
    assert entries == 0
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http",
                                          model="credit_risk", code="200") >= FAST_REQUESTS, 5,
                   what="the front's requests in /metrics")


async def test_what_the_front_does_not_serve_is_answered_by_the_python_app_behind_it(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton)))
    front = sidecar.server
    body = json.dumps(credit_json()).encode()
    handovers = front.handovers
    for method, path, data, status in (
            ("GET", "/readyz", None, 200),
            ("GET", "/v2/models/credit_risk", None, 200),
            ("POST", "/v2/repository/models/credit_risk/unload", b"{}", 403),
            ("POST", "/v2/models/credit_risk/versions/1/infer", body, 200),  # a pinned version: routing
            ("POST", "/v2/models/no_such_model/infer", body, 404)):
        # A connection each: a handed-over connection stays with the Python app until it closes.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.request(method, sidecar.url + path, data=data) as r:
            assert r.status == status, (path, await r.text())
    assert front.handovers - handovers >= 5
    async with sidecar.session.get(sidecar.url + "/metrics") as r:
        assert "triton_sidecar_http_connections " in await r.text()


async def test_a_kept_alive_client_that_asks_for_metadata_keeps_its_infers_on_the_front(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton)))
    front = sidecar.server
    await wait_for(lambda: "credit_risk" in {lane[0] for lane in front.lanes()[0]}, 5, what="credit_risk a lane")
    body = json.dumps(credit_json()).encode()
    infer = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
             % (CREDIT.encode(), len(body))) + body
    metadata = b"GET /v2/models/credit_risk HTTP/1.1\r\nHost: x\r\n\r\n"
    before_fast, before_handed = front.fast_requests, front.handovers
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        writer.write(metadata + infer + metadata + infer)  # pipelined: answered in order
        answers = await _answers(reader, 4)
    finally:
        writer.close()
    assert [status for status, _ in answers] == [200, 200, 200, 200]
    assert ["platform" in json.loads(doc) for _, doc in answers] == [True, False, True, False]
    assert front.fast_requests - before_fast == 2  # both infers the front's, though metadata came first
    assert front.handovers - before_handed == 2  # each metadata request answered by the Python app
