"""What it costs to pace golden rounds by traffic (issue 35): the supervisor's look at the data plane's
counters (a poll) against a threshold callback the request path would run for every request.

    .venv/bin/python -m bench.pacing_cost [--models 10] [--rate 2000] [--every 50]

In one process, no server: the registry holds --models models' request counters, as a busy sidecar's
does. The poll is `RequestCounters.served(model)` plus the supervisor's `TrafficCount.since()` and
`next_look()`; the callback is the least a request would do to call back at N: bump a per-model
count and compare it with N (`telemetry.finish` would run it for every request, pacing on or off).
Printed: the time of each, and the CPU share each takes at --rate requests a second to one model
paced every --every requests (looks: two per round, the one after the round and the one aimed at
the Nth request, plus the idle looks of the other models).
"""

from __future__ import annotations

import argparse
import collections
import sys
import timeit
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from sidecar.app.request_counters import RequestCounters
from sidecar.health.traffic_pace import POLL_IDLE_S, TrafficCount
from sidecar.metrics import SidecarMetrics
from sidecar.states import ModelHealth


def measure(models: int, rate: float, every: int) -> dict[str, float]:
    metrics = SidecarMetrics(CollectorRegistry())
    names = [f"model_{i}" for i in range(models)]
    for name in names:
        for protocol, code in (("http", "200"), ("http", "400"), ("http", "503"), ("grpc", "OK")):
            for _ in range(1000):
                metrics.requests.finish(protocol, name, code, 0.002)
    counters = RequestCounters(metrics)
    health = ModelHealth(names[0], failure_threshold=3, success_threshold=1)
    cases = [SimpleNamespace(version="")] * 3  # three unversioned golden cases
    count = TrafficCount(names[0], counters.served, cases_for=lambda model: cases,  # type: ignore[arg-type,return-value]
                         health=lambda: health, clock=lambda: 0.0)
    count.mark()

    def look() -> None:
        count.next_look(every, count.since() or 0)

    counts: collections.Counter[str] = collections.Counter()
    callbacks: list[str] = []

    def callback(model: str = names[0]) -> None:  # per request, what a threshold callback needs at least
        counts[model] += 1
        if counts[model] >= every:
            counts[model] = 0
            callbacks.append(model)

    n = 200_000
    look_s = min(timeit.repeat(look, number=n, repeat=5)) / n
    callback_s = min(timeit.repeat(callback, number=n, repeat=5)) / n
    looks_per_s = 2 * rate / every + (models - 1) / POLL_IDLE_S
    return {"look_us": look_s * 1e6, "callback_us": callback_s * 1e6, "looks_per_s": looks_per_s,
            "poll_cpu_share": look_s * looks_per_s, "callback_cpu_share": callback_s * rate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pacing_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--rate", type=float, default=2000.0, help="requests a second to the paced model")
    parser.add_argument("--every", type=int, default=50, help="probes.every_requests")
    args = parser.parse_args(argv)
    r = measure(args.models, args.rate, args.every)
    print(f"poll: {r['look_us']:.2f} us a look, {r['looks_per_s']:.0f} looks/s -> {r['poll_cpu_share']:.4%} of a core")
    print(f"threshold callback: {r['callback_us']:.3f} us a request, {args.rate:.0f} req/s -> "
          f"{r['callback_cpu_share']:.4%} of a core, on the request path of every request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
