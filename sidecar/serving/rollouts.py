"""Version rollouts inside the pod: stages, the evidence of each stage, and the decisions.

One `Rollout` per model named in `rollouts` (sidecar.config.RolloutSettings). Its life:

    GATING  -> the candidate's golden cases run (an injected function); fail -> ABORTED
    PROGRESSING, step by step: the candidate gets `steps[i]` of unpinned traffic
        abort at once when, with at least step_min_requests / 10 samples, the compared answers
        differ above max_diff_rate or the candidate's 5xx/NaN answers pass max_error_rate
        pass the step when it has lasted step_min_s with step_min_requests compared answers and
        the candidate's p99 is within max_p99_increase of stable's (else wait one step_min_s more,
        then abort)
    -> PROMOTED after the last step: every unpinned request goes to the candidate

While PROGRESSING, a failed probe round confined to the candidate (its own `"version"` golden cases)
aborts the rollout at once (`Rollouts.on_transition`): the candidate leaves service, its cases go
back to the gate, and the model's confirmation round, on stable's cases, passes. Left to the model's
health instead, the candidate's failure would quarantine the model and have the healer reload it,
stable with it (Triton reloads every version of a model), for a version that had a canary's share.

Decisions are taken on every observation (a compared pair, a candidate answer), and at least every
`TICK_S` by `Rollouts.run` (time alone passes a stage). An abort is a state change in this process:
the very next unpinned request goes to stable. Rollout state is not model state: /healthz and the
model's health never move for it.

The evidence of one answer pair is compared here (`compare_answers`) with the golden files'
tolerance rule (sidecar.golden.compare), output by output: shape, datatype, values, NaN. Outputs the
filtering rules hide are compared too; an abort's example then names the output and index only.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from sidecar.config import RolloutSettings
from sidecar.golden.cases import ExpectedOutput, ReceivedOutput
from sidecar.golden.compare import Mismatch, compare_output
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.answers import BINARY_DTYPES, AnswerTensor
from sidecar.states import ModelState, ModelStates, Transition

# numpy only where a function needs it (imported there): an idle sidecar never loads it (issue 30).
if TYPE_CHECKING:
    import numpy as np

log = structlog.get_logger("sidecar.rollouts")


#: Longest time (s) between two decisions when no traffic comes: a stage passes on time alone, and
#: the issue asks for decisions within 100 ms.
TICK_S = 0.1


#: Latencies kept per version per stage for its p99: the last 4,096 answers (32 KB) are plenty to
#: tell a 10 % p99 increase, and bound memory whatever the traffic.
LATENCY_WINDOW = 4096


#: Served answers of each version a stage needs before p99s are compared: the p99 of fewer is
#: their maximum, one slow answer (a GC pause, a busy core) would hold or abort a stage.
MIN_P99_SAMPLES = 100


#: Smallest p99 difference (s) that counts as the candidate being slower: below it, p99 is scheduler
#: and GC noise (an identical candidate's p99 measured 0.4 ms above stable's on a shared 2-core
#: node), and a 10 % rule on a 1 ms model would roll back on noise.
P99_NOISE_FLOOR_S = 0.002


#: The least samples needed to judge a rate, as a share of step_min_requests (the issue: 1/10).
EARLY_SHARE = 0.1


#: Runs the candidate's golden cases: None when they pass, else why not.
GoldenGate = Callable[[str, str], Awaitable[str | None]]


#: Is this output of this model hidden by the filtering rules (its values never leave the pod)?
IsHiddenOutput = Callable[[str, str], bool]


class RolloutState(str, enum.Enum):
    GATING = "gating"
    PROGRESSING = "progressing"
    PROMOTED = "promoted"
    ABORTED = "aborted"


@dataclass
class StageEvidence:
    """What one stage has seen so far."""

    started_at: float
    compared: int = 0
    differs: int = 0
    candidate_answers: int = 0
    candidate_errors: int = 0
    latencies: dict[str, deque[float]] = field(default_factory=dict)
    #: One differing pair, in words (output, index, expected vs got; never input data).
    example: str = ""
    #: When the stage had all it needs but the candidate's p99 was too high.
    slow_since: float | None = None

    @property
    def diff_rate(self) -> float:
        return self.differs / self.compared if self.compared else 0.0

    @property
    def error_rate(self) -> float:
        return self.candidate_errors / self.candidate_answers if self.candidate_answers else 0.0

    def p99(self, version: str) -> float | None:
        import numpy as np

        samples = self.latencies.get(version)
        if not samples or len(samples) < MIN_P99_SAMPLES:
            return None
        return float(np.percentile(np.fromiter(samples, dtype=np.float64), 99))


class Rollout:
    """One model's rollout: where unpinned traffic goes, and the stage's evidence and decisions."""

    def __init__(self, model: str, settings: RolloutSettings, *, clock: Callable[[], float],
                 on_change: Callable[[Rollout], None]) -> None:
        self.model = model
        self.settings = settings
        self._clock = clock
        self._on_change = on_change
        self.state = RolloutState.GATING
        self.step = 0
        self.cause = "golden gate: the candidate's golden cases have not run yet"
        self.stage = StageEvidence(started_at=clock())
        #: Totals over the whole rollout (the stage's counts start again at every step).
        self.compared_total = 0
        self.differs_total = 0
        if settings.decision != "auto":
            self.decide_by_config(settings.decision)

    # -- routing ----------------------------------------------------------------------------------------

    @property
    def share(self) -> float:
        """The candidate's share of unpinned traffic now."""
        if self.state is RolloutState.PROGRESSING:
            return self.settings.steps[self.step]
        return 1.0 if self.state is RolloutState.PROMOTED else 0.0

    def pick(self, bucket: float) -> str:
        """The version for an unpinned request at `bucket` in [0, 1)."""
        return self.settings.candidate if bucket < self.share else self.settings.stable

    @property
    def candidate_in_service(self) -> bool:
        """Does the candidate serve unpinned traffic or shadows (progressing, promoted)? While gating
        or aborted the golden gate is its judge, not the model's probe rounds."""
        return self.state in (RolloutState.PROGRESSING, RolloutState.PROMOTED)

    @property
    def serving_version(self) -> str:
        """The version most unpinned traffic reaches, which unversioned golden cases probe: stable
        until the rollout is promoted, then the candidate."""
        return self.settings.candidate if self.state is RolloutState.PROMOTED else self.settings.stable

    def other(self, version: str) -> str:
        if version == self.settings.stable:
            return self.settings.candidate
        if version == self.settings.candidate:
            return self.settings.stable
        return ""

    def wants_shadow(self, draw: float) -> bool:
        """Compare this answer with the other version's? While progressing only (the gate must
        pass before the candidate sees a live request, even a shadow one)."""
        return self.state is RolloutState.PROGRESSING and draw < self.settings.shadow_rate

    # -- evidence -----------------------------------------------------------------------------------------

    def answered(self, version: str, latency_s: float, *, error: bool, served: bool = True) -> None:
        """An answer of stable or the candidate; errors: 5xx, timeouts, NaN. Only served answers'
        latencies count for p99: a shadow call runs beside the next client request, so it is slower
        by design and would make either version look worse."""
        if self.state is not RolloutState.PROGRESSING:
            return
        if version == self.settings.candidate:
            self.stage.candidate_answers += 1
            self.stage.candidate_errors += int(error)
        if served and not error:
            window = self.stage.latencies.get(version)
            if window is None:
                window = self.stage.latencies[version] = deque(maxlen=LATENCY_WINDOW)
            window.append(latency_s)
        self.decide()

    def compared(self, differences: Sequence[Mismatch], *, hidden: Callable[[str], bool]) -> bool | None:
        """One pair of answers to the same request compared; whether they differ (None: not
        counted, the rollout is no longer progressing)."""
        if self.state is not RolloutState.PROGRESSING:
            return None
        self.stage.compared += 1
        self.compared_total += 1
        if differences:
            self.stage.differs += 1
            self.differs_total += 1
            if not self.stage.example:
                first = differences[0]
                self.stage.example = (f"{first.output} differs (a filtered output: values stay in the pod)"
                                      if hidden(first.output) else first.message)
        self.decide()
        return bool(differences)

    # -- decisions ----------------------------------------------------------------------------------------

    def decide(self) -> None:
        if self.state is not RolloutState.PROGRESSING:
            return
        s, stage, now = self.settings, self.stage, self._clock()
        early = max(1, math.ceil(s.step_min_requests * EARLY_SHARE))
        if stage.compared >= early and stage.diff_rate > s.max_diff_rate:
            self.abort(f"answers differ on {stage.diff_rate:.2%} of {stage.compared} compared requests at step "
                       f"{self.step + 1} (max_diff_rate {s.max_diff_rate:.2%}); e.g. {stage.example}")
            return
        if stage.candidate_answers >= early and stage.error_rate > s.max_error_rate:
            self.abort(f"the candidate answered {stage.candidate_errors} of {stage.candidate_answers} requests with "
                       f"a 5xx, a timeout or NaN ({stage.error_rate:.2%}; max_error_rate {s.max_error_rate:.2%})")
            return
        if now - stage.started_at < s.step_min_s or stage.compared < s.step_min_requests:
            return
        increase = self.p99_increase()
        if increase is not None and increase > s.max_p99_increase:
            if stage.slow_since is None:
                stage.slow_since = now
                log.warning("rollout_step_waiting", model=self.model, step=self.step + 1,
                            p99_increase=round(increase, 3), max_p99_increase=s.max_p99_increase)
            elif now - stage.slow_since >= max(s.step_min_s, TICK_S):
                self.abort(f"the candidate's p99 stayed {increase:.0%} above stable's at step {self.step + 1} for "
                           f"{now - stage.slow_since:.1f} s (max_p99_increase {s.max_p99_increase:.0%})")
            return
        self.next_step()

    def p99_increase(self) -> float | None:
        stable, candidate = self.stage.p99(self.settings.stable), self.stage.p99(self.settings.candidate)
        if stable is None or candidate is None or stable <= 0 or candidate - stable <= P99_NOISE_FLOOR_S:
            return None
        return candidate / stable - 1

    def next_step(self) -> None:
        passed = self.step
        log.info("rollout_step", model=self.model, step=passed + 1, share=self.settings.steps[passed],
                 compared=self.stage.compared, differs=self.stage.differs, **self._p99s())
        if passed + 1 >= len(self.settings.steps):
            self._move(RolloutState.PROMOTED, f"every step passed ({len(self.settings.steps)})")
            log.info("rollout_promoted", model=self.model, stable=self.settings.stable,
                     candidate=self.settings.candidate, compared=self.compared_total, differs=self.differs_total)
            return
        self.step = passed + 1
        self.stage = StageEvidence(started_at=self._clock())
        self._on_change(self)

    def gate_passed(self) -> None:
        if self.state is RolloutState.GATING:
            self.stage = StageEvidence(started_at=self._clock())
            self._move(RolloutState.PROGRESSING, "golden gate passed")
            log.info("rollout_started", model=self.model, stable=self.settings.stable,
                     candidate=self.settings.candidate, share=self.share)

    def gate_failed(self, cause: str) -> None:
        if self.state is RolloutState.GATING:
            self.abort(f"golden gate: {cause}")

    def abort(self, cause: str) -> None:
        if self.state is RolloutState.ABORTED:
            return
        self._move(RolloutState.ABORTED, cause)
        log.warning("rollout_aborted", model=self.model, stable=self.settings.stable,
                    candidate=self.settings.candidate, step=self.step + 1, cause=cause,
                    compared=self.stage.compared, differs=self.stage.differs, **self._p99s())

    def decide_by_config(self, decision: str) -> None:
        """The operator's decision (`decision: abort | promote`), applied at once."""
        if decision == "abort":
            self.abort("aborted by configuration (decision: abort)")
        elif decision == "promote" and self.state is not RolloutState.PROMOTED:
            self._move(RolloutState.PROMOTED, "promoted by configuration (decision: promote)")
            log.info("rollout_promoted", model=self.model, stable=self.settings.stable,
                     candidate=self.settings.candidate, cause=self.cause)

    def _move(self, state: RolloutState, cause: str) -> None:
        self.state, self.cause = state, cause
        self._on_change(self)

    def _p99s(self) -> dict[str, float | None]:
        def ms(p99: float | None) -> float | None:
            return round(p99 * 1000, 2) if p99 is not None else None

        return {"stable_p99_ms": ms(self.stage.p99(self.settings.stable)),
                "candidate_p99_ms": ms(self.stage.p99(self.settings.candidate))}

    def status(self) -> dict[str, Any]:
        stage = self.stage
        return {"stable": self.settings.stable, "candidate": self.settings.candidate, "state": self.state.value,
                "step": self.step + 1, "steps": list(self.settings.steps), "share": self.share,
                "compared": stage.compared, "differs": stage.differs, "diff_rate": round(stage.diff_rate, 5),
                "candidate_answers": stage.candidate_answers, "error_rate": round(stage.error_rate, 5),
                "in_step_for_s": round(self._clock() - stage.started_at, 1),
                "compared_total": self.compared_total, "differs_total": self.differs_total,
                **self._p99s(), "cause": self.cause, "example": stage.example or None}


class Rollouts:
    """Every model's rollout, rebuilt from each (re)loaded config; the decision loop and the gate."""

    def __init__(self, settings: Mapping[str, RolloutSettings], *, metrics: SidecarMetrics,
                 clock: Callable[[], float], golden_gate: GoldenGate | None = None,
                 states: ModelStates | None = None) -> None:
        self._metrics = metrics
        self._clock = clock
        self.golden_gate = golden_gate
        self._states = states
        self._by_model: dict[str, Rollout] = {}
        self._gates: dict[str, asyncio.Task[None]] = {}
        #: Called after a rollout's routing may have changed (its state, step, or the rollout itself
        #: added or removed): the Rust front publishes its routes again at once, so the very next
        #: request after an abort goes to stable.
        self._listeners: list[Callable[[], None]] = []
        #: Set while any rollout is configured: without one the decision loop sleeps on it instead of
        #: waking every TICK_S (ten wake-ups a second were a tenth of an idle sidecar's CPU).
        self._configured = asyncio.Event()
        self.reconfigure(settings)
        if states is not None:
            states.add_listener(self.on_transition)

    def on_transition(self, t: Transition) -> None:
        """A probe round that failed on the candidate alone, while it serves a share: abort (see the
        module docstring). A whole-model failure, or one after promotion, is the model's health's."""
        if t.state_to not in (ModelState.DEGRADED, ModelState.UNHEALTHY) or self._states is None:
            return
        rollout, health = self._by_model.get(t.model), self._states.get(t.model)
        if rollout is None or health is None or rollout.state is not RolloutState.PROGRESSING:
            return
        if health.broken_versions == {rollout.settings.candidate}:
            rollout.abort(f"the candidate failed its golden cases at step {rollout.step + 1}: {t.cause}")

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def get(self, model: str) -> Rollout | None:
        return self._by_model.get(model)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_model.values()))

    def reconfigure(self, settings: Mapping[str, RolloutSettings]) -> None:
        """A new or changed rollout (other versions, steps, thresholds) starts again at the gate; a
        changed `decision` only applies the decision; a removed one is forgotten."""
        for model in list(self._by_model):
            if model not in settings:
                self._forget(model)
        for model, new in settings.items():
            current = self._by_model.get(model)
            if current is not None and current.settings == new:
                continue
            if current is not None and _same_but_decision(current.settings, new):
                current.settings = new
                if new.decision != "auto":
                    current.decide_by_config(new.decision)
                continue
            if current is not None:
                self._forget(model)
            self._by_model[model] = Rollout(model, new, clock=self._clock, on_change=self._published)
            self._published(self._by_model[model])
            log.info("rollout_configured", model=model, stable=new.stable, candidate=new.candidate,
                     steps=list(new.steps), decision=new.decision)
        if self._by_model:
            self._configured.set()
        else:
            self._configured.clear()

    def _forget(self, model: str) -> None:
        rollout = self._by_model.pop(model)
        gate = self._gates.pop(model, None)
        if gate is not None:
            gate.cancel()
        self._metrics.forget_rollout(model, rollout.settings.candidate)
        for listener in self._listeners:
            listener()

    def _published(self, rollout: Rollout) -> None:
        self._metrics.set_rollout(rollout.model, rollout.settings.candidate, rollout.state.value, rollout.share)
        for listener in self._listeners:
            listener()

    def tick(self) -> None:
        """Decide on time alone, and start the golden gate of rollouts waiting for it."""
        for rollout in self:
            if rollout.state is RolloutState.GATING and rollout.model not in self._gates:
                self._start_gate(rollout)
            rollout.decide()

    def _start_gate(self, rollout: Rollout) -> None:
        if self.golden_gate is None:
            rollout.gate_passed()
            return
        task = asyncio.get_running_loop().create_task(self._gate(rollout), name=f"rollout-gate:{rollout.model}")
        self._gates[rollout.model] = task

    async def _gate(self, rollout: Rollout) -> None:
        assert self.golden_gate is not None
        try:
            cause = await self.golden_gate(rollout.model, rollout.settings.candidate)
        except Exception as e:  # a bug or Triton down: the candidate gets no traffic, say why
            cause = f"could not run: {e!r}"[:300]
        if self._by_model.get(rollout.model) is not rollout:
            return  # reconfigured while the gate ran
        if cause is None:
            rollout.gate_passed()
        else:
            rollout.gate_failed(cause)

    async def run(self) -> None:
        """Decide at least every TICK_S while a rollout is configured, until cancelled."""
        try:
            while True:
                if not self._by_model:
                    await self._configured.wait()
                self.tick()
                await asyncio.sleep(TICK_S)
        finally:
            await self.close()

    async def close(self) -> None:
        gates = list(self._gates.values())
        for task in gates:
            task.cancel()
        await asyncio.gather(*gates, return_exceptions=True)
        self._gates.clear()


def _same_but_decision(old: RolloutSettings, new: RolloutSettings) -> bool:
    from dataclasses import replace

    return replace(old, decision=new.decision) == new


# -- comparing two answers to the same request -----------------------------------------------------------


def tensor_values(tensor: AnswerTensor) -> tuple[str, str, tuple[int, ...], np.ndarray]:
    """(name, datatype, shape, flat float64 values) of an answer tensor (binary data or decoded JSON)."""
    import numpy as np

    name, datatype, shape, values = tensor
    if isinstance(values, np.ndarray):
        array = values.astype(np.float64, copy=False).reshape(-1)
    else:
        array = np.frombuffer(values, dtype=BINARY_DTYPES[datatype]).astype(np.float64)
    return name, datatype, tuple(int(d) for d in shape), array


def compare_answers(expected: Sequence[AnswerTensor], got: Sequence[AnswerTensor],
                    settings: RolloutSettings) -> list[Mismatch]:
    """Every way the second version's outputs differ from the first's, with the rollout's
    tolerances: an output missing on either side, its datatype, shape, values, NaN."""
    mine = {t[0]: tensor_values(t) for t in expected}
    theirs = {t[0]: tensor_values(t) for t in got}
    mismatches = [Mismatch(name, f"output {name} only in version {'one' if name in mine else 'two'}'s answer")
                  for name in sorted(set(mine) ^ set(theirs))]
    for name in sorted(set(mine) & set(theirs)):
        _, datatype, shape, values = mine[name]
        tolerance = settings.tolerance(name)
        reference = ExpectedOutput(datatype, shape, values, atol=tolerance.atol, rtol=tolerance.rtol)
        _, datatype2, shape2, values2 = theirs[name]
        mismatches.extend(compare_output(name, reference, ReceivedOutput(datatype2, shape2, values2)))
    return mismatches


def compare_texts(expected: Mapping[str, str], got: Mapping[str, str]) -> list[Mismatch]:
    """How a generate answer's outputs differ from the other version's: equal or not, output by
    output. The texts themselves are not quoted: a generated text may repeat the prompt (input data)."""
    mismatches = [Mismatch(name, f"output {name} only in version {'one' if name in expected else 'two'}'s answer")
                  for name in sorted(set(expected) ^ set(got))]
    mismatches.extend(Mismatch(name, f"{name} differs: {len(expected[name])} vs {len(got[name])} characters")
                      for name in sorted(set(expected) & set(got)) if expected[name] != got[name])
    return mismatches
