"""Probe rounds: ask Triton what a user would, and record the answers. Judging them (the state
machine) is the model supervisor's (sidecar.health.supervisor): this module writes no model state.

One round for a model is (a) server ready, (b) model ready and its metadata declares the inputs and
outputs the golden requests use, (c) every golden case: infer and compare. Each call is bounded by
`probes.timeout_s`; each model has its own supervisor, so a hung model never delays another's probes.

A golden request that outlives its probe's bound is not cancelled (`LateAnswers`): Triton needs about
a second to say that a python stub died, and that verdict, whenever it comes, goes to the model's
supervisor (`on_late_verdict`) as a final failure. While such a request is still unanswered, the next
round waits for it one interval more instead of queueing another request behind it: a hung model
fails its rounds at the probe interval, so the diagnosis does not depend on `timeout_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from sidecar.config import ProbesSection
from sidecar.golden.cases import GoldenCase
from sidecar.health.late_answers import LateAnswers
from sidecar.health.probe_round import GOLDEN, ProbeResult, RoundResult, probe_model
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import StubUnhealthy

log = structlog.get_logger("sidecar.probes")


@dataclass
class ProbeRecord:
    """What /status shows of a model's probes."""

    last_round: RoundResult | None = None
    rounds: int = 0
    last_by_probe: dict[str, ProbeResult] = field(default_factory=dict)
    #: The round's notes were logged (once per model).
    noted: bool = False


class Prober:
    """Runs probe rounds and records them (metrics, /status); shared by every model's supervisor."""

    def __init__(
        self,
        *,
        triton: TritonClient,
        cases_for: Callable[[str], Sequence[GoldenCase]],
        settings: ProbesSection,
        metrics: SidecarMetrics,
        on_late_verdict: Callable[[str, StubUnhealthy], None] = lambda model, error: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._triton = triton
        self.cases_for = cases_for
        self._settings = settings
        self._metrics = metrics
        self._late = LateAnswers(interval_s=settings.interval_s, on_final=on_late_verdict, clock=clock)
        self.records: dict[str, ProbeRecord] = {}
        #: Each probe's counter and duration series, looked up once: prometheus_client's `labels()`
        #: checks its arguments and takes a lock on every call, a dozen times a round (issue 30's
        #: idle CPU). These families are never pruned (SidecarMetrics.forget_model keeps counters).
        self._series: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def reconfigure(self, settings: ProbesSection) -> None:
        """Settings from a reloaded config: used from each model's next round on."""
        self._settings = settings

    def unanswered_for(self, model: str) -> float | None:
        """Seconds the model's last golden request has gone unanswered past its probe, or None."""
        return self._late.unanswered_for(model)

    async def close(self) -> None:
        await self._late.close()

    async def run_round(self, model: str) -> RoundResult:
        """One round, recorded in metrics and /status; judging it is the caller's."""
        result = await probe_model(self._triton, model, self.cases_for(model), timeout_s=self._settings.timeout_s,
                                   stop_at_first_failure=True, late=self._late)
        record = self.records.setdefault(model, ProbeRecord())
        record.last_round, record.rounds = result, record.rounds + 1
        if result.notes and not record.noted:
            record.noted = True  # once per model: the same metadata would repeat it every round
            log.warning("probe_metadata_incomplete", model=model, notes=list(result.notes))
        for probe in result.results:
            record.last_by_probe[probe.probe if not probe.case else f"{GOLDEN}:{probe.case}"] = probe
            counted, timed = self._series_of(model, probe.probe, probe.result)
            counted.inc()
            timed.observe(probe.duration_s)
        return result

    def _series_of(self, model: str, probe: str, result: str) -> tuple[Any, Any]:
        key = (model, probe, result)
        series = self._series.get(key)
        if series is None:
            series = (self._metrics.probes.labels(model=model, probe=probe, result=result),
                      self._metrics.probe_duration.labels(model=model, probe=probe))
            self._series[key] = series
        return series

    async def verify_round(self, model: str) -> RoundResult:
        """The healer's proof after a reload: a request still open on the replaced instance says
        nothing about the new one, so it is dropped first."""
        self._late.forget(model)
        return await self.run_round(model)
