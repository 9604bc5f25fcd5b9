"""Shorter fault windows (issue 23), against the real Triton: requests already waiting at a hung
instance end with 503 + Retry-After (gRPC UNAVAILABLE) as soon as the model is quarantined, their
connections to Triton closed; and with `proxy.hold_while_suspect_ms`, requests that come while a
failed golden round is being confirmed wait for its verdict: served when it passes, refused when the
model is quarantined, never given the answer the failed round judged wrong."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from bench.repository import credit_risk_scores
from sidecar.devtools.tritonserver import free_port
from sidecar.fronts.appkeys import SERVING, STATES, UPSTREAM_POOL
from sidecar.fronts.grpc_server import SERVICE
from sidecar.fronts.http_front import HttpFront
from sidecar.states import ModelState
from tests.harness import sidecar_config, wait_for
from tests.proxy_support import PythonEntries, credit_json, features, served_by_front

pytestmark = pytest.mark.fault

QUARANTINED = (ModelState.UNHEALTHY, ModelState.HEALING, ModelState.FAILED)
#: How soon after the quarantine a request waiting at the hung instance must have its answer (s).
ENDED_WITHIN_S = 1.0


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, int, dict, Any]:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=25)) as response:
        answer = await response.read()
        return time.monotonic(), response.status, dict(response.headers), json.loads(answer)


async def _grpc_infer(target: str, model: str, seed: int) -> tuple[float, grpc.StatusCode, dict[str, str]]:
    """(when it ended, its status code, its trailing metadata)."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[1, 128])
    tensor.contents.fp32_contents.extend(features(1, seed=seed).ravel().tolist())
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/{SERVICE}/ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)(request, timeout=25)
        try:
            await call
        except grpc.aio.AioRpcError as e:
            return time.monotonic(), e.code(), dict(e.trailing_metadata() or ())
        return time.monotonic(), grpc.StatusCode.OK, {}


async def test_requests_waiting_at_a_hung_instance_end_503_within_a_second_of_quarantine(
        triton, fresh_model, start):
    model = fresh_model.name
    config = sidecar_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                            probes={"interval_s": 0.5, "timeout_s": 1.0, "failure_threshold": 2},
                            proxy={"upstream_timeout_s": 30.0, "retry_after_s": 1})
    config = replace(config, listen=replace(config.listen, grpc_port=free_port()))
    sidecar = await start(config)
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    url = f"{sidecar.url}/v2/models/{model}/infer"
    _, status, _, _ = await _post(sidecar.session, url, credit_json(seed=1))
    assert status == 200

    fresh_model.inject("hang")
    http = [asyncio.create_task(_post(sidecar.session, url, credit_json(seed=i))) for i in range(3)]
    grpc_calls = [asyncio.create_task(_grpc_infer(f"127.0.0.1:{config.listen.grpc_port}", model, seed=i))
                  for i in range(2)]
    # Every one of them is at Triton (the sidecar's in-flight gauge), before the sidecar has judged.
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_in_flight", model=model) == 5, 10,
                   what="5 requests waiting at the hung instance")
    quarantine = await _quarantine(sidecar, model)

    answers = await asyncio.gather(*http)
    for finished, status, headers, body in answers:
        assert status == 503 and headers.get("Retry-After") == "1", (status, body)
        assert body["reason"] == "quarantined" and body["model"] == model, body
        assert finished - quarantine <= ENDED_WITHIN_S, f"answered {finished - quarantine:.2f} s after quarantine"
    for finished, code, trailing in await asyncio.gather(*grpc_calls):
        assert code is grpc.StatusCode.UNAVAILABLE, code
        assert trailing.get("x-sidecar-reason") == "quarantined", trailing
        assert trailing.get("grpc-retry-pushback-ms") == "1000", trailing  # Retry-After's 1 s, for gRPC clients
        assert finished - quarantine <= ENDED_WITHIN_S, f"answered {finished - quarantine:.2f} s after quarantine"
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="ended_at_triton") == 5
    # Their connections to Triton were closed, not given back to the pool for the next request.
    pool = sidecar.app[UPSTREAM_POOL]
    await wait_for(lambda: pool.open_connections == 0, 5, what="the hung requests' connections closed")
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 30, what=f"{model} healed")


async def _quarantine(sidecar, model: str) -> float:  # type: ignore[no-untyped-def]
    """When the model went into quarantine (the states' clock is time.monotonic)."""
    await wait_for(lambda: sidecar.first_transition_to(model, *QUARANTINED) is not None, 20,
                   what=f"{model} quarantined")
    return sidecar.first_transition_to(model, *QUARANTINED).at


async def _held_requests(sidecar, model: str, fault, count: int = 4) -> list[tuple[int, dict, Any]]:  # type: ignore[no-untyped-def]
    """Inject `fault`, and as soon as the model is suspect (a failed round is being confirmed) send
    `count` requests: they come while the confirmation runs."""
    fault()
    health = sidecar.app[STATES].get(model)
    await wait_for(lambda: health.suspect, 20, interval=0.002, what=f"{model} suspect")
    url = f"{sidecar.url}/v2/models/{model}/infer"
    answers = await asyncio.gather(*(_post(sidecar.session, url, credit_json(seed=i)) for i in range(count)))
    return [(status, headers, body) for _, status, headers, body in answers]


def _hold_config(triton, fresh_model):  # type: ignore[no-untyped-def]
    return sidecar_config(triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                          probes={"interval_s": 0.5, "timeout_s": 2.0, "failure_threshold": 2},
                          proxy={"hold_while_suspect_ms": 3000.0, "retry_after_s": 1})


async def test_requests_held_while_suspect_are_served_when_the_confirmation_passes(triton, fresh_model, start):
    model = fresh_model.name
    sidecar = await start(_hold_config(triton, fresh_model))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")

    # One wrong answer (the probe's), then a slow confirmation that passes.
    answers = await _held_requests(sidecar, model, lambda: fresh_model.inject("blip"))

    for i, (status, _, body) in enumerate(answers):
        assert status == 200, body
        scores = np.asarray(next(o for o in body["outputs"] if o["name"] == "scores")["data"], dtype=np.float32)
        np.testing.assert_allclose(scores, credit_risk_scores(features(1, seed=i)).ravel(), atol=1e-5, rtol=1e-4)
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="suspect_released") >= 1
    assert sidecar.first_transition_to(model, *QUARANTINED) is None
    await wait_for(lambda: not sidecar.app[STATES].get(model).suspect, 10, what="the confirmation decided")


async def test_requests_held_while_suspect_are_held_and_served_by_the_front_without_python(
        triton, fresh_model, start):
    """The suspect hold on the Rust front: the requests wait for the verdict in the front's admission
    and are answered by it when the confirmation passes, none handed to the Python app or entering
    its chain."""
    model = fresh_model.name
    config = _hold_config(triton, fresh_model)
    sidecar = await start(replace(config, listen=replace(config.listen, front="rust")))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    front = sidecar.server
    assert isinstance(front, HttpFront)
    await served_by_front(front, model)

    handovers = front.handovers
    with PythonEntries(sidecar.app[SERVING]) as entries:
        answers = await _held_requests(sidecar, model, lambda: fresh_model.inject("blip"))
    for i, (status, _, body) in enumerate(answers):
        assert status == 200, body
        scores = np.asarray(next(o for o in body["outputs"] if o["name"] == "scores")["data"], dtype=np.float32)
        np.testing.assert_allclose(scores, credit_risk_scores(features(1, seed=i)).ravel(), atol=1e-5, rtol=1e-4)
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="suspect_released") >= 1
    assert front.handovers == handovers, f"{front.handovers - handovers} requests handed to the Python app"
    assert entries.count == 0, f"{entries.count} entries into the Python request chain"


async def test_requests_held_while_suspect_are_refused_when_the_confirmation_fails(triton, fresh_model, start):
    model = fresh_model.name
    sidecar = await start(_hold_config(triton, fresh_model))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    front = sidecar.server
    await served_by_front(front, model)  # held and refused by the front's own admission
    handovers = front.handovers if isinstance(front, HttpFront) else 0

    # Wrong answers from now on, each 0.2 s late: the confirmation fails, slowly enough to be held for.
    answers = await _held_requests(sidecar, model, lambda: fresh_model.inject("slow_drift"))

    for status, headers, body in answers:
        assert status == 503 and headers.get("Retry-After") == "1", (status, body)
        assert body["reason"] == "quarantined", body
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="suspect_refused") >= 1
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="suspect_released") in (
        None, 0.0)
    if isinstance(front, HttpFront):
        assert front.handovers == handovers, f"{front.handovers - handovers} requests handed to the Python app"
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 30, what=f"{model} healed")
