"""One model's supervisor: the only writer of the model's state, as a Kubernetes controller's
reconcile loop is of its object.

Each pass (`reconcile`) runs one probe round, applies it to the state machine, and when the model is
UNHEALTHY decides: release it (no golden files and Triton no longer has it READY: its owner unloaded
it on purpose) or heal it (the healer's unload, load and verify, awaited here; the outcome is applied
here). Everything else reaches the supervisor as an event on its queue (`tell`): passive signals from
traffic and changed golden files bring the next round forward, Triton's late verdict on a golden
request is a final failure, a dead stub seen by traffic is a fact the healer needs at once.

Schedule: rounds start every `probes.interval_s` (± jitter), start to start. A failed round is
confirmed at once: the next round starts after a few milliseconds, not an interval, so a model
crosses `failure_threshold` (consecutive failed rounds) within the time its probes take; while that
confirmation runs the model is flagged SUSPECT (`ModelStates.set_suspect`). A passing confirmation
returns to the normal schedule. With `probes.every_requests` a round also starts as soon as the model
has served that many live requests since its last round began (sidecar.health.traffic_pace), never
sooner than `probes.min_interval_s` after it; rounds run one at a time, in this loop only.

Before healing, the supervisor asks whose fault it is (sidecar.health.escalation, fault_scope): a
fault of Triton's process (a sticky CUDA error, the same error in several models at once, the same
CUDA error after a reload) is not reloaded: it is escalated to a restart of Triton, and the model
waits for it, UNHEALTHY, with a cause naming the evidence.

Heartbeat: `last_round_at` is the clock time of the last completed pass (and, during a heal, of the
last check that the heal still runs): a supervisor that has not completed one for
`liveness.watchdog_stall_s` (stuck, or crashing at every round) fails /healthz with the model named.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import structlog

from sidecar.config import SidecarConfig
from sidecar.golden.cases import GoldenCase
from sidecar.health.escalation import RestartEscalation
from sidecar.health.fault_scope import Failure, Verdict, judge_after_reload
from sidecar.health.healer import Healer, HealOutcome
from sidecar.health.probe_round import RoundResult, probe_events, round_attributes
from sidecar.health.prober import Prober
from sidecar.health.tasks import CrashRecord
from sidecar.health.traffic_pace import ServedRequests, TrafficCount
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import StubUnhealthy, TritonError, TritonUnavailable
from sidecar.states import ModelHealth, ModelState, ModelStates
from sidecar.tracing.spans import NO_SPAN, NO_SPANS, HealthSpans

log = structlog.get_logger("sidecar.probes")


#: Longest delay (s) before a confirmation round: a few milliseconds of jitter so that models that
#: failed together (Triton busy) do not confirm in lockstep; short against any probe interval.
CONFIRM_JITTER_MAX_S = 0.01


#: Why a round started (the values of triton_sidecar_probe_rounds_total's cause, sidecar.metrics.ROUND_CAUSES).
TIME, TRAFFIC, CONFIRMATION, EVENT = "time", "traffic", "confirmation", "event"


#: Release cause for a model its owner unloaded (no golden files, no longer READY in Triton).
UNLOADED_ON_PURPOSE = ("no longer READY in Triton and has no golden files: taken as unloaded on purpose, "
                       "not reloaded")


@dataclass(frozen=True)
class ProbeSoon:
    """Run the next round now (passive signal from traffic, golden files changed)."""

    cause: str


@dataclass(frozen=True)
class LateVerdict:
    """Triton declared the stub dead in answer to a golden request whose probe had given up."""

    error: StubUnhealthy


@dataclass(frozen=True)
class StubDead:
    """Traffic was told by Triton that the model's stub died."""


Event = ProbeSoon | LateVerdict | StubDead


class ModelSupervisor:
    """Owns one model's state: runs its probe rounds, decides heal or release, hears its events."""

    def __init__(
        self,
        model: str,
        *,
        states: ModelStates,
        prober: Prober,
        healer: Healer,
        escalation: RestartEscalation,
        triton: TritonClient,
        metrics: SidecarMetrics,
        config: Callable[[], SidecarConfig],
        cases_for: Callable[[str], Sequence[GoldenCase]],
        clock: Callable[[], float],
        rng: random.Random | None = None,
        served: ServedRequests | None = None,
        spans: HealthSpans = NO_SPANS,
    ) -> None:
        """`spans`: each probe round as a trace (sampled by tracing.sample_rate): the round and its
        verdict, with the state change and log events it causes inside the span."""
        self.model = model
        self._spans = spans
        self._states = states
        self._prober = prober
        self._healer = healer
        self._escalation = escalation
        self._triton = triton
        self._metrics = metrics
        self._config = config
        self._cases_for = cases_for
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - schedule jitter, not secrets
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.crashes = CrashRecord()
        #: clock() of the last completed pass: the watchdog's per-model heartbeat. Starts at creation,
        #: so the first round (a model still loading) has the whole stall bound.
        self.last_round_at = clock()
        #: The last round failed and the next one confirms it at once.
        self.confirming = False
        #: Why the last round started (TIME, TRAFFIC, CONFIRMATION, EVENT); None before the first.
        self.last_round_cause: str | None = None
        #: Live requests since the last round began (None: the app counts no traffic for the health loop).
        self.traffic = None if served is None else TrafficCount(
            model, served, cases_for=prober.cases_for, health=self._health, clock=clock)
        #: The latest failed round's evidence, for the verdict before a heal.
        self._failure: Failure | None = None
        #: The model waits, UNHEALTHY, for the restart an escalation asked for.
        self._held = False

    # -- events -----------------------------------------------------------------------------------------

    def tell(self, event: Event) -> None:
        """An event for this model. A dead stub is noted for the healer at once, not queued: a heal
        under way polls it to stop waiting for an unload that never finishes."""
        if isinstance(event, StubDead | LateVerdict):
            self._healer.note_stub_dead(self.model)
            # Triton's verdict on this model's own stub: whatever the round saw (often a timeout, which
            # several models may share), the fault is the model's, and a reload heals it.
            self._failure = Failure(self.model, self._clock(), "", "Triton declared the model's stub process dead")
        if not isinstance(event, StubDead):
            self._events.put_nowait(event)

    def _handle(self, event: Event) -> bool:
        """Apply one queued event; True when the next pass should start now."""
        if isinstance(event, LateVerdict):
            health = self._health()
            if health.state in (ModelState.HEALING, ModelState.FAILED):
                return False  # about an instance a heal replaces anyway (noted for the healer by tell)
            error = event.error
            self._failed(f"golden request, answered late: Triton answered {error.status}: {error.message}",
                         final=True)
            return True
        return isinstance(event, ProbeSoon)

    def _discard_events(self) -> None:
        """Events queued during a heal were about the instance it replaced."""
        while not self._events.empty():
            self._events.get_nowait()

    # -- the loop ---------------------------------------------------------------------------------------

    async def run(self) -> str | None:
        """Reconcile until cancelled; returns the cause when the model is to be released, None when
        its heal was stopped from outside (the sidecar is stopping)."""
        self._states.apply(self.model, lambda h, now: h.begin_warmup(now))
        # Spread the first rounds too, so 100 models don't all fire at start-up.
        probes = self._config().probes
        await self.wait(self._rng.uniform(0, probes.interval_s * probes.jitter))
        cause = TIME
        while True:
            started = self._clock()
            release = await self.reconcile(cause)
            if release is not None:
                return release or None
            self.beat()
            woken_by = await self.wait(self.next_delay(started))
            cause = CONFIRMATION if self.confirming else woken_by

    def beat(self) -> None:
        """A pass completed: the heartbeat moves and any crash streak is over."""
        self.last_round_at = self._clock()
        self.crashes.recovered()

    def stalled_for(self) -> float:
        """Seconds since the last completed pass."""
        return self._clock() - self.last_round_at

    def next_delay(self, started: float) -> float:
        """Seconds until the next pass: at once (a few ms) to confirm a failed round, else the rest
        of the interval, start to start (a slow round does not stretch the time to detect)."""
        if self.confirming:
            return self._rng.uniform(0, min(CONFIRM_JITTER_MAX_S, self._config().probes.interval_s / 10))
        probes = self._config().probes
        wait = probes.interval_s * self._rng.uniform(1 - probes.jitter, 1 + probes.jitter)
        return max(0.0, wait - (self._clock() - started))

    async def wait(self, seconds: float) -> str:
        """Sleep `seconds`, handling events as they come; ends early on an event that asks to (EVENT)
        or, with `probes.every_requests`, once the model has served that many requests since its last
        round began and `probes.min_interval_s` has passed since (TRAFFIC); else TIME."""
        deadline = self._clock() + seconds
        while True:
            now = self._clock()
            timeout, until_deadline = deadline - now, True
            every = self._paced_every()
            if every:
                assert self.traffic is not None
                since = self.traffic.since() or 0
                if since >= every:
                    floor_at = self.traffic.marked_at + self._config().probes.min_interval_s
                    if now >= floor_at:
                        return TRAFFIC
                    look = floor_at - now  # due: start at the floor, not before
                else:
                    look = self.traffic.next_look(every, since)
                if look < timeout:
                    timeout, until_deadline = look, False
            try:
                async with asyncio.timeout(max(0.0, timeout)):
                    event = await self._events.get()
            except TimeoutError:
                if until_deadline:
                    return TIME
                continue
            if self._handle(event):
                return EVENT

    def _paced_every(self) -> int:
        """probes.every_requests while traffic paces this model's rounds now, else 0: pacing is off,
        a confirmation is due (it does not wait), no round ran yet, or no golden case to run."""
        every = self._config().probes.every_requests
        traffic = self.traffic
        if not every or traffic is None or self.confirming or not traffic.counting or not traffic.probed:
            return 0
        return every

    def requests_since_round(self) -> int | None:
        """Live requests served since the last round began (None: not counted, or no round yet)."""
        return None if self.traffic is None else self.traffic.since()

    async def reconcile(self, cause: str = TIME) -> str | None:
        """One pass: probe (unless the model is already judged), then heal or release an UNHEALTHY
        model. Returns a release cause, "" when a heal was stopped from outside, else None.
        `cause`: why this pass runs (counted when it runs a round)."""
        if self._health().state is ModelState.FAILED:
            return None  # terminal until a restart: nothing to probe or heal
        if self._awaits_restart():
            return None
        if not (self._health().state is ModelState.UNHEALTHY and self._healer.allowed):
            self._round_begins(cause)
            with self._spans.probe_round(self.model, cause) as span:
                result = await self._prober.run_round(self.model)
                if span is not NO_SPAN:  # tracing off: no attributes built only to be dropped
                    span.set(round_attributes(result))
                    for name, attributes in probe_events(result):
                        span.event(name, attributes)
                    if not result.ok:
                        span.failed(result.cause)
                self.apply_round(result)
        if self._health().state is not ModelState.UNHEALTHY or not self._healer.allowed:
            return None
        if self._awaits_restart():
            return None
        if await self.unloaded_on_purpose():
            return UNLOADED_ON_PURPOSE
        if await self._escalated():
            return None
        outcome = await self._heal()
        return "" if outcome is None else None

    def _round_begins(self, cause: str) -> None:
        """Count live requests from here, and say why this round runs (/status, metrics)."""
        if self.traffic is not None:
            self.traffic.mark()
        self.last_round_cause = cause
        self._metrics.probe_rounds.labels(model=self.model, cause=cause).inc()

    # -- judging a round --------------------------------------------------------------------------------

    def apply_round(self, result: RoundResult) -> None:
        """A round's verdict on the state machine, and whether it needs confirming."""
        if not result.conclusive:
            # Triton itself is down: the liveness grace handles that, not the healer; and
            # confirming at once would only spin against a server that does not answer.
            self.confirming = False
            self._states.set_suspect(self.model, False)
            return
        health = self._health()
        if result.versions:
            health.default_version = result.default_version
            health.loaded_versions = result.versions
        failure = self._escalation.failure_of(self.model, result)
        self._escalation.judged(self.model, failure)
        if failure is not None:
            self._failure = failure
        if result.ok:
            self._states.apply(self.model, lambda h, now: h.probe_passed(now))
            self._judged()
            return
        failed = next(r for r in result.results if not r.ok)
        log.warning("probe_failed", model=self.model, probe=failed.probe, case=failed.case or None,
                    final=result.final, cause=result.cause, duration_ms=round(failed.duration_s * 1000, 1))
        self._failed(result.cause, final=result.final, versions=result.broken_versions)

    def _failed(self, cause: str, *, final: bool, versions: frozenset[str] = frozenset()) -> None:
        if final:
            self._healer.note_stub_dead(self.model)
        self._states.apply(self.model, lambda h, now: h.probe_failed(cause, now, final=final, versions=versions))
        self._judged()

    def _judged(self) -> None:
        health = self._health()
        self._metrics.consecutive_failures.labels(model=self.model).set(health.consecutive_failures)
        self.confirming = health.consecutive_failures > 0 and not health.state.quarantined
        if self.confirming and not health.suspect:
            log.info("probe_confirming", model=self.model, consecutive_failures=health.consecutive_failures,
                     failure_threshold=health.failure_threshold)
        self._states.set_suspect(self.model, self.confirming)

    # -- reload or restart ------------------------------------------------------------------------------

    def _awaits_restart(self) -> bool:
        """An escalation stands and the model is UNHEALTHY: it waits for the restart, which reloads every
        model, instead of being reloaded (or probed) now."""
        active = self._escalation.active
        if active is None or self._health().state is not ModelState.UNHEALTHY:
            return False
        if not self._held:
            self._escalation.join(self.model)
            self._hold(f"not reloaded: Triton restarts for a process-level fault ({active.cause}); "
                       f"this model failed with: {self._health().cause}")
        return True

    async def _escalated(self) -> bool:
        """Ask whose fault it is; a process-level fault is escalated (True: the model waits for the
        restart), unless the cooldown refuses it (False: the reload ladder, as for a model's fault)."""
        failure = self._failure
        if failure is None:
            return False
        since = self._health().first_failure_at or failure.at
        verdict = await self._escalation.verdict(failure, since)
        log.info("fault_judged", model=self.model, scope="process" if verdict.process else "model",
                 evidence=verdict.evidence.value if verdict.evidence else None, models=list(verdict.models),
                 cause=verdict.cause)
        if not verdict.process or not self._escalation.escalate(verdict):
            return False
        self._hold_for(verdict)
        return True

    def _hold_for(self, verdict: Verdict) -> None:
        active = self._escalation.active
        assert active is not None
        if active is verdict:
            cause = f"escalated to a restart of Triton, no reload (evidence: {verdict.evidence.value}): {verdict.cause}"  # type: ignore[union-attr]
        else:
            cause = f"not reloaded: Triton restarts for a process-level fault ({active.cause})"
        self._hold(cause)

    def _hold(self, cause: str) -> None:
        self._held = True
        self._states.apply(self.model, lambda h, now: h.await_restart(cause, now))

    def _reload_cannot_help(self) -> tuple[Callable[[RoundResult], bool] | None, list[Verdict]]:
        """The healer's `stop_if` for this heal: the reloaded model failed as before with a CUDA error
        (history) and the cooldown lets that escalate. The verdict is kept in the list it returns."""
        before = self._failure
        found: list[Verdict] = []
        if before is None or not before.signature:
            return None, found

        def stop_if(result: RoundResult) -> bool:
            after = self._escalation.failure_of(self.model, result)
            verdict = judge_after_reload(before, after) if after is not None else None
            if verdict is None or not (self._escalation.active is not None or self._escalation.allows(verdict)):
                return False
            found.append(verdict)
            return True

        return stop_if, found

    # -- heal or release --------------------------------------------------------------------------------

    async def unloaded_on_purpose(self) -> bool:
        """An UNHEALTHY model without golden files that Triton no longer has READY was unloaded by its
        owner (deleting a model's golden files is how an owner retires it): release, do not reload.
        Asked here, before a heal, because the roster's periodic look would race the heal's reload."""
        if self._cases_for(self.model) or self._config().models:
            return False
        try:
            index = await self._triton.repository_index()
        except (TritonUnavailable, TritonError):
            return False  # cannot tell: heal, as for any model
        return not any(e.get("name") == self.model and e.get("state") == "READY" for e in index)

    async def _heal(self) -> HealOutcome | None:
        """Heal and apply the outcome; None when the heal was stopped from outside."""
        cause = self._health().cause
        self._states.apply(self.model, lambda h, now: h.heal_started(f"healing after: {cause}", now))
        stop_if, history = self._reload_cannot_help()
        task = self._healer.start_heal(self.model, cause, stop_if=stop_if)
        try:
            while True:
                # A heal takes up to minutes (load_timeout_s): progress, not a stall, while it runs.
                done, _ = await asyncio.wait({task}, timeout=self._config().probes.interval_s)
                if done:
                    break
                self.beat()
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.cancelled():
            return None
        outcome = task.result()
        self._discard_events()
        if outcome.healed:
            self._states.apply(self.model, lambda h, now: h.heal_succeeded(outcome.cause, now))
        elif outcome.stopped_after is not None and history and self._escalation.escalate(history[0]):
            self._hold_for(history[0])
        else:
            self._states.apply(self.model, lambda h, now: h.fail(outcome.cause, now))
        self._judged()
        return outcome

    def _health(self) -> ModelHealth:
        return self._states.track(self.model)


class Supervisors:
    """The running supervisors by model (the roster adds and removes them), and the address every
    event for a model goes to; an event for a model no longer guarded is dropped."""

    def __init__(self) -> None:
        self._by_model: dict[str, ModelSupervisor] = {}

    def add(self, supervisor: ModelSupervisor) -> None:
        self._by_model[supervisor.model] = supervisor

    def remove(self, model: str) -> None:
        self._by_model.pop(model, None)

    def get(self, model: str) -> ModelSupervisor | None:
        return self._by_model.get(model)

    def __iter__(self) -> Iterator[ModelSupervisor]:
        return iter(list(self._by_model.values()))

    def tell(self, model: str, event: Event) -> None:
        supervisor = self._by_model.get(model)
        if supervisor is not None:
            supervisor.tell(event)

    def probe_soon(self, model: str, cause: str) -> None:
        self.tell(model, ProbeSoon(cause))

    def stub_dead(self, model: str) -> None:
        self.tell(model, StubDead())

    def late_verdict(self, model: str, error: StubUnhealthy) -> None:
        self.tell(model, LateVerdict(error))

