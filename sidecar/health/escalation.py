"""The pod's one decision to restart Triton instead of reloading models (a process-level fault).

Each model's supervisor tells this board how each of its rounds ended (`judged`) and, before it would
heal an UNHEALTHY model, asks for the verdict (`verdict`, sidecar.health.fault_scope). Breadth needs
every other model's word: the board asks the supervisors of the models still served to probe now and
waits for their rounds (a few milliseconds; at most `probes.timeout_s` + BREADTH_SLACK_S for a model
that hangs), so a Triton that fails every model is restarted before the first of them is reloaded.

An escalation (`escalate`) holds until the process ends: /healthz fails with its cause, so the kubelet
restarts Triton's container (and the sidecar's, whose liveness probe asks the same /healthz); no model
is reloaded meanwhile, since the restart reloads them all. The board writes no model's state: each
supervisor moves its own (UNHEALTHY, cause naming the restart).

No restart storms: within `healing.escalation_cooldown_s` of the last escalation in the record (which
survives restarts: sidecar.health.escalation_record), a new one needs the same evidence (the same
signature: the same sticky error, the same shared error); other evidence goes the reload ladder, which
ends in FAILED, and a restart, only after `healing.max_attempts`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import structlog

from sidecar.config import SidecarConfig
from sidecar.health.escalation_record import EscalationRecord, PastEscalation
from sidecar.health.fault_scope import Evidence, Failure, Verdict, devices_of, failure_of, judge
from sidecar.health.probe_round import RoundResult
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import TritonError, TritonUnavailable
from sidecar.states import ModelStates

log = structlog.get_logger("sidecar.healer")


#: Added (s) to probes.timeout_s when waiting for the other models' rounds: a round is a few calls of
#: milliseconds besides the one that may hang.
BREADTH_SLACK_S = 0.5


class RestartEscalation:
    """Collects the evidence of every model's rounds; decides, records and announces an escalation."""

    def __init__(
        self,
        *,
        record: EscalationRecord,
        metrics: SidecarMetrics,
        config: Callable[[], SidecarConfig],
        states: ModelStates,
        triton: TritonClient,
        probe_soon: Callable[[str, str], None],
        guarded: Callable[[], Iterable[str]],
        clock: Callable[[], float],
    ) -> None:
        self.record = record
        self._metrics = metrics
        self._config = config
        self._states = states
        self._triton = triton
        self._probe_soon = probe_soon
        self._guarded = guarded
        self._clock = clock
        #: Each model's latest conclusive round: its failure, or None when it passed.
        self._latest: dict[str, Failure | None] = {}
        self._judged_at: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._devices: dict[str, frozenset[str]] = {}
        self._patterns: tuple[tuple[str, ...], tuple[re.Pattern[str], ...]] = ((), ())
        #: The escalation of this process, once decided; it holds until the process ends.
        self.active: Verdict | None = None
        self.active_at: float | None = None
        self._joined: list[str] = []
        for cause, count in record.by_cause.items():
            if cause in {e.value for e in Evidence}:
                # The counter goes on from the record, so a restart does not reset what it counts.
                metrics.restart_escalations.labels(cause=cause).inc(count)

    # -- evidence ---------------------------------------------------------------------------------------

    def failure_of(self, model: str, result: RoundResult) -> Failure | None:
        return failure_of(model, result, at=self._clock(), patterns=self._compiled())

    def judged(self, model: str, failure: Failure | None) -> None:
        """A conclusive round of `model` ended: failed as `failure`, or passed (None)."""
        self._latest[model] = failure
        self._judged_at[model] = self._clock()
        self._changed.set()

    def forget(self, model: str) -> None:
        self._latest.pop(model, None)
        self._judged_at.pop(model, None)
        self._devices.pop(model, None)

    async def verdict(self, failure: Failure, since: float) -> Verdict:
        """Whose fault `failure` is (its model UNHEALTHY since `since`, clock()). A failure that could be
        shared waits for every other served model's round after `since`, asking for them now."""
        settings = self._config()
        window_s = settings.probes.interval_s * (1 + settings.probes.jitter)
        if failure.signature and not failure.sticky:
            await self._hear_the_others(failure.model, since, settings.probes.timeout_s + BREADTH_SLACK_S)
        guarded = set(self._guarded())
        latest = {m: f for m, f in self._latest.items() if m in guarded}
        found = judge(failure, latest, since=since, window_s=window_s,
                      min_models=settings.healing.process_fault_min_models, devices={})
        if found.process or len(found.models) < 2:
            return found
        # Two or more alike, fewer than the minimum: every model of one device may still be all of them.
        devices = await self._devices_of(list(latest))
        return judge(failure, latest, since=since, window_s=window_s,
                     min_models=settings.healing.process_fault_min_models, devices=devices)

    async def _hear_the_others(self, model: str, since: float, bound_s: float) -> None:
        others = [m for m in self._guarded() if m != model and self._served(m)]
        waiting = [m for m in others if self._judged_at.get(m, float("-inf")) < since]
        for other in waiting:
            self._probe_soon(other, f"model {model} failed with an error Triton may give every model: "
                                    "checking whether it is alone")
        deadline = self._clock() + bound_s
        while any(self._judged_at.get(m, float("-inf")) < since and self._served(m) for m in waiting):
            self._changed.clear()
            remaining = deadline - self._clock()
            if remaining <= 0:
                return
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                return

    def _served(self, model: str) -> bool:
        """A model whose rounds still run: not quarantined (an UNHEALTHY or HEALING model's last word is
        already in `_latest`), not FAILED."""
        health = self._states.get(model)
        return health is not None and not health.state.quarantined

    async def _devices_of(self, models: list[str]) -> dict[str, frozenset[str]]:
        for model in models:
            if model in self._devices:
                continue
            try:
                config = await self._triton.model_config(model, timeout_s=self._config().probes.timeout_s)
            except (TritonError, TritonUnavailable) as e:
                log.debug("model_devices_unknown", model=model, cause=str(e))
                continue
            self._devices[model] = devices_of(config)
        return {m: self._devices[m] for m in models if m in self._devices}

    def _compiled(self) -> tuple[re.Pattern[str], ...]:
        patterns = self._config().healing.process_fault_patterns
        if patterns != self._patterns[0]:
            self._patterns = (patterns, tuple(re.compile(p, re.IGNORECASE) for p in patterns))
        return self._patterns[1]

    # -- the decision -----------------------------------------------------------------------------------

    def allows(self, verdict: Verdict) -> bool:
        """May this verdict restart Triton now? Not within the cooldown of the last escalation in the
        record, unless the same evidence is back (restarting again is then still the only remedy, and
        the count shows the restarts do not help)."""
        last = self.record.last
        since = self.record.seconds_since_last()
        cooldown_s = self._config().healing.escalation_cooldown_s
        if last is None or since is None or since >= cooldown_s or last.signature == verdict.signature:
            return True
        log.warning("escalation_held_by_cooldown", model=verdict.model, evidence=verdict.evidence,
                    cause=verdict.cause, last_escalation_s_ago=round(since, 1), cooldown_s=cooldown_s,
                    last_evidence=last.evidence, last_error=last.signature,
                    remedy="the reload ladder (healing.max_attempts, then FAILED)")
        return False

    def escalate(self, verdict: Verdict) -> bool:
        """Restart Triton for `verdict`: True once an escalation stands (this one, or one before it that
        the model joins), False when the cooldown refuses it."""
        if self.active is not None:
            self.join(verdict.model)
            return True
        if verdict.evidence is None or not self.allows(verdict):
            return False
        self.active, self.active_at = verdict, self._clock()
        self.record.add(PastEscalation(at=self.record.wall(), cause=verdict.cause, evidence=verdict.evidence.value,
                                       signature=verdict.signature, models=verdict.models))
        self._metrics.restart_escalations.labels(cause=verdict.evidence.value).inc()
        log.error("escalated_to_restart", models=list(verdict.models), evidence=verdict.evidence.value,
                  error=verdict.error[:300], cause=verdict.cause, restarts_escalated=self.record.count,
                  remedy="/healthz fails: the kubelet restarts Triton's container and the sidecar's")
        return True

    def join(self, model: str) -> None:
        """A model that failed after the escalation: not reloaded either, the restart replaces it."""
        if self.active is not None and model not in self.active.models and model not in self._joined:
            self._joined.append(model)

    def problem(self) -> str | None:
        """/healthz's problem while an escalation stands."""
        if self.active is None:
            return None
        return (f"process-level fault, Triton must restart (evidence: {self.active.evidence.value}; models: "  # type: ignore[union-attr]
                f"{', '.join(self.models())}): {self.active.cause}")

    def models(self) -> list[str]:
        return [*self.active.models, *self._joined] if self.active is not None else []

    def status(self) -> dict[str, Any]:
        """/status's `escalations`: this process's escalation and the record's count (survives restarts)."""
        last = self.record.last
        active = self.active
        return {
            "restarts_escalated": self.record.count,
            "by_cause": dict(sorted(self.record.by_cause.items())),
            "record_file": str(self.record.path) if self.record.path else None,
            "last": None if last is None else {
                "at": datetime.fromtimestamp(last.at, UTC).isoformat(timespec="seconds"),
                "evidence": last.evidence, "models": list(last.models), "cause": last.cause},
            "active": None if active is None else {
                "evidence": active.evidence.value if active.evidence else None, "models": self.models(),
                "error": active.error[:300], "cause": active.cause,
                "for_s": round(self._clock() - (self.active_at or 0.0), 1)},
            "cooldown_s": self._config().healing.escalation_cooldown_s,
        }
