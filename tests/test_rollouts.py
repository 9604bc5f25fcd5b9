"""Version rollouts inside the pod, against the real Triton with a model holding two versions
(`version_policy: { all {} }`): golden gate, weighted steps, live answers compared, abort within a
second, pinning by path / header / gRPC, cohort stickiness, fallback, shadow cost and cap, restart
and config decisions."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc.aio
import pytest
from structlog.testing import capture_logs
from tritonclient.grpc import service_pb2 as pb

from sidecar.app.factory import apply_config
from sidecar.config import FilterRule, RolloutSettings
from sidecar.devtools.tritonserver import LocalTriton, free_port
from sidecar.fronts.appkeys import SERVING
from sidecar.fronts.grpc_server import SERVICE
from sidecar.fronts.http_front import HttpFront
from sidecar.serving.rollouts import RolloutState
from sidecar.states import ModelState
from tests.harness import (
    FAULTY_TEMPLATE,
    FAULTY_TEXT_TEMPLATE,
    GOLDEN,
    REPO,
    sidecar_config,
    stop_sidecar,
    triton_post,
    wait_for,
)
from tests.proxy_support import PythonEntries, binary_request, credit_json, features
from tests.test_versions import TwoVersions

_names = iter(range(1_000_000))


#: x[0] above this for about 10 % of standard normal rows: where the "differs" candidate answers otherwise.
TENTH = 1.2816


_SCORES = "scores = _sigmoid(x @ self.w + self.b).astype(np.float32).reshape(-1, 1)"


#: The line of tests/models/faulty_text that reverses words (its "wrong" fault).
_REVERSED = 'if self.fault == "wrong":'


#: Version 2's code for each kind of candidate: (line of version 1, its replacement); None: a copy.
CANDIDATES = {
    "same": None,
    "differs": (_SCORES, _SCORES.replace("_sigmoid(x @ self.w + self.b)",
                                         f"(_sigmoid(x @ self.w + self.b) + 0.2 * (x[:, 0] > {TENTH}))")),
    "wrong": (_SCORES, _SCORES.replace("self.b)", "self.b + 3.0)")),
    # Only the filtered output differs: the golden cases (scores only) still pass.
    "income_differs": ("income = _sigmoid(x @ self.v)", "income = _sigmoid(x @ self.v + 1.0)"),
    # Words starting with z come back reversed: the golden cases (alpha, beta...) still pass.
    "text_differs_on_z": (_REVERSED, 'if self.fault == "wrong" or word.startswith("z"):'),
}


def _two_versions(triton: LocalTriton, tmp_path: Path, candidate: str, template: Path = FAULTY_TEMPLATE,
                  golden_from: str = "credit_risk") -> Iterator[TwoVersions]:
    name = f"rollout_{os.getpid()}_{next(_names)}"
    path = triton.model_repository / name
    shutil.copytree(template, path)
    shutil.copytree(path / "1", path / "2")
    change = CANDIDATES[candidate]
    if change is not None:
        line, replacement = change
        source = (path / "2" / "model.py").read_text()
        assert line in source
        (path / "2" / "model.py").write_text(source.replace(line, replacement))
    config = re.sub(r'name: "[^"]+"', f'name: "{name}"', (path / "config.pbtxt").read_text(), count=1)
    (path / "config.pbtxt").write_text(config + "version_policy: { all { } }\n")
    # Unversioned golden cases: the prober aims them at the serving version, the gate at the candidate.
    golden = tmp_path / "golden"
    (golden / name).mkdir(parents=True)
    for case in (GOLDEN / golden_from).glob("*.json"):
        shutil.copy(case, golden / name / case.name)
    status, body = triton_post(triton, f"/v2/repository/models/{name}/load")
    assert status == 200, body
    yield TwoVersions(triton, name, path, golden)
    triton_post(triton, f"/v2/repository/models/{name}/load")
    triton_post(triton, f"/v2/repository/models/{name}/unload")


@pytest.fixture
def same_candidate(triton: LocalTriton, tmp_path: Path) -> Iterator[TwoVersions]:
    yield from _two_versions(triton, tmp_path, "same")


@pytest.fixture
def two_ms_model(triton: LocalTriton, tmp_path: Path) -> Iterator[TwoVersions]:
    """bench's credit_risk_2ms (2 ms of device time per batch, a sleep) with two identical versions."""
    yield from _two_versions(triton, tmp_path, "same", REPO / "bench" / "models" / "credit_risk_2ms")


@pytest.fixture
def differing_candidate(triton: LocalTriton, tmp_path: Path) -> Iterator[TwoVersions]:
    yield from _two_versions(triton, tmp_path, "differs")


@pytest.fixture
def text_candidate(triton: LocalTriton, tmp_path: Path) -> Iterator[TwoVersions]:
    """tests/models/faulty_text with two versions; version 2 reverses words that start with z."""
    yield from _two_versions(triton, tmp_path, "text_differs_on_z", FAULTY_TEXT_TEMPLATE, golden_from="text_echo")


@pytest.fixture
def income_candidate(triton: LocalTriton, tmp_path: Path) -> Iterator[TwoVersions]:
    yield from _two_versions(triton, tmp_path, "income_differs")


@pytest.fixture
def wrong_candidate(triton: LocalTriton, tmp_path: Path) -> Iterator[TwoVersions]:
    yield from _two_versions(triton, tmp_path, "wrong")


def rollout_config(model: TwoVersions, *, grpc: bool = False, proxy: dict | None = None, **rollout: Any):  # type: ignore[no-untyped-def]
    config = sidecar_config(model.triton, models=[model.name], golden_dir=model.golden_dir,
                            healing={"enabled": False}, **({"proxy": proxy} if proxy else {}))
    settings = RolloutSettings(**{"stable": "1", "candidate": "2", **rollout})
    config = replace(config, rollouts={model.name: settings})
    if grpc:
        config = replace(config, listen=replace(config.listen, grpc_port=free_port()))
    return config


async def infer(sidecar, model: str, seed: int, *, version: str = "", headers: dict | None = None
                ) -> tuple[int, dict[str, Any]]:  # type: ignore[no-untyped-def]
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    async with sidecar.session.post(sidecar.url + path, json=credit_json(rows=1, seed=seed),
                                    headers=headers or {}) as response:
        return response.status, await response.json()


def rollout_of(sidecar, model: str):  # type: ignore[no-untyped-def]
    return sidecar.app[SERVING].rollouts.get(model)


async def healthy_and_progressing(start, config, model: str):  # type: ignore[no-untyped-def]
    sidecar = await start(config)
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 30, what="HEALTHY")
    await wait_for(lambda: rollout_of(sidecar, model).state is not RolloutState.GATING, 20, what="gate done")
    return sidecar


async def test_an_identical_candidate_passes_the_gate_and_is_promoted_through_every_step(same_candidate, start):
    model = same_candidate.name
    config = rollout_config(same_candidate, steps=(0.1, 0.5, 1.0), step_min_requests=20, step_min_s=0.3,
                            shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    assert rollout.state is RolloutState.PROGRESSING, rollout.cause
    steps_seen = set()
    seed = 0
    deadline = time.monotonic() + 60
    while rollout.state is RolloutState.PROGRESSING:
        assert time.monotonic() < deadline, rollout.status()
        steps_seen.add(rollout.step)
        seed += 1
        status, body = await infer(sidecar, model, seed)
        assert status == 200, body
    assert rollout.state is RolloutState.PROMOTED, rollout.status()
    assert steps_seen == {0, 1, 2}
    assert rollout.differs_total == 0 and rollout.compared_total >= 60
    # Promoted: every unpinned answer comes from the candidate; stable still answers when pinned.
    for i in range(20):
        status, body = await infer(sidecar, model, 1000 + i)
        assert (status, body["model_version"]) == (200, "2"), body
    status, body = await infer(sidecar, model, 1, version="1")
    assert (status, body["model_version"]) == (200, "1")
    _, doc = await sidecar.get("/status")
    assert doc["rollouts"][model]["state"] == "promoted"
    assert sidecar.metric("triton_sidecar_rollout_state", model=model, state="promoted") == 1
    assert sidecar.metric("triton_sidecar_rollout_share", model=model, candidate="2") == 1.0
    assert sidecar.metric("triton_sidecar_rollout_compared_total", model=model, candidate="2", outcome="same") >= 60
    # Golden probes now treat the candidate as the default version.
    probed = sidecar.app[SERVING].rollouts.get(model).serving_version
    assert probed == "2"


async def test_a_candidate_differing_on_a_tenth_of_inputs_is_aborted_within_a_second(differing_candidate, start):
    model = differing_candidate.name
    config = rollout_config(differing_candidate, steps=(0.5, 1.0), step_min_requests=100, step_min_s=60,
                            shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    early = 10  # step_min_requests / 10
    crossed_at, differing = None, 0
    for seed in range(1, 2000):
        status, body = await infer(sidecar, model, seed)
        assert status == 200, body
        differing += int(features(1, seed)[0, 0] > TENTH)
        if crossed_at is None and seed >= early and differing:
            # This request's pair makes `early` compared with one differing: the rate is crossed.
            crossed_at = time.monotonic()
        if rollout.state is RolloutState.ABORTED:
            break
    await wait_for(lambda: rollout.state is RolloutState.ABORTED, 1.0, what="aborted")
    assert crossed_at is not None
    aborted_within = time.monotonic() - crossed_at
    assert aborted_within < 1.0, aborted_within
    assert "answers differ" in rollout.cause and "scores[0] expected" in rollout.cause, rollout.cause
    # From then on no unpinned answer comes from the candidate.
    for i in range(50):
        status, body = await infer(sidecar, model, 5000 + i)
        assert (status, body["model_version"]) == (200, "1"), body
    assert sidecar.metric("triton_sidecar_rollout_state", model=model, state="aborted") == 1
    assert sidecar.metric("triton_sidecar_rollout_share", model=model, candidate="2") == 0
    # The rollout is not model state: the model stays HEALTHY and the pod alive.
    code, _ = await sidecar.get("/healthz")
    assert code == 200 and sidecar.state(model) is ModelState.HEALTHY
    _, doc = await sidecar.get("/status")
    assert doc["rollouts"][model]["state"] == "aborted" and "scores" in doc["rollouts"][model]["cause"]


async def test_a_filtered_output_is_compared_in_the_pod_and_its_values_never_leave_it(income_candidate, start):
    model = income_candidate.name
    config = rollout_config(income_candidate, steps=(0.5, 1.0), step_min_requests=20, step_min_s=60, shadow_rate=1.0)
    config = replace(config, filtering=replace(config.filtering, rules=(
        FilterRule(model="rollout_.*", drop_outputs=("income_prob",)),)))
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    with capture_logs() as logs:
        for seed in range(1, 40):
            status, body = await infer(sidecar, model, seed)
            assert status == 200 and [o["name"] for o in body["outputs"]] == ["scores"], body
            if rollout.state is RolloutState.ABORTED:
                break
        await wait_for(lambda: rollout.state is RolloutState.ABORTED, 5, what="aborted on the filtered output")
    assert "income_prob differs (a filtered output: values stay in the pod)" in rollout.cause, rollout.cause
    aborted = [e for e in logs if e["event"] == "rollout_aborted"]
    assert len(aborted) == 1 and not re.search(r"\d\.\d{3}", aborted[0]["cause"]), aborted
    _, doc = await sidecar.get("/status")
    assert not re.search(r"\d\.\d{3}", doc["rollouts"][model]["example"] or ""), doc["rollouts"][model]


async def generate(sidecar, model: str, text: str) -> tuple[int, dict[str, Any]]:  # type: ignore[no-untyped-def]
    async with sidecar.session.post(f"{sidecar.url}/v2/models/{model}/generate",
                                    json={"text_input": text}) as response:
        return response.status, await response.json()


async def test_generate_answers_are_compared_as_text_and_a_differing_text_aborts(text_candidate, start):
    model = text_candidate.name
    config = rollout_config(text_candidate, steps=(0.5, 1.0), step_min_requests=20, step_min_s=60, shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    for _ in range(6):  # both versions echo "alpha": compared, the same
        status, body = await generate(sidecar, model, "alpha")
        assert (status, body["text_output"]) == (200, "alpha"), body
    await wait_for(lambda: rollout.compared_total == 6, 10, what="6 generate answers compared")
    assert rollout.differs_total == 0 and rollout.state is RolloutState.PROGRESSING, rollout.status()
    assert sidecar.metric("triton_sidecar_rollout_compared_total", model=model, candidate="2", outcome="same") == 6

    with capture_logs() as logs:
        for _ in range(20):  # "zeta": stable echoes it, the candidate answers "atez"
            await generate(sidecar, model, "zeta")
            if rollout.state is RolloutState.ABORTED:
                break
        await wait_for(lambda: rollout.state is RolloutState.ABORTED, 5, what="aborted on a differing text")
    assert "text_output differs" in rollout.cause, rollout.cause
    aborted = [e for e in logs if e["event"] == "rollout_aborted"]
    assert len(aborted) == 1 and "text_output differs" in aborted[0]["cause"], aborted
    # The texts themselves (a prompt's echo is input data) are in neither the cause nor the event.
    assert not any(word in json.dumps(aborted[0]) for word in ("zeta", "atez")), aborted
    for _ in range(5):
        status, body = await generate(sidecar, model, "zeta")
        assert (status, body["text_output"], body["model_version"]) == (200, "zeta", "1"), body


async def test_the_front_splits_shadows_and_compares_a_rollout_s_requests_without_python(same_candidate, start):
    """On the Rust front a rollout model is a lane: each HTTP infer request (JSON or binary) is split,
    answered, shadowed to the other version and the two answers compared in the data plane; no
    request enters the Python chain, which hears only the evidence (a served answer, a compared
    pair) and keeps the decisions."""
    model = same_candidate.name
    config = rollout_config(same_candidate, steps=(0.5, 1.0), step_min_s=600, step_min_requests=100_000,
                            shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    front = sidecar.server
    if not isinstance(front, HttpFront):
        pytest.skip("the Python listener has no data plane: its rollouts are the Python chain's (tested above)")

    def pinnable() -> set[str]:
        return {version for lane in front.lanes()[0] if lane[0] == model for version, *_ in lane[6]}

    await wait_for(lambda: {"1", "2"} <= pinnable() and front.settled, 10, what="both versions lanes on the front")
    rollout = rollout_of(sidecar, model)
    n = 40
    versions = []
    with PythonEntries(sidecar.app[SERVING]) as entries:
        for seed in range(n):
            if seed % 2:
                body, headers = binary_request("features", features(1, seed))
                async with sidecar.session.post(f"{sidecar.url}/v2/models/{model}/infer", data=body,
                                                headers=headers) as response:
                    assert response.status == 200, await response.text()
                    versions.append("binary")
            else:
                status, answer = await infer(sidecar, model, seed)
                assert status == 200, answer
                versions.append(answer["model_version"])
        shadows = sidecar.app[SERVING].shadows
        await wait_for(lambda: len(shadows) == 0, 10, what="every shadow heard")
    assert entries.count == 0, "a rollout's request entered the Python chain"
    dropped = sidecar.metric("triton_sidecar_shadow_dropped_total", model=model) or 0
    # Every pair compared (the same candidate: no difference), and each pair is one candidate answer.
    assert rollout.compared_total + dropped == n and rollout.differs_total == 0, rollout.status()
    await wait_for(lambda: rollout.stage.candidate_answers == n, 5, what="every served answer heard")
    assert sum(len(w) for w in rollout.stage.latencies.values()) == n, rollout.stage.latencies
    split = [sidecar.metric("triton_sidecar_routed_total", model=model, version=v, reason="split") or 0
             for v in ("1", "2")]
    shadowed = [sidecar.metric("triton_sidecar_routed_total", model=model, version=v, reason="shadow") or 0
                for v in ("1", "2")]
    assert sum(split) == n and all(split), split  # a 50 % step: both versions served
    assert sum(shadowed) + dropped == n, shadowed
    assert {"1", "2"} >= {v for v in versions if v != "binary"}
    assert sidecar.metric("triton_sidecar_rollout_compared_total", model=model, candidate="2",
                          outcome="same") == rollout.compared_total


async def test_a_candidate_that_fails_its_golden_case_never_serves(wrong_candidate, start):
    model = wrong_candidate.name
    config = rollout_config(wrong_candidate, steps=(0.5, 1.0), shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    assert rollout.state is RolloutState.ABORTED
    assert rollout.cause.startswith("golden gate: golden case"), rollout.cause
    for i in range(40):
        status, body = await infer(sidecar, model, i)
        assert (status, body["model_version"]) == (200, "1"), body
    assert sidecar.metric("triton_sidecar_routed_total", model=model, version="2", reason="split") is None
    assert sidecar.metric("triton_sidecar_routed_total", model=model, version="2", reason="shadow") is None
    # The model's own probes aim its unversioned cases at stable: the model is still HEALTHY.
    assert sidecar.state(model) is ModelState.HEALTHY


async def test_the_gate_runs_the_candidate_s_own_versioned_cases_and_their_failure_leaves_the_pod_alone(
        same_candidate, start):
    """A case written for version 2 (`"version": "2"`) judges the candidate instead of the model's
    unversioned cases, which version 2 would pass. It is the gate's alone: the model's rounds do not
    run it while the candidate serves nobody, so nothing is quarantined, reloaded or unready."""
    model = same_candidate.name
    normal = json.loads((same_candidate.golden_dir / model / "normal.json").read_text())
    normal["expect"]["outputs"]["scores"]["data"] = [0.9]  # what version 2 was meant to answer
    (same_candidate.golden_dir / model / "v2_normal.json").write_text(json.dumps({**normal, "version": "2"}))
    config = sidecar_config(same_candidate.triton, models=[model], golden_dir=same_candidate.golden_dir,
                            healing={"backoff_initial_s": 0.2})  # healing on: a reload loop would show
    config = replace(config, rollouts={model: RolloutSettings(stable="1", candidate="2", steps=(0.5, 1.0),
                                                              shadow_rate=1.0)})
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    assert rollout.state is RolloutState.ABORTED, rollout.status()
    assert rollout.cause.startswith("golden gate: golden case v2_normal"), rollout.cause
    for i in range(20):
        status, body = await infer(sidecar, model, i)
        assert (status, body["model_version"]) == (200, "1"), body
    def golden_passes() -> float:
        return sidecar.metric("triton_sidecar_probes_total", model=model, probe="golden", result="success") or 0

    passed = golden_passes()
    await wait_for(lambda: golden_passes() >= passed + 6, 10, what="two more rounds of the 3 cases")
    assert sidecar.state(model) is ModelState.HEALTHY and sidecar.first_transition_to(
        model, ModelState.UNHEALTHY, ModelState.HEALING) is None
    assert (await sidecar.get("/readyz"))[0] == 200 and (await sidecar.get("/healthz"))[0] == 200


async def test_a_candidate_that_breaks_while_progressing_is_rolled_back_without_a_heal(same_candidate, start):
    """Past its gate, the candidate's own case fails (NaN in version 2's stub): the rollout aborts at
    the first failed round, so unpinned traffic stays on stable, and the model is not quarantined
    or reloaded (a reload would take stable down with it)."""
    model = same_candidate.name
    normal = json.loads((same_candidate.golden_dir / model / "normal.json").read_text())
    (same_candidate.golden_dir / model / "v2_normal.json").write_text(json.dumps({**normal, "version": "2"}))
    config = sidecar_config(same_candidate.triton, models=[model], golden_dir=same_candidate.golden_dir,
                            healing={"backoff_initial_s": 0.2})  # healing on: a heal would show
    config = replace(config, rollouts={model: RolloutSettings(stable="1", candidate="2", steps=(0.5, 1.0),
                                                              step_min_s=600, shadow_rate=0.0)})
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    assert rollout.state is RolloutState.PROGRESSING, rollout.status()
    same_candidate.inject("2", "nan")
    await wait_for(lambda: rollout.state is RolloutState.ABORTED, 10, what="rollout aborted")
    assert rollout.cause.startswith("the candidate failed its golden cases at step 1: "), rollout.cause
    assert "v2_normal" in rollout.cause, rollout.cause
    for i in range(20):
        status, body = await infer(sidecar, model, i)
        assert (status, body["model_version"]) == (200, "1"), body
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 10, what="HEALTHY on stable's cases")
    assert sidecar.first_transition_to(model, ModelState.UNHEALTHY, ModelState.HEALING) is None
    assert (await sidecar.get("/readyz"))[0] == 200 and (await sidecar.get("/healthz"))[0] == 200


async def test_a_version_is_pinned_by_path_header_and_grpc(same_candidate, start):
    model = same_candidate.name
    config = rollout_config(same_candidate, grpc=True, steps=(0.001, 1.0), step_min_s=600)
    sidecar = await healthy_and_progressing(start, config, model)
    for version in ("1", "2"):
        status, body = await infer(sidecar, model, 1, version=version)
        assert (status, body["model_version"]) == (200, version)
        status, body = await infer(sidecar, model, 1, headers={"x-model-version": version})
        assert (status, body["model_version"]) == (200, version)
    status, body = await infer(sidecar, model, 1, version="1", headers={"x-model-version": "2"})
    assert status == 400 and "x-model-version" in body["error"], body
    x = features(1, 1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        for version in ("1", "2"):
            request = pb.ModelInferRequest(model_name=model, model_version=version)
            tensor = request.inputs.add(name="features", datatype="FP32", shape=[1, 128])
            tensor.contents.fp32_contents.extend(x.ravel().tolist())
            assert (await call(request)).model_version == version
            request.model_version = ""
            answer = await call(request, metadata=(("x-model-version", version),))
            assert answer.model_version == version
    pinned = sidecar.metric("triton_sidecar_routed_total", model=model, version="2", reason="pinned")
    assert pinned == 4


async def test_a_cohort_key_keeps_each_user_on_one_version(same_candidate, start):
    model = same_candidate.name
    config = rollout_config(same_candidate, steps=(0.5, 1.0), step_min_s=600, cohort_key="x-user")
    sidecar = await healthy_and_progressing(start, config, model)
    seen: dict[str, set[str]] = {}
    for user in range(24):
        for i in range(4):
            status, body = await infer(sidecar, model, i, headers={"x-user": f"user-{user}"})
            assert status == 200
            seen.setdefault(f"user-{user}", set()).add(body["model_version"])
    assert all(len(versions) == 1 for versions in seen.values()), seen
    assert {v for versions in seen.values() for v in versions} == {"1", "2"}, seen


async def test_unpinned_requests_fall_back_to_the_trusted_version_while_one_is_quarantined(same_candidate, start):
    """No rollout: version 2 (Triton's default) answers NaN and is quarantined; version 1 serves."""
    model = same_candidate.name
    config = sidecar_config(same_candidate.triton, models=[model], golden_dir=same_candidate.golden_dir,
                            healing={"enabled": False})
    config = replace(config, listen=replace(config.listen, grpc_port=free_port()))
    # Versioned cases, so that a NaN in version 2 blames version 2 only.
    for case in list(same_candidate.golden_dir.joinpath(model).glob("*.json")):
        doc = json.loads(case.read_text())
        for version in ("1", "2"):
            case.with_name(f"v{version}_{case.name}").write_text(json.dumps({**doc, "version": version}))
        case.unlink()
    sidecar = await start(config)
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 30, what="HEALTHY")
    same_candidate.inject("2", "nan")
    await wait_for(lambda: sidecar.state(model) is ModelState.UNHEALTHY, 20, what="UNHEALTHY")
    for i in range(5):
        status, body = await infer(sidecar, model, i)
        assert (status, body["model_version"]) == (200, "1"), body
    status, body = await infer(sidecar, model, 1, version="2")
    assert (status, body["reason"]) == (503, "quarantined"), body
    # The same on gRPC: unpinned falls back to 1, pinned to 2 is UNAVAILABLE.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        request = pb.ModelInferRequest(model_name=model)
        tensor = request.inputs.add(name="features", datatype="FP32", shape=[1, 128])
        tensor.contents.fp32_contents.extend(features(1, 1).ravel().tolist())
        assert (await call(request)).model_version == "1"
        request.model_version = "2"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(request)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert sidecar.metric("triton_sidecar_routed_total", model=model, version="1", reason="fallback") == 6


async def _p50_ms(sidecar, model: str, n: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for i in range(n):
        started = time.perf_counter()
        status, _ = await infer(sidecar, model, i % 50)
        samples.append((time.perf_counter() - started) * 1000)
        assert status == 200
    return statistics.median(samples)


async def test_shadow_calls_do_not_delay_the_client(two_ms_model, start):
    model = two_ms_model.name
    # At the first step nearly every client request goes to stable and every shadow to the candidate:
    # the client's path never waits for a shadow. (At a 50 % share the shadow of one request sits in
    # the very instance the next request needs: that is capacity, see docs/rollouts.md.)
    settings = {"steps": (0.001, 1.0), "step_min_s": 600, "step_min_requests": 100_000}
    plain = await healthy_and_progressing(start, rollout_config(two_ms_model, shadow_rate=0.0, **settings), model)
    shadowed = await healthy_and_progressing(start, rollout_config(two_ms_model, shadow_rate=1.0, **settings), model)
    without, with_shadow = [], []
    for _ in range(4):  # interleaved blocks: load from other processes hits both alike
        without.append(await _p50_ms(plain, model, 60))
        with_shadow.append(await _p50_ms(shadowed, model, 60))
    base, shadow = statistics.median(without), statistics.median(with_shadow)
    print(f"p50 without shadow {base:.2f} ms, with shadow_rate 1.0 {shadow:.2f} ms")
    # What this proves: the client does not wait for its shadow call. A client that waited would pay
    # a second 2 ms execute (p50 about 2x); one that does not pays only the shared CPU of Triton
    # answering the shadow beside the next request (measured +10-25 % on this 2-core machine, more
    # under load from other processes). The 10 % figure of issue 20 is a benchmark's to measure
    # (bench.rollout_cost, bench/RESULTS.md), not a timed test's on a shared machine.
    assert shadow <= base * 1.5, (without, with_shadow)
    assert rollout_of(shadowed, model).compared_total >= 200


async def test_a_client_never_waits_for_its_shadow_even_when_the_candidate_hangs(same_candidate, start):
    """The proof without a stopwatch: the candidate's execute() blocks forever, so a client that
    waited for its shadow call would never get its answer (or only after upstream_timeout_s, 30 s)."""
    model = same_candidate.name
    # A first step of 0 %: every client request goes to stable, every shadow to the hung candidate.
    config = rollout_config(same_candidate, proxy={"max_shadow_in_flight": 3}, steps=(0.0, 1.0), step_min_s=600,
                            step_min_requests=100_000, shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    same_candidate.inject("2", "hang")
    shadows = sidecar.app[SERVING].shadows
    for seed in range(30):
        async with asyncio.timeout(5):
            status, body = await infer(sidecar, model, seed)
        assert (status, body["model_version"]) == (200, "1"), body
    # The first three shadows hang at the candidate, at their cap; the other 27 were never sent.
    assert len(shadows) == 3
    assert sidecar.metric("triton_sidecar_shadow_dropped_total", model=model) == 27


async def test_shadow_calls_stop_at_their_cap_and_are_counted(same_candidate, start):
    model = same_candidate.name
    config = rollout_config(same_candidate, proxy={"max_shadow_in_flight": 2}, steps=(0.5, 1.0), step_min_s=600,
                            step_min_requests=100_000, shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    shadows = sidecar.app[SERVING].shadows
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(shadows))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(infer(sidecar, model, i) for i in range(60)))
    await wait_for(lambda: len(shadows) == 0, 10, what="shadows done")
    watcher.cancel()
    assert all(status == 200 for status, _ in results)
    dropped = sidecar.metric("triton_sidecar_shadow_dropped_total", model=model)
    compared = rollout_of(sidecar, model).compared_total
    assert most <= 2 and dropped and dropped > 0, (most, dropped)
    assert compared + dropped == 60, (compared, dropped)


async def test_a_restart_starts_the_rollout_again_and_a_decision_in_the_config_is_kept(same_candidate, start,
                                                                                        sidecars):
    model = same_candidate.name
    config = rollout_config(same_candidate, steps=(0.5, 1.0), step_min_requests=10, step_min_s=0.2, shadow_rate=1.0)
    sidecar = await healthy_and_progressing(start, config, model)
    rollout = rollout_of(sidecar, model)
    seed = 0
    while rollout.step == 0:
        seed += 1
        await infer(sidecar, model, seed)
    assert rollout.step == 1 and rollout.state is RolloutState.PROGRESSING
    # A restart forgets the evidence: the rollout starts again at the gate, then the first step.
    sidecars.remove(sidecar)
    await stop_sidecar(sidecar)
    again = await healthy_and_progressing(start, config, model)
    assert rollout_of(again, model).state is RolloutState.PROGRESSING
    assert rollout_of(again, model).step == 0 and rollout_of(again, model).compared_total == 0
    # The operator's decision, written in the config, applies on reload and after every restart.
    aborted = replace(config, rollouts={model: replace(config.rollouts[model], decision="abort")})
    apply_config(again.app, aborted)
    assert rollout_of(again, model).state is RolloutState.ABORTED
    for i in range(10):
        status, body = await infer(again, model, i)
        assert (status, body["model_version"]) == (200, "1")
    third = await start(aborted)
    assert rollout_of(third, model).state is RolloutState.ABORTED
    assert "configuration" in rollout_of(third, model).cause


async def test_promote_by_a_config_change(same_candidate, start):
    model = same_candidate.name
    config = rollout_config(same_candidate, steps=(0.001, 1.0), step_min_s=600)
    sidecar = await healthy_and_progressing(start, config, model)
    apply_config(sidecar.app, replace(config, rollouts={model: replace(config.rollouts[model], decision="promote")}))
    for i in range(10):
        status, body = await infer(sidecar, model, i)
        assert (status, body["model_version"]) == (200, "2")
    # Removing the rollout ends it: the gauges go.
    apply_config(sidecar.app, replace(config, rollouts={}))
    assert rollout_of(sidecar, model) is None
    assert sidecar.metric("triton_sidecar_rollout_state", model=model, state="promoted") is None
