"""What the sidecar's own work costs per request, part by part, in one process (issue 18).

    .venv/bin/python -m bench.chain_cost [--repeats 5] [--loops 20000]

No server and no socket: the real functions of the HTTP inference path on bench.dataplane's request
(1x128 FP32 JSON to credit_risk, `income_prob` filtered, NaN refused), timed in loops on uvloop with
warm caches, best of `--repeats`:
- `validate`: `validate_infer_request` (the data plane's checks, in Rust: parse, the document's checks,
  dtype and finiteness) on the 1x128 request;
- `validate 1 MB`: the same on a 1 MB JSON body (1088x128 FP32, credit_risk batching up to 2048);
- `screen`: `screen_infer_response` cutting `income_prob` out of Triton's answer;
- `scope + infer`: one `RequestScope` around `ServingCore.resolve` + `ServingCore.infer` with an
  upstream that answers at once (admission, routing, breaker slot, in-flight gauge, validation,
  screening, passive signals, counters, histogram, the 1 % sampled access log);
- `scope only`: the scope with nothing inside (ids, log context, drain count, counters, histogram).
What the wire adds (parsing, sockets, the event loop) is bench.http_candidates' to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import uvloop
from prometheus_client import CollectorRegistry

from bench.inference import features, json_request
from bench.validation_cost import CONFIG, METADATA
from sidecar.config import FilterRule, SidecarConfig
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import OutputPolicy, Screened, ServingCore
from sidecar.serving.filtering import screen_infer_response
from sidecar.serving.passive_signals import HealthEvents
from sidecar.serving.telemetry import HTTP
from sidecar.serving.validation import CheckedRequest, Limits, ModelSpec, build_model_spec, validate_infer_request
from sidecar.states import ModelHealth, ModelStates

MODEL = "credit_risk"
#: Triton's answer to the request, as Triton writes it (one output dropped by the filter).
ANSWER = json.dumps({"model_name": MODEL, "model_version": "1", "outputs": [
    {"name": "scores", "datatype": "FP32", "shape": [1, 1], "data": [0.1234]},
    {"name": "income_prob", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}]}, separators=(",", ":")).encode()


class _Exchange:
    """The HTTP exchange's decoding and screening, with an upstream that answers at once."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def validate(self, spec: ModelSpec) -> CheckedRequest:
        return validate_infer_request(spec, self.body)

    async def send(self, version: str) -> bytes:
        return ANSWER

    def screen(self, answer: bytes, policy: OutputPolicy) -> Screened[bytes]:
        screened = screen_infer_response(answer, None, is_hidden=policy.is_hidden,
                                         check_non_finite=policy.check_non_finite)
        return Screened(screened.body, dropped=screened.dropped, non_finite=screened.non_finite)

    def answer_tensors(self, answer: bytes) -> None:
        return None

    def answer_texts(self, answer: bytes) -> None:
        return None


def _core() -> ServingCore:
    base = SidecarConfig()
    config = replace(base, models=(MODEL,),
                     filtering=replace(base.filtering, rules=(FilterRule(model=MODEL, drop_outputs=("income_prob",)),)))
    states = ModelStates(failure_threshold=1, success_threshold=1, clock=time.monotonic)

    async def fetch(model: str, version: str, what: str) -> tuple[int, bytes]:
        return 200, json.dumps(METADATA if what == "metadata" else CONFIG).encode()

    core = ServingCore(config, states=states, metrics=SidecarMetrics(CollectorRegistry()), fetch_document=fetch,
                       cases_for=lambda model: (),
                       events=HealthEvents(probe_soon=lambda model, cause: None, stub_dead=lambda model: None,
                                           triton_unreachable=lambda cause: None))
    states.track(MODEL)
    states.apply(MODEL, ModelHealth.probe_passed)
    return core


async def _best(run: Callable[[], Awaitable[Any]] | Callable[[], Any], loops: int, repeats: int) -> float:
    """Microseconds per call, best of `repeats` loops of `loops` calls."""
    best = float("inf")
    is_async = asyncio.iscoroutinefunction(run)
    for _ in range(repeats):
        started = time.perf_counter()
        if is_async:
            for _ in range(loops):
                await run()  # type: ignore[misc]
        else:
            for _ in range(loops):
                run()
        best = min(best, (time.perf_counter() - started) / loops * 1e6)
    return best


async def measure(loops: int, repeats: int) -> dict[str, float]:
    core = _core()
    body = json_request(features(1)).body
    exchange = _Exchange(body)
    spec = await core.specs.get(MODEL, "")
    hidden = core.policy(MODEL).is_hidden

    async def scope_and_infer() -> None:
        scope = core.request(HTTP, None, None, method="POST", path=f"/v2/models/{MODEL}/infer")
        async with scope:
            core.resolve(scope, MODEL, "")
            await core.infer(MODEL, "", exchange)
            scope.answered(200)

    async def scope_only() -> None:
        scope = core.request(HTTP, None, None, method="POST", path=f"/v2/models/{MODEL}/infer")
        async with scope:
            scope.label = MODEL
            scope.answered(200)

    big_spec = build_model_spec(MODEL, "", METADATA, {**CONFIG, "max_batch_size": 2048},
                                limits=Limits(4_000_000, 1 << 20, reject_non_finite=True))
    big_body = json_request(features(1088)).body
    assert 0.95e6 < len(big_body) < 1.1e6, len(big_body)
    validate_infer_request(big_spec, big_body)  # it passes: the loop times a valid request

    await scope_and_infer()  # the spec and the metric children are cached, as after a first request
    return {
        "validate": await _best(lambda: validate_infer_request(spec, body), loops, repeats),
        "validate 1 MB": await _best(lambda: validate_infer_request(big_spec, big_body), max(loops // 1000, 5),
                                     repeats),
        "screen": await _best(lambda: screen_infer_response(ANSWER, None, is_hidden=hidden, check_non_finite=True),
                              loops, repeats),
        "scope + infer": await _best(scope_and_infer, loops, repeats),
        "scope only": await _best(scope_only, loops, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chain_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="loops timed, the best kept (default 5)")
    parser.add_argument("--loops", type=int, default=20000, help="calls per loop (default 20000)")
    args = parser.parse_args(argv)
    import structlog

    # The 1 % sampled access log goes nowhere: its cost is the sampling, not a terminal's.
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(measure(args.loops, args.repeats))
    for part, us in result.items():
        print(f"{part:15} {us:7.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
