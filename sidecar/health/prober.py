"""Probes: ask Triton what a user would, and judge the answers.

One round for a model is (a) server ready, (b) model ready and its metadata declares the inputs and
outputs the golden requests use, (c) every golden case: infer and compare. Each call is bounded by
`probes.timeout_s`; each model has its own loop, so a hung model never delays another's probes.

A golden request that outlives its probe's bound is not cancelled (`LateAnswers`): Triton needs about
a second to say that a python stub died, and that verdict, whenever it comes, goes straight to the
state machine as a final failure. While such a request is still unanswered, the next round waits
for it one interval more instead of queueing another request behind it: a hung model fails its
rounds at the probe interval, so the diagnosis does not depend on `timeout_s`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from sidecar.config import ProbesSection
from sidecar.golden.cases import GoldenCase
from sidecar.health.late_answers import LateAnswers
from sidecar.health.probe_round import GOLDEN, ProbeResult, RoundResult, probe_model
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import StubUnhealthy
from sidecar.states import ModelState, ModelStates

log = structlog.get_logger("sidecar.probes")


@dataclass
class ProbeRecord:
    """What /status shows of a model's probes."""

    last_round: RoundResult | None = None
    rounds: int = 0
    last_by_probe: dict[str, ProbeResult] = field(default_factory=dict)
    #: The round's notes were logged (once per model).
    noted: bool = False


RoundListener = Callable[[str, RoundResult], None]


class Prober:
    """Runs one probe loop per model and feeds the results to the state machine."""

    def __init__(
        self,
        *,
        triton: TritonClient,
        states: ModelStates,
        cases: Mapping[str, Sequence[GoldenCase]],
        settings: ProbesSection,
        metrics: SidecarMetrics,
        on_unhealthy: Callable[[str], None],
        on_stub_dead: Callable[[str], None] = lambda model: None,
        rng: random.Random | None = None,
    ) -> None:
        self._triton = triton
        self._states = states
        self._cases = cases
        self._settings = settings
        self._metrics = metrics
        self._on_unhealthy = on_unhealthy
        self._on_stub_dead = on_stub_dead
        self._late = LateAnswers(interval_s=settings.interval_s, on_final=self._late_verdict)
        self._rng = rng or random.Random()  # noqa: S311 - schedule jitter, not secrets
        self._wake: dict[str, asyncio.Event] = {}
        self.records: dict[str, ProbeRecord] = {}
        #: time.monotonic() of the last finished round of any model: the watchdog's heartbeat.
        self.last_tick = time.monotonic()

    def cases_for(self, model: str) -> Sequence[GoldenCase]:
        return self._cases.get(model, ())

    def reconfigure(self, settings: ProbesSection) -> None:
        """Settings from a reloaded config: used from each model's next wait and round on."""
        self._settings = settings

    def unanswered_for(self, model: str) -> float | None:
        """Seconds the model's last golden request has gone unanswered past its probe, or None."""
        return self._late.unanswered_for(model)

    async def close(self) -> None:
        await self._late.close()

    def probe_soon(self, model: str) -> None:
        """Run the model's next round now instead of after its interval (passive signals)."""
        event = self._wake.get(model)
        if event is not None:
            event.set()

    def _next_wait(self) -> float:
        jitter = self._settings.jitter
        return self._settings.interval_s * self._rng.uniform(1 - jitter, 1 + jitter)

    async def run_round(self, model: str) -> RoundResult:
        """One round, recorded in metrics and /status, but not applied to the state machine."""
        result = await probe_model(self._triton, model, self.cases_for(model), timeout_s=self._settings.timeout_s,
                                   stop_at_first_failure=True, late=self._late)
        record = self.records.setdefault(model, ProbeRecord())
        record.last_round, record.rounds = result, record.rounds + 1
        if result.notes and not record.noted:
            record.noted = True  # once per model: the same metadata would repeat it every round
            log.warning("probe_metadata_incomplete", model=model, notes=list(result.notes))
        for probe in result.results:
            record.last_by_probe[probe.probe if not probe.case else f"{GOLDEN}:{probe.case}"] = probe
            self._metrics.probes.labels(model=model, probe=probe.probe, result=probe.result).inc()
            self._metrics.probe_duration.labels(model=model, probe=probe.probe).observe(probe.duration_s)
        self.last_tick = time.monotonic()
        return result

    async def verify_round(self, model: str) -> RoundResult:
        """The healer's proof after a reload: a request still open on the replaced instance says
        nothing about the new one, so it is dropped first."""
        self._late.forget(model)
        return await self.run_round(model)

    def apply_round(self, model: str, result: RoundResult) -> None:
        if not result.conclusive:
            return  # Triton itself is down: the liveness grace handles that, not the healer
        health = self._states.get(model)
        if health is not None and result.versions:
            health.default_version = result.default_version
        if result.ok:
            self._states.apply(model, lambda h, now: h.probe_passed(now))
            self._judged(model)
            return
        failed = next(r for r in result.results if not r.ok)
        log.warning("probe_failed", model=model, probe=failed.probe, case=failed.case or None, final=result.final,
                    cause=result.cause, duration_ms=round(failed.duration_s * 1000, 1))
        self._failed(model, result.cause, final=result.final, versions=result.broken_versions)

    def _late_verdict(self, model: str, error: StubUnhealthy) -> None:
        """Triton's verdict on a request whose probe had given up: judged as if the round had seen it."""
        health = self._states.get(model)
        if health is None or health.state in (ModelState.HEALING, ModelState.FAILED):
            self._on_stub_dead(model)  # a heal under way still learns not to wait for the unload
            return
        self._failed(model, f"golden request, answered late: Triton answered {error.status}: {error.message}",
                     final=True)

    def _failed(self, model: str, cause: str, *, final: bool, versions: frozenset[str] = frozenset()) -> None:
        if final:
            self._on_stub_dead(model)
        self._states.apply(model, lambda h, now: h.probe_failed(cause, now, final=final, versions=versions))
        self._judged(model)

    def _judged(self, model: str) -> None:
        health = self._states.get(model)
        assert health is not None
        self._metrics.consecutive_failures.labels(model=model).set(health.consecutive_failures)
        if health.state is ModelState.UNHEALTHY:
            self._on_unhealthy(model)

    async def run_model(self, model: str) -> None:
        """The model's probe loop: first round at once, then every interval (± jitter)."""
        wake = self._wake.setdefault(model, asyncio.Event())
        self._states.apply(model, lambda h, now: h.begin_warmup(now))
        # Spread the first rounds too, so 100 models don't all fire at start-up.
        await self._sleep_or_wake(wake, self._rng.uniform(0, self._settings.interval_s * self._settings.jitter))
        while True:
            started = time.monotonic()
            health = self._states.get(model)
            if health is not None and health.state not in (ModelState.HEALING, ModelState.FAILED):
                result = await self.run_round(model)
                # A heal may have started while this round ran; its verdict is the healer's.
                if self._states.get(model).state is not ModelState.HEALING:  # type: ignore[union-attr]
                    self.apply_round(model, result)
            else:
                self.last_tick = time.monotonic()
            # Fixed rate, start to start: a slow round (a hang costs timeout_s) does not stretch
            # the time to detect by another interval.
            await self._sleep_or_wake(wake, max(0.0, self._next_wait() - (time.monotonic() - started)))

    @staticmethod
    async def _sleep_or_wake(wake: asyncio.Event, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await wake.wait()
        except TimeoutError:
            pass
        wake.clear()

