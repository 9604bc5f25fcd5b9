"""What `proxy.hold_while_suspect_ms` costs healthy traffic when probes are flaky (issue 23 §2).

    .venv/bin/python -m bench.hold_cost [--seconds 30] [--rounds 2] [--clients 4] [--blip-every 1.5]
                                        [--hold-ms 50]

One copy of tests/models/faulty behind the sidecar (`triton-sidecar run`, probes every 0.5 s, failure
threshold 2), closed-loop clients at full speed with random inputs (as bench/soak.py), and every
--blip-every seconds a `probe_blip`: the next golden request with a row of zeros (the `boundary`
case) answers wrong once. So a golden round fails by chance, its confirmation passes, the model is
never quarantined, and every client answer stays correct: only the hold can cost the clients
anything. Legs alternate, a fresh sidecar each: hold 0 (the default) and hold --hold-ms.

Reported per leg: requests, correct share, client latency p50 / p99 / p99.9 / max, the flaky rounds
(golden probe failures), the requests held and released (`proxy_quarantined_total{outcome=
"suspect_released"}`) and refused, and how long each confirmation ran (the sidecar's log, from
`probe_confirming` to the state change that ends it): the longest any held request waited. What the
hold costs per flaky round is then (requests held per round) x (at most the confirmation's time).
Latency percentiles of the two settings are close to the noise of a shared machine; the held counts
and the confirmation times are not. Exit 0 when every answer of every leg was correct and no request
was refused or timed out, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.faults import PROBE_BLIP, FaultyModel
from bench.machine import command_line, describe_machine, keep_logs, write_results
from bench.repository import FAULTY_TEMPLATE, copy_golden, copy_model
from bench.shutdown import interrupt_on_termination
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.soak import CORRECT, INPUTS, VICTIM, Clients, Inputs
from sidecar.devtools.tritonserver import LocalTriton

PROBE_INTERVAL_S = 0.5
FAILURE_THRESHOLD = 2


@dataclass
class Leg:
    hold_ms: float
    requests: int
    correct_share: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    mean_ms: float
    blips: int
    failed_rounds: int
    held_released: int
    held_refused_or_timed_out: int
    quarantined: bool
    #: Each confirmation's time (ms), from the sidecar's log.
    confirmations_ms: list[float]

    @property
    def held_per_round(self) -> float:
        return self.held_released / self.failed_rounds if self.failed_rounds else 0.0


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[line.index("{"):line.rindex("}")]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _scrape(sidecar: SidecarProcess) -> str:
    with urllib.request.urlopen(sidecar.url + "/metrics", timeout=5) as response:
        return response.read().decode()


async def _leg(sidecar: SidecarProcess, model: FaultyModel, *, seconds: float, clients: int, blip_every_s: float,
               hold_ms: float) -> Leg:
    inputs = Inputs.random(INPUTS)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        load = Clients(session, sidecar.url, inputs, timeout_s=10.0)
        tasks = [asyncio.create_task(load.closed_loop(VICTIM, seed)) for seed in range(clients)]
        await asyncio.sleep(2.0)  # warm-up: connections open, caches warm
        load.outcomes.clear()
        before = await asyncio.to_thread(_scrape, sidecar)
        blips = 0
        stop_at = time.monotonic() + seconds
        try:
            while time.monotonic() < stop_at:
                await asyncio.to_thread(model.inject, PROBE_BLIP)
                blips += 1
                await asyncio.sleep(min(blip_every_s, max(0.0, stop_at - time.monotonic())))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        after = await asyncio.to_thread(_scrape, sidecar)
        status = await asyncio.to_thread(sidecar.status)

    def delta(name: str, **labels: str) -> int:
        return round(_metric(after, name, **labels) - _metric(before, name, **labels))

    latencies = np.asarray([(o.finished - o.started) * 1000 for o in load.outcomes])
    correct = sum(o.category == CORRECT for o in load.outcomes)
    transitions = status["models"][VICTIM].get("state")
    return Leg(
        hold_ms=hold_ms, requests=len(load.outcomes), correct_share=round(correct / max(1, len(load.outcomes)), 5),
        p50_ms=round(float(np.percentile(latencies, 50)), 3), p99_ms=round(float(np.percentile(latencies, 99)), 3),
        p999_ms=round(float(np.percentile(latencies, 99.9)), 3), max_ms=round(float(latencies.max()), 3),
        mean_ms=round(float(latencies.mean()), 4), blips=blips,
        failed_rounds=delta("triton_sidecar_probes_total", model=VICTIM, probe="golden", result="failure"),
        held_released=delta("triton_sidecar_proxy_quarantined_total", model=VICTIM, outcome="suspect_released"),
        held_refused_or_timed_out=(
            delta("triton_sidecar_proxy_quarantined_total", model=VICTIM, outcome="suspect_refused")
            + delta("triton_sidecar_proxy_quarantined_total", model=VICTIM, outcome="suspect_timeout")
            + delta("triton_sidecar_proxy_quarantined_total", model=VICTIM, outcome="rejected")),
        quarantined=transitions not in ("HEALTHY", "DEGRADED"),
        confirmations_ms=confirmations_ms(sidecar.log_path),
    )


def confirmations_ms(log_path: Path) -> list[float]:
    """How long each confirmation round ran (ms): from `probe_confirming` to the model's next state
    change (HEALTHY when it passed), by the log's timestamps."""
    windows, started = [], None
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "probe_confirming":
            started = datetime.fromisoformat(event["timestamp"])
        elif event.get("event") == "model_state_changed" and started is not None:
            windows.append(round((datetime.fromisoformat(event["timestamp"]) - started).total_seconds() * 1000, 2))
            started = None
    return windows


def run(args: argparse.Namespace, workdir: Path) -> list[Leg]:
    repository, golden_dir = workdir / "model_repository", workdir / "golden"
    copy_model(FAULTY_TEMPLATE, repository, VICTIM)
    copy_golden("credit_risk", golden_dir, VICTIM)
    legs: list[Leg] = []
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=repository, models=[VICTIM], workdir=workdir / "triton")
        stack.callback(triton.stop, 3)
        triton.start()
        model = FaultyModel(triton, VICTIM, repository / VICTIM)
        for round_ in range(args.rounds):
            for hold_ms in ((0.0, args.hold_ms) if round_ % 2 == 0 else (args.hold_ms, 0.0)):
                sidecar = SidecarProcess(sidecar_settings(
                    triton, models=[VICTIM], golden_dir=golden_dir,
                    probes={"interval_s": PROBE_INTERVAL_S, "timeout_s": 2, "failure_threshold": FAILURE_THRESHOLD},
                    proxy={"retry_after_s": 1, "hold_while_suspect_ms": hold_ms},
                    filtering={"rules": [CREDIT_FILTER_RULE]},
                    logging={"format": "json", "level": "info", "access_log_sample_rate": 0.0},
                ), workdir / f"sidecar-{len(legs)}")
                with sidecar:
                    sidecar.start()
                    leg = asyncio.run(_leg(sidecar, model, seconds=args.seconds, clients=args.clients,
                                           blip_every_s=args.blip_every, hold_ms=hold_ms))
                print(f"  hold {hold_ms:g} ms: {leg}", flush=True)
                legs.append(leg)
    return legs


def summary(legs: list[Leg]) -> dict[str, Any]:
    """Per hold setting: medians over its legs, the requests held per flaky round and the
    confirmations' times."""
    by_hold: dict[float, list[Leg]] = {}
    for leg in legs:
        by_hold.setdefault(leg.hold_ms, []).append(leg)
    rows: dict[float, dict[str, Any]] = {}
    for hold, group in sorted(by_hold.items()):
        confirmations = [ms for leg in group for ms in leg.confirmations_ms]
        rows[hold] = {
            **{field: statistics.median(getattr(leg, field) for leg in group)
               for field in ("requests", "p50_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms")},
            "failed_rounds": sum(leg.failed_rounds for leg in group),
            "held_released": sum(leg.held_released for leg in group),
            "held_per_round": round(sum(leg.held_released for leg in group)
                                    / max(1, sum(leg.failed_rounds for leg in group)), 2),
            "confirmation_ms_median": statistics.median(confirmations) if confirmations else None,
            "confirmation_ms_max": max(confirmations, default=None),
        }
    return {"by_hold_ms": rows}


def markdown(legs: list[Leg], summary_: dict[str, Any]) -> str:
    lines = ["| hold ms | requests | correct | p50 ms | p99 ms | p99.9 ms | max ms | failed rounds | held and released "
             "| held per round | refused or timed out | quarantined | confirmation ms median / max |",
             "|" + "---|" * 13]
    for leg in legs:
        times = leg.confirmations_ms
        confirmation = f"{statistics.median(times):.1f} / {max(times):.1f}" if times else "-"
        lines.append(f"| {leg.hold_ms:g} | {leg.requests} | {leg.correct_share:.2%} | {leg.p50_ms} | {leg.p99_ms} | "
                     f"{leg.p999_ms} | {leg.max_ms} | {leg.failed_rounds} | {leg.held_released} | "
                     f"{leg.held_per_round:.1f} | {leg.held_refused_or_timed_out} | {leg.quarantined} | "
                     f"{confirmation} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hold_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per leg (default 30)")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of legs, order alternating (default 2)")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients (default 4)")
    parser.add_argument("--blip-every", type=float, default=1.5, help="seconds between flaky rounds (default 1.5)")
    parser.add_argument("--hold-ms", type=float, default=50.0, help="proxy.hold_while_suspect_ms (default 50)")
    args = parser.parse_args(argv)
    interrupt_on_termination()
    machine = describe_machine()
    with tempfile.TemporaryDirectory(prefix="bench-hold-") as scratch:
        try:
            legs = run(args, Path(scratch))
        finally:
            keep_logs(Path(scratch), "hold_cost")
    summary_ = summary(legs)
    table = markdown(legs, summary_)
    result = {"benchmark": "hold_cost", "command": command_line(), "machine": machine, "settings": vars(args),
              "legs": [asdict(leg) for leg in legs], "summary": summary_}
    path = write_results("hold_cost", result, table)
    print(f"\n{table}\nresults: {path}")
    passed = all(leg.correct_share == 1.0 and not leg.held_refused_or_timed_out and not leg.quarantined
                 for leg in legs)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
