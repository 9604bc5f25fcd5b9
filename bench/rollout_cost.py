"""Rollout cost: CPU per request of routing, and of one shadow compare, in the serving core.

    .venv/bin/python -m bench.rollout_cost [--requests 20000] [--repeats 5]

Timed, with no server (CPU time is `time.process_time`, best of `--repeats` runs):
- routing: `Router.route` for an unpinned request of a model with a progressing rollout, then
  `ServingCore.count_route` (the routed_total counter), what every request of such a model pays;
  and for a model without a rollout (one dict lookup and the trust check);
- shadow compare: what the sidecar's CPU does for one compared pair besides sending the request
  again: decode both HTTP JSON answers (credit_risk's `scores` and `income_prob`, 1x1 FP32), compare
  them output by output with the tolerances, record the pair (`Rollout.compared`, decisions
  included). The second upstream call itself costs what one proxied request costs (bench/RESULTS.md
  section 1), times `shadow_rate`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry

from sidecar.config import RolloutSettings
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
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
    routed = metrics.routed

    def route() -> None:
        r = router.route("credit_risk", "", "")
        routed.labels(model="credit_risk", version=r.version, reason=r.reason).inc()

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
