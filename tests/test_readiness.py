"""One readiness (sidecar.serving.readiness) behind every endpoint that answers it: `/readyz`,
`/v2/health/ready`, `/v2/models/{m}/ready`, gRPC `ServerReady` and `ModelReady`, and grpc.health.v1
`Check` agree, in front of the real shared Triton, (a) under `probes.require_golden` with a model
that has no golden files, (b) while a model is being healed (its heal held at the unload by a gate
in the Triton client) and (c) while the pod drains."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from sidecar.fronts.appkeys import LIFECYCLE, WATCH
from sidecar.health.triton_client import TritonClient
from sidecar.states import ModelState
from tests.harness import GOLDEN, RunningSidecar, wait_for
from tests.proxy_support import started_and_healthy
from tests.test_grpc import GRPC_FRONT, _raw_call, grpc_config


async def _views(sidecar: RunningSidecar, target: str, models: list[str]) -> dict[str, Any]:
    """Every endpoint's answer: True for ready. Pod-wide under "pod", each model under its name."""
    pod: dict[str, bool] = {}
    for path in ("/readyz", "/v2/health/ready"):
        async with sidecar.session.get(sidecar.url + path) as r:
            pod[path] = r.status == 200
    _, _, _, answer = await _raw_call(target, "ServerReady", pb.ServerReadyRequest().SerializeToString())
    pod["ServerReady"] = pb.ServerReadyResponse.FromString(answer).ready
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        pod["health.Check('')"] = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status == serving
        views: dict[str, Any] = {"pod": pod}
        for model in models:
            async with sidecar.session.get(f"{sidecar.url}/v2/models/{model}/ready") as r:
                http_ready = r.status == 200
            _, _, _, answer = await _raw_call(target, "ModelReady",
                                              pb.ModelReadyRequest(name=model).SerializeToString())
            check = await health.Check(health_pb2.HealthCheckRequest(service=model))
            views[model] = {f"/v2/models/{model}/ready": http_ready,
                            "ModelReady": pb.ModelReadyResponse.FromString(answer).ready,
                            f"health.Check({model!r})": check.status == serving}
    return views


def _agree(views: dict[str, Any], pod: bool, **models: bool) -> None:
    """Every endpoint says `pod` for the pod and the given value for each model."""
    assert set(views["pod"].values()) == {pod}, views
    for model, ready in models.items():
        assert set(views[model].values()) == {ready}, views


async def test_readiness_endpoints_agree_under_require_golden_with_a_model_without_golden_files(
        triton, start, tmp_path: Path):
    golden = tmp_path / "golden"
    shutil.copytree(GOLDEN / "credit_risk", golden / "credit_risk")  # image_classifier has none here
    config = grpc_config(triton, models=["credit_risk", "image_classifier"], golden_dir=golden,
                         probes={"require_golden": True})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    views = await _views(sidecar, target, ["credit_risk", "image_classifier"])
    _agree(views, pod=False, credit_risk=True, image_classifier=False)
    _, body = await sidecar.get("/v2/health/ready")
    assert any("image_classifier has no golden files" in p for p in body["problems"]), body
    _, body = await sidecar.get("/readyz")
    assert any("image_classifier has no golden files" in p for p in body["problems"]), body


class _GatedTriton(TritonClient):
    """The real Triton client, except that a heal's unload waits for the test to open the gate: the
    model stays HEALING for as long as the test looks."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout_s=5.0)
        self.gate = asyncio.Event()
        self.unloads_waiting = 0

    async def unload_model(self, model: str, timeout_s: float | None = None) -> None:
        self.unloads_waiting += 1
        await self.gate.wait()
        await super().unload_model(model, timeout_s)


async def test_readiness_endpoints_agree_during_a_heal_and_after_it(triton, fresh_model, start):
    shutil.copytree(GOLDEN / "credit_risk", fresh_model.golden_dir / "credit_risk")
    model = fresh_model.name
    config = grpc_config(triton, models=["credit_risk", model], golden_dir=fresh_model.golden_dir)
    gated = _GatedTriton(triton.url)
    sidecar = await start(config, triton=gated)
    for name in config.models:
        await wait_for(lambda n=name: sidecar.state(n) is ModelState.HEALTHY, 30, what=f"{name} HEALTHY")
    target = f"127.0.0.1:{config.listen.grpc_port}"
    _agree(await _views(sidecar, target, ["credit_risk", model]), pod=True, credit_risk=True, **{model: True})

    fresh_model.kill_stub()
    await wait_for(lambda: gated.unloads_waiting > 0 and sidecar.state(model) is ModelState.HEALING, 30,
                   what="a heal held at its unload")
    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    _agree(await _views(sidecar, target, ["credit_risk", model]), pod=False, credit_risk=True, **{model: False})
    assert sidecar.state(model) is ModelState.HEALING, "the views were taken during the heal"
    if GRPC_FRONT == "rust":  # the healing model's ModelReady is the sidecar's verdict, given without Python
        assert sidecar.server.grpc_handovers == handovers

    gated.gate.set()
    # Triton itself is "not ready" while it reloads the model (strict readiness): wait for both.
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY and sidecar.app[WATCH].ready, 30,
                   what="healed, and Triton ready again")
    _agree(await _views(sidecar, target, ["credit_risk", model]), pod=True, credit_risk=True, **{model: True})


async def test_readiness_endpoints_agree_during_drain(triton, start):
    config = grpc_config(triton, models=["credit_risk", "image_classifier"])
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    _agree(await _views(sidecar, target, ["credit_risk", "image_classifier"]), pod=True, credit_risk=True,
           image_classifier=True)
    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    sidecar.app[LIFECYCLE].begin_drain()
    views = await _views(sidecar, target, ["credit_risk", "image_classifier"])
    _agree(views, pod=False, credit_risk=False, image_classifier=False)
    status, body = await sidecar.get("/v2/health/ready")
    assert status == 503 and "shutting down" in body["problems"], body
    if GRPC_FRONT == "rust":  # ServerReady and ModelReady said so from the sidecar's verdict, without Python
        assert sidecar.server.grpc_handovers == handovers
