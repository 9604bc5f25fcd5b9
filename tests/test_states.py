"""The per-model state machine, as pure logic."""

from __future__ import annotations

from sidecar.states import ModelHealth, ModelState, ModelStates, Transition


def _health(failure_threshold: int = 3, success_threshold: int = 2) -> ModelHealth:
    return ModelHealth("m", failure_threshold=failure_threshold, success_threshold=success_threshold)


def test_first_passing_round_makes_a_warming_model_healthy():
    h = _health()
    assert h.begin_warmup(0.0).state_to is ModelState.WARMING
    t = h.probe_passed(1.0)
    assert (t.state_from, t.state_to) == (ModelState.WARMING, ModelState.HEALTHY)


def test_failures_below_the_threshold_degrade_then_the_threshold_makes_it_unhealthy():
    h = _health(failure_threshold=3)
    h.begin_warmup(0.0)
    h.probe_passed(0.5)
    assert h.probe_failed("golden case normal: scores[0] expected 0.7310±0.0001, got nan", 1.0).state_to \
        is ModelState.DEGRADED
    assert h.probe_failed("again", 2.0) is None  # still DEGRADED: no transition
    assert h.state is ModelState.DEGRADED and h.cause == "again"
    t = h.probe_failed("third", 3.0)
    assert (t.state_from, t.state_to, t.cause) == (ModelState.DEGRADED, ModelState.UNHEALTHY, "third")


def test_degraded_needs_success_threshold_passes_in_a_row_to_be_healthy():
    h = _health(failure_threshold=3, success_threshold=2)
    h.begin_warmup(0.0)
    h.probe_passed(0.0)
    h.probe_failed("x", 1.0)
    assert h.probe_passed(2.0) is None and h.state is ModelState.DEGRADED
    h.probe_failed("y", 3.0)
    assert h.probe_passed(4.0) is None
    t = h.probe_passed(5.0)
    assert t.state_to is ModelState.HEALTHY
    assert t.recovered_after_s == 4.0  # from the first failure at t=1


def test_a_model_that_never_passes_goes_from_warming_to_unhealthy():
    h = _health(failure_threshold=2)
    h.begin_warmup(0.0)
    h.probe_failed("not ready", 1.0)
    assert h.state is ModelState.WARMING and h.cause == "not ready"
    assert h.probe_failed("not ready", 2.0).state_to is ModelState.UNHEALTHY


def test_healing_ignores_probe_rounds_and_ends_healthy_with_time_to_recover():
    h = _health(failure_threshold=1)
    h.begin_warmup(0.0)
    h.probe_passed(0.0)
    h.probe_failed("stub died", 10.0)
    assert h.heal_started("healing", 11.0).state_to is ModelState.HEALING
    assert h.probe_failed("late round", 12.0) is None and h.state is ModelState.HEALING
    assert h.probe_passed(12.5) is None and h.state is ModelState.HEALING
    t = h.heal_succeeded("healed", 13.5)
    assert t.state_to is ModelState.HEALTHY and t.recovered_after_s == 3.5
    assert h.consecutive_failures == 0


def test_failed_is_terminal():
    h = _health(failure_threshold=1)
    h.begin_warmup(0.0)
    h.probe_failed("x", 1.0)
    h.heal_started("h", 1.0)
    assert h.fail("healing exhausted", 2.0).state_to is ModelState.FAILED
    assert h.probe_passed(3.0) is None
    assert h.heal_started("again", 4.0) is None
    assert h.state is ModelState.FAILED


def test_quarantine_and_serving_states():
    assert {s for s in ModelState if s.serves_traffic} == {ModelState.HEALTHY, ModelState.DEGRADED}
    assert {s for s in ModelState if s.quarantined} == {ModelState.UNHEALTHY, ModelState.HEALING, ModelState.FAILED}


def test_model_states_announce_each_transition_once():
    seen: list[Transition] = []
    now = [0.0]
    states = ModelStates(failure_threshold=1, success_threshold=1, clock=lambda: now[0], listener=seen.append)
    states.track("a")
    states.track("b")
    states.apply("a", lambda h, t: h.begin_warmup(t))
    states.apply("a", lambda h, t: h.probe_passed(t))
    states.apply("a", lambda h, t: h.probe_passed(t))  # no change, no announcement
    assert [(t.model, t.state_to) for t in seen] == [("a", ModelState.WARMING), ("a", ModelState.HEALTHY)]
    assert not states.all_serving()  # b was never probed
    states.apply("b", lambda h, t: h.probe_passed(t))
    assert states.all_serving()
    states.apply("b", lambda h, t: h.fail("gone", t))
    assert states.failed() == ["b"]


def test_a_final_failure_skips_the_threshold():
    health = ModelHealth("m", failure_threshold=3, success_threshold=1)
    health.probe_passed(0.0)
    moved = health.probe_failed("Triton: the stub died", 1.0, final=True)
    assert moved is not None and moved.state_to is ModelState.UNHEALTHY and health.consecutive_failures == 1
