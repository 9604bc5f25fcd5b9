"""A live repository: golden files and settings reloaded without a restart, and models guarded as
Triton loads them and released when their owner retires them. All against a real Triton."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from structlog.testing import capture_logs

from bench.sidecar_process import SidecarProcess, sidecar_settings
from sidecar.config import load_config
from sidecar.fronts.appkeys import LIVE, PROBER, ROSTER, STATES
from sidecar.health.reload import RELOAD_POLL_S, merge_reloadable
from sidecar.states import ModelState
from tests.conftest import EXAMPLE_MODELS
from tests.harness import FAST_PROBES, GOLDEN, SLACK_S, FreshModel, sidecar_config, triton_post, wait_for

#: A change on disk is in force within one poll, and judged by the round it triggers at once.
PICKUP_BOUND_S = RELOAD_POLL_S + FAST_PROBES["timeout_s"] + SLACK_S
#: A model Triton loads after start is guarded within one discovery pass (one probe interval).
DISCOVERY_BOUND_S = FAST_PROBES["interval_s"] * (1 + FAST_PROBES["jitter"]) + SLACK_S
NORMAL = json.loads((GOLDEN / "credit_risk" / "normal.json").read_text())


def _golden_copy(root: Path, *models: str) -> Path:
    golden = root / "golden"
    for model in models:
        shutil.copytree(GOLDEN / model, golden / model)
    return golden


def _write_json(path: Path, doc: Any) -> None:
    """Written beside and renamed into place, as an editor or a deployment tool does: a reader sees
    the old file or the new one, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _wrong_expectation() -> dict[str, Any]:
    case = json.loads(json.dumps(NORMAL))
    case["expect"]["outputs"]["scores"]["data"] = [0.9]  # the model answers 0.4345
    return case


async def _status_of(sidecar, model: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    _, body = await sidecar.get("/status")
    return body["models"][model]


def test_a_reload_takes_the_reloadable_settings_and_keeps_and_names_the_start_up_ones():
    current = load_config(None, environ={})
    new = load_config(None, environ={"SIDECAR_LISTEN_PORT": "9090", "SIDECAR_PROBES_INTERVAL_S": "1",
                                     "SIDECAR_PROXY_RETRY_AFTER_S": "9", "SIDECAR_MODELS": "a,b"})
    merged, needs_restart = merge_reloadable(current, new)
    assert needs_restart == ["listen.port", "proxy.retry_after_s"]
    assert merged.listen == current.listen and merged.proxy == current.proxy
    assert merged.probes.interval_s == 1 and merged.models == ("a", "b")
    assert merge_reloadable(current, current) == (current, [])


def test_a_reloaded_body_limit_is_live_for_http_and_named_as_needing_a_restart_for_grpc():
    current = load_config(None, environ={})
    new = load_config(None, environ={"SIDECAR_VALIDATION_MAX_BODY_BYTES": "1024"})
    merged, needs_restart = merge_reloadable(current, new)
    assert merged.validation.max_body_bytes == 1024  # the HTTP fronts read it at once
    assert needs_restart == ["validation.max_body_bytes"]  # the gRPC server keeps the limit it started with
    no_grpc = load_config(None, environ={"SIDECAR_LISTEN_GRPC_PORT": "0"})
    new = load_config(None, environ={"SIDECAR_LISTEN_GRPC_PORT": "0", "SIDECAR_VALIDATION_MAX_BODY_BYTES": "1024"})
    assert merge_reloadable(no_grpc, new)[1] == []


def test_a_moved_escalation_record_is_named_as_needing_a_restart_and_the_other_healing_keys_reload():
    current = load_config(None, environ={})
    new = load_config(None, environ={"SIDECAR_HEALING_ESCALATION_RECORD_FILE": "/var/lib/x/escalations.json",
                                     "SIDECAR_HEALING_ESCALATION_COOLDOWN_S": "60"})
    merged, needs_restart = merge_reloadable(current, new)
    assert needs_restart == ["healing.escalation_record_file"]  # the record opened at start stays in use
    assert merged.healing.escalation_cooldown_s == 60


async def test_a_golden_file_changed_on_disk_is_picked_up_and_its_failing_case_quarantines_the_model(
        triton, fresh_model, start, tmp_path):
    model = fresh_model.name
    sidecar = await start(sidecar_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                                         healing={"enabled": False}))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    loaded_before = (await _status_of(sidecar, model))["golden_loaded_at"]

    changed_at = time.monotonic()
    _write_json(fresh_model.golden_dir / model / "normal.json", _wrong_expectation())
    await wait_for(lambda: sidecar.state(model).quarantined,
                   PICKUP_BOUND_S + FAST_PROBES["interval_s"] * FAST_PROBES["failure_threshold"],
                   what=f"{model} quarantined by its changed case")
    took = time.monotonic() - changed_at

    status = await _status_of(sidecar, model)
    assert "golden case normal: scores[0] expected 0.9" in status["reason"]
    assert status["golden_cases"] == 3
    assert status["golden_loaded_at"] is not None and loaded_before is not None
    assert status["golden_refused"] is None
    async with sidecar.session.post(f"{sidecar.url}/v2/models/{model}/infer", json=NORMAL["request"]) as r:
        assert r.status == 503, "a quarantined model's traffic is refused"
    assert took < PICKUP_BOUND_S + FAST_PROBES["interval_s"] * 2 + SLACK_S


def _triton_scores(triton, data: list[float]) -> list[float]:  # type: ignore[no-untyped-def]
    status, answer = triton_post(triton, "/v2/models/credit_risk/infer", {"inputs": [
        {"name": "features", "shape": [1, 128], "datatype": "FP32", "data": data}], "outputs": [{"name": "scores"}]})
    assert status == 200, answer
    return answer["outputs"][0]["data"]


async def test_a_changed_golden_request_is_the_one_probed_next(triton, start, tmp_path):
    golden = _golden_copy(tmp_path, "credit_risk")
    sidecar = await start(sidecar_config(triton, models=["credit_risk"], golden_dir=golden,
                                         healing={"enabled": False}))
    await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 20, what="credit_risk HEALTHY")
    path = golden / "credit_risk" / "normal.json"

    # A new request and the answer Triton gives to it, changed together: every round still passes,
    # which it could not if the old request (answering 0.4345) were still the one sent.
    case = json.loads(json.dumps(NORMAL))
    new_data, other_data = ([round(float(x), 4) for x in np.random.default_rng(seed).normal(0, 3, 128)]
                            for seed in (5, 6))
    case["request"]["inputs"][0]["data"] = new_data
    case["expect"]["outputs"]["scores"]["data"] = _triton_scores(triton, new_data)
    assert abs(case["expect"]["outputs"]["scores"]["data"][0] - NORMAL["expect"]["outputs"]["scores"]["data"][0]) > 0.01
    seen = len(sidecar.transitions)
    _write_json(path, case)
    await wait_for(lambda: any(c.name == "normal" and c.request["inputs"][0]["data"] == new_data
                               for c in sidecar.app[LIVE].golden.cases_for("credit_risk")),
                   PICKUP_BOUND_S, what="the changed case loaded")
    rounds = _record(sidecar).rounds
    threshold = FAST_PROBES["failure_threshold"]
    await wait_for(lambda: _record(sidecar).rounds >= rounds + threshold + 1, 20, what="rounds with the new case")
    assert sidecar.state("credit_risk") is ModelState.HEALTHY
    assert sidecar.transitions[seen:] == [], "not even DEGRADED for a round"

    # Only the request changed: its answer no longer matches the expectation, the model is quarantined.
    assert abs(_triton_scores(triton, other_data)[0] - case["expect"]["outputs"]["scores"]["data"][0]) > 0.01
    case["request"]["inputs"][0]["data"] = other_data
    _write_json(path, case)
    await wait_for(lambda: sidecar.state("credit_risk").quarantined,
                   PICKUP_BOUND_S + FAST_PROBES["interval_s"] * (threshold + 1), what="credit_risk quarantined")
    _, status = await sidecar.get("/status")
    assert "golden case normal: scores[0] expected" in status["models"]["credit_risk"]["reason"]


async def test_a_broken_golden_file_is_refused_and_the_model_keeps_probing_with_its_last_good_cases(
        triton, start, tmp_path):
    golden = _golden_copy(tmp_path, "credit_risk")
    sidecar = await start(sidecar_config(triton, models=["credit_risk"], golden_dir=golden))
    await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 20, what="credit_risk HEALTHY")
    good_names = {c.name for c in sidecar.app[LIVE].golden.cases_for("credit_risk")}
    assert good_names == {"normal", "boundary", "abnormal_shape"}

    with capture_logs() as logs:
        (golden / "credit_risk" / "extra.json").write_text('{"request": {"inputs": []}, "expect": ')
        await wait_for(lambda: sidecar.metric("triton_sidecar_reload_failures_total", what="golden"), PICKUP_BOUND_S,
                       what="the broken file refused")
    refused = [e for e in logs if e["event"] == "golden_reload_refused"]
    assert refused and refused[0]["model"] == "credit_risk" and refused[0]["log_level"] == "error"
    assert "extra.json" in refused[0]["cause"] and "not valid JSON" in refused[0]["cause"]
    assert refused[0]["kept_cases"] == 3

    status = await _status_of(sidecar, "credit_risk")
    assert status["golden_cases"] == 3
    assert "extra.json" in status["golden_refused"]["error"]
    # Still guarded with the old cases: more rounds, each running the three good cases.
    rounds = status["probe_rounds"]
    await wait_for(lambda: _record(sidecar).rounds >= rounds + 2, 10, what="two more rounds")
    assert sidecar.state("credit_risk") is ModelState.HEALTHY
    probed = {r.case for r in _last_round(sidecar).results if r.case}
    assert probed == good_names
    assert sidecar.metric("triton_sidecar_reload_failures_total", what="golden") == 1, "refused once, not per poll"

    # Fixed: the folder loads again, with the new case.
    extra = json.loads(json.dumps(NORMAL))
    extra["description"] = "added while running"
    _write_json(golden / "credit_risk" / "extra.json", extra)
    await wait_for(lambda: len(sidecar.app[LIVE].golden.cases_for("credit_risk")) == 4, PICKUP_BOUND_S,
                   what="the fixed file loaded")
    assert (await _status_of(sidecar, "credit_risk"))["golden_refused"] is None
    await wait_for(lambda: "extra" in {r.case for r in _last_round(sidecar).results}, 10, what="extra probed")

    # Removed: the model goes back to three cases.
    (golden / "credit_risk" / "extra.json").unlink()
    await wait_for(lambda: len(sidecar.app[LIVE].golden.cases_for("credit_risk")) == 3, PICKUP_BOUND_S,
                   what="the removed file dropped")
    assert sidecar.state("credit_risk") is ModelState.HEALTHY


def _record(sidecar, model: str = "credit_risk"):  # type: ignore[no-untyped-def]
    return sidecar.app[PROBER].records[model]


def _last_round(sidecar, model: str = "credit_risk"):  # type: ignore[no-untyped-def]
    return _record(sidecar, model).last_round


async def test_a_configmap_update_by_symlink_swap_is_picked_up(triton, start, tmp_path):
    """The layout kubelet writes for a ConfigMap volume mounted at <golden_dir>/<model> (as
    k8s/base does): a timestamped folder with the files, `..data` pointing at it, and one symlink
    per key through `..data`. An update is kubelet's atomic writer, step by step."""
    golden = tmp_path / "golden"
    mount = golden / "credit_risk"
    first = mount / "..2026_12_03_01"
    shutil.copytree(GOLDEN / "credit_risk", first)
    (mount / "..data").symlink_to(first.name)
    for case in sorted(p.name for p in first.iterdir()):
        (mount / case).symlink_to(f"..data/{case}")
    # Healing off: the last step makes a case fail, and the shared Triton's credit_risk must not be
    # reloaded for it.
    sidecar = await start(sidecar_config(triton, models=["credit_risk"], golden_dir=golden,
                                         healing={"enabled": False}))
    await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 20, what="credit_risk HEALTHY")
    assert {c.name for c in sidecar.app[LIVE].golden.cases_for("credit_risk")} == {
        "normal", "boundary", "abnormal_shape"}, "..data and ..<time> are not cases"

    # The update drops abnormal_shape and adds renamed_boundary: kubelet writes the new folder,
    # adds the new key's link (dangling until the swap), renames a fresh link over `..data`, then
    # removes the old key's link and the old folder.
    second = mount / "..2026_12_03_02"
    second.mkdir()
    shutil.copy(GOLDEN / "credit_risk" / "normal.json", second / "normal.json")
    shutil.copy(GOLDEN / "credit_risk" / "boundary.json", second / "boundary.json")
    shutil.copy(GOLDEN / "credit_risk" / "boundary.json", second / "renamed_boundary.json")
    (mount / "renamed_boundary.json").symlink_to("..data/renamed_boundary.json")
    (mount / "..data_tmp").symlink_to(second.name)
    os.replace(mount / "..data_tmp", mount / "..data")
    (mount / "abnormal_shape.json").unlink()
    shutil.rmtree(first)

    await wait_for(lambda: {c.name for c in sidecar.app[LIVE].golden.cases_for("credit_risk")}
                   == {"normal", "boundary", "renamed_boundary"}, PICKUP_BOUND_S, what="the swapped-in cases")
    await wait_for(lambda: "renamed_boundary" in {r.case for r in _last_round(sidecar).results}, 10,
                   what="the new case probed")
    assert sidecar.state("credit_risk") is ModelState.HEALTHY
    assert sidecar.metric("triton_sidecar_reload_failures_total", what="golden") == 0

    # A swap to content that changed in place under the same names is seen too (new targets).
    third = mount / "..2026_12_03_03"
    third.mkdir()
    for name in ("boundary.json", "renamed_boundary.json"):
        shutil.copy(GOLDEN / "credit_risk" / "boundary.json", third / name)
    _write_json(third / "normal.json", _wrong_expectation())
    (mount / "..data_tmp").symlink_to(third.name)
    os.replace(mount / "..data_tmp", mount / "..data")
    await wait_for(lambda: sidecar.state("credit_risk") is not ModelState.HEALTHY, PICKUP_BOUND_S,
                   what="the changed case failing")
    assert "expected 0.9" in sidecar.app[STATES].get("credit_risk").cause


def _sighup(process: SidecarProcess) -> None:
    os.kill(process.pid, signal.SIGHUP)


def _log_events(process: SidecarProcess) -> list[dict[str, Any]]:
    events = []
    for line in process.log_path.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            raw = response.read()
            return response.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def test_sighup_reloads_settings_in_a_real_process_and_keeps_what_needs_a_restart(triton, tmp_path):
    golden = _golden_copy(tmp_path, "credit_risk")  # image_classifier has no golden files here
    settings = sidecar_settings(triton, models=["credit_risk", "image_classifier"], golden_dir=golden,
                                probes={**FAST_PROBES, "require_golden": False})
    process = SidecarProcess(settings, tmp_path / "sidecar").start(ready_timeout_s=60)
    try:
        status = process.status()
        assert status["models"]["image_classifier"]["without_golden"] is True
        assert status["models"]["image_classifier"]["golden_cases"] == 0
        assert status["models"]["credit_risk"]["without_golden"] is False
        _, metrics = _get(process.url + "/metrics")
        assert b'triton_sidecar_model_without_golden{model="image_classifier"} 1.0' in metrics
        assert b'triton_sidecar_model_without_golden{model="credit_risk"} 0.0' in metrics

        # A reloadable setting and one that needs a restart, changed together. Size, inode and
        # mtime stay as they were, so the watch sees no change: only SIGHUP makes it read the file.
        stat = process.config_path.stat()
        port = settings["listen"]["port"]
        other_port = port + 1 if len(str(port + 1)) == len(str(port)) else port - 1
        original = process.config_path.read_text()
        text = original.replace("require_golden: false", "require_golden: true ").replace(
            f"port: {port}", f"port: {other_port}")
        assert len(text) == len(original) and text != original
        process.config_path.write_text(text)
        os.utime(process.config_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        _sighup(process)
        await wait_for(lambda: _get(process.url + "/readyz")[0] == 503, 10, what="/readyz 503 after SIGHUP")
        _, body = _get(process.url + "/readyz")
        assert any("image_classifier has no golden files" in p for p in json.loads(body)["problems"])
        status = process.status()
        assert status["config"]["needs_restart"] == ["listen.port"]
        assert status["models"]["credit_risk"]["state"] == "HEALTHY", "the sidecar kept guarding"
        events = _log_events(process)
        assert any(e["event"] == "reload_requested" and e["cause"] == "SIGHUP" for e in events)
        restart = [e for e in events if e["event"] == "config_needs_restart"]
        assert restart and restart[0]["keys"] == ["listen.port"]

        # A config that does not load is refused (seen by the watch this time, no signal): the
        # sidecar keeps its settings and its port.
        process.config_path.write_text(text.replace("require_golden: true ", "require_golden: maybe"))
        await wait_for(lambda: b'triton_sidecar_reload_failures_total{what="config"} 1.0'
                       in _get(process.url + "/metrics")[1], 10, what="the broken config refused")
        refused = [e for e in _log_events(process) if e["event"] == "reload_refused"]
        assert refused and "probes.require_golden" in refused[0]["cause"]
        assert _get(process.url + "/readyz")[0] == 503, "require_golden still in force"

        # Fixed and turned off again: picked up from the file change alone, no signal.
        process.config_path.write_text(yaml.safe_dump(settings, sort_keys=False))
        await wait_for(lambda: _get(process.url + "/readyz")[0] == 200, PICKUP_BOUND_S, what="/readyz 200 again")
    finally:
        process.stop()


async def test_a_model_loaded_after_start_is_guarded_proxied_and_healed(own_triton, start, tmp_path):
    golden = _golden_copy(tmp_path, "credit_risk", "image_classifier", "text_echo")
    sidecar = await start(sidecar_config(own_triton, models=[], golden_dir=golden))
    await wait_for(lambda: sidecar.app[ROSTER].models == sorted(EXAMPLE_MODELS), 20,
                   what="the example models discovered")

    fresh = FreshModel.create(own_triton, tmp_path)  # loaded through the repository API
    loaded_at = time.monotonic()
    shutil.copytree(fresh.golden_dir / fresh.name, golden / fresh.name)
    await wait_for(lambda: fresh.name in sidecar.app[STATES], DISCOVERY_BOUND_S, what=f"{fresh.name} guarded")
    assert time.monotonic() - loaded_at < DISCOVERY_BOUND_S
    await wait_for(lambda: len(sidecar.app[LIVE].golden.cases_for(fresh.name)) == 3, PICKUP_BOUND_S,
                   what="its golden files loaded")
    await wait_for(lambda: sidecar.state(fresh.name) is ModelState.HEALTHY, 20, what=f"{fresh.name} HEALTHY")
    assert sidecar.metric("triton_sidecar_model_without_golden", model=fresh.name) == 0

    async with sidecar.session.post(f"{sidecar.url}/v2/models/{fresh.name}/infer", json=NORMAL["request"]) as r:
        assert r.status == 200
        assert (await r.json())["outputs"][0]["name"] == "scores"

    broken_at = time.monotonic()
    fresh.kill_stub()
    await wait_for(lambda: sidecar.first_transition_to(fresh.name, ModelState.HEALING, after=broken_at), 20,
                   what="a heal started")
    await wait_for(lambda: sidecar.first_transition_to(fresh.name, ModelState.HEALTHY, after=broken_at), 30,
                   what="healed")
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=fresh.name, result="success") >= 1


async def test_a_model_retired_by_its_owner_stops_being_guarded_while_one_unloaded_by_accident_is_healed(
        own_triton, start, tmp_path):
    golden = _golden_copy(tmp_path, "credit_risk", "image_classifier")
    sidecar = await start(sidecar_config(own_triton, models=[], golden_dir=golden))
    for model in ("credit_risk", "image_classifier"):
        await wait_for(lambda m=model: m in sidecar.app[STATES] and sidecar.state(m) is ModelState.HEALTHY, 20,
                       what=f"{model} HEALTHY")

    # The owner retires image_classifier: its golden files go, then the model.
    with capture_logs() as logs:
        shutil.rmtree(golden / "image_classifier")
        await wait_for(lambda: not sidecar.app[LIVE].golden.cases_for("image_classifier"), PICKUP_BOUND_S,
                       what="its golden files gone")
        triton_post(own_triton, "/v2/repository/models/image_classifier/unload")
        # credit_risk still has golden files: an unload nobody meant is healed.
        triton_post(own_triton, "/v2/repository/models/credit_risk/unload")
        await wait_for(lambda: "image_classifier" not in sidecar.app[STATES], DISCOVERY_BOUND_S + SLACK_S,
                       what="image_classifier released")
    released = [e for e in logs if e["event"] == "model_released"]
    assert [e["model"] for e in released] == ["image_classifier"]
    assert "unloaded on purpose" in released[0]["cause"]

    _, status = await sidecar.get("/status")
    assert "image_classifier" not in status["models"]
    async with sidecar.session.post(f"{sidecar.url}/v2/models/image_classifier/infer", json={"inputs": []}) as r:
        assert r.status == 404
    assert sidecar.metric("triton_sidecar_model_state", model="image_classifier", state="HEALTHY") is None
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model="image_classifier", result="success") == 0

    await wait_for(lambda: sidecar.first_transition_to("credit_risk", ModelState.HEALING), 20,
                   what="credit_risk healing")
    await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 30, what="credit_risk healed")
    _, index = triton_post(own_triton, "/v2/repository/index")
    states = {e["name"]: e.get("state") for e in index}
    assert states["credit_risk"] == "READY"
    assert states["image_classifier"] != "READY", "a retired model is not reloaded"
    await wait_for(lambda: _readyz_ok(sidecar), 10, what="/readyz 200 without the retired model")


async def _readyz_ok(sidecar) -> bool:  # type: ignore[no-untyped-def]
    return (await sidecar.get("/readyz"))[0] == 200


async def test_a_model_removed_from_the_configured_models_stops_being_guarded(triton, start, tmp_path):
    golden = _golden_copy(tmp_path, "credit_risk", "image_classifier")
    path = tmp_path / "sidecar.yaml"
    settings = sidecar_settings(triton, models=["credit_risk", "image_classifier"], golden_dir=golden,
                                probes=dict(FAST_PROBES))
    path.write_text(yaml.safe_dump(settings))
    sidecar = await start(load_config(path, environ={}), config_path=path)
    await wait_for(lambda: sidecar.app[ROSTER].models == ["credit_risk", "image_classifier"], 20, what="both guarded")

    path.write_text(yaml.safe_dump({**settings, "models": ["credit_risk"],
                                    "probes": {**FAST_PROBES, "failure_threshold": 5}}))
    # The roster drops the model first, then awaits its supervisor's end and forgets its state: wait
    # for the whole release, not only its first step.
    await wait_for(lambda: sidecar.app[ROSTER].models == ["credit_risk"] and "image_classifier" not in
                   sidecar.app[STATES], PICKUP_BOUND_S + SLACK_S, what="image_classifier released and forgotten")
    assert sidecar.app[LIVE].config.probes.failure_threshold == 5
    assert sidecar.app[STATES].get("credit_risk").failure_threshold == 5
    _, index = triton_post(triton, "/v2/repository/index")
    assert {e["name"]: e.get("state") for e in index}["image_classifier"] == "READY", "released, not unloaded"


async def test_a_released_model_ends_its_held_requests_with_404_and_its_open_streams(
        triton, fresh_model, start, tmp_path):
    import grpc.aio
    from tritonclient.grpc import service_pb2 as pb

    from sidecar.devtools.tritonserver import free_port
    from sidecar.fronts.appkeys import SERVING
    from sidecar.fronts.grpc_server import SERVICE

    model = fresh_model.name
    golden = _golden_copy(tmp_path, "credit_risk")
    shutil.copytree(fresh_model.golden_dir / model, golden / model)
    path = tmp_path / "sidecar.yaml"
    settings = sidecar_settings(triton, models=["credit_risk", model], golden_dir=golden, probes=dict(FAST_PROBES),
                                healing={"enabled": False}, proxy={"hold_during_heal_s": 60})
    settings["listen"]["grpc_port"] = free_port()
    path.write_text(yaml.safe_dump(settings))
    sidecar = await start(load_config(path, environ={}), config_path=path)
    await wait_for(lambda: model in sidecar.app[STATES] and sidecar.state(model) is ModelState.HEALTHY, 20,
                   what=f"{model} HEALTHY")
    retire = {**settings, "models": ["credit_risk"]}

    # An open stream to the model, answered once: released, the stream ends with the model's 404.
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[1, 128])
    request = pb.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[b"\0" * 512])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{settings['listen']['grpc_port']}") as channel:
        stream = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer",
                                       request_serializer=pb.ModelInferRequest.SerializeToString,
                                       response_deserializer=pb.ModelStreamInferResponse.FromString)()
        await stream.write(request)
        first = await asyncio.wait_for(stream.read(), 10)
        assert not first.error_message, first
        path.write_text(yaml.safe_dump(retire))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(stream.read(), PICKUP_BOUND_S + SLACK_S)
    assert ended.value.code() is grpc.StatusCode.NOT_FOUND
    assert "no longer guarded" in (ended.value.details() or "")

    # Guarded again, then quarantined: a request is held for the heal that never comes (healing is
    # off); released, it ends at once with 404 instead of waiting out its 60 s hold.
    path.write_text(yaml.safe_dump(settings))
    await wait_for(lambda: model in sidecar.app[STATES] and sidecar.state(model) is ModelState.HEALTHY, 20,
                   what=f"{model} guarded and HEALTHY again")
    fresh_model.inject("nan")
    await wait_for(lambda: sidecar.state(model).quarantined, 20, what=f"{model} quarantined")
    held = asyncio.create_task(sidecar.session.post(f"{sidecar.url}/v2/models/{model}/infer",
                                                    json=NORMAL["request"]))
    admission = sidecar.app[SERVING].admission
    await wait_for(lambda: admission.holding[model] == 1, 10, what="the request held")
    released_at = time.monotonic()
    path.write_text(yaml.safe_dump(retire))
    async with await asyncio.wait_for(held, PICKUP_BOUND_S + SLACK_S) as response:
        assert response.status == 404
        doc = await response.json()
    assert doc["reason"] == "unknown_model" and "no longer guarded" in doc["error"], doc
    assert time.monotonic() - released_at < PICKUP_BOUND_S + SLACK_S
    assert model not in admission.holding
