"""A rollout's decisions and the shadow router, as pure logic on a fake clock (issue 20 §3-§5): the
rules tests/test_rollouts.py cannot drive with a real Triton in a few seconds, such as a candidate
whose p99 is too high, or one that answers 5xx. No server: fakes only for the clock and the states."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from sidecar.config import CompareTolerance, RolloutSettings
from sidecar.golden.compare import Mismatch
from sidecar.metrics import SidecarMetrics
from sidecar.serving.rollouts import Rollout, Rollouts, RolloutState, compare_answers, compare_texts
from sidecar.serving.routing import FALLBACK, SPLIT, Router
from sidecar.states import ModelStates

MODEL = "credit_risk"


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def rollouts_of(clock: FakeClock, **settings: object) -> Rollouts:
    return Rollouts({MODEL: RolloutSettings(stable="1", candidate="2", **settings)},  # type: ignore[arg-type]
                    metrics=SidecarMetrics(CollectorRegistry()), clock=clock)


def progressing(**settings: object) -> tuple[Rollout, FakeClock]:
    """A rollout past its golden gate (none configured: the first tick passes it)."""
    clock = FakeClock()
    rollouts = rollouts_of(clock, **settings)
    rollouts.tick()
    rollout = rollouts.get(MODEL)
    assert rollout is not None and rollout.state is RolloutState.PROGRESSING
    return rollout, clock


SAME: list[Mismatch] = []
DIFFERS = [Mismatch("scores", "scores[0] expected 0.5±5e-05, got 0.7")]


def never_hidden(output: str) -> bool:
    return False


def serve(rollout: Rollout, n: int, *, stable_s: float, candidate_s: float) -> None:
    """n answers of each version, each pair compared the same."""
    for _ in range(n):
        rollout.answered("1", stable_s, error=False)
        rollout.answered("2", candidate_s, error=False)
        rollout.compared(SAME, hidden=never_hidden)


# -- the rates -----------------------------------------------------------------------------------------------


def test_a_candidate_answering_5xx_above_max_error_rate_is_aborted_once_a_tenth_of_the_samples_came():
    rollout, _ = progressing(step_min_requests=200, max_error_rate=0.001)
    for _ in range(19):
        rollout.answered("2", 0.001, error=False)
    rollout.answered("2", 0.001, error=True)  # 1 of 20 = 5 %: enough samples (200 / 10) to judge
    assert rollout.state is RolloutState.ABORTED
    assert "1 of 20 requests with a 5xx" in rollout.cause and "max_error_rate" in rollout.cause
    assert rollout.share == 0.0 and rollout.pick(0.0) == "1"


def test_one_differing_pair_among_fewer_than_a_tenth_of_the_samples_does_not_abort_yet():
    rollout, _ = progressing(step_min_requests=200, max_diff_rate=0.005)
    rollout.compared(DIFFERS, hidden=never_hidden)
    for _ in range(18):
        rollout.compared(SAME, hidden=never_hidden)
    assert rollout.state is RolloutState.PROGRESSING, rollout.cause  # 19 samples < 20
    rollout.compared(SAME, hidden=never_hidden)
    assert rollout.state is RolloutState.ABORTED  # 1 of 20 = 5 % > 0.5 %
    assert "answers differ on 5.00% of 20" in rollout.cause and "scores[0] expected 0.5" in rollout.cause


def test_a_differing_filtered_output_is_named_without_its_values():
    rollout, _ = progressing(step_min_requests=10)
    rollout.compared([Mismatch("income_prob", "income_prob[0] expected 0.31±3e-05, got 0.93")],
                     hidden=lambda output: output == "income_prob")
    assert rollout.state is RolloutState.ABORTED
    assert "income_prob differs (a filtered output" in rollout.cause
    assert "0.31" not in rollout.cause and "0.93" not in rollout.cause


# -- p99 and time --------------------------------------------------------------------------------------------


def test_a_stage_passes_on_time_alone_once_it_has_its_samples():
    rollout, clock = progressing(steps=(0.05, 1.0), step_min_requests=20, step_min_s=60)
    serve(rollout, 20, stable_s=0.003, candidate_s=0.003)
    assert rollout.step == 0, "passed before step_min_s"
    clock.now += 60
    rollout.decide()  # what the decision loop's tick does every 100 ms, with no answer coming
    assert rollout.step == 1 and rollout.share == 1.0 and rollout.state is RolloutState.PROGRESSING


def test_a_candidate_with_a_slow_p99_holds_its_stage_then_is_aborted():
    rollout, clock = progressing(steps=(0.05, 1.0), step_min_requests=100, step_min_s=60, max_p99_increase=0.10)
    serve(rollout, 100, stable_s=0.010, candidate_s=0.020)  # p99 +100 %, 10 ms above stable's
    clock.now += 60
    with capture_logs() as logs:
        rollout.decide()
        assert rollout.state is RolloutState.PROGRESSING and rollout.step == 0, "waits before it aborts"
        clock.now += 59
        rollout.decide()
        assert rollout.state is RolloutState.PROGRESSING and rollout.step == 0
        clock.now += 1
        rollout.decide()
    assert rollout.state is RolloutState.ABORTED
    assert "p99 stayed 100% above stable's" in rollout.cause, rollout.cause
    assert [e["event"] for e in logs] == ["rollout_step_waiting", "rollout_aborted"]
    assert logs[1]["stable_p99_ms"] == 10.0 and logs[1]["candidate_p99_ms"] == 20.0


def test_a_p99_difference_under_the_noise_floor_does_not_hold_a_stage():
    rollout, clock = progressing(steps=(0.05, 1.0), step_min_requests=100, step_min_s=60, max_p99_increase=0.10)
    serve(rollout, 100, stable_s=0.0010, candidate_s=0.0015)  # +50 %, but 0.5 ms: scheduler noise
    clock.now += 60
    rollout.decide()
    assert rollout.step == 1, rollout.status()


def test_after_the_last_step_the_candidate_is_promoted_and_serves_every_unpinned_request():
    rollout, clock = progressing(steps=(0.5, 1.0), step_min_requests=10, step_min_s=1)
    with capture_logs() as logs:
        for _ in range(2):
            serve(rollout, 10, stable_s=0.003, candidate_s=0.003)
            clock.now += 1
            rollout.decide()
    assert rollout.state is RolloutState.PROMOTED and rollout.serving_version == "2"
    assert [(e["event"], e.get("step")) for e in logs] == [
        ("rollout_step", 1), ("rollout_step", 2), ("rollout_promoted", None)], logs
    assert logs[-1]["compared"] == 20 and logs[-1]["differs"] == 0
    assert {rollout.pick(b) for b in np.linspace(0, 0.999, 50)} == {"2"}


# -- routing and the shadow's target -------------------------------------------------------------------------


def router_with(rollouts: Rollouts) -> tuple[Router, ModelStates]:
    states = ModelStates(failure_threshold=1, success_threshold=1, clock=FakeClock())
    health = states.track(MODEL)
    health.begin_warmup(0.0)
    health.probe_passed(0.0)
    health.loaded_versions = ("1", "2")
    health.default_version = "2"
    return Router(states=states, rollouts=rollouts, fallback=lambda: True, rng=random.Random(3)), states


def test_no_shadow_call_goes_to_a_quarantined_version_and_its_requests_fall_back():
    rollouts = rollouts_of(FakeClock(), steps=(0.5, 1.0), shadow_rate=1.0)
    rollouts.tick()
    router, states = router_with(rollouts)
    served_by_stable = router.route(MODEL, "", "")
    while served_by_stable.version != "1":
        served_by_stable = router.route(MODEL, "", "")
    assert router.shadow_target(served_by_stable) == "2"
    # Version 2 fails its golden cases (only it): quarantined for version 2.
    states.get(MODEL).probe_failed("v2 NaN", 1.0, versions=frozenset({"2"}))  # type: ignore[union-attr]
    assert router.shadow_target(served_by_stable) == ""
    routes = [router.route(MODEL, "", "") for _ in range(40)]
    assert {(r.version, r.reason) for r in routes} <= {("1", SPLIT), ("1", FALLBACK)}
    assert any(r.reason == FALLBACK for r in routes)
    assert all(router.shadow_target(r) == "" for r in routes)


def test_no_shadow_call_before_the_golden_gate_passed():
    gating = rollouts_of(FakeClock(), shadow_rate=1.0)  # no tick: the gate has not run
    router, _ = router_with(gating)
    routes = [router.route(MODEL, "", "") for _ in range(20)]
    assert {r.version for r in routes} == {"1"}
    assert all(router.shadow_target(r) == "" for r in routes)


# -- comparing two answers -----------------------------------------------------------------------------------


def tensor(name: str, values: list[float], datatype: str = "FP32", shape: tuple[int, ...] | None = None):  # type: ignore[no-untyped-def]
    return (name, datatype, shape or (len(values), 1), np.asarray(values, dtype=np.float32))


def test_two_answers_differ_by_value_beyond_the_tolerance_by_shape_datatype_nan_or_a_missing_output():
    settings = RolloutSettings(stable="1", candidate="2", compare=CompareTolerance(atol=1e-3, rtol=0.0),
                               compare_outputs={"income_prob": CompareTolerance(atol=0.5, rtol=0.0)})
    stable = [tensor("scores", [0.5, 0.25]), tensor("income_prob", [0.1])]
    assert compare_answers(stable, [tensor("scores", [0.5005, 0.25]), tensor("income_prob", [0.5])], settings) == []
    cases = {
        "value": [tensor("scores", [0.5, 0.26]), tensor("income_prob", [0.1])],
        "nan": [tensor("scores", [0.5, float("nan")]), tensor("income_prob", [0.1])],
        "shape": [tensor("scores", [0.5, 0.25], shape=(1, 2)), tensor("income_prob", [0.1])],
        "datatype": [tensor("scores", [0.5, 0.25], datatype="FP64"), tensor("income_prob", [0.1])],
        "missing": [tensor("scores", [0.5, 0.25])],
    }
    found = {kind: [m.message for m in compare_answers(stable, got, settings)] for kind, got in cases.items()}
    assert found["value"] == ["scores[1] expected 0.2500±0.0010, got 0.2600"], found
    assert found["nan"] == ["scores[1] expected 0.2500±0.0010, got nan"], found
    assert found["shape"] == ["scores shape expected [2, 1], got [1, 2]"], found
    assert found["datatype"] == ["scores datatype expected FP32, got FP64"], found
    assert found["missing"] == ["output income_prob only in version one's answer"], found


def test_generate_texts_are_equal_or_not_and_the_example_never_quotes_them():
    assert compare_texts({"text_output": '"alpha"'}, {"text_output": '"alpha"'}) == []
    differs = compare_texts({"text_output": '"my secret prompt"'}, {"text_output": '"tpmorp terces ym"'})
    assert [m.output for m in differs] == ["text_output"]
    assert "secret" not in differs[0].message and "terces" not in differs[0].message
    assert compare_texts({"text_output": '"a"'}, {})[0].message == "output text_output only in version one's answer"


def rollout_watching_states(clock: FakeClock) -> tuple[Rollout, ModelStates]:
    states = ModelStates(failure_threshold=3, success_threshold=1, clock=clock)
    states.track(MODEL)
    states.apply(MODEL, lambda h, now: h.begin_warmup(now))
    states.apply(MODEL, lambda h, now: h.probe_passed(now))
    rollouts = Rollouts({MODEL: RolloutSettings(stable="1", candidate="2")},
                        metrics=SidecarMetrics(CollectorRegistry()), clock=clock, states=states)
    rollouts.tick()
    rollout = rollouts.get(MODEL)
    assert rollout is not None and rollout.state is RolloutState.PROGRESSING
    return rollout, states


def test_a_round_failed_on_the_candidate_alone_aborts_the_rollout_at_its_first_failure() -> None:
    rollout, states = rollout_watching_states(FakeClock())
    states.apply(MODEL, lambda h, now: h.probe_failed("golden case v2_normal: scores[0] expected 0.43, got nan",
                                                      now, versions=frozenset({"2"})))
    assert rollout.state is RolloutState.ABORTED and rollout.share == 0.0
    assert rollout.cause.startswith("the candidate failed its golden cases at step 1: golden case v2_normal")


def test_a_whole_model_failure_or_one_of_stable_is_the_model_s_health_s_not_the_rollout_s() -> None:
    for versions in (frozenset(), frozenset({"1"}), frozenset({"1", "2"})):
        rollout, states = rollout_watching_states(FakeClock())
        states.apply(MODEL, lambda h, now, v=versions: h.probe_failed("golden case normal failed", now, versions=v))
        assert rollout.state is RolloutState.PROGRESSING, versions


def test_a_candidate_failure_after_promotion_is_the_model_s_health_s() -> None:
    rollout, states = rollout_watching_states(FakeClock())
    rollout.decide_by_config("promote")
    states.apply(MODEL, lambda h, now: h.probe_failed("golden case v2_normal failed", now, versions=frozenset({"2"})))
    assert rollout.state is RolloutState.PROMOTED
