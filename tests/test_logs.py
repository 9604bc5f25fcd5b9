"""What an on-call engineer reads: the sidecar's stdout during a real heal is JSON lines with the
documented fields, tells the heal step by step, and never holds tensor data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime

import pytest

from sidecar.devtools.tritonserver import free_port
from tests.harness import GOLDEN, REPO

pytestmark = pytest.mark.fault

HEAL_SEQUENCE = [
    "heal_attempt_started",
    "heal_unload_sent",
    "heal_unloaded",
    "heal_load_sent",
    "heal_ready",
    "heal_verified",
    "heal_attempt_succeeded",
]


def _state(url: str, model: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=2) as response:
            return json.load(response)["models"].get(model, {}).get("state")
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _poll(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _tensor_values() -> list[str]:
    """Distinctive numbers from a golden request and its expected answer: none may reach a log."""
    case = json.loads((GOLDEN / "credit_risk" / "normal.json").read_text())
    inputs = [str(v) for v in case["request"]["inputs"][0]["data"] if len(str(v)) >= 6][:20]
    outputs = [str(v)[:8] for v in case["expect"]["outputs"]["scores"]["data"]]
    return inputs + outputs


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_real_heal_is_logged_as_json_lines_step_by_step_without_tensor_data(triton, fresh_model, tmp_path):
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"filtering:\n  rules:\n  - {{model: '{fresh_model.name}', drop_outputs: ['income_prob']}}\n")
    golden = json.loads((GOLDEN / "credit_risk" / "normal.json").read_text())["request"]
    request = json.dumps(golden).encode()  # asks for scores only
    plain = {"inputs": golden["inputs"]}  # all outputs: the filter must drop income_prob
    _, direct = _post(f"{triton.url}/v2/models/{fresh_model.name}/infer", json.dumps(plain).encode())
    income = next(o for o in direct["outputs"] if o["name"] == "income_prob")["data"][0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "SIDECAR_TRITON_URL": triton.url,
        "SIDECAR_LISTEN_HOST": "127.0.0.1",
        "SIDECAR_LISTEN_PORT": str(port),
        "SIDECAR_MODELS": fresh_model.name,
        "SIDECAR_GOLDEN_DIR": str(fresh_model.golden_dir),
        "SIDECAR_PROBES_INTERVAL_S": "0.5",
        "SIDECAR_PROBES_FAILURE_THRESHOLD": "2",
        "SIDECAR_LIFECYCLE_DRAIN_S": "1",
        "SIDECAR_HEALING_UNLOAD_TIMEOUT_S": "2",
        "SIDECAR_LOGGING_LEVEL": "debug",
    }
    process = subprocess.Popen([sys.executable, "-m", "sidecar", "run", "--config", str(config)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _poll(lambda: _state(url, fresh_model.name) == "HEALTHY", 30, "HEALTHY")
        infer = f"{url}/v2/models/{fresh_model.name}/infer"
        status, answer = _post(infer, json.dumps(plain).encode())
        assert status == 200 and [o["name"] for o in answer["outputs"]] == ["scores"]
        assert _post(infer, request)[0] == 200
        assert _post(infer, b'{"inputs": [')[0] == 400
        fresh_model.kill_stub()
        _poll(lambda: _state(url, fresh_model.name) == "HEALING", 15, "HEALING")
        _poll(lambda: _state(url, fresh_model.name) == "HEALTHY", 30, "HEALTHY again")
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            out, _ = process.communicate()
            print(out[-6000:])
    assert process.returncode == 0, stderr

    lines = [line for line in stdout.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    for event in events:
        assert {"timestamp", "level", "event", "logger"} <= event.keys(), event
        assert event["timestamp"].endswith("Z")
        datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
        assert event["level"] in {"debug", "info", "warning", "error"}
        assert event["logger"].startswith("sidecar.")

    model_events = [e for e in events if e.get("model") == fresh_model.name]
    transitions = [(e["state_from"], e["state_to"]) for e in model_events if e["event"] == "model_state_changed"]
    # Triton's verdict on a dead stub is final: UNHEALTHY at the first failed round, no DEGRADED first.
    assert ("HEALTHY", "UNHEALTHY") in transitions
    assert ("UNHEALTHY", "HEALING") in transitions
    assert transitions[-1] == ("HEALING", "HEALTHY")
    unhealthy = next(e for e in model_events if e.get("state_to") == "UNHEALTHY")
    assert "is not healthy" in unhealthy["cause"] or "Stub process" in unhealthy["cause"], unhealthy["cause"]
    recovered = [e for e in model_events if e.get("state_to") == "HEALTHY"][-1]
    assert recovered["duration_ms"] > 0  # time to recover, from the first failed probe

    steps = [e["event"] for e in model_events if e["event"].startswith("heal_")]
    # A dead stub's instance never finishes unloading: the healer says so and loads at once.
    assert "heal_unload_not_awaited" in steps and "heal_unload_incomplete" not in steps, steps
    steps = [s if s != "heal_unload_not_awaited" else "heal_unloaded" for s in steps]
    positions = [steps.index(step) for step in HEAL_SEQUENCE]
    assert positions == sorted(positions), steps
    for step in ("heal_ready", "heal_verified", "heal_attempt_succeeded"):
        assert next(e for e in model_events if e["event"] == step)["duration_ms"] >= 0
    assert any(e["event"] == "probe_failed" and e.get("probe") == "golden" for e in model_events)
    rejected = [e for e in model_events if e["event"] == "proxy_request" and e.get("status") == 400]
    assert rejected and rejected[0]["reason"] and rejected[0]["request_id"]

    # Timestamps hold digits too: look at everything else in each event.
    text = "\n".join(json.dumps({k: v for k, v in e.items() if k != "timestamp"}) for e in events)
    for value in [*_tensor_values(), str(income)[:8]]:
        assert value not in text, f"tensor value {value} leaked into the log"
    assert '"data"' not in text
