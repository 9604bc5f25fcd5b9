"""Versions side by side: golden files name a version, each loaded version with cases is probed,
and a broken version is quarantined for the requests that reach it (explicitly, or unversioned
ones Triton routes to it) while the other version keeps answering; a heal reloads the model.
A pinned version (path `/versions/N`, header `x-model-version`) is answered by that version and
counted as pinned; on the Rust front (the default) without entering Python once its
spec is fetched, with the same refusals."""

from __future__ import annotations

import asyncio
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
from sidecar.fronts.appkeys import SERVING, STATES
from sidecar.fronts.http_front import HttpFront
from sidecar.states import ModelState
from tests.harness import FAULTY_TEMPLATE, GOLDEN, SLACK_S, looked_after, sidecar_config, triton_post, wait_for
from tests.proxy_support import PythonEntries, credit_json, features, triton_successes

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


async def _scores(sidecar, model: str, version: str = "", header: str = ""):  # type: ignore[no-untyped-def]
    """(200, scores) or (status, refusal) of one infer; `header`: x-model-version's value."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    headers = {"x-model-version": header} if header else {}
    async with sidecar.session.post(sidecar.url + path, json=credit_json(rows=2, seed=3),
                                    headers=headers) as response:
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
    await _pins_served(sidecar, model)  # on the Rust front: both versions its own before the fault
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


async def test_an_unpinned_request_falls_back_to_the_trusted_version_on_the_front(two_versions, start):
    """Version 2 (Triton's choice) broken: unpinned requests are answered by version 1 (the fallback,
    counted in routed_total as such and counted by Triton on version 1), a request pinned to version
    2 is refused as before, one pinned to 1 is answered; on the Rust front, all without Python."""
    model = two_versions.name
    sidecar = await start(sidecar_config(two_versions.triton, models=[model], golden_dir=two_versions.golden_dir,
                                         healing={"enabled": False}))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    expected = credit_risk_scores(features(rows=2, seed=3)).ravel()
    await _pins_served(sidecar, model)
    two_versions.inject("2", "nan")
    await wait_for(lambda: sidecar.state(model) is ModelState.UNHEALTHY, 20, what="UNHEALTHY")
    front = sidecar.server
    if isinstance(front, HttpFront):  # the fallback and version 1 published to the front
        await wait_for(lambda: (model, False, True, "1") in front.lanes()[2] and _pinnable(sidecar, model) >= {"1"},
                       5, what="the fallback to version 1 on the front")
    fallback_before = _routed(sidecar, model, "1", "fallback")
    rejected_before = sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="rejected") or 0
    on_1, on_2 = triton_successes(two_versions.triton, model, "1"), triton_successes(two_versions.triton, model, "2")
    handovers = front.handovers if isinstance(front, HttpFront) else 0
    with PythonEntries(sidecar.app[SERVING]) as entries:
        for _ in range(5):
            code, scores = await _scores(sidecar, model)
            assert code == 200 and np.allclose(scores, expected, atol=1e-5), scores
        code, body = await _scores(sidecar, model, "2")
        assert (code, body["reason"]) == (503, "quarantined") and "version 2" in body["error"], body
        code, scores = await _scores(sidecar, model, header="1")
        assert code == 200 and np.allclose(scores, expected, atol=1e-5), scores
    assert _routed(sidecar, model, "1", "fallback") - fallback_before == 5
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="rejected") == (
        rejected_before + 1)
    assert triton_successes(two_versions.triton, model, "1") - on_1 == 6
    assert triton_successes(two_versions.triton, model, "2") == on_2
    if isinstance(front, HttpFront):
        assert front.handovers == handovers, f"{front.handovers - handovers} requests handed to the Python app"
        assert entries.count == 0, f"{entries.count} entries into the Python request chain"


def _routed(sidecar, model: str, version: str, reason: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("triton_sidecar_routed_total", model=model, version=version, reason=reason) or 0.0


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


def _pinnable(sidecar, model: str) -> set[str]:  # type: ignore[no-untyped-def]
    """The versions of `model` the Rust front serves pinned on its own now (none on the Python front)."""
    front = sidecar.server
    if not isinstance(front, HttpFront):
        return set()
    return {version for lane in front.lanes()[0] if lane[0] == model for version, *_ in lane[6]}


async def _pins_served(sidecar, model: str) -> None:  # type: ignore[no-untyped-def]
    """One request pinned to each version (the Python chain fetches its spec), then, on the Rust
    front, wait until both versions are published to it."""
    for version in ("1", "2"):
        status, answer = await _scores(sidecar, model, version)
        assert status == 200, (version, answer)
    if isinstance(sidecar.server, HttpFront):
        await wait_for(lambda: _pinnable(sidecar, model) == {"1", "2"}, 5, what="versions 1 and 2 on the front")


def _routed_pinned(sidecar, model: str, version: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("triton_sidecar_routed_total", model=model, version=version, reason="pinned") or 0.0


#: Requests per kind of pin in the pinned proof (path to 1, path to 2, header naming 1).
PINNED = 20


async def test_a_pinned_version_answers_from_that_version_and_is_counted_as_pinned(two_versions, start):
    model, triton = two_versions.name, two_versions.triton
    sidecar = await start(sidecar_config(triton, models=[model], golden_dir=two_versions.golden_dir,
                                         probes={"interval_s": 3600.0, "jitter": 0.0}))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    expected = credit_risk_scores(features(rows=2, seed=3)).ravel()
    await _pins_served(sidecar, model)
    on_front = isinstance(sidecar.server, HttpFront)
    answered = {v: triton_successes(triton, model, v) for v in ("1", "2")}
    routed = {v: _routed_pinned(sidecar, model, v) for v in ("1", "2")}
    with PythonEntries(sidecar.app[SERVING]) as python:
        for _ in range(PINNED):
            for version, header in (("1", ""), ("2", ""), ("", "1")):
                status, scores = await _scores(sidecar, model, version, header)
                assert status == 200 and np.allclose(scores, expected, atol=1e-5), (version, header, scores)
    # Each reached the version it named (Triton's own count per version: the URL names it)...
    assert triton_successes(triton, model, "1") - answered["1"] == 2 * PINNED
    assert triton_successes(triton, model, "2") - answered["2"] == PINNED
    # ... counted as pinned, whichever front served it ...
    assert _routed_pinned(sidecar, model, "1") - routed["1"] == 2 * PINNED
    assert _routed_pinned(sidecar, model, "2") - routed["2"] == PINNED
    # ... and on the Rust front none of them entered Python (on the Python front each did).
    assert python.count == 0 if on_front else python.count >= 3 * PINNED, python.count
    # Refused as before, by the Python chain on either front: a version Triton has not loaded
    # (routed as "other", a bounded label), one that is not a number, path and header disagreeing.
    status, body = await _scores(sidecar, model, "7")
    assert (status, body["reason"]) == (404, "unknown_model"), body
    assert _routed_pinned(sidecar, model, "other") == 1
    status, body = await _scores(sidecar, model, "x")
    assert (status, body["reason"]) == (404, "unknown_model") and "versions are numbers" in body["error"], body
    status, body = await _scores(sidecar, model, "1", header="2")
    assert (status, body["reason"], body["field"]) == (400, "schema", "x-model-version"), body


async def test_requests_at_triton_for_a_version_quarantined_alone_end_while_the_other_version_s_finish(
        two_versions, start):
    """Version 2 hangs, version 1 is slow (0.2 s a call); with requests pinned to each waiting at
    Triton, version 2 alone is quarantined: its requests end at once with 503, version 1's are
    answered. On the Rust front every one of them is the front's, ended by it."""
    model = two_versions.name
    # No probe rounds after the first: the quarantine below is the test's, confined to version 2.
    sidecar = await start(sidecar_config(two_versions.triton, models=[model], golden_dir=two_versions.golden_dir,
                                         healing={"enabled": False}, probes={"interval_s": 3600.0, "jitter": 0.0},
                                         proxy={"upstream_timeout_s": 30.0, "retry_after_s": 1}))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    await _pins_served(sidecar, model)
    two_versions.inject("2", "hang")
    two_versions.inject("1", "slow_drift")

    async def timed(version: str) -> tuple[float, int, object]:
        status, answer = await _scores(sidecar, model, version)
        return time.monotonic(), status, answer

    with PythonEntries(sidecar.app[SERVING]) as python:
        hung = [asyncio.create_task(timed("2")) for _ in range(3)]
        slow = [asyncio.create_task(timed("1")) for _ in range(10)]  # one at a time at Triton: 2 s in all
        await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_in_flight", model=model) == 13, 5,
                       what="13 requests waiting at Triton")
        broken = sidecar.app[STATES].apply(model, lambda health, now: health.probe_failed(
            "golden case v2_boundary: no answer", now, final=True, versions=frozenset({"2"})))
        assert broken is not None and sidecar.app[SERVING].admission.trusted(model, "1")
        ended, answered = await asyncio.gather(*hung), await asyncio.gather(*slow)
    for finished, status, body in ended:
        assert (status, body["reason"]) == (503, "quarantined") and "version 2" in body["error"], body
        assert finished - broken.at <= 1.0 + SLACK_S, f"answered {finished - broken.at:.2f} s after quarantine"
    assert [status for _, status, _ in answered] == [200] * len(slow)
    assert max(finished for finished, _, _ in answered) > broken.at  # some were still at Triton then
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="ended_at_triton") == 3
    # On the Rust front the thirteen were its own, ended or answered by it; on the Python front each
    # entered the Python chain.
    assert python.count == 0 if isinstance(sidecar.server, HttpFront) else python.count >= 13, python.count
