"""Live data and prediction drift (issue 22): references recorded from a real Triton, the sidecar's
windows fed by real traffic on both wires, PSI, missing ratios and output histograms on /metrics,
and drift in /status without touching the model's state."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import service_pb2 as pb

from sidecar.cli.main import main
from sidecar.config import ConfigError, SidecarConfig
from sidecar.devtools.tritonserver import LocalTriton, free_port
from sidecar.fronts.appkeys import HEALER, SERVING
from sidecar.fronts.grpc_server import SERVICE
from sidecar.fronts.http_front import HttpFront
from sidecar.serving.drift import PSI_FLOOR, DriftMonitor, ReferenceFileError, load_reference, parse_reference
from sidecar.states import ModelState
from tests.harness import FAULTY_TEMPLATE, GOLDEN, REPO, RunningSidecar, sidecar_config, triton_post, wait_for
from tests.proxy_support import PythonEntries, served_by_front, started_and_healthy

MODEL = "credit_risk"
#: Rows per request: 16-row batches keep a 1,000-row window to 63 requests.
BATCH = 16
REFERENCE_ROWS = 2000
WINDOW = 1000
SHIFTED = 7


def rows(n: int, seed: int, *, shift: float = 0.0, sentinel_share: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal((n, 128)), 4).astype(np.float32)
    x[:, SHIFTED] += shift
    if sentinel_share:
        x[rng.random(x.shape) < sentinel_share] = -999.0
    return x


def request_body(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "features", "shape": list(x.shape), "datatype": "FP32",
                        "data": [float(v) for v in x.ravel()]}]}


def record(triton: LocalTriton, tmp_path: Path, model: str = MODEL, *, version: str = "", seed: int = 1,
           config_yaml: str = "") -> Path:
    """The reference of REFERENCE_ROWS standard-normal rows, written by the real command."""
    requests = tmp_path / f"requests-{model}.jsonl"
    requests.write_text("".join(json.dumps(request_body(x)) + "\n"
                                for x in np.split(rows(REFERENCE_ROWS, seed), REFERENCE_ROWS // BATCH)))
    config = tmp_path / "record.yaml"
    config.write_text(f"triton: {{url: '{triton.url}'}}\n{config_yaml}")
    out = tmp_path / "reference"
    args = ["record-reference", "--model", model, "--from", str(requests), "--config", str(config), "--out", str(out)]
    assert main([*args, *(["--version", version] if version else [])]) == 0
    return out


def drift_config(triton: LocalTriton, reference_dir: Path, models: list[str], golden_dir: Path = GOLDEN,
                 **drift: Any) -> SidecarConfig:
    return sidecar_config(triton, models=models, golden_dir=golden_dir,
                          drift={"reference_dir": reference_dir, "window": WINDOW, **drift})


async def send(sidecar: RunningSidecar, x: np.ndarray, model: str = MODEL, version: str = "") -> None:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    for batch in (x[i: i + BATCH] for i in range(0, len(x), BATCH)):
        async with sidecar.session.post(sidecar.url + path, json=request_body(batch)) as response:
            assert response.status == 200, await response.text()


def psi(sidecar: RunningSidecar, tensor: str, feature: str, model: str = MODEL, version: str = "1") -> float | None:
    return sidecar.metric("triton_sidecar_drift_psi", model=model, version=version, tensor=tensor, feature=feature)


def max_psi(sidecar: RunningSidecar, model: str = MODEL, version: str = "1") -> float | None:
    return sidecar.metric("triton_sidecar_drift_max_psi", model=model, version=version)


# --- against the real Triton -----------------------------------------------------------------------------


async def test_reference_traffic_stays_quiet_and_a_two_sigma_shift_is_named_within_one_window(
        triton, tmp_path, start):
    reference_dir = record(triton, tmp_path)
    sidecar = await started_and_healthy(start, drift_config(triton, reference_dir, [MODEL], degrade_above_psi=0.25))
    await served_by_front(sidecar.server, MODEL)

    with PythonEntries(sidecar.app[SERVING]) as entries:
        await send(sidecar, rows(WINDOW, seed=2))
    if isinstance(sidecar.server, HttpFront):
        # A measured model is a lane: its answers are binned by the data plane, Python never entered.
        assert entries.count == 0, "a measured request entered the Python chain"
    quiet = max_psi(sidecar)
    assert quiet is not None and quiet < 0.1, f"max PSI {quiet} on traffic drawn like the reference"
    _, status = await sidecar.get("/status")
    assert status["models"][MODEL]["drift"]["degraded"] is False, status["models"][MODEL]["drift"]
    assert status["models"][MODEL]["drift"]["state"] == "STABLE", status["models"][MODEL]["drift"]

    await send(sidecar, rows(WINDOW, seed=3, shift=2.0))
    shifted = psi(sidecar, "features", str(SHIFTED))
    assert shifted is not None and shifted > 0.25, f"PSI of the shifted feature {shifted}"
    assert max_psi(sidecar) == pytest.approx(shifted)
    others = [psi(sidecar, "features", str(i)) for i in range(128) if i != SHIFTED]
    assert max(v for v in others if v is not None) < 0.1, "only the shifted feature may drift"

    # Reported, never acted on: the model keeps its state and its traffic, and is never unloaded.
    _, status = await sidecar.get("/status")
    drift = status["models"][MODEL]["drift"]
    assert drift["degraded"] is True and f"features feature {SHIFTED}" in drift["cause"], drift
    assert drift["state"] == "DEGRADED", drift
    assert status["models"][MODEL]["state"] == "HEALTHY" and status["models"][MODEL]["heal_attempts"] == 0
    await send(sidecar, rows(BATCH, seed=4, shift=2.0))
    # A heal would have to pass through HEALING (the healer is the only caller of unload/load), and
    # degrade_above_psi must not count as a failed probe round either.
    assert sidecar.first_transition_to(MODEL, ModelState.HEALING, ModelState.UNHEALTHY,
                                       ModelState.DEGRADED) is None
    assert sidecar.app[HEALER].attempts.get(MODEL, 0) == 0
    _, ready = await sidecar.get("/readyz")
    assert ready["status"] == "ok", ready


async def test_a_missing_value_sentinel_rate_rises_in_its_metric(triton, tmp_path, start):
    sentinels = "drift: {missing_sentinels: {credit_risk: {features: [-999]}}}\n"
    reference_dir = record(triton, tmp_path, config_yaml=sentinels)
    assert load_reference(reference_dir / "credit_risk.json").inputs["features"].missing.max() == 0
    sidecar = await started_and_healthy(start, drift_config(triton, reference_dir, [MODEL],
                                       missing_sentinels={MODEL: {"features": (-999.0,)}}))
    await send(sidecar, rows(WINDOW // 2, seed=5))
    ratio = lambda: sidecar.metric("triton_sidecar_feature_missing_ratio", model=MODEL, version="1",  # noqa: E731
                                   input="features")
    assert ratio() == 0.0
    await send(sidecar, rows(WINDOW // 2, seed=6, sentinel_share=0.3))
    assert 0.1 < ratio() < 0.2, ratio()  # half the window at 30 %
    # Missing values are not a shift of the inputs' distribution: they are kept out of the bins. (The
    # scores do move: the model was fed -999s.)
    input_psi = [psi(sidecar, "features", str(i)) for i in range(128)]
    assert max(v for v in input_psi if v is not None) < 0.1


async def test_a_model_without_a_reference_is_not_measured_and_status_says_so(triton, tmp_path, start):
    reference_dir = record(triton, tmp_path)
    sidecar = await started_and_healthy(start, drift_config(triton, reference_dir, [MODEL, "image_classifier"]))
    _, status = await sidecar.get("/status")
    drift = status["models"]["image_classifier"]["drift"]
    assert drift["measured"] is False and "no reference file" in drift["reason"], drift
    await send(sidecar, rows(BATCH * 4, seed=10))
    assert [r.model for r in sidecar.app[SERVING].drift.readings()] == [MODEL]
    assert not [s for s in sidecar.registry.collect() if s.name.startswith("triton_sidecar_drift")
                for sample in s.samples if sample.labels.get("model") == "image_classifier"]


async def test_a_changed_model_version_shifts_the_output_histogram_and_its_psi(triton, tmp_path, start):
    name = f"drift_versions_{os.getpid()}"
    path = triton.model_repository / name
    shutil.copytree(FAULTY_TEMPLATE, path)
    shutil.copytree(path / "1", path / "2")
    model_py = path / "2" / "model.py"
    model_py.write_text(model_py.read_text().replace("self.b = np.float32(-0.25)", "self.b = np.float32(1.5)"))
    config = (path / "config.pbtxt").read_text().replace('name: "faulty"', f'name: "{name}"')
    (path / "config.pbtxt").write_text(config + "version_policy: { all { } }\n")
    golden = tmp_path / "golden"
    (golden / name).mkdir(parents=True)
    status, body = triton_post(triton, f"/v2/repository/models/{name}/load")
    assert status == 200, body
    try:
        reference_dir = record(triton, tmp_path, name, version="1")
        assert (reference_dir / f"{name}@1.json").exists()
        # The version-1 reference stands for the model: version 2 is measured against it.
        (reference_dir / f"{name}@1.json").rename(reference_dir / f"{name}.json")
        sidecar = await started_and_healthy(start, drift_config(triton, reference_dir, [name], golden_dir=golden))
        for version in ("1", "2"):
            await send(sidecar, rows(WINDOW, seed=8), model=name, version=version)
        old = psi(sidecar, "scores", "0", model=name, version="1")
        new = psi(sidecar, "scores", "0", model=name, version="2")
        assert old is not None and old < 0.1, old
        assert new is not None and new > 0.25, new
        # Inputs did not change: only the prediction drifted.
        assert psi(sidecar, "features", "0", model=name, version="2") is None or max(
            v for v in (psi(sidecar, "features", str(i), model=name, version="2") for i in range(128))
            if v is not None) < 0.1
        edges = load_reference(reference_dir / f"{name}.json").outputs["scores"].edges[0]
        middle = f"{float(np.nextafter(edges[len(edges) // 2], -np.inf))!r}"
        below = {v: sidecar.metric("triton_sidecar_output_value_bucket", model=name, version=v, output="scores",
                                   le=middle) / WINDOW for v in ("1", "2")}
        assert 0.35 < below["1"] < 0.65, below  # the reference's median, about half below
        assert below["2"] < 0.2, below  # a larger bias moves the scores up

        # Version 2's own reference (`<model>@2.json`) wins over the model-wide one for version 2, read
        # without a restart: its scores are no drift against themselves.
        await asyncio.to_thread(record, triton, tmp_path, name, version="2")
        monitor = sidecar.app[SERVING].drift
        await wait_for(lambda: len(monitor.reference_for(name)) == 2, 5, what="version 2's reference loaded")
        await send(sidecar, rows(WINDOW, seed=8), model=name, version="2")
        own = psi(sidecar, "scores", "0", model=name, version="2")
        assert own is not None and own < 0.1, own
        _, status = await sidecar.get("/status")
        assert str(reference_dir / f"{name}@2.json") in status["models"][name]["drift"]["references"]
    finally:
        triton_post(triton, f"/v2/repository/models/{name}/unload")


async def test_record_reference_live_writes_the_next_n_rows_and_run_reads_it_without_a_restart(
        triton, tmp_path, start):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    sidecar = await started_and_healthy(start, drift_config(triton, reference_dir, [MODEL]))
    monitor = sidecar.app[SERVING].drift
    assert not monitor.has_reference(MODEL)
    # No --out: the file goes to the config's drift.reference_dir, the directory `run` reads.
    config_file = tmp_path / "record.yaml"
    config_file.write_text(f"drift: {{reference_dir: {reference_dir}}}\n")
    args = ["record-reference", "--model", MODEL, "--live", str(REFERENCE_ROWS), "--sidecar-url", sidecar.url,
            "--config", str(config_file), "--timeout", "60"]
    recording = asyncio.ensure_future(asyncio.to_thread(main, args))
    await wait_for(lambda: MODEL in monitor.recorders, 10, what="the live recording registered")
    recorded = rows(REFERENCE_ROWS, seed=1)
    with PythonEntries(sidecar.app[SERVING]) as entries:
        await send(sidecar, recorded)
    if isinstance(sidecar.server, HttpFront):
        # Recorded by the lane (the Rust front's event tells the waiting route): no entry into Python.
        assert entries.count == 0, "a recorded request entered the Python chain"
    assert await asyncio.wait_for(recording, 30) == 0
    assert MODEL not in monitor.recorders  # the recording ends with the command

    reference = load_reference(reference_dir / f"{MODEL}.json")
    assert reference.rows == REFERENCE_ROWS and reference.version == ""
    features_ref = reference.inputs["features"]
    # The deciles of exactly the rows that were sent (not of other traffic, not of a sample).
    for feature in (0, SHIFTED, 127):
        want = np.quantile(recorded[:, feature].astype(np.float64), np.linspace(0, 1, 11)[1:-1])
        assert np.allclose(features_ref.edges[feature], want), feature
    assert features_ref.counts.sum(axis=1).tolist() == [REFERENCE_ROWS] * 128
    assert reference.outputs["scores"].counts.sum() == REFERENCE_ROWS  # Triton's answers, binned too

    # `run` picks the new file up like a golden file; from then on the model is measured.
    await wait_for(lambda: monitor.has_reference(MODEL), 5, what="the recorded reference loaded")
    await send(sidecar, rows(WINDOW, seed=2))
    quiet = max_psi(sidecar)
    assert quiet is not None and quiet < 0.1, quiet


async def test_grpc_traffic_is_measured_like_http(triton, tmp_path, start):
    reference_dir = record(triton, tmp_path)
    config = drift_config(triton, reference_dir, [MODEL])
    config = replace(config, listen=replace(config.listen, grpc_port=free_port()))
    sidecar = await started_and_healthy(start, config)
    await served_by_front(sidecar.server, MODEL)
    front = sidecar.server
    rust_grpc = isinstance(front, HttpFront) and front.grpc_port
    handovers = front.grpc_handovers if rust_grpc else 0
    target = f"127.0.0.1:{config.listen.grpc_port}"
    # Typed contents first (half a window): read from the message's fp32_contents.
    typed = rows(WINDOW // 2, seed=11, shift=2.0)
    async with grpc.aio.insecure_channel(target) as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        for batch in (typed[i: i + BATCH] for i in range(0, len(typed), BATCH)):
            request = pb.ModelInferRequest(model_name=MODEL)
            tensor = request.inputs.add(name="features", datatype="FP32", shape=list(batch.shape))
            tensor.contents.fp32_contents.extend(batch.ravel().tolist())
            await infer(request, timeout=10)
    (reading,) = sidecar.app[SERVING].drift.readings(MODEL)
    assert reading.rows == len(typed)
    # Then raw_input_contents, as tritonclient sends them: a whole window.
    client = grpcclient.InferenceServerClient(target)
    try:
        x = rows(WINDOW, seed=9, shift=2.0)
        for batch in (x[i: i + BATCH] for i in range(0, WINDOW, BATCH)):
            tensor = grpcclient.InferInput("features", list(batch.shape), "FP32")
            tensor.set_data_from_numpy(batch)
            await client.infer(MODEL, [tensor])
    finally:
        await client.close()
    if rust_grpc:
        assert front.grpc_handovers == handovers, "a measured call was handed to the Python gRPC server"
    (reading,) = sidecar.app[SERVING].drift.readings(MODEL)
    assert reading.rows == WINDOW
    shifted = psi(sidecar, "features", str(SHIFTED))
    assert shifted is not None and shifted > 0.25, shifted


async def test_a_broken_reference_is_refused_at_reload_and_the_last_good_one_kept(triton, tmp_path, start):
    reference_dir = record(triton, tmp_path)
    sidecar = await started_and_healthy(start, drift_config(triton, reference_dir, [MODEL]))
    good = sidecar.app[SERVING].drift.reference_for(MODEL)
    (reference_dir / "credit_risk.json").write_text(json.dumps({"format": 1, "model": MODEL, "rows": 0}))
    await wait_for(lambda: sidecar.metric("triton_sidecar_reload_failures_total", what="drift_reference") == 1, 10,
                   what="the broken reference refused")
    assert sidecar.app[SERVING].drift.reference_for(MODEL) == good
    _, status = await sidecar.get("/status")
    assert "key 'rows'" in status["models"][MODEL]["drift"]["reload_refused"]


# --- pure logic ------------------------------------------------------------------------------------------


def test_a_broken_reference_file_stops_the_start_naming_the_file_and_key(tmp_path):
    from sidecar.app.factory import create_app

    (tmp_path / "m.json").write_text(json.dumps({"format": 1, "model": "m", "rows": 10, "inputs": {
        "x": {"datatype": "FP32", "features": 1, "edges": [[1.0, 0.5]], "counts": [[1, 1, 1]]}}}))
    config = SidecarConfig()
    config = replace(config, drift=replace(config.drift, reference_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"m\.json: key 'inputs\.x\.edges\.0'"):
        create_app(config, golden={})
    # The command: one line naming the file and the key, exit 2, before anything listens.
    config_file = tmp_path / "sidecar.yaml"
    config_file.write_text(f"golden_dir: {GOLDEN}\nlisten: {{port: {free_port()}, grpc_port: 0}}\n"
                           f"drift: {{reference_dir: {tmp_path}}}\n")
    run = subprocess.run([sys.executable, "-m", "sidecar", "run", "--config", str(config_file)], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(err) == 1, run.stderr
    assert str(tmp_path / "m.json") in err[0] and "key 'inputs.x.edges.0'" in err[0], err


def _monitor(features: int, **settings: Any) -> DriftMonitor:
    from sidecar.serving.drift import reference_from_values

    x = np.random.default_rng(0).standard_normal((5000, features))
    reference = parse_reference(reference_from_values("m", "", {"x": ("FP64", x)}, {}), Path("m.json"))
    rng = settings.pop("rng", None)
    drift = replace(SidecarConfig().drift, window=1000, **settings)
    return DriftMonitor(drift, {("m", ""): reference}, **({"rng": rng} if rng else {}))


def test_max_features_keeps_only_the_most_drifted_features_of_a_tensor_on_metrics():
    from prometheus_client import CollectorRegistry

    monitor = _monitor(6, max_features=2)
    live = np.random.default_rng(1).standard_normal((1000, 6))
    live[:, 4] += 2.0
    live[:, 1] += 0.7
    monitor.observe("m", "1", [("x", "FP64", live.shape, live)], [], batched=True)
    registry = CollectorRegistry()
    registry.register(monitor.collector())
    series = {sample.labels["feature"]: sample.value for family in registry.collect()
              if family.name == "triton_sidecar_drift_psi" for sample in family.samples}
    assert list(series) == ["4", "1"], series  # the two most drifted, most drifted first; the rest dropped
    assert series["4"] > series["1"] > 0.1
    assert registry.get_sample_value("triton_sidecar_drift_max_psi", {"model": "m", "version": "1"}) == \
        pytest.approx(series["4"])


def test_sample_rate_measures_that_share_of_requests_and_costs_no_draw_without_a_reference():
    draws = iter([0.1, 0.5, 0.24, 0.9])
    monitor = _monitor(1, sample_rate=0.25, rng=lambda: next(draws))
    assert monitor.wants("other_model") is False  # no reference: no draw taken
    assert [monitor.wants("m") for _ in range(4)] == [True, False, True, False]


def test_psi_is_zero_for_the_reference_itself_and_floors_empty_bins():
    x = np.random.default_rng(0).standard_normal((5000, 3))
    from sidecar.serving.drift import reference_from_values

    reference = parse_reference(reference_from_values("m", "", {"x": ("FP64", x)}, {}), Path("m.json"))
    monitor = DriftMonitor(SidecarConfig().drift, {("m", ""): reference})
    monitor.observe("m", "", [("x", "FP64", x[:1000].shape, x[:1000])], [], batched=True)
    (reading,) = monitor.readings("m")
    assert reading.measured and reading.max_psi < 0.05
    monitor.observe("m", "", [("x", "FP64", (1000, 3), np.full((1000, 3), 50.0))], [], batched=True)
    (reading,) = monitor.readings("m")
    # Everything in the last bin: bounded by the floor, not infinite.
    assert np.isfinite(reading.max_psi) and reading.max_psi > 1
    assert PSI_FLOOR > 0
    with pytest.raises(ReferenceFileError, match="key 'rows'"):
        parse_reference({"format": 1, "model": "m", "rows": -1}, Path("m.json"))


def test_the_window_counts_exactly_the_last_window_rows_after_it_wraps():
    from sidecar.serving.drift import reference_from_values

    rng = np.random.default_rng(4)
    reference = parse_reference(reference_from_values("m", "", {"x": ("FP64", rng.standard_normal((3000, 5)))}, {}),
                                Path("m.json"))
    drift = replace(SidecarConfig().drift, window=100, missing_sentinels={"m": {"x": (-999.0,)}})
    monitor = DriftMonitor(drift, {("m", ""): reference})
    seen = rng.standard_normal((257, 5))
    seen[rng.random(seen.shape) < 0.1] = -999.0
    monitor.observe("m", "1", [("x", "FP64", (7, 5), seen[:7])], [], batched=True)  # a batch, then single rows
    for row in seen[7:]:
        monitor.observe("m", "1", [("x", "FP64", (1, 5), row[None, :])], [], batched=True)
    last = seen[-100:]
    edges = reference.inputs["x"].edges
    want = np.zeros((5, reference.inputs["x"].bins + 1), dtype=np.int64)
    for f in range(5):
        present = last[:, f][last[:, f] != -999.0]
        cuts = edges[f][np.isfinite(edges[f])]
        want[f, : len(cuts) + 1] = np.bincount(np.searchsorted(cuts, present, side="right"), minlength=len(cuts) + 1)
        want[f, -1] = int((last[:, f] == -999.0).sum())
    (window,) = monitor.windows_now("m")
    counted = window.inputs["x"]
    assert counted.rows == 100
    assert np.array_equal(counted.table(), want)
    assert counted.missing_ratio() == pytest.approx((last == -999.0).mean())
    # The same values as float32 bytes (a binary request's section) land in the same cells.
    again = DriftMonitor(drift, {("m", ""): reference})
    again.observe("m", "1", [("x", "FP32", (100, 5), last.astype("<f4").tobytes())], [], batched=True)
    (window,) = again.windows_now("m")
    assert window.inputs["x"].rows == 100 and window.inputs["x"].missing_ratio() == counted.missing_ratio()
