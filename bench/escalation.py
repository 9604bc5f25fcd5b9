"""From a fault of Triton's process to /healthz 503, with production-like probe settings: the sidecar as
its own process (`triton-sidecar run`) in front of a real Triton, one sidecar per run (issue 34).

    .venv/bin/python -m bench.escalation [--runs 3] [--interval 5] [--timeout 2] [--threshold 3]
                                         [--fault sticky|breadth]

Three clones of the fault-injectable model (tests/models/faulty) are guarded. Each run starts a
sidecar, waits for /readyz, injects the fault (`sticky`: one model's execute() answers Triton's error
"CUDA error: an illegal memory access was encountered"; `breadth`: two models raise the same
non-sticky error at once), polls /healthz every 10 ms, and takes from the sidecar's JSON log the time
of the first failing golden round (`probe_failed`). Between runs the sidecar stops and the models are
reloaded, which is what the kubelet's restart does to them.

Figures per run: first failing round -> /healthz 503 (target <= probes.interval_s + 1 s), fault ->
503 (adds the wait for the next round, up to interval × (1 + jitter)), and the reload attempts
(target 0). Results go to bench/out/escalation-*.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.machine import command_line, describe_machine, keep_logs, write_results
from bench.repository import copy_golden, copy_model
from bench.sidecar_process import SidecarProcess, sidecar_settings
from sidecar.devtools.tritonserver import LocalTriton, stub_pids

FAULTY = Path(__file__).resolve().parent.parent / "tests" / "models" / "faulty"
MODELS = ["victim_a", "victim_b", "bystander"]
FAULTS = {
    "sticky": {"victim_a": "error:CUDA error: an illegal memory access was encountered"},
    "breadth": {"victim_a": "raise:the backend's execution context is gone",
                "victim_b": "raise:the backend's execution context is gone"},
}
#: How often (s) /healthz is asked after the fault: the resolution of the figure.
POLL_S = 0.01


def _post(url: str) -> None:
    request = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=60):
        pass


def _healthz(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def _inject(triton: LocalTriton, repository: Path, model: str, kind: str) -> None:
    (repository / model / "1" / "fault").write_text(kind)
    for pid in stub_pids(model, parent=triton.pid):
        os.kill(pid, signal.SIGUSR1)


def _reload(triton: LocalTriton, model: str) -> None:
    """A fresh instance, as after Triton's restart: unload, wait until gone, load."""
    _post(f"{triton.url}/v2/repository/models/{model}/unload")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{triton.url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            index = json.loads(response.read())
        if all(e.get("state") not in ("READY", "UNLOADING") for e in index if e.get("name") == model):
            break
        time.sleep(0.05)
    _post(f"{triton.url}/v2/repository/models/{model}/load")


def _first_failed_round(log_path: Path, after: float) -> float | None:
    """Wall time of the first `probe_failed` logged after `after` (Unix time)."""
    for line in log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") != "probe_failed":
            continue
        at = datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
        if at >= after:
            return at
    return None


def one_run(triton: LocalTriton, repository: Path, golden: Path, workdir: Path, args: argparse.Namespace,
            run: int) -> dict[str, Any]:
    settings = sidecar_settings(triton, models=MODELS, golden_dir=golden,
                                probes={"interval_s": args.interval, "timeout_s": args.timeout,
                                        "failure_threshold": args.threshold},
                                healing={"load_timeout_s": 60})
    with SidecarProcess(settings, workdir / f"run-{run}").start() as sidecar:
        time.sleep(args.interval)  # let a round or two pass on a healthy pod
        injected = time.time()
        for model, kind in FAULTS[args.fault].items():
            _inject(triton, repository, model, kind)
        deadline = time.monotonic() + args.interval * 3 + 30
        failed_at = None
        while time.monotonic() < deadline:
            if _healthz(sidecar.url) == 503:
                failed_at = time.time()
                break
            time.sleep(POLL_S)
        status = sidecar.status()
        first_round = _first_failed_round(sidecar.log_path, injected)
    for model in FAULTS[args.fault]:
        _reload(triton, model)
    escalation = status.get("escalations", {}).get("active") or {}
    return {
        "run": run,
        "healthz_503": failed_at is not None,
        "fault_to_503_s": None if failed_at is None else round(failed_at - injected, 3),
        "first_failed_round_to_503_s": None if failed_at is None or first_round is None
        else round(failed_at - first_round, 3),
        "reload_attempts": sum(m["heal_attempts"] for m in status["models"].values()),
        "evidence": escalation.get("evidence"),
        "models": escalation.get("models"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--interval", type=float, default=5.0, help="probes.interval_s (s)")
    parser.add_argument("--timeout", type=float, default=2.0, help="probes.timeout_s (s)")
    parser.add_argument("--threshold", type=int, default=3, help="probes.failure_threshold")
    parser.add_argument("--fault", choices=sorted(FAULTS), default="sticky")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-escalation-") as scratch:
        root = Path(scratch)
        repository, golden = root / "model_repository", root / "golden"
        repository.mkdir()
        for model in MODELS:
            copy_model(FAULTY, repository, model)
            copy_golden("credit_risk", golden, model)
        triton = LocalTriton(model_repository=repository, models=MODELS, workdir=root / "triton")
        triton.start()
        try:
            runs = [one_run(triton, repository, golden, root, args, run) for run in range(1, args.runs + 1)]
            machine = describe_machine(triton.url)
        finally:
            triton.stop(grace_s=3)
            keep_logs(root, "escalation")
    target_s = args.interval + 1.0
    from_round = [r["first_failed_round_to_503_s"] for r in runs if r["first_failed_round_to_503_s"] is not None]
    from_fault = [r["fault_to_503_s"] for r in runs if r["fault_to_503_s"] is not None]
    summary = {
        "first_failed_round_to_503_s": {"median": statistics.median(from_round) if from_round else None,
                                        "max": max(from_round) if from_round else None},
        "fault_to_503_s": {"median": statistics.median(from_fault) if from_fault else None,
                           "max": max(from_fault) if from_fault else None},
        "reload_attempts": sum(r["reload_attempts"] for r in runs),
        "target_s": target_s,
        "met": len(from_round) == len(runs) and max(from_round) <= target_s
        and all(r["reload_attempts"] == 0 for r in runs),
    }
    table = "\n".join([
        f"`{command_line()}`",
        "",
        "| run | evidence | first failing round → /healthz 503 | fault → 503 | reload attempts |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {r['run']} | {r['evidence']} | {r['first_failed_round_to_503_s']} s | {r['fault_to_503_s']} s | "
          f"{r['reload_attempts']} |" for r in runs],
        "",
        f"target: first failing round → 503 ≤ interval + 1 s = {target_s:g} s, 0 reloads: "
        f"{'met' if summary['met'] else 'MISSED'}",
        "",
    ])
    path = write_results("escalation", {"command": command_line(), "settings": vars(args), "runs": runs,
                                        "summary": summary, "machine": machine}, table)
    print(table)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
