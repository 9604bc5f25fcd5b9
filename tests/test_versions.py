"""Versions side by side: golden files name a version, each loaded version with cases is probed,
and a broken version is quarantined for the requests that reach it (explicitly, or unversioned
ones Triton routes to it) while the other version keeps answering; a heal reloads the model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bench.repository import credit_risk_scores
from sidecar.devtools.tritonserver import LocalTriton, stub_pids
from sidecar.states import ModelState
from tests.harness import FAULTY_TEMPLATE, GOLDEN, looked_after, sidecar_config, triton_post, wait_for
from tests.proxy_support import credit_json, features

_names = iter(range(1_000_000))


@dataclass
class TwoVersions:
    triton: LocalTriton
    name: str
    path: Path
    golden_dir: Path

    def inject(self, version: str, kind: str) -> None:
        """Damage one version's running stub (see tests/models/faulty): the other is untouched."""
        (self.path / version / "fault").write_text(kind)
        pids = stub_pids(self.name, parent=self.triton.pid, version=version)
        assert len(pids) == 1, f"expected one stub for {self.name} version {version}, found {pids}"
        os.kill(pids[0], signal.SIGUSR1)


@pytest.fixture
def two_versions(triton: LocalTriton, tmp_path: Path) -> Iterator[TwoVersions]:
    """The fault-injectable model with versions 1 and 2 both loaded, and golden cases for each."""
    name = f"versioned_{os.getpid()}_{next(_names)}"
    path = triton.model_repository / name
    shutil.copytree(FAULTY_TEMPLATE, path)
    shutil.copytree(path / "1", path / "2")
    config = (path / "config.pbtxt").read_text().replace('name: "faulty"', f'name: "{name}"')
    (path / "config.pbtxt").write_text(config + "version_policy: { all { } }\n")
    golden = tmp_path / "golden"
    (golden / name).mkdir(parents=True)
    for case in (GOLDEN / "credit_risk").glob("*.json"):
        for version in ("1", "2"):
            doc = json.loads(case.read_text())
            (golden / name / f"v{version}_{case.name}").write_text(json.dumps({**doc, "version": version}))
    status, body = triton_post(triton, f"/v2/repository/models/{name}/load")
    assert status == 200, body
    yield TwoVersions(triton, name, path, golden)
    triton_post(triton, f"/v2/repository/models/{name}/load")  # a fresh instance unloads cleanly
    triton_post(triton, f"/v2/repository/models/{name}/unload")


async def _scores(sidecar, model: str, version: str = ""):  # type: ignore[no-untyped-def]
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    async with sidecar.session.post(sidecar.url + path, json=credit_json(rows=2, seed=3)) as response:
        body = await response.json()
    if response.status != 200:
        return response.status, body
    return 200, np.asarray(next(o for o in body["outputs"] if o["name"] == "scores")["data"])


async def test_a_broken_version_is_quarantined_while_the_other_keeps_answering(two_versions, start):
    model = two_versions.name
    # Without the fallback to a trusted version (on by default: tests/test_rollouts.py), unversioned
    # requests reach Triton's choice, the broken version 2.
    sidecar = await start(sidecar_config(two_versions.triton, models=[model], golden_dir=two_versions.golden_dir,
                                         healing={"enabled": False}, proxy={"version_fallback": False}))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    expected = credit_risk_scores(features(rows=2, seed=3)).ravel()
    two_versions.inject("2", "nan")
    await wait_for(lambda: sidecar.state(model) is ModelState.UNHEALTHY, 20, what="UNHEALTHY")
    _, status = await sidecar.get("/status")
    assert status["models"][model]["broken_versions"] == ["2"], status["models"][model]
    # Version 1 passes its golden cases: still served, with the right answers.
    code, scores = await _scores(sidecar, model, "1")
    assert code == 200 and np.allclose(scores, expected, atol=1e-5), scores
    # Version 2, asked by number or reached unversioned (Triton routes to the highest): quarantined.
    for version in ("2", ""):
        code, body = await _scores(sidecar, model, version)
        assert (code, body["reason"]) == (503, "quarantined"), (version, body)
        assert "version 2" in body["error"], body


async def test_a_broken_version_is_healed_by_a_reload(two_versions, start):
    model = two_versions.name
    sidecar = await start(sidecar_config(two_versions.triton, models=[model], golden_dir=two_versions.golden_dir))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    two_versions.inject("2", "nan")
    broken = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 20, what="UNHEALTHY")
    await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=broken.at), 40,
                   what="healed")
    expected = credit_risk_scores(features(rows=2, seed=3)).ravel()
    for version in ("1", "2", ""):
        code, scores = await _scores(sidecar, model, version)
        assert code == 200 and np.allclose(scores, expected, atol=1e-5), (version, scores)


async def test_each_version_with_golden_cases_of_its_own_counts_its_own_requests_for_traffic_rounds(
        two_versions, start):
    """probes.every_requests 10: 9 requests to version 1 by name and 9 unversioned (Triton's choice,
    version 2) start no round, though the model served 18; the 10th to version 1 does."""
    model, every = two_versions.name, 10
    sidecar = await start(sidecar_config(two_versions.triton, models=[model], golden_dir=two_versions.golden_dir,
                                         probes={"interval_s": 60.0, "jitter": 0.0, "every_requests": every}))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")

    def traffic_rounds() -> float:
        return sidecar.metric("triton_sidecar_probe_rounds_total", model=model, cause="traffic") or 0.0

    for _ in range(every - 1):
        for version in ("1", ""):
            status, answer = await _scores(sidecar, model, version)
            assert status == 200, answer
    await looked_after(sidecar, time.monotonic(), model)
    assert traffic_rounds() == 0, "a round started on the model's 18 requests, not on a version's 10"
    status, answer = await _scores(sidecar, model, "1")
    assert status == 200, answer
    await wait_for(lambda: traffic_rounds() == 1, 2, interval=0.005, what="a round paced by version 1's traffic")
