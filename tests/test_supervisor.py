"""The health rules as pure logic, on a fake clock: no Triton, no sleeping, milliseconds per test.

A model supervisor judges scripted probe rounds (threshold counting, confirmation at once, success
threshold), decides heal or release, and applies the healer's outcome (backoff schedule, exhaustion,
flapping guard) against a scripted repository API; the task supervisor restarts crashed loops with
backoff; the watchdog sees a supervisor that completes no round. What Triton does is tested against
the real Triton elsewhere (test_healing.py, test_supervision.py); these fakes stand in for it only to
drive the sidecar's own decisions.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from sidecar.app.factory import create_app
from sidecar.app.kubelet import liveness_problems
from sidecar.app.request_counters import RequestCounters
from sidecar.config import SidecarConfig
from sidecar.fronts.appkeys import ESCALATION, HEALER, METRICS, PROBER, ROSTER, STATES, WATCH
from sidecar.health.escalation import RestartEscalation
from sidecar.health.escalation_record import EscalationRecord, PastEscalation
from sidecar.health.fault_scope import (
    NO_ANSWER,
    Evidence,
    Failure,
    devices_of,
    failure_of,
    judge,
    judge_after_reload,
)
from sidecar.health.healer import Healer
from sidecar.health.probe_round import GOLDEN, MODEL_READY, ProbeResult, RoundResult
from sidecar.health.supervisor import UNLOADED_ON_PURPOSE, LateVerdict, ModelSupervisor
from sidecar.health.tasks import CRASH_BACKOFF_MAX_S, CrashRecord, crash_backoff, supervise
from sidecar.health.traffic_pace import POLL_IDLE_S, POLL_MIN_S, TrafficCount
from sidecar.health.triton_client import TritonClient
from sidecar.health.triton_watch import TritonWatch
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import StubUnhealthy, TritonUnavailable
from sidecar.states import ModelHealth, ModelState, ModelStates, Transition

MODEL = "m"


@dataclass
class FakeClock:
    """Time that moves only when told to, or when someone sleeps on it."""

    now: float = 1000.0
    slept: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def passed() -> RoundResult:
    return RoundResult(MODEL, (ProbeResult(GOLDEN, True, 0.001, case="normal"),))


def failed(detail: str = "scores[0] expected 0.73, got 0.66") -> RoundResult:
    return RoundResult(MODEL, (ProbeResult(GOLDEN, False, 0.001, detail, case="normal"),))


def not_ready() -> RoundResult:
    return RoundResult(MODEL, (ProbeResult(MODEL_READY, False, 0.001, "not ready"),))


def triton_error(message: str, status: int = 500, model: str = MODEL) -> RoundResult:
    """A golden case Triton answered with an error status, as probe_round records it."""
    return RoundResult(model, (ProbeResult(GOLDEN, False, 0.001, f"Triton answered {status}: {message}", case="normal",
                                           error=message, status=status),))


STICKY = "CUDA error: an illegal memory access was encountered"


def triton_down() -> RoundResult:
    return RoundResult(MODEL, conclusive=False)


class ScriptedProber:
    """Answers each round with the next scripted result (the last one repeats)."""

    def __init__(self, clock: FakeClock, rounds: list[RoundResult], verify: list[RoundResult] | None = None,
                 round_s: float = 0.002) -> None:
        self.clock, self.rounds, self.verify, self.round_s = clock, list(rounds), list(verify or [passed()]), round_s
        self.asked = 0

    async def run_round(self, model: str) -> RoundResult:
        self.asked += 1
        self.clock.now += self.round_s
        return self.rounds.pop(0) if len(self.rounds) > 1 else self.rounds[0]

    async def verify_round(self, model: str) -> RoundResult:
        return self.verify.pop(0) if len(self.verify) > 1 else self.verify[0]

    def unanswered_for(self, model: str) -> float | None:
        return None


class ScriptedRepository:
    """Triton's repository API as the healer sees it: unload/load always accepted, the model gone at
    once after an unload; `index` is what the repository index says outside a heal."""

    def __init__(self, index: list[dict[str, str]] | None = None, *, index_fails: bool = False) -> None:
        self.index = index if index is not None else [{"name": MODEL, "state": "READY"}]
        self.index_fails = index_fails
        self.calls: list[str] = []
        self._unloaded = False

    async def repository_index(self) -> list[dict[str, str]]:
        if self.index_fails:
            raise TritonUnavailable("connection refused")
        return [] if self._unloaded else self.index

    async def unload_model(self, model: str, timeout_s: float | None = None) -> None:
        self.calls.append("unload")
        self._unloaded = True

    async def load_model(self, model: str, timeout_s: float | None = None) -> None:
        self.calls.append("load")
        self._unloaded = False

    async def model_ready(self, model: str, timeout_s: float | None = None) -> bool:
        return True


@dataclass
class Rig:
    supervisor: ModelSupervisor
    states: ModelStates
    clock: FakeClock
    prober: ScriptedProber
    repository: ScriptedRepository
    registry: CollectorRegistry
    transitions: list[Transition]
    suspect: list[tuple[str, bool]]
    escalation: RestartEscalation

    @property
    def state(self) -> ModelState:
        return self.states.get(MODEL).state  # type: ignore[union-attr]

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def rig(rounds: list[RoundResult], *, verify: list[RoundResult] | None = None, golden: bool = True,
        repository: ScriptedRepository | None = None, probes: dict[str, Any] | None = None,
        healing: dict[str, Any] | None = None, models: tuple[str, ...] = (MODEL,),
        record: EscalationRecord | None = None, others: tuple[str, ...] = ()) -> Rig:
    base = SidecarConfig()
    config = replace(base, models=models,
                     probes=replace(base.probes, **{"interval_s": 5.0, "failure_threshold": 3, **(probes or {})}),
                     healing=replace(base.healing,
                                     **{"backoff_initial_s": 1.0, "backoff_max_s": 3.0, **(healing or {})}))
    clock = FakeClock()
    transitions: list[Transition] = []
    suspect: list[tuple[str, bool]] = []
    states = ModelStates(failure_threshold=config.probes.failure_threshold,
                         success_threshold=config.probes.success_threshold, clock=clock, listener=transitions.append)
    states.add_suspect_listener(lambda model, flag: suspect.append((model, flag)))
    states.track(MODEL)
    registry = CollectorRegistry()
    metrics = SidecarMetrics(registry)
    prober = ScriptedProber(clock, rounds, verify)
    repository = repository or ScriptedRepository()
    healer = Healer(triton=repository, settings=config.healing, metrics=metrics,  # type: ignore[arg-type]
                    verify=prober.verify_round, unanswered_for=prober.unanswered_for, sleep=clock.sleep, clock=clock)
    escalation = RestartEscalation(record=record or EscalationRecord(None, wall=lambda: clock.now),
                                   metrics=metrics, config=lambda: config, states=states,
                                   triton=repository, probe_soon=lambda model, cause: None,  # type: ignore[arg-type]
                                   guarded=lambda: [MODEL, *others], clock=clock)
    supervisor = ModelSupervisor(MODEL, states=states, prober=prober, healer=healer,  # type: ignore[arg-type]
                                 escalation=escalation, triton=repository, metrics=metrics, config=lambda: config,  # type: ignore[arg-type]
                                 cases_for=lambda model: ("a case",) if golden else (),  # type: ignore[arg-type,return-value]
                                 clock=clock, rng=random.Random(7))
    return Rig(supervisor, states, clock, prober, repository, registry, transitions, suspect, escalation)


async def passes(r: Rig, n: int) -> list[str | None]:
    """n reconcile passes, as the loop runs them (each started when the last one ended)."""
    return [await r.supervisor.reconcile() for _ in range(n)]


# -- rounds and the state machine ------------------------------------------------------------------------


async def test_a_failed_round_is_confirmed_at_once_and_the_threshold_is_crossed_within_the_probe_time():
    r = rig([passed(), failed(), failed(), failed()], healing={"enabled": False})
    await passes(r, 1)
    assert r.state is ModelState.HEALTHY and not r.supervisor.confirming
    started = r.clock.now
    await passes(r, 1)
    assert r.state is ModelState.DEGRADED and r.supervisor.confirming
    assert r.states.get(MODEL).suspect and r.suspect == [(MODEL, True)]  # type: ignore[union-attr]
    # The confirmation starts within a few ms, not an interval (5 s) later.
    assert r.supervisor.next_delay(started) <= 0.01
    await passes(r, 2)
    assert r.state is ModelState.UNHEALTHY
    assert r.clock.now - started < 0.01, "three failed rounds took longer than the probes themselves"
    assert not r.states.get(MODEL).suspect and r.suspect[-1] == (MODEL, False)  # type: ignore[union-attr]
    assert r.metric("triton_sidecar_probe_consecutive_failures", model=MODEL) == 3


async def test_a_passing_confirmation_returns_to_the_normal_schedule():
    r = rig([passed(), failed(), passed()], probes={"success_threshold": 1, "jitter": 0.1})
    await passes(r, 2)
    assert r.supervisor.confirming
    started = r.clock.now
    await passes(r, 1)
    assert r.state is ModelState.HEALTHY and not r.supervisor.confirming
    assert 4.5 - 0.01 <= r.supervisor.next_delay(started) <= 5.5
    assert r.suspect == [(MODEL, True), (MODEL, False)]


async def test_degraded_needs_success_threshold_passes_in_a_row():
    r = rig([passed(), failed(), passed(), failed(), passed(), passed()], probes={"success_threshold": 2})
    await passes(r, 5)
    assert r.state is ModelState.DEGRADED
    await passes(r, 1)
    assert r.state is ModelState.HEALTHY
    assert r.transitions[-1].recovered_after_s is not None


async def test_a_round_triton_did_not_answer_judges_nothing_and_confirms_nothing():
    r = rig([passed(), failed(), triton_down()])
    await passes(r, 3)
    assert r.state is ModelState.DEGRADED and r.states.get(MODEL).consecutive_failures == 1  # type: ignore[union-attr]
    assert not r.supervisor.confirming, "confirming at once against a silent Triton would spin"


async def test_a_late_verdict_is_final_and_ignored_during_a_heal():
    r = rig([passed()])
    await passes(r, 1)
    r.supervisor.tell(LateVerdict(StubUnhealthy(500, "Stub process 'm_0_0' is not healthy.")))
    await r.supervisor.wait(5.0)  # handles the queued verdict and returns at once, not in 5 s
    assert r.state is ModelState.UNHEALTHY and "not healthy" in r.states.get(MODEL).cause  # type: ignore[union-attr]
    asked = r.prober.asked
    await passes(r, 1)  # already judged: straight to the heal, no round first
    assert r.prober.asked == asked and r.repository.calls == ["unload", "load"] and r.state is ModelState.HEALTHY


# -- heal or release ---------------------------------------------------------------------------------------


async def test_an_unhealthy_model_is_healed_and_its_outcome_applied():
    r = rig([passed(), not_ready()], probes={"failure_threshold": 1})
    assert await passes(r, 2) == [None, None]
    moves = [(t.state_from, t.state_to) for t in r.transitions]
    assert moves[-3:] == [(ModelState.HEALTHY, ModelState.UNHEALTHY), (ModelState.UNHEALTHY, ModelState.HEALING),
                          (ModelState.HEALING, ModelState.HEALTHY)]
    assert r.repository.calls == ["unload", "load"]
    assert r.metric("triton_sidecar_heal_attempts_total", model=MODEL, result="success") == 1


async def test_heal_attempts_back_off_and_exhaustion_fails_the_model():
    r = rig([passed(), not_ready()], verify=[failed()], probes={"failure_threshold": 1},
            healing={"max_attempts": 4, "backoff_initial_s": 1.0, "backoff_max_s": 3.0})
    with capture_logs() as logs:
        await passes(r, 2)
    assert r.state is ModelState.FAILED
    assert "healing exhausted after 4 attempts" in r.states.get(MODEL).cause  # type: ignore[union-attr]
    retries = [e["backoff_s"] for e in logs if e["event"] == "heal_retry_scheduled"]
    assert retries == [1.0, 2.0, 3.0]  # doubled, capped at backoff_max_s
    assert r.metric("triton_sidecar_escalations_total", model=MODEL) == 1
    asked = r.prober.asked
    await passes(r, 3)
    assert r.prober.asked == asked and r.state is ModelState.FAILED, "FAILED is terminal: no more rounds"


async def test_a_model_healed_too_often_within_the_flap_window_fails():
    r = rig([passed(), not_ready(), not_ready(), not_ready()], probes={"failure_threshold": 1},
            healing={"flap_max_heals": 2, "flap_window_s": 100.0})
    await passes(r, 3)  # two heals
    assert r.state is ModelState.HEALTHY
    await passes(r, 1)  # the third within the window
    assert r.state is ModelState.FAILED and "flapping" in r.states.get(MODEL).cause  # type: ignore[union-attr]


async def test_heals_outside_the_flap_window_do_not_count():
    r = rig([passed(), not_ready()], probes={"failure_threshold": 1},
            healing={"flap_max_heals": 1, "flap_window_s": 100.0})
    for _ in range(4):
        r.prober.rounds = [not_ready(), passed()]
        await passes(r, 1)
        assert r.state is ModelState.HEALTHY
        r.clock.now += 101.0
    assert r.metric("triton_sidecar_heal_attempts_total", model=MODEL, result="success") == 4


# -- reload or restart: whose fault it is ------------------------------------------------------------------


async def test_a_sticky_cuda_error_escalates_to_a_restart_without_one_reload():
    r = rig([passed(), triton_error(STICKY)])
    with capture_logs() as logs:
        await passes(r, 5)
    assert r.repository.calls == [], "a reload cannot clear a sticky CUDA error"
    assert r.state is ModelState.UNHEALTHY and "escalated to a restart" in r.states.get(MODEL).cause  # type: ignore[union-attr]
    assert r.escalation.active is not None and r.escalation.active.evidence.value == "sticky_error"  # type: ignore[union-attr]
    assert "sticky_error" in (r.escalation.problem() or "")
    assert r.metric("triton_sidecar_restart_escalations_total", cause="sticky_error") == 1
    assert not r.metric("triton_sidecar_heal_attempts_total", model=MODEL, result="failure")
    [event] = [e for e in logs if e["event"] == "escalated_to_restart"]
    assert event["models"] == [MODEL] and STICKY in event["error"], event
    asked = r.prober.asked
    await passes(r, 3)
    assert r.prober.asked == asked, "a model waiting for the restart is neither probed nor reloaded"


async def test_a_pattern_of_ones_own_names_a_process_fault_too():
    r = rig([passed(), triton_error("XID 79: GPU has fallen off the bus")],
            healing={"process_fault_patterns": ("fallen off the bus",)})
    await passes(r, 5)
    assert r.repository.calls == [] and r.escalation.active is not None


@pytest.mark.parametrize("round_", [failed(), not_ready(), triton_error("features must be finite numbers", 400)],
                         ids=["wrong answer", "not ready", "a model's own error"])
async def test_a_models_own_fault_alone_still_heals_by_reload(round_):
    r = rig([passed(), round_])
    await passes(r, 5)
    assert r.repository.calls[:2] == ["unload", "load"] and r.escalation.active is None
    assert r.metric("triton_sidecar_restart_escalations_total", cause="breadth") == 0
    assert r.metric("triton_sidecar_restart_escalations_total", cause="sticky_error") == 0


async def test_a_cuda_error_that_survives_a_reload_escalates_after_that_one_reload():
    cuda = "CUDA error: out of memory"  # not sticky by itself: a reload may help, once
    r = rig([passed(), triton_error(cuda)], verify=[triton_error(cuda)], healing={"max_attempts": 3})
    await passes(r, 5)
    assert r.repository.calls == ["unload", "load"], "one reload, not max_attempts"
    assert r.escalation.active is not None and r.escalation.active.evidence.value == "history"  # type: ignore[union-attr]
    assert r.state is ModelState.UNHEALTHY
    assert not r.metric("triton_sidecar_escalations_total", model=MODEL), "not FAILED: the model is not at fault"


async def test_within_the_cooldown_other_evidence_goes_the_reload_ladder_and_the_same_evidence_escalates(tmp_path):
    clock = FakeClock()
    record = EscalationRecord.open(str(tmp_path / "escalations.json"), wall=lambda: clock.now)
    record.add(PastEscalation(at=clock.now - 60, cause="before the restart", evidence="sticky_error",
                              signature="sticky: device-side assert triggered", models=(MODEL,)))
    reopened = EscalationRecord.open(str(tmp_path / "escalations.json"), wall=lambda: clock.now)
    assert reopened.count == 1 and reopened.last is not None and reopened.last.evidence == "sticky_error"

    r = rig([passed(), triton_error(STICKY)], record=reopened, healing={"escalation_cooldown_s": 600})
    assert r.metric("triton_sidecar_restart_escalations_total", cause="sticky_error") == 1, "carried over"
    with capture_logs() as logs:
        await passes(r, 5)
    assert "escalation_held_by_cooldown" in [e["event"] for e in logs]
    assert r.repository.calls[:2] == ["unload", "load"] and r.escalation.active is None

    again = rig([passed(), triton_error("CUDA error: device-side assert triggered")], record=reopened,
                healing={"escalation_cooldown_s": 600})
    await passes(again, 5)
    assert again.repository.calls == [] and again.escalation.active is not None, "the same evidence is back"
    assert EscalationRecord.open(str(tmp_path / "escalations.json")).count == 2


async def test_tritons_verdict_on_a_dead_stub_makes_it_the_models_own_fault_even_when_another_model_timed_out():
    timed_out = RoundResult(MODEL, (ProbeResult(GOLDEN, False, 0.3, "no answer within 0.3 s", "normal", True),))
    r = rig([passed(), timed_out, passed()], probes={"failure_threshold": 5}, others=("other",))
    r.escalation.judged("other", Failure("other", r.clock.now, NO_ANSWER, "no answer within 0.3 s"))
    await passes(r, 2)
    assert r.state is ModelState.DEGRADED
    r.supervisor.tell(LateVerdict(StubUnhealthy(500, "Stub process 'm_0_0' is not healthy.")))
    await r.supervisor.wait(0)  # hears the event
    assert r.state is ModelState.UNHEALTHY
    await passes(r, 1)
    assert r.repository.calls[:2] == ["unload", "load"] and r.escalation.active is None


def test_breadth_device_and_history_verdicts():
    def failure(model: str, message: str, at: float = 10.0) -> Failure:
        found = failure_of(model, triton_error(message.replace("{m}", model), model=model), at=at)
        assert found is not None
        return found

    shared = "Failed to process the request(s) for model '{m}_0_0', message: RuntimeError: backend lost"
    a, b, c = failure("a", shared), failure("b", shared), failure("c", shared, at=2.0)
    assert a.signature == b.signature and "<model>" in a.signature
    latest = {"a": a, "b": b, "c": c, "d": None}
    verdict = judge(a, latest, since=9.0, window_s=5.0, min_models=2, devices={})
    assert verdict.evidence is Evidence.BREADTH and verdict.models == ("a", "b"), "c failed too long before"
    assert judge(a, latest, since=9.0, window_s=5.0, min_models=3, devices={}).evidence is None
    on_gpu0 = {"a": frozenset({"gpu:0"}), "b": frozenset({"gpu:0"}), "d": frozenset({"gpu:1"})}
    by_device = judge(a, latest, since=9.0, window_s=5.0, min_models=3, devices=on_gpu0)
    assert by_device.evidence is Evidence.DEVICE and by_device.models == ("a", "b")
    assert judge(a, {"a": a}, since=9.0, window_s=5.0, min_models=2, devices={}).evidence is None
    assert devices_of({"instance_group": [{"kind": "KIND_GPU", "gpus": [0, 1]}, {"kind": "KIND_CPU"}]}) == {
        "gpu:0", "gpu:1", "cpu"}

    cuda = failure("a", "CUDA error: out of memory")
    assert judge_after_reload(cuda, failure("a", "CUDA error: out of memory")) is not None
    assert judge_after_reload(cuda, failure("a", "something else")) is None
    assert judge_after_reload(failure("a", "model file corrupted"), failure("a", "model file corrupted")) is None


@pytest.mark.parametrize("golden, listed, index, released", [
    (False, (), [], True),  # no golden files, gone from Triton: unloaded on purpose
    (False, (), [{"name": MODEL, "state": "READY"}], False),  # still READY: broken, heal it
    (True, (), [], False),  # golden files: always healed
    (False, (MODEL,), [], False),  # listed in the config: always healed
])
async def test_release_or_heal(golden, listed, index, released):
    r = rig([passed(), not_ready()], golden=golden, models=listed, repository=ScriptedRepository(index),
            probes={"failure_threshold": 1})
    outcome = await passes(r, 2)
    assert outcome[-1] == (UNLOADED_ON_PURPOSE if released else None)
    assert (r.repository.calls == []) is released


async def test_a_repository_that_does_not_answer_means_heal_not_release():
    r = rig([passed(), not_ready()], golden=False, models=(), repository=ScriptedRepository(index_fails=True),
            probes={"failure_threshold": 1})
    assert await r.supervisor.unloaded_on_purpose() is False


# -- watchdog and supervised tasks ------------------------------------------------------------------------


async def test_the_heartbeat_moves_with_completed_rounds_only():
    r = rig([passed()])
    r.clock.now += 61.0
    assert r.supervisor.stalled_for() == pytest.approx(61.0)
    await passes(r, 1)
    r.supervisor.beat()
    assert r.supervisor.stalled_for() == 0.0


async def test_a_supervisor_that_completes_no_round_fails_liveness_with_the_model_named(tmp_path):
    clock = FakeClock()
    base = SidecarConfig()
    config = replace(base, golden_dir=tmp_path, models=(MODEL, "other"),
                     liveness=replace(base.liveness, triton_unreachable_grace_s=3600.0))
    triton = TritonClient("http://127.0.0.1:9", timeout_s=1.0)  # never called: nothing is started
    try:
        app = create_app(config, triton=triton, golden={}, clock=clock)
        roster = app[ROSTER]
        for model in (MODEL, "other"):
            app[STATES].track(model)
            roster.supervisors.add(ModelSupervisor(model, states=app[STATES], prober=app[PROBER], healer=app[HEALER],
                                                   escalation=app[ESCALATION], triton=triton, metrics=app[METRICS],
                                                   config=lambda: config,
                                                   cases_for=lambda m: (), clock=clock))
        assert liveness_problems(app) == []
        clock.now += config.liveness.watchdog_stall_s - 1
        roster.supervisors.get("other").beat()  # type: ignore[union-attr]
        app[WATCH].last_tick = clock.now  # the watch too keeps ticking: only one supervisor is stuck
        clock.now += 2
        crashing = roster.supervisors.get(MODEL)
        crashing.crashes.in_a_row, crashing.crashes.last_error = 3, "KeyError: 'inputs'"  # type: ignore[union-attr]
        problems = liveness_problems(app)
        assert len(problems) == 1, problems
        assert f"model {MODEL}: probe loop stalled" in problems[0] and "KeyError: 'inputs'" in problems[0]
    finally:
        await triton.close()


async def test_a_crashing_task_is_logged_counted_and_restarted_with_growing_backoff():
    clock = FakeClock()
    registry = CollectorRegistry()
    record = CrashRecord()
    runs = 0

    async def run() -> str:
        nonlocal runs
        runs += 1
        if runs <= 8:
            raise KeyError("inputs")
        return "released"

    with capture_logs() as logs:
        result = await supervise(run, kind="supervisor", name="supervisor:m", metrics=SidecarMetrics(registry),
                                 record=record, clock=clock, sleep=clock.sleep)
    assert result == "released" and runs == 9
    assert clock.slept == [crash_backoff(n) for n in range(1, 9)]
    assert clock.slept[:3] == [0.1, 0.2, 0.4] and clock.slept[-1] == CRASH_BACKOFF_MAX_S
    assert registry.get_sample_value("triton_sidecar_task_crashes_total", {"task": "supervisor"}) == 8
    crashes = [e for e in logs if e["event"] == "task_crashed"]
    assert len(crashes) == 8 and crashes[0]["error"] == "KeyError" and crashes[0]["exc_info"] is not None
    assert record.crashes == 8 and record.last_error == "KeyError: 'inputs'"
    record.recovered()
    assert record.in_a_row == 0


async def test_cancelling_a_supervised_task_is_not_a_crash():
    registry = CollectorRegistry()
    task = asyncio.create_task(supervise(lambda: asyncio.sleep(3600), kind="reload", name="reload-files",
                                         metrics=SidecarMetrics(registry)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert registry.get_sample_value("triton_sidecar_task_crashes_total", {"task": "reload"}) == 0


async def test_a_connect_failure_reported_by_traffic_stands_until_the_next_check():
    class Answers:
        async def server_live(self, timeout_s: float | None = None) -> bool:
            return True

        async def server_ready(self, timeout_s: float | None = None) -> bool:
            return True

    clock = FakeClock()
    watch = TritonWatch(triton=Answers(), settings=SidecarConfig().probes,  # type: ignore[arg-type]
                        metrics=SidecarMetrics(CollectorRegistry()), clock=clock)
    await watch.check()
    assert watch.ready and watch.live
    clock.now += 1
    watch.mark_unreachable("proxied request could not connect")
    assert not watch.ready and not watch.live and watch.detail == "proxied request could not connect"
    clock.now += 1
    await watch.check()
    assert watch.ready and watch.detail == "ready"


# -- rounds paced by traffic: the count ------------------------------------------------------------------


def _count(cases: list[str], served: dict[tuple[str, str], int], *, default: str = "2",
           loaded: tuple[str, ...] = ("1", "2")) -> TrafficCount:
    health = ModelHealth(MODEL, failure_threshold=3, success_threshold=1)
    health.default_version, health.loaded_versions = default, loaded
    golden = [SimpleNamespace(version=v) for v in cases]
    return TrafficCount(MODEL, lambda model, version: served.get((model, version), 0),
                        cases_for=lambda model: golden,  # type: ignore[arg-type,return-value]
                        health=lambda: health, clock=FakeClock())


def test_unversioned_cases_count_every_request_the_model_served():
    served = {(MODEL, ""): 100}
    count = _count([""], served)
    assert count.since() is None, "no round has begun: nothing counted yet"
    count.mark()
    served[(MODEL, "")] = 130
    assert count.since() == 30


def test_each_version_with_cases_of_its_own_counts_its_own_requests():
    """v1 pinned by a few clients, the rest unversioned (Triton's default, v2): a round is due when
    either version with golden cases has served N, not when the model has."""
    served = {(MODEL, ""): 100, (MODEL, "1"): 10}
    count = _count(["1", "2"], served)
    count.mark()
    served[(MODEL, "")], served[(MODEL, "1")] = 150, 15  # 5 more to v1 by name, 45 unversioned to v2
    assert count.since() == 45
    served[(MODEL, "")], served[(MODEL, "1")] = 210, 75  # 60 more to v1, none to v2
    assert count.since() == 65


def test_the_next_look_is_aimed_at_the_nth_request_from_the_rate_seen():
    clock = FakeClock()
    served = {(MODEL, ""): 0}
    count = _count([""], served)
    count._clock = clock  # type: ignore[attr-defined]
    count.mark()
    assert count.next_look(50, 0) == POLL_IDLE_S, "no request yet: the idle look"
    clock.now += 0.01
    served[(MODEL, "")] = 20  # 2,000 req/s: 30 more in 15 ms
    assert count.next_look(50, count.since()) == pytest.approx(0.015)
    clock.now += 0.015
    assert count.next_look(50, 49) == POLL_MIN_S


def test_request_counters_read_the_counters_metrics_exports_without_adding_series():
    registry = CollectorRegistry()
    metrics = SidecarMetrics(registry)
    counters = RequestCounters(metrics)
    assert counters.served(MODEL) == 0 and counters.served(MODEL, "1") == 0
    assert registry.get_sample_value("triton_sidecar_proxy_requests_total",
                                     {"protocol": "http", "model": MODEL, "code": "200"}) is None
    for protocol, code, times in (("http", "200", 3), ("grpc", "OK", 2), ("http", "400", 7)):  # 400: not served
        for _ in range(times):
            metrics.requests.finish(protocol, MODEL, code, 0.002)
    for reason, times in (("pinned", 2), ("shadow", 9)):  # shadow: the sidecar's own copies
        for _ in range(times):
            metrics.requests.routed(MODEL, "1", reason)
    assert counters.served(MODEL) == 5 and counters.served(MODEL, "1") == 2
