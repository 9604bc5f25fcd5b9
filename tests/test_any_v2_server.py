"""The sidecar in front of another v2 server: a real Seldon MLServer with a small custom model.
Its metadata declares no inputs or outputs, it has no model config endpoint, its repository index
wants a JSON body and names states its own way; the sidecar still probes, proxies and heals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from sidecar.states import ModelState
from tests.harness import sidecar_config, wait_for
from tests.mlserver_support import LocalMLServer, mlserver_binary

MODEL = "doubler"
X = [1.0, 2.0, 3.0, 4.0]
CASE = {"description": "y = 2x", "request": {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": X}]},
        "expect": {"status": 200, "outputs": {"y": {"datatype": "FP32", "shape": [1, 4], "data": [2 * v for v in X]}}}}


@pytest.fixture
def mlserver(tmp_path: Path) -> Iterator[LocalMLServer]:
    binary = mlserver_binary()
    if binary is None:
        pytest.skip("MLServer is not installed: `make test` puts it in .venv-mlserver "
                    "(or set SIDECAR_TEST_MLSERVER to an mlserver binary)")
    server = LocalMLServer(binary, tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    root = tmp_path / "golden"
    (root / MODEL).mkdir(parents=True)
    (root / MODEL / "doubles.json").write_text(json.dumps(CASE))
    return root


async def _guarded(start, mlserver: LocalMLServer, golden: Path, **sections):  # type: ignore[no-untyped-def]
    config = sidecar_config(mlserver, models=[MODEL], golden_dir=golden,  # type: ignore[arg-type]
                            metrics={"include_triton": False}, **sections)
    sidecar = await start(config)
    await wait_for(lambda: sidecar.state(MODEL) is ModelState.HEALTHY, 30, what=f"{MODEL} HEALTHY")
    return sidecar


async def _infer(sidecar, values: list[float]):  # type: ignore[no-untyped-def]
    body = {"inputs": [{"name": "x", "shape": [1, len(values)], "datatype": "FP32", "data": values}]}
    async with sidecar.session.post(f"{sidecar.url}/v2/models/{MODEL}/infer", json=body) as response:
        return response.status, await response.json()


async def test_mlserver_is_probed_by_its_golden_cases_and_proxied_like_triton(mlserver, golden, start):
    with capture_logs() as logs:
        sidecar = await _guarded(start, mlserver, golden)
    warned = [e for e in logs if e["event"] == "probe_metadata_incomplete"]
    assert warned and warned[0]["model"] == MODEL, [e["event"] for e in logs]
    assert (await sidecar.get("/readyz"))[0] == 200
    status, answer = await _infer(sidecar, [0.5, -1.0, 2.0])
    assert status == 200, answer
    assert np.allclose(answer["outputs"][0]["data"], [1.0, -2.0, 4.0])
    # What the sidecar checks without a declared spec still holds: nothing malformed reaches MLServer.
    status, refused = await _infer(sidecar, [float("nan")] * 3)
    assert (status, refused["reason"]) == (400, "non_finite"), refused
    async with sidecar.session.post(f"{sidecar.url}/v2/models/{MODEL}/infer", json={
            "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0]}]}) as response:
        assert response.status == 400 and (await response.json())["reason"] == "shape"


async def test_a_model_unloaded_behind_the_sidecars_back_is_healed(mlserver, golden, start):
    sidecar = await _guarded(start, mlserver, golden, healing={"unload_timeout_s": 20.0})
    with capture_logs() as logs:
        status, _ = mlserver.post(f"/v2/repository/models/{MODEL}/unload", {})
        assert status == 200
        healing = await wait_for(lambda: sidecar.first_transition_to(MODEL, ModelState.HEALING), 15, what="HEALING")
        healed = await wait_for(lambda: sidecar.first_transition_to(MODEL, ModelState.HEALTHY, after=healing.at),
                                15, what="healed")
    assert mlserver.index()[MODEL] == "READY"
    # MLServer lists an unloaded model as UNAVAILABLE (Triton's word too, but not its only one): the
    # unload is complete once the model is no longer listed as ready or loading, so the heal never
    # waits out healing.unload_timeout_s (20 s here).
    assert not [e for e in logs if e["event"] == "heal_unload_incomplete"]
    assert healed.at - healing.at < 10, healed.at - healing.at
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=MODEL, result="success") == 1


async def test_wrong_answers_from_mlserver_are_quarantined_and_healed(mlserver, golden, start):
    sidecar = await _guarded(start, mlserver, golden)
    mlserver.inject("nan")
    answers: list[tuple[int, dict]] = []
    unhealthy = None
    for _ in range(200):
        answers.append(await _infer(sidecar, [1.0, 2.0]))
        unhealthy = sidecar.first_transition_to(MODEL, ModelState.UNHEALTHY, ModelState.HEALING)
        if unhealthy:
            break
        await asyncio.sleep(0.02)
    assert unhealthy, "the NaN answers were never detected"
    await wait_for(lambda: sidecar.first_transition_to(MODEL, ModelState.HEALTHY, after=unhealthy.at), 30,
                   what="healed")
    status, answer = await _infer(sidecar, [1.0, 2.0])
    assert status == 200 and answer["outputs"][0]["data"] == [2.0, 4.0]
    for status, body in answers:
        if status == 200:
            assert np.all(np.isfinite(body["outputs"][0]["data"])), body
        else:
            assert body["reason"] in ("non_finite_output", "quarantined"), body
