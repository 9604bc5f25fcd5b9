"""The data plane's HTTP front (`listen.front: rust`, sidecar/fronts/http_front.py), against the real
shared Triton: infer to a trusted model is served without entering Python's request chain, answers
equal the Python chain's, the front's passive signals reach the health loop, and what the front does
not serve is handed to the Python app behind it; generate and generate_stream to a trusted model are
served by the front too, the stream relayed event by event, and so are requests pinned to a version
of it. The listener's bounds are the same tests as the Python listener's: the suite runs against the
front (the default), and make test runs test_http_limits, test_http_listener, test_proxy,
test_generate, test_generation, test_versions and test_tls again with SIDECAR_TEST_FRONT=python."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import threading
import time
import zlib
from dataclasses import replace
from typing import Any

import aiohttp
import brotli

from sidecar.app.factory import apply_config
from sidecar.app.probe_port import ProbeListener
from sidecar.fronts.appkeys import LIFECYCLE, SERVING
from sidecar.fronts.http_front import FRONT_RUNTIME, HttpFront
from sidecar.serving.lifecycle import QUIET_PERIOD_S
from tests.harness import SLACK_S, wait_for
from tests.proxy_support import (
    PythonEntries,
    binary_request,
    credit_json,
    features,
    proxy_config,
    served_by_front,
    started_and_healthy,
    triton_counted,
    triton_successes,
)

CREDIT = "/v2/models/credit_risk/infer"

#: Requests the no-Python proof sends (the issue's figure), over this many connections at once.
FAST_REQUESTS = 10_000
CONNECTIONS = 4

#: Requests to a pinned version the pinned proof sends, per kind (path, header, generate).
PINNED_REQUESTS = 200

TEXT = "text_echo"
#: generate requests and generate_stream streams the generate proof sends; streams this many at once.
GENERATE_REQUESTS = 200
STREAMS = 50
STREAMS_AT_ONCE = 5
#: Words per stream: text_echo sends one per 20 ms (its delay_ms), so a stream lasts about 200 ms.
STREAM_WORDS = 10


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
    await served_by_front(front, "credit_risk", 5, settled=False)
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

    with PythonEntries(core) as python:
        results = await asyncio.gather(*(one_connection() for _ in range(CONNECTIONS)))
    entries = python.count
    assert set().union(*results) == {python_answer}  # every answer the Python chain's, filtered alike
    assert python_answer[0] == 200 and b"income_prob" not in python_answer[1]
    assert front.fast_requests - before_fast == FAST_REQUESTS
    assert await triton_counted(triton, "credit_risk", before_triton + FAST_REQUESTS) - before_triton == FAST_REQUESTS
    assert entries == 0
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http",
                                          model="credit_risk", code="200") >= FAST_REQUESTS, 5,
                   what="the front's requests in /metrics")


def _pinnable(front: HttpFront, model: str) -> set[str]:
    """The versions of `model` a client may pin on the front now (published with its lane)."""
    return {version for lane in front.lanes()[0] if lane[0] == model for version, *_ in lane[6]}


def _routed_pinned(sidecar: Any, model: str, version: str) -> float:
    return sidecar.metric("triton_sidecar_routed_total", model=model, version=version, reason="pinned") or 0.0


async def test_infer_and_generate_pinned_to_a_trusted_version_are_served_by_the_front(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, models=["credit_risk", TEXT],
                                                                  probes={"interval_s": 3600, "jitter": 0.0})))
    front = sidecar.server
    assert isinstance(front, HttpFront)
    core = sidecar.app[SERVING]
    body = json.dumps(credit_json(rows=2, seed=7)).encode()
    json_type = {"Content-Type": "application/json"}
    pinned = "/v2/models/credit_risk/versions/1/infer"
    text = f"{sidecar.url}/v2/models/{TEXT}/versions/1"
    one = {"text_input": "alpha"}
    words = {"text_input": " ".join(f"w{i}" for i in range(STREAM_WORDS)), "max_tokens": STREAM_WORDS}
    # The Python chain's own answers (a query string is left to it). Its first request to a version
    # fetches that version's spec, which is published to the front at once.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(sidecar.url + pinned + "?via=python", data=body, headers=json_type) as r:
            python_answer = (r.status, await r.read())
        async with session.post(text + "/generate?via=python", json=one) as r:
            python_generate = (r.status, r.headers["Content-Type"], await r.read())
        python_stream = await _stream(session, text + "/generate_stream?via=python", words)
    assert python_answer[0] == 200 and b"income_prob" not in python_answer[1]
    assert python_generate[0] == 200 and json.loads(python_generate[2])["text_output"] == "alpha"
    assert python_stream[0] == 200 and len(python_stream[2]) == STREAM_WORDS
    await wait_for(lambda: _pinnable(front, "credit_risk") == {"1"} and _pinnable(front, TEXT) == {"1"}, 5,
                   what="version 1 of credit_risk and text_echo pinnable on the front")
    routed = _routed_pinned(sidecar, "credit_risk", "1"), _routed_pinned(sidecar, TEXT, "1")
    before_fast, before_handed = front.fast_requests, front.handovers
    before_triton = triton_successes(triton, "credit_risk")

    async def infer(session: aiohttp.ClientSession, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        async with session.post(sidecar.url + path, data=body, headers={**json_type, **headers}) as r:
            return r.status, await r.read()

    async def generate(session: aiohttp.ClientSession) -> tuple[int, str, bytes]:
        async with session.post(text + "/generate", json=one) as r:
            return r.status, r.headers["Content-Type"], await r.read()

    with PythonEntries(core) as python:
        async with aiohttp.ClientSession() as session:
            by_path = await asyncio.gather(*(infer(session, pinned, {}) for _ in range(PINNED_REQUESTS)))
            by_header = await asyncio.gather(*(infer(session, CREDIT, {"x-model-version": " 1 "})
                                               for _ in range(PINNED_REQUESTS)))
            generates = await asyncio.gather(*(generate(session) for _ in range(PINNED_REQUESTS)))
            streams = await asyncio.gather(*(_stream(session, text + "/generate_stream", words)
                                             for _ in range(STREAMS_AT_ONCE)))
    assert python.count == 0
    assert front.fast_requests - before_fast == 3 * PINNED_REQUESTS + STREAMS_AT_ONCE
    assert front.handovers == before_handed
    assert set(by_path) == set(by_header) == {python_answer}
    assert set(generates) == {python_generate}
    for status, content_type, events in streams:
        assert (status, content_type) == python_stream[:2]
        assert [event for _, event in events] == [event for _, event in python_stream[2]]
    # Triton answered them as version 1 (the URL the front sent names it)...
    assert await triton_counted(triton, "credit_risk", before_triton + 2 * PINNED_REQUESTS) - before_triton == (
        2 * PINNED_REQUESTS)
    # ... and routed_total counts infer and generate as pinned, as the Python chain does (a stream
    # is not routed).
    assert _routed_pinned(sidecar, "credit_risk", "1") - routed[0] == 2 * PINNED_REQUESTS
    assert _routed_pinned(sidecar, TEXT, "1") - routed[1] == PINNED_REQUESTS


#: A rule file (validation.schemas): the envelope's JSON Schema and a value rule on the features.
RULES = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["id"],
    "properties": {"id": {"type": "string", "pattern": "^app-"}},
    "x-tensors": {"features": {"minimum": -10, "maximum": 10}},
}


def _with_id(body: bytes, headers: dict[str, str], request_id: str) -> tuple[bytes, dict[str, str]]:
    """A binary-extension body with `id` set in its JSON header."""
    split = int(headers["Inference-Header-Content-Length"])
    header = json.dumps({**json.loads(body[:split]), "id": request_id}).encode()
    return header + body[split:], {**headers, "Inference-Header-Content-Length": str(len(header))}


async def test_a_model_with_a_rule_file_is_served_and_refused_by_the_front(triton, start, tmp_path):
    path = tmp_path / "credit_risk.schema.json"
    path.write_text(json.dumps(RULES))
    sidecar = await started_and_healthy(start, _rust(proxy_config(
        triton, probes={"interval_s": 3600, "jitter": 0.0}, validation={"schemas": {"credit_risk": str(path)}})))
    front = sidecar.server
    assert isinstance(front, HttpFront)
    core = sidecar.app[SERVING]
    json_type = {"Content-Type": "application/json"}
    too_big = features(1)
    too_big[0, 5] = 11.0
    requests = {
        "json within the rules": (json.dumps(credit_json(id="app-1")).encode(), json_type),
        "binary within the rules": _with_id(*binary_request("features", features(1, seed=3)), "app-2"),
        "envelope without id": (json.dumps(credit_json()).encode(), json_type),
        "json value above the maximum": (json.dumps({"id": "app-3", "inputs": [
            {"name": "features", "shape": [1, 128], "datatype": "FP32", "data": too_big.tolist()}]}).encode(),
            json_type),
        "binary value above the maximum": _with_id(*binary_request("features", too_big), "app-4"),
    }

    async def answers(suffix: str) -> dict[str, tuple[int, bytes]]:
        out = {}
        async with aiohttp.ClientSession() as session:
            for name, (body, headers) in requests.items():
                async with session.post(sidecar.url + CREDIT + suffix, data=body, headers=headers) as r:
                    out[name] = (r.status, await r.read())
        return out

    python_answers = await answers("?via=python")  # a query string is left to the Python chain
    await served_by_front(front, "credit_risk", 5, settled=False)
    before_fast, before_handed = front.fast_requests, front.handovers
    before_triton = triton_successes(triton, "credit_risk")
    with PythonEntries(core) as python:
        front_answers = await answers("")
    assert python.count == 0
    assert front.handovers == before_handed
    assert front.fast_requests - before_fast == len(requests)
    # The refused ones never reach it.
    assert await triton_counted(triton, "credit_risk", before_triton + 2) - before_triton == 2
    assert front_answers == python_answers  # status and body, byte for byte the Python chain's
    assert front_answers["json within the rules"][0] == front_answers["binary within the rules"][0] == 200
    refusals = {name: (status, json.loads(body)) for name, (status, body) in front_answers.items() if status != 200}
    assert refusals["envelope without id"] == (400, {
        "error": "request breaks credit_risk.schema.json at $: 'id' is a required property",
        "reason": "business_rule", "model": "credit_risk"})
    for kind in ("json", "binary"):
        status, doc = refusals[f"{kind} value above the maximum"]
        assert (status, doc["reason"], doc["input"]) == (400, "business_rule", "features")
        assert doc["error"] == ("input 'features' breaks credit_risk.schema.json: element 5 = 11.0 is above the "
                                "maximum 10")
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="http",
                                          model="credit_risk", reason="business_rule") == 6, 5,
                   what="both halves' business_rule refusals counted")


async def test_a_reloaded_rule_file_reaches_the_front(triton, start, tmp_path):
    path = tmp_path / "credit_risk.schema.json"
    path.write_text(json.dumps({"x-tensors": {"features": {"maximum": 10}}}))
    config = _rust(proxy_config(triton, probes={"interval_s": 3600, "jitter": 0.0},
                                validation={"schemas": {"credit_risk": str(path)}}))
    sidecar = await started_and_healthy(start, config)
    front = sidecar.server
    assert isinstance(front, HttpFront)
    x = features(1)
    x[0, 5] = 11.0
    body = json.dumps({"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                   "data": x.tolist()}]}).encode()

    async def post() -> tuple[int, dict[str, Any]]:
        async with sidecar.session.post(sidecar.url + CREDIT, data=body,
                                        headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()

    await served_by_front(front, "credit_risk", 5, settled=False)
    handed = front.handovers
    status, doc = await post()
    assert (status, doc["reason"], front.handovers) == (400, "business_rule", handed)
    path.write_text(json.dumps({"x-tensors": {"features": {"maximum": 20}}}))
    apply_config(sidecar.app, config)  # what a reload does: the file is read and compiled again

    async def accepted() -> bool:
        return (await post())[0] == 200

    await wait_for(accepted, 5, what="the reloaded rule file in force")
    await served_by_front(front, "credit_risk", 5, settled=False)
    handed, served = front.handovers, front.fast_requests
    assert [(await post())[0] for _ in range(5)] == [200] * 5
    assert front.handovers == handed and front.fast_requests - served == 5


async def test_what_the_front_does_not_serve_is_answered_by_the_python_app_behind_it(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton)))
    front = sidecar.server
    body = json.dumps(credit_json()).encode()
    handovers = front.handovers
    for method, path, data, status in (
            ("GET", "/readyz", None, 200),
            ("GET", "/v2/models/credit_risk/versions/1", None, 200),  # filtered and pinned: Python rewrites it
            ("POST", "/v2/models/credit_risk/versions/7/infer", body, 404)):  # a version Triton has not loaded
        # A connection each: a handed-over connection stays with the Python app until it closes.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.request(method, sidecar.url + path, data=data) as r:
            assert r.status == status, (path, await r.text())
    assert front.handovers - handovers >= 3
    async with sidecar.session.get(sidecar.url + "/metrics") as r:
        assert "triton_sidecar_http_connections " in await r.text()


async def test_a_kept_alive_client_that_asks_for_metadata_keeps_its_infers_on_the_front(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton)))
    front = sidecar.server
    await served_by_front(front, "credit_risk", 5, settled=False)
    body = json.dumps(credit_json()).encode()
    infer = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
             % (CREDIT.encode(), len(body))) + body
    # A filtered model's pinned version: rewritten by the Python app (its spec is the Python chain's).
    metadata = b"GET /v2/models/credit_risk/versions/1 HTTP/1.1\r\nHost: x\r\n\r\n"
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


HEALTH = ("/v2/health/live", "/v2/health/ready")


def _raw_get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        answer = connection.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        connection.close()


async def test_health_endpoints_are_answered_by_the_front_as_the_python_app_answers_them(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton)))
    front = sidecar.server
    assert isinstance(front, HttpFront)
    core = sidecar.app[SERVING]
    await wait_for(lambda: _raw_get(front.port, "/v2/health/ready")[0] == 200, 10, what="the pod ready")
    before_fast, before_handed = front.fast_requests, front.handovers
    before_count = sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http", model="_server_",
                                  code="200") or 0.0
    with PythonEntries(core) as python:
        for _ in range(100):
            for path in HEALTH:
                status, headers, body = await asyncio.to_thread(_raw_get, front.port, path)
                assert (status, body) == (200, b""), path
                assert "content-type" not in headers  # as aiohttp writes an empty 200
                assert len(headers["x-request-id"]) == 32
    assert python.count == 0
    assert front.handovers == before_handed
    assert front.fast_requests - before_fast == 200
    assert sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http", model="_server_",
                          code="200") == before_count + 200
    # The Python app behind the front gives the same answers (one rule, http_routes').
    for path in HEALTH:
        assert (await asyncio.to_thread(_raw_get, front.back.port, path))[0::2] == (200, b"")

    # A drain fails readiness at once, not at the front's next tick; liveness stays.
    sidecar.app[LIFECYCLE].begin_drain()
    status, headers, body = await asyncio.to_thread(_raw_get, front.port, "/v2/health/ready")
    assert status == 503
    assert headers["content-type"] == "application/json; charset=utf-8"
    assert json.loads(body) == {"error": "shutting down", "reason": "not_ready", "problems": ["shutting down"]}
    assert (status, body) == (await asyncio.to_thread(_raw_get, front.back.port, "/v2/health/ready"))[0::2]
    assert (await asyncio.to_thread(_raw_get, front.port, "/v2/health/live"))[0] == 200
    assert sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="http", model="_server_",
                          reason="not_ready") == 2  # the front's refusal and the app's
    assert front.handovers == before_handed


#: liveness.watchdog_stall_s in the watchdog tests: above a probe round's length on a busy machine
#: (the supervisors' own stall is judged by the same bound).
STALL_S = 2.0


def _get(port: int, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST" if body else "GET", path, body=body,
                           headers={"Content-Type": "application/json"} if body else {})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


async def test_a_health_loop_that_stops_turning_fails_healthz_on_the_front_which_still_serves(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, liveness={"watchdog_stall_s": STALL_S})))
    front = sidecar.server
    await served_by_front(front, "credit_risk", 5, settled=False)
    body = json.dumps(credit_json()).encode()
    seen: dict[str, Any] = {}
    answered = threading.Event()

    def while_wedged() -> None:
        # Off the event loop: wait (bounded) until the front has not heard from the loop for longer
        # than the bound, then ask as the kubelet would, and infer as a client would.
        try:
            deadline = time.monotonic() + STALL_S + SLACK_S + 5
            while front.control_silent_for <= STALL_S:
                assert time.monotonic() < deadline, "the front kept hearing from a wedged loop"
                time.sleep(0.05)
            seen["healthz"] = _get(front.port, "/healthz")
            seen["readyz"] = _get(front.port, "/readyz")
            seen["infer"] = _get(front.port, CREDIT, body)
        except BaseException as e:
            seen["error"] = e
        finally:
            answered.set()

    threading.Thread(target=while_wedged, daemon=True).start()
    # The wedge: the event loop itself blocked, as a blocking call in a handler or a runaway
    # computation would block it, until the thread has its answers (bounded).
    assert answered.wait(timeout=STALL_S + SLACK_S + 20), "no answer while the loop was wedged"
    assert "error" not in seen, seen.get("error")
    for endpoint in ("healthz", "readyz"):
        status, text = seen[endpoint]
        assert status == 503, (endpoint, text)
        problems = json.loads(text)["problems"]
        assert problems and problems[0].startswith("control plane stalled"), problems
        assert "liveness.watchdog_stall_s" in problems[0]
    # Requests to a trusted model do not wait for the control plane.
    status, text = seen["infer"]
    assert status == 200 and [o["name"] for o in json.loads(text)["outputs"]] == ["scores"], text
    # The loop turns again: the Python app answers /healthz again, with every model's state.
    async def healthy() -> bool:
        status, doc = await sidecar.get("/healthz")
        return status == 200 and "credit_risk" in doc["models"]
    deadline = time.monotonic() + SLACK_S + 5
    while not await healthy():
        assert time.monotonic() < deadline, "/healthz did not recover after the loop turned again"
        await asyncio.sleep(0.05)


async def test_a_front_runtime_that_stops_answering_fails_healthz_and_readyz_naming_it(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, liveness={"watchdog_stall_s": STALL_S})))
    front = sidecar.server
    probes = ProbeListener(sidecar.app)  # listen.probe_port: Python answers while the front cannot
    await probes.start("127.0.0.1", 0)
    try:
        async def probe(path: str) -> tuple[int, dict]:
            async with sidecar.session.get(f"http://127.0.0.1:{probes.port}{path}") as r:
                return r.status, await r.json()

        assert (await probe("/healthz"))[0] == 200
        front.stall_runtime(STALL_S + 4)  # its one worker blocked, as a deadlock would block it
        deadline = time.monotonic() + STALL_S + SLACK_S + 3
        while (answer := await probe("/healthz"))[0] != 503:
            assert time.monotonic() < deadline, f"/healthz stayed {answer} with the front's runtime blocked"
            await asyncio.sleep(0.05)
        problems = answer[1]["problems"]
        assert any(p.startswith(FRONT_RUNTIME + " stalled") for p in problems), problems
        status, doc = await probe("/readyz")
        assert status == 503 and any(p.startswith(FRONT_RUNTIME) for p in doc["problems"]), doc
        # The runtime turns again: both recover with no restart of anything.
        deadline = time.monotonic() + 4 + SLACK_S + 5
        while (answer := await probe("/healthz"))[0] != 200:
            assert time.monotonic() < deadline, f"/healthz stayed {answer} after the runtime turned again"
            await asyncio.sleep(0.05)
        assert (await probe("/readyz"))[0] == 200
    finally:
        await probes.close()


async def test_the_drain_waits_for_the_fronts_own_requests_to_go_quiet(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton)))
    front = sidecar.server
    await served_by_front(front, "credit_risk", 5, settled=False)
    body = json.dumps(credit_json()).encode()
    before = front.fast_requests
    traffic_until = time.monotonic() + 2.5

    async def traffic() -> tuple[int, float]:
        sent = 0
        while time.monotonic() < traffic_until:
            async with sidecar.session.post(sidecar.url + CREDIT, data=body) as r:
                assert r.status == 200, await r.text()
            sent += 1
        return sent, time.monotonic()

    running = asyncio.create_task(traffic())
    await wait_for(lambda: front.fast_requests > before, 5, what="the front serving")
    lifecycle = sidecar.app[LIFECYCLE]
    lifecycle.begin_drain()  # what SIGTERM does first (sidecar.cli.run)
    drained = await lifecycle.wait_drained(10)
    returned_at = time.monotonic()
    sent, last_at = await running
    assert drained
    # None of these requests entered the Python app, yet the drain waited for the last of them
    # and then for the quiet period, as for the Python listener's.
    assert front.fast_requests - before == sent
    assert returned_at - last_at >= QUIET_PERIOD_S * 0.9, (returned_at - last_at)


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                  ) -> tuple[int, str, list[tuple[float, bytes]]]:
    """(status, Content-Type, [(seconds since the request, event as sent)]) of one generate_stream,
    read as it arrives."""
    events: list[tuple[float, bytes]] = []
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                events.append((time.perf_counter() - started, event))
        assert buffer == b"", buffer
        return response.status, response.headers["Content-Type"], events


async def test_generate_and_generate_stream_to_a_trusted_model_never_enter_the_python_chain(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, models=[TEXT], rules=(),
                                                                  probes={"interval_s": 3600, "jitter": 0.0})))
    front = sidecar.server
    core = sidecar.app[SERVING]
    base = f"{sidecar.url}/v2/models/{TEXT}"
    one = {"text_input": "alpha"}  # one word: one response, what generate (one answer) takes
    words = {"text_input": " ".join(f"w{i}" for i in range(STREAM_WORDS)), "max_tokens": STREAM_WORDS}
    # The Python chain's own answers to the same bodies (a query string is left to it); a stream is
    # handed over with its connection, so each gets a connection of its own.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(base + "/generate?via=python", json=one) as r:
            python_answer = (r.status, r.headers["Content-Type"], await r.read())
        python_stream = await _stream(session, base + "/generate_stream?via=python", words)
    assert python_answer[0] == 200 and json.loads(python_answer[2])["text_output"] == "alpha"
    assert python_stream[0] == 200 and len(python_stream[2]) == STREAM_WORDS
    await served_by_front(front, TEXT, 5, settled=False)
    before_fast, before_handed = front.fast_requests, front.handovers

    async def generate(session: aiohttp.ClientSession) -> tuple[int, str, bytes]:
        async with session.post(base + "/generate", json=one) as r:
            return r.status, r.headers["Content-Type"], await r.read()

    streams: list[tuple[int, str, list[tuple[float, bytes]]]] = []
    with PythonEntries(core) as python:
        async with aiohttp.ClientSession() as session:  # kept alive: the streams' connections are reused
            answers = await asyncio.gather(*(generate(session) for _ in range(GENERATE_REQUESTS)))
            for _ in range(STREAMS // STREAMS_AT_ONCE):
                streams += await asyncio.gather(*(_stream(session, base + "/generate_stream", words)
                                                  for _ in range(STREAMS_AT_ONCE)))
    assert python.count == 0
    assert front.fast_requests - before_fast == GENERATE_REQUESTS + STREAMS
    assert front.handovers == before_handed
    assert set(answers) == {python_answer}  # every answer the Python chain's, byte for byte
    python_events = [event for _, event in python_stream[2]]
    for status, content_type, events in streams:
        assert (status, content_type) == python_stream[:2]
        assert [event for _, event in events] == python_events
        # One event per 20 ms at the model: the first reaches the client long before the last is made.
        first, last = events[0][0], events[-1][0]
        assert last - first > 0.1, f"events arrived together ({first:.3f} s, {last:.3f} s): buffered"
    await wait_for(lambda: sidecar.metric("triton_sidecar_stream_endings_total", model=TEXT, outcome="complete")
                   == STREAMS + 1, 5, what="the front's streams in /metrics")
    assert sidecar.metric("triton_sidecar_stream_events_sum", model=TEXT) == (STREAMS + 1) * STREAM_WORDS
    assert sidecar.metric("triton_sidecar_streams_in_flight", model=TEXT) == 0
    assert sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http", model=TEXT,
                          code="200") >= GENERATE_REQUESTS + STREAMS


async def test_a_query_string_or_a_percent_encoded_name_is_served_by_the_front(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, models=["credit_risk"],
                                                                  probes={"interval_s": 3600, "jitter": 0.0})))
    front = sidecar.server
    await served_by_front(front, "credit_risk", 5)
    body = json.dumps(credit_json(rows=2, seed=5)).encode()
    json_type = {"Content-Type": "application/json"}

    async def post(path: str) -> tuple[int, bytes]:
        async with sidecar.session.post(sidecar.url + path, data=body, headers=json_type) as r:
            return r.status, await r.read()

    plain = await post(CREDIT)
    assert plain[0] == 200
    # Version 1's spec is fetched by the first request that pins it (the Python chain's), then the
    # front serves pins to it.
    assert (await post("/v2/models/credit_risk/versions/1/infer"))[0] == 200
    await wait_for(lambda: any(pin[0] == "1" for lane in front.lanes()[0] if lane[0] == "credit_risk"
                               for pin in lane[6]), 5, what="version 1 pinnable on the front")
    front.publish()
    before_fast, before_handed = front.fast_requests, front.handovers
    before_triton = triton_successes(triton, "credit_risk")
    with PythonEntries(sidecar.app[SERVING]) as python:
        answers = [await post(path) for path in (CREDIT + "?debug=1&x=%2F", "/v2/models/credit%5Frisk/infer",
                                                 "/v2/models/credit_risk/versions/%31/infer?x")]
    assert python.count == 0
    assert front.handovers == before_handed and front.fast_requests - before_fast == 3
    # The answers of the plain request (the same version: 1 is the one Triton serves unpinned).
    assert [status for status, _ in answers] == [200, 200, 200]
    assert {json.dumps({k: v for k, v in json.loads(a).items() if k != "id"}) for _, a in answers} == {
        json.dumps({k: v for k, v in json.loads(plain[1]).items() if k != "id"})}
    assert await triton_counted(triton, "credit_risk", before_triton + 3) == before_triton + 3
    # A name that decodes to one Triton's path must quote is the Python app's, which knows no such model.
    status, answer = await post("/v2/models/credit%2Frisk/infer")
    assert front.handovers == before_handed + 1
    assert status == 404, answer


def _zstd(exponent: int, blocks: list[bytes | tuple[int, int]]) -> bytes:
    """A zstd frame (RFC 8878 §3.1.1), made by hand: no zstd library is a dependency. No content
    size, a window of 2 ** (10 + exponent) bytes; each block raw (bytes) or RLE ((byte, times))."""
    frame = bytearray(b"\x28\xb5\x2f\xfd\x00" + bytes([exponent << 3]))
    for i, block in enumerate(blocks):
        last = int(i + 1 == len(blocks))
        kind, size, content = (0, len(block), block) if isinstance(block, bytes) else (1, block[1], bytes([block[0]]))
        frame += (last | kind << 1 | size << 3).to_bytes(3, "little") + content
    return bytes(frame)


async def test_zstd_infer_bodies_are_decoded_by_the_front(triton, start):
    limit = 1024 * 1024
    sidecar = await _body_limited(triton, start, limit)
    front = sidecar.server
    await served_by_front(front, "credit_risk", 5)
    body = json.dumps(credit_json(rows=2, seed=3)).encode()
    json_type = {"Content-Type": "application/json"}

    async def post(data: bytes, encoding: str = "zstd") -> tuple[int, Any]:
        headers = {**json_type, **({"Content-Encoding": encoding} if encoding else {})}
        async with sidecar.session.post(sidecar.url + CREDIT, data=data, headers=headers) as r:
            answer = await r.read()
            return r.status, json.loads(answer)

    plain = await post(body, "")
    assert plain[0] == 200
    before_fast, before_handed = front.fast_requests, front.handovers
    before_successes = triton_successes(triton, "credit_risk")
    with PythonEntries(sidecar.app[SERVING]) as python:
        decoded = await post(_zstd(10, [body[:100], body[100:]]))
        # 32 MiB of zeros in about a kilobyte: refused at the limit, never decoded past it.
        bomb = await post(_zstd(10, [(0, 128 * 1024)] * 256))
        # A frame of a few bytes asking for a 1 GiB window: refused before anything is reserved.
        huge_window = await post(_zstd(20, [(0, 1)]))
        garbage = await post(b"\x28\xb5\x2f\xfd" + b"\xff" * 16)
    assert python.count == 0 and front.handovers == before_handed and front.fast_requests - before_fast == 4
    assert decoded == plain
    assert await triton_counted(triton, "credit_risk", before_successes + 1) == before_successes + 1
    assert bomb == (413, {"error": f"request body larger than {limit} bytes (validation.max_body_bytes)",
                          "reason": "body_too_large", "model": "credit_risk"})
    for status, refused in (huge_window, garbage):
        assert status == 400 and refused["reason"] == "malformed", refused
        assert refused["error"].startswith("request body cannot be read (zstd): "), refused


def _peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM): the sidecar under test runs in it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


async def _body_limited(triton: Any, start: Any, limit: int) -> Any:
    """The Rust front guarding credit_risk with validation.max_body_bytes `limit`, probes out of the way."""
    return await started_and_healthy(start, _rust(proxy_config(triton, models=["credit_risk"],
                                                               validation={"max_body_bytes": limit},
                                                               probes={"interval_s": 3600, "jitter": 0.0})))


async def test_compressed_infer_bodies_are_inflated_by_the_front(triton, start):
    limit = 1024 * 1024
    sidecar = await _body_limited(triton, start, limit)
    front = sidecar.server
    core = sidecar.app[SERVING]
    await served_by_front(front, "credit_risk", 5, settled=False)
    body = json.dumps(credit_json(rows=2, seed=3)).encode()
    json_type = {"Content-Type": "application/json"}
    async with sidecar.session.post(sidecar.url + CREDIT, data=body, headers=json_type) as r:
        plain = (r.status, await r.read())
    assert plain[0] == 200
    # 256 MiB of zeros in about 256 KiB of gzip, within the limit as sent, 256 times over it inflated;
    # made a piece at a time, so that only the sidecar could make this process's memory peak.
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1024 * 1024)
    bomb = b"".join(packer.compress(zeros) for _ in range(256)) + packer.flush()
    assert len(bomb) < limit
    garbage = b"\x1f\x8b\x08\x00" + b"\xff" * 64  # a gzip header, then no deflate stream
    br_bomb = brotli.compress(bytes(16 * limit), quality=1)
    assert len(br_bomb) < limit
    before_fast, before_handed = front.fast_requests, front.handovers
    before_successes = triton_successes(triton, "credit_risk")
    peak = _peak_rss_bytes()
    with PythonEntries(core) as python:
        answers = {}
        for name, data, encoding in (("gzip", gzip.compress(body), "gzip"), ("deflate", zlib.compress(body), "deflate"),
                                     ("GZIP", gzip.compress(body), " GZIP "), ("bomb", bomb, "gzip"),
                                     ("garbage", garbage, "gzip"), ("x-lzw", body, "x-lzw"),
                                     ("br", brotli.compress(body), "br"), ("br bomb", br_bomb, "br"),
                                     ("br garbage", b"\xff" * 64, "br")):
            async with sidecar.session.post(sidecar.url + CREDIT, data=data,
                                            headers={**json_type, "Content-Encoding": encoding}) as r:
                answers[name] = (r.status, await r.read())
    assert python.count == 0
    assert front.handovers == before_handed
    assert front.fast_requests - before_fast == 9
    assert answers["gzip"] == answers["deflate"] == answers["GZIP"] == answers["br"] == plain
    assert await triton_counted(triton, "credit_risk", before_successes + 4) == before_successes + 4
    assert answers["br bomb"][0] == 413
    assert json.loads(answers["br garbage"][1])["error"] == (
        "request body cannot be read (br): 400, message:\n  Can not decode content-encoding: br")
    assert answers["bomb"][0] == 413
    assert json.loads(answers["bomb"][1]) == {
        "error": f"request body larger than {limit} bytes (validation.max_body_bytes)", "reason": "body_too_large",
        "model": "credit_risk"}
    # Inflated to the limit and no further: 256 MiB inflated would have raised the peak by as much.
    assert _peak_rss_bytes() - peak < 64 * 1024 * 1024
    assert answers["garbage"][0] == 400
    assert json.loads(answers["garbage"][1])["reason"] == "malformed"
    assert json.loads(answers["garbage"][1])["error"].startswith(
        "request body cannot be read (gzip): Error -3 while decompressing data: ")
    assert answers["x-lzw"][0] == 415
    assert json.loads(answers["x-lzw"][1]) == {
        "error": "Content-Encoding 'x-lzw' is not accepted; send the body uncompressed, gzip, deflate, br or zstd",
        "reason": "unsupported_media_type", "model": "credit_risk"}
    for reason, count in (("body_too_large", 2), ("malformed", 2), ("unsupported_media_type", 1)):
        assert sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="http", model="credit_risk",
                              reason=reason) == count, reason
    # The Python listener behind the front refuses the same bodies alike (one rule: the data plane's).
    back = f"http://127.0.0.1:{front.back.port}{CREDIT}"
    # (br: aiohttp's decoder behind the front, as before, gives the same answers.)
    for name, data, encoding in (("bomb", bomb, "gzip"), ("garbage", garbage, "gzip"), ("x-lzw", body, "x-lzw"),
                                 ("br bomb", br_bomb, "br"), ("br garbage", b"\xff" * 64, "br")):
        async with sidecar.session.post(back, data=data, headers={**json_type, "Content-Encoding": encoding}) as r:
            assert r.status == answers[name][0], name
            assert {k: v for k, v in (await r.json()).items()} == json.loads(answers[name][1]), name


def _exchange(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body=body)
        answer = connection.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        connection.close()


#: (method, path, body, status) the front answers without Python, as the Python app answers them.
DOCUMENTS = (
    ("GET", "/v2", None, 200),
    ("GET", "/v2/models/image_classifier", None, 200),
    ("GET", "/v2/models/image_classifier/config", None, 200),
    ("GET", "/v2/models/image_classifier/versions/1/config", None, 200),
    ("GET", "/v2/models/credit_risk", None, 200),  # an output filter names it: hidden outputs removed
    ("GET", "/v2/models/credit_risk/config", None, 200),
    ("GET", "/v2/models/image_classifier/ready", None, 200),
    ("GET", "/v2/models/image_classifier/versions/9/ready", None, 503),  # a version Triton has not loaded
    ("GET", "/v2/models/image_classifier/versions/x", None, 404),
    ("GET", "/v2/models/no_such_model/config", None, 404),
    ("GET", "/v2/models/stats", None, 403),  # proxy.allow_statistics: false
    ("GET", "/v2/models/image_classifier/stats", None, 403),
    ("POST", "/v2/repository/models/credit_risk/unload", b"{}", 403),
    ("GET", "/v2/repository/index", None, 403),
    ("DELETE", "/v2/logging", None, 403),
    ("PUT", "/v2/models/image_classifier/trace/setting", b"{}", 403),
    ("GET", "/v2/nothing", None, 404),
    ("POST", "/v2", b"{}", 405),
    ("GET", "/v2/models/image_classifier/infer", None, 405),
    ("GET", "/v1/models/credit_risk:predict", None, 404),
    ("DELETE", "/admin", None, 404),
    ("POST", "/metrics", b"{}", 405),
    ("POST", "/v2/models/no_such_model/infer", b'{"inputs": []}', 404),
    ("POST", "/v2/models/no_such_model/versions/2/generate", b'{"text_input": "x"}', 404),
)


def _comparable(answer: tuple[int, dict[str, str], bytes]) -> tuple[int, str, bytes, bool]:
    status, headers, body = answer
    # aiohttp's JSON answers name a charset; its passthrough of Triton's bytes does not.
    return status, headers.get("content-type", ""), body, "x-request-id" in headers


async def test_documents_refusals_404s_and_405s_are_answered_by_the_front_as_the_python_app(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, proxy={"allow_statistics": False})))
    front = sidecar.server
    core = sidecar.app[SERVING]
    before_fast, before_handed = front.fast_requests, front.handovers
    with PythonEntries(core) as python:
        answers = [await asyncio.to_thread(_exchange, front.port, method, path, body)
                   for method, path, body, _ in DOCUMENTS]
    assert python.count == 0
    assert front.handovers == before_handed
    assert front.fast_requests - before_fast == len(DOCUMENTS)
    assert [status for status, _, _ in answers] == [status for *_, status in DOCUMENTS]
    for (method, path, body, _), answer in zip(DOCUMENTS, answers, strict=True):
        # The Python app behind the front (the Python chain) gives the very same answer.
        python_answer = await asyncio.to_thread(_exchange, front.back.port, method, path, body)
        assert _comparable(answer) == _comparable(python_answer), (method, path)
    metadata = json.loads(answers[0][2])
    assert "extensions" in metadata and "logging" not in metadata["extensions"]
    assert json.loads(answers[12][2])["reason"] == "forbidden_endpoint"
    assert json.loads(answers[16][2])["reason"] == "unknown_path"
    assert json.loads(answers[7][2])["reason"] == "not_ready"
    # credit_risk's rule hides its income_prob* outputs: gone from its metadata and config, counted.
    for doc in (json.loads(answers[4][2])["outputs"], json.loads(answers[5][2])["output"]):
        assert [o["name"] for o in doc] == ["scores"]
    assert sidecar.metric("triton_sidecar_outputs_filtered_total", model="credit_risk", output="income_prob") == 2 * 2
    # Counted as the Python chain counts them (the front's and the app's answers alike).
    for model, reason, count in (("_server_", "forbidden_endpoint", 6), ("_unknown_", "unknown_path", 3),
                                 ("_unknown_", "method_not_allowed", 3), ("_unknown_", "unknown_model", 3),
                                 ("image_classifier", "unknown_model", 1)):
        assert sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="http", model=model,
                              reason=reason) == 2 * count, (model, reason)
    assert sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http", model="image_classifier",
                          code="200") == 2 * 4


async def test_statistics_are_served_by_the_front_by_default(triton, start):
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton)))
    front = sidecar.server
    core = sidecar.app[SERVING]
    before_handed = front.handovers
    with PythonEntries(core) as python:
        server = await asyncio.to_thread(_exchange, front.port, "GET", "/v2/models/stats")
        model = await asyncio.to_thread(_exchange, front.port, "GET", "/v2/models/credit_risk/stats")
        metadata = await asyncio.to_thread(_exchange, front.port, "GET", "/v2")
    assert python.count == 0
    assert front.handovers == before_handed
    assert server[0] == model[0] == metadata[0] == 200
    assert {m["name"] for m in json.loads(server[2])["model_stats"]} >= {"credit_risk"}
    assert [m["name"] for m in json.loads(model[2])["model_stats"]] == ["credit_risk"]
    assert "statistics" in json.loads(metadata[2])["extensions"]
