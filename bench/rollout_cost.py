"""Rollout cost: CPU per request of routing, and of one shadow compare, in the serving core; and
with --latency-blocks, what a client waits with every request shadowed.

    .venv/bin/python -m bench.rollout_cost [--requests 20000] [--repeats 5]
    .venv/bin/python -m bench.rollout_cost --latency-blocks 8 [--block 100]

Timed, with no server (CPU time is `time.process_time`, best of `--repeats` runs):
- routing: `Router.route` for an unpinned request of a model with a progressing rollout, then
  `ServingCore.count_route` (the routed_total counter), what every request of such a model pays;
  and for a model without a rollout (one dict lookup and the trust check);
- shadow compare: what the sidecar's CPU does for one compared pair besides sending the request
  again: decode both HTTP JSON answers (credit_risk's `scores` and `income_prob`, 1x1 FP32), compare
  them output by output with the tolerances, record the pair (`Rollout.compared`, decisions
  included). The second upstream call itself costs what one proxied request costs (bench/RESULTS.md
  section 1), times `shadow_rate`.

--latency-blocks (issue 20 §8, "p50 with shadow_rate 1.0 within 10 % of without, on the 2 ms
model"): the real Triton with bench/models/credit_risk_2ms holding two identical versions, and two
sidecars (`triton-sidecar run`, each in its own process) with the same rollout at its first step
(--share, 0.1 % by default: clients on stable, shadows on the candidate), one with shadow_rate 0,
one with 1.0. One
sequential client in this process (not in a sidecar's event loop) sends `--block` requests to one,
then to the other, `--latency-blocks` times, order alternating; p50 per block, median of blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from bench.inference import json_request
from bench.machine import command_line, describe_machine, write_results
from bench.repository import REPO, copy_golden, copy_model
from bench.sidecar_process import SidecarProcess, sidecar_settings
from sidecar.config import RolloutSettings
from sidecar.devtools.tritonserver import LocalTriton
from sidecar.fronts.http_routes import HttpInferExchange
from sidecar.metrics import SidecarMetrics
from sidecar.serving.rollouts import Rollouts, compare_answers
from sidecar.serving.routing import Router
from sidecar.states import ModelStates


def _answer(version: str, seed: int) -> tuple[int, dict[str, str], bytes]:
    rng = np.random.default_rng(seed)
    doc = {"model_name": "credit_risk", "model_version": version,
           "outputs": [{"name": "scores", "datatype": "FP32", "shape": [1, 1], "data": [float(rng.random())]},
                       {"name": "income_prob", "datatype": "FP32", "shape": [1, 1], "data": [float(rng.random())]}]}
    return 200, {"Content-Type": "application/json"}, json.dumps(doc).encode()


def _best(run: Callable[[], None], requests: int, repeats: int) -> float:
    """Best CPU microseconds per call."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(requests):
            run()
        best = min(best, (time.process_time() - started) / requests * 1e6)
    return best


MODEL_2MS = "credit_risk_2ms"


def _two_versions(repository: Path) -> None:
    path = copy_model(REPO / "bench" / "models" / MODEL_2MS, repository, MODEL_2MS)
    shutil.copytree(path / "1", path / "2")
    config = path / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy: { all { } }\n")


async def _p50_ms(url: str, bodies: list[bytes]) -> float:
    samples = []
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            started = time.perf_counter()
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                await response.read()
                assert response.status == 200, response.status
            samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def latency(blocks: int, block: int, share: float) -> dict[str, object]:
    """p50 per block without and with every request shadowed, sidecars in their own processes."""
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as scratch, contextlib.ExitStack() as stack:
        workdir = Path(scratch)
        repository, golden_dir = workdir / "model_repository", workdir / "golden"
        _two_versions(repository)
        copy_golden("credit_risk", golden_dir, MODEL_2MS)
        triton = LocalTriton(model_repository=repository, models=[MODEL_2MS], workdir=workdir / "triton")
        stack.callback(triton.stop, 3)
        triton.start()
        urls = {}
        for shadow_rate in (0.0, 1.0):
            rollout = {"stable": "1", "candidate": "2", "steps": [share, 1.0], "step_min_s": 1e6,
                       "step_min_requests": 10**9, "shadow_rate": shadow_rate}
            sidecar = SidecarProcess(sidecar_settings(
                triton, models=[MODEL_2MS], golden_dir=golden_dir, probes={"interval_s": 5},
                rollouts={MODEL_2MS: rollout},
                logging={"format": "json", "level": "warning", "access_log_sample_rate": 0.0},
            ), workdir / f"sidecar-{shadow_rate}")
            stack.callback(sidecar.stop)
            sidecar.start()
            deadline = time.monotonic() + 30
            while sidecar.status()["rollouts"][MODEL_2MS]["state"] != "progressing":
                assert time.monotonic() < deadline, sidecar.status()["rollouts"]
                time.sleep(0.1)
            urls[shadow_rate] = f"{sidecar.url}/v2/models/{MODEL_2MS}/infer"
        rng = np.random.default_rng(20)
        bodies = [json_request(rng.standard_normal((1, 128)).astype(np.float32)).body for _ in range(block)]
        asyncio.run(_p50_ms(urls[0.0], bodies[:20]))  # warm both paths
        asyncio.run(_p50_ms(urls[1.0], bodies[:20]))
        p50s: dict[float, list[float]] = {0.0: [], 1.0: []}
        for i in range(blocks):
            for shadow_rate in ((0.0, 1.0) if i % 2 == 0 else (1.0, 0.0)):
                p50s[shadow_rate].append(round(asyncio.run(_p50_ms(urls[shadow_rate], bodies)), 3))
    without, with_shadow = statistics.median(p50s[0.0]), statistics.median(p50s[1.0])
    # Each pair of blocks ran back to back: the median of their ratios cancels the machine's drift.
    paired = statistics.median(b / a - 1 for a, b in zip(p50s[0.0], p50s[1.0], strict=True))
    return {"candidate_share": share, "p50_ms_blocks": {"shadow_rate 0": p50s[0.0], "shadow_rate 1.0": p50s[1.0]},
            "p50_ms_without": without, "p50_ms_with_shadow": with_shadow,
            "increase": round(with_shadow / without - 1, 4), "increase_paired_median": round(paired, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency-blocks", type=int, default=0,
                        help="measure client p50 with and without shadows in this many block pairs (0: skip)")
    parser.add_argument("--block", type=int, default=100, help="requests per latency block (default 100)")
    parser.add_argument("--share", type=float, default=0.001,
                        help="the candidate's share at the rollout's first step (default 0.001)")
    args = parser.parse_args()
    if args.latency_blocks:
        machine = describe_machine()
        result = latency(args.latency_blocks, args.block, args.share)
        table = (f"| p50 without shadow | p50 with shadow_rate 1.0 | increase of the medians | median of paired "
                 f"increases |\n| --- | --- | --- | --- |\n| {result['p50_ms_without']} ms | "
                 f"{result['p50_ms_with_shadow']} ms | {result['increase']:+.1%} | "
                 f"{result['increase_paired_median']:+.1%} |\n")
        path = write_results("rollout_latency", {"benchmark": "rollout_latency", "command": command_line(),
                                                 "machine": machine, "result": result}, table)
        print(json.dumps(result["p50_ms_blocks"]))
        print(table + f"results: {path}")
        return
    metrics = SidecarMetrics(CollectorRegistry())
    states = ModelStates(failure_threshold=1, success_threshold=1, clock=time.monotonic)
    for model in ("credit_risk", "plain"):
        health = states.track(model)
        states.apply(model, lambda h, now: h.probe_passed(now))
        health.loaded_versions, health.default_version = ("1", "2"), "2"
    settings = RolloutSettings(stable="1", candidate="2", steps=(0.3, 1.0), step_min_requests=10**9, step_min_s=1e9)
    rollouts = Rollouts({"credit_risk": settings}, metrics=metrics, clock=time.monotonic)
    rollout = rollouts.get("credit_risk")
    rollout.gate_passed()
    router = Router(states=states, rollouts=rollouts, fallback=lambda: True)
    counts = metrics.requests

    def route() -> None:
        r = router.route("credit_risk", "", "")
        counts.routed("credit_risk", r.version, r.reason)

    stable, candidate = _answer("1", 1), _answer("2", 1)

    def shadow_compare() -> None:
        mine, theirs = HttpInferExchange.answer_tensors(stable), HttpInferExchange.answer_tensors(candidate)
        assert mine is not None and theirs is not None
        rollout.compared(compare_answers(mine[1], theirs[1], settings), hidden=lambda name: False)

    rows = {
        "route, model with a rollout (+ routed_total)": _best(route, args.requests, args.repeats),
        "route, model without a rollout": _best(lambda: router.route("plain", "", ""), args.requests, args.repeats),
        "shadow compare, 2 outputs 1x1 FP32, HTTP JSON": _best(shadow_compare, args.requests // 4, args.repeats),
    }
    assert rollout.differs_total == 0
    print("| step | CPU per request (us) |\n| --- | --- |")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
