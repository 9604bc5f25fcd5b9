"""The sidecar as kubelet and an operator meet it: start-up refusals, Triton dying, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from sidecar.devtools.tritonserver import free_port
from sidecar.states import ModelState
from tests.harness import FAST_PROBES, GOLDEN, REPO, SLACK_S, sidecar_config, wait_for

SIDECAR = [sys.executable, "-m", "sidecar"]


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*SIDECAR, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    ("config_text", "expected"),
    [
        ("probes:\n  interval_s: 0\n", "key 'probes.interval_s'"),
        ("healing:\n  max_atempts: 3\n", "unknown key 'healing.max_atempts'"),
        ("listen:\n  port: '8080'\n", "key 'listen.port': '8080' is not of type 'integer'"),
    ],
)
def test_a_bad_config_stops_the_start_with_one_line_and_exit_code_2(tmp_path, config_text, expected):
    config = tmp_path / "sidecar.yaml"
    config.write_text(config_text)
    result = _run(["run", "--config", str(config)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"triton-sidecar: error: {config}: ") and expected in lines[0]


def test_a_bad_environment_override_stops_the_start_with_exit_code_2():
    result = _run(["run"], env={"SIDECAR_PROBES_FAILURE_THRESHOLD": "zero"})
    assert result.returncode == 2
    assert result.stderr.strip() == ("triton-sidecar: error: defaults: key 'probes.failure_threshold': "
                                     "'zero' is not of type 'integer'")


def test_a_bad_golden_file_stops_the_start_with_one_line_naming_file_and_path(tmp_path):
    bad = tmp_path / "golden" / "credit_risk" / "normal.json"
    bad.parent.mkdir(parents=True)
    case = json.loads((GOLDEN / "credit_risk" / "normal.json").read_text())
    case["request"]["inputs"][0]["shape"] = [2, 128]
    bad.write_text(json.dumps(case))
    result = _run(["run"], env={"SIDECAR_GOLDEN_DIR": str(tmp_path / "golden")})
    assert result.returncode == 2
    assert result.stderr.strip() == (f"triton-sidecar: error: {bad}: at $.request.inputs[0].data: "
                                     "128 values, but shape [2, 128] holds 256")


async def test_triton_killed_fails_readiness_at_once_and_liveness_after_the_grace(own_triton, start):
    grace = 3.0
    sidecar = await start(sidecar_config(own_triton, models=["credit_risk"], golden_dir=GOLDEN,
                                         liveness={"triton_unreachable_grace_s": grace}))
    await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 20, what="HEALTHY")
    await wait_for(lambda: _status_is(sidecar, "/readyz", 200), 5, what="/readyz 200")

    own_triton.kill()
    killed_at = time.monotonic()
    await wait_for(lambda: _status_is(sidecar, "/readyz", 503), FAST_PROBES["interval_s"] + SLACK_S,
                   what="/readyz 503 after Triton was killed")
    # Within the grace, liveness holds: a Triton restart by kubelet is worth waiting for.
    if time.monotonic() - killed_at < grace - 0.5:
        assert (await sidecar.get("/healthz"))[0] == 200
    await wait_for(lambda: _status_is(sidecar, "/healthz", 503), grace + SLACK_S + FAST_PROBES["interval_s"],
                   what="/healthz 503 after the grace")
    # Counted from the last time Triton was seen live, at most one watch interval before the kill.
    assert time.monotonic() - killed_at >= grace - FAST_PROBES["interval_s"] * (1 + FAST_PROBES["jitter"])
    _, body = await sidecar.get("/healthz")
    assert any("Triton not live" in p for p in body["problems"]), body
    # Nothing can be healed while the server is gone: no heal was attempted, the model is not blamed.
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model="credit_risk", result="failure") == 0
    assert sidecar.state("credit_risk") is ModelState.HEALTHY
    assert sidecar.metric("triton_sidecar_triton_up") == 0


async def _status_is(sidecar, path: str, status: int) -> bool:  # type: ignore[no-untyped-def]
    return (await sidecar.get(path))[0] == status


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _poll(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_sigterm_fails_readiness_at_once_then_drains_and_exits_cleanly(triton, tmp_path):
    port = free_port()
    drain_s = 3.0
    env = {
        "SIDECAR_TRITON_URL": triton.url,
        "SIDECAR_LISTEN_HOST": "127.0.0.1",
        "SIDECAR_LISTEN_PORT": str(port),
        "SIDECAR_MODELS": "credit_risk",
        "SIDECAR_GOLDEN_DIR": str(GOLDEN),
        "SIDECAR_PROBES_INTERVAL_S": "0.3",
        "SIDECAR_LIFECYCLE_DRAIN_S": str(drain_s),
        "PYTHONWARNINGS": "always",
        "PYTHONASYNCIODEBUG": "1",
    }
    process = subprocess.Popen([*SIDECAR, "run"], cwd=REPO, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _poll(lambda: _http_status(f"{url}/readyz") == 200, 30, "/readyz 200")
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _poll(lambda: _http_status(f"{url}/readyz") == 503, 1.0, "/readyz 503 right after SIGTERM")
        assert _http_status(f"{url}/healthz") == 200  # draining is not a liveness failure
        process.wait(timeout=drain_s + 10)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
        stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    assert took < drain_s + 5
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    events = [record["event"] for record in records]
    assert events.index("drain_started") < events.index("drain_finished") < events.index("sidecar_stopped")
    # Served on uvloop, the default listen.event_loop (TLS off).
    assert next(r for r in records if r["event"] == "sidecar_started")["event_loop"] == "uvloop"
    for trouble in ("Unclosed", "Task was destroyed", "Traceback", "never awaited"):
        assert trouble not in stderr + stdout, f"{trouble!r} in output:\n{stderr}"
