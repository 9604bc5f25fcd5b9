"""Self-healing: unload a broken model, wait until Triton has really let go of it, load it again,
wait until it is ready, and prove it with its golden requests.

A plain `load` of a loaded, unchanged model is a no-op in Triton (it does not restart a dead python
stub), hence unload first. One heal per model at a time; different models heal concurrently up to
`healing.max_concurrent`. A model whose fault returns after every heal (flapping) is given up on.

The healer writes no model state: `heal` returns a `HealOutcome` and the model's supervisor
(sidecar.health.supervisor) moves the state. Every time is read from the injected clock.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from sidecar.config import HealingSection
from sidecar.health.probe_round import RoundResult, round_attributes
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import TritonError, TritonUnavailable
from sidecar.tracing.spans import NO_SPANS, HealthSpans, Span

log = structlog.get_logger("sidecar.healer")


#: How often (s) to ask Triton whether an unload or load has finished: often enough that a
#: 1.5 s reload is not stretched, rare enough to cost Triton nothing.
POLL_INTERVAL_S = 0.1


#: How old (s) Triton's verdict that a stub died may be and still say what broke the model now.
RECENT_ERROR_S = 30.0


class HealStepFailed(Exception):
    """One step of a heal attempt failed; the message says which and why."""


@dataclass(frozen=True)
class HealOutcome:
    """How a heal episode ended: healed (the model serves again) or given up (FAILED), and why."""

    healed: bool
    cause: str
    #: The verification round after which the episode stopped early because its caller's `stop_if`
    #: said the reload cannot help (the fault is Triton's process's): the caller escalates.
    stopped_after: RoundResult | None = None


class Healer:
    def __init__(
        self,
        *,
        triton: TritonClient,
        settings: HealingSection,
        metrics: SidecarMetrics,
        verify: Callable[[str], Awaitable[RoundResult]],
        unanswered_for: Callable[[str], float | None] = lambda model: None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        spans: HealthSpans = NO_SPANS,
    ) -> None:
        """`spans`: every heal episode as a trace of its own (sidecar.tracing), its steps as children."""
        self._triton = triton
        self._spans = spans
        self._clock = clock
        self._settings = settings
        self._metrics = metrics
        self._verify = verify
        self._unanswered_for = unanswered_for
        self._sleep = sleep
        self._limit = asyncio.Semaphore(settings.max_concurrent)
        self._tasks: dict[str, asyncio.Task[HealOutcome]] = {}
        #: Each model's last verification round in the running attempt (for `stop_if`).
        self._verified: dict[str, RoundResult] = {}
        self._recent_heals: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self.attempts: dict[str, int] = collections.Counter()
        self.last_heal_s: dict[str, float] = {}
        self.accepting = True
        #: clock() when Triton last declared each model's stub dead (StubUnhealthy), to
        #: probes or to live traffic.
        self._stub_dead_at: dict[str, float] = {}

    def note_stub_dead(self, model: str) -> None:
        """Triton said the model's stub process died: its instance will never finish unloading."""
        self._stub_dead_at[model] = self._clock()

    def _unload_cannot_finish(self, model: str) -> str | None:
        """Why waiting for this model's unload is pointless, or None. Triton unloads an instance only
        once its requests are done: a dead stub's never are, and neither are a hung execute()'s."""
        if self._clock() - self._stub_dead_at.get(model, float("-inf")) <= RECENT_ERROR_S:
            return "Triton declared the stub process dead: its instance never finishes unloading, and holds no memory"
        waited = self._unanswered_for(model)
        if waited is not None:
            return (f"a golden request has had no answer for {waited:.1f} s: a hung execute() keeps its instance, "
                    "which never finishes unloading")
        return None

    def reconfigure(self, settings: HealingSection) -> None:
        """Settings from a reloaded config, for the next attempt on. A running episode keeps its
        concurrency slot; a new max_concurrent applies to the episodes that start after it."""
        if settings.max_concurrent != self._settings.max_concurrent:
            self._limit = asyncio.Semaphore(settings.max_concurrent)
        self._settings = settings

    async def forget(self, model: str) -> None:
        """The model is no longer guarded: stop its heal, if one runs, and drop what is known of it."""
        task = self._tasks.pop(model, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._stub_dead_at.pop(model, None)
        self._recent_heals.pop(model, None)
        self._verified.pop(model, None)

    def is_healing(self, model: str) -> bool:
        task = self._tasks.get(model)
        return task is not None and not task.done()

    @property
    def allowed(self) -> bool:
        """Heals may start: healing is enabled and the sidecar is not draining."""
        return self._settings.enabled and self.accepting

    def start_heal(self, model: str, cause: str, *,
                   stop_if: Callable[[RoundResult], bool] | None = None) -> asyncio.Task[HealOutcome]:
        """A heal episode for the model, as a task of its own so that draining can wait for it and
        stopping can cancel it; the caller (the model's supervisor) awaits its outcome. Never two
        at once for one model: the running one is returned. `stop_if`: asked after an attempt whose
        reloaded model failed its golden cases; True ends the episode there (no further attempt)."""
        running = self._tasks.get(model)
        if running is not None and not running.done():
            return running
        task = asyncio.create_task(self._episode(model, cause, stop_if), name=f"heal:{model}")
        self._tasks[model] = task
        return task

    async def wait_idle(self, timeout_s: float) -> None:
        """Let running heals finish (used while draining); they are cancelled after that."""
        running = [t for t in self._tasks.values() if not t.done()]
        if running:
            await asyncio.wait(running, timeout=timeout_s)

    async def close(self) -> None:
        self.accepting = False
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _episode(self, model: str, cause: str, stop_if: Callable[[RoundResult], bool] | None) -> HealOutcome:
        attempts_before = self.attempts[model]
        with self._spans.heal(model, cause) as span:
            try:
                outcome = await self._attempts(model, cause, stop_if, span)
            except Exception as e:  # the episode must end; a model left HEALING is never probed again
                self._count_error(model, e, where="heal episode")
                outcome = self._escalate(model, f"healing stopped by an unexpected {type(e).__name__}: {e}")
            span.set({"sidecar.heal.healed": outcome.healed, "sidecar.heal.outcome": outcome.cause,
                      "sidecar.heal.attempts": self.attempts[model] - attempts_before,
                      "sidecar.heal.stopped_for_restart": outcome.stopped_after is not None})
            if not outcome.healed:
                span.failed(outcome.cause)
            return outcome

    def _count_error(self, model: str, e: Exception, *, where: str) -> None:
        """An exception no step foresaw (a bug, or an answer nobody expected): logged with its traceback
        and counted, so that it is fixed rather than hidden behind a retry."""
        self._metrics.heal_errors.labels(model=model).inc()
        log.error("heal_error", model=model, where=where, error=type(e).__name__, cause=str(e)[:300], exc_info=e)

    async def _attempts(self, model: str, cause: str, stop_if: Callable[[RoundResult], bool] | None,
                        span: Span) -> HealOutcome:
        backoff = self._settings.backoff_initial_s
        error: str | None = cause
        async with self._limit:
            for attempt in range(1, self._settings.max_attempts + 1):
                self.attempts[model] += 1
                self._verified.pop(model, None)
                error = await self._attempt(model, attempt)
                if error is None:
                    return self._after_success(model, attempt)
                verified = self._verified.pop(model, None)
                if stop_if is not None and verified is not None and stop_if(verified):
                    log.warning("heal_stopped", model=model, attempt=attempt, cause=error,
                                reason="the reloaded model failed as before: a reload cannot help")
                    return HealOutcome(healed=False, cause=error, stopped_after=verified)
                if attempt < self._settings.max_attempts:
                    log.warning("heal_retry_scheduled", model=model, attempt=attempt, backoff_s=backoff, cause=error)
                    span.event("retry scheduled", {"sidecar.heal.attempt": attempt, "sidecar.heal.backoff_s": backoff,
                                                   "sidecar.heal.cause": error})
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, self._settings.backoff_max_s)
        return self._escalate(model, f"healing exhausted after {self._settings.max_attempts} attempts; "
                                     f"last: {error}")

    def _escalate(self, model: str, cause: str) -> HealOutcome:
        """Give up on the model: FAILED fails /healthz, so the kubelet restarts the pod."""
        self._metrics.escalations.labels(model=model).inc()
        log.error("model_escalated", model=model, cause=cause)
        return HealOutcome(healed=False, cause=cause)

    def _after_success(self, model: str, attempt: int) -> HealOutcome:
        self._stub_dead_at.pop(model, None)  # that verdict was about the instance just replaced
        now = self._clock()
        recent = self._recent_heals[model]
        recent.append(now)
        while recent and now - recent[0] > self._settings.flap_window_s:
            recent.popleft()
        if len(recent) > self._settings.flap_max_heals:
            return self._escalate(model, f"flapping: healed {len(recent)} times within "
                                         f"{self._settings.flap_window_s:g} s; the fault returns after every reload")
        return HealOutcome(healed=True,
                           cause=f"healed by unload and reload (attempt {attempt}), golden requests pass")

    async def _attempt(self, model: str, attempt: int) -> str | None:
        """One unload -> load -> verify; None on success, else what went wrong."""
        started = self._clock()
        log.info("heal_attempt_started", model=model, attempt=attempt)
        try:
            with self._spans.heal_step("unload", model, attempt) as step:
                step.set({"sidecar.heal.unload": await self._unload(model)})
            with self._spans.heal_step("load", model, attempt):
                await self._load(model)
            with self._spans.heal_step("verify", model, attempt) as step:
                await self._check_golden(model, step)
        except HealStepFailed as e:
            error = str(e)
        except Exception as e:  # an unforeseen failure fails this attempt; the episode goes on
            self._count_error(model, e, where=f"attempt {attempt}")
            error = f"unexpected {type(e).__name__} while healing: {str(e)[:200]}"
        else:
            error = None
        duration = self._clock() - started
        self.last_heal_s[model] = duration
        result = "success" if error is None else "failure"
        self._metrics.heal_attempts.labels(model=model, result=result).inc()
        self._metrics.heal_duration.labels(model=model).observe(duration)
        if error is None:
            log.info("heal_attempt_succeeded", model=model, attempt=attempt, duration_ms=round(duration * 1000, 1))
        else:
            log.warning("heal_attempt_failed", model=model, attempt=attempt, cause=error,
                        duration_ms=round(duration * 1000, 1))
        return error

    async def _unload(self, model: str) -> str:
        """Unload and wait until the model is gone; says how it ended (gone, not_loaded, not_awaited:
        it never finishes, incomplete: still unloading at the bound)."""
        step = self._clock()
        try:
            await self._triton.unload_model(model, timeout_s=self._settings.unload_timeout_s)
        except (TritonError, TritonUnavailable) as e:
            # Someone else may have unloaded it already; then there is nothing to wait for.
            if not await self._is_gone(model):
                raise HealStepFailed(f"unload refused: {e}") from e
            log.info("heal_unloaded", model=model, duration_ms=self._ms(step), cause="was not loaded")
            return "not_loaded"
        log.info("heal_unload_sent", model=model, duration_ms=self._ms(step))
        deadline = self._clock() + self._settings.unload_timeout_s
        while True:
            # Asked at every poll: Triton's verdict on a dead stub may arrive while the unload runs.
            hopeless = self._unload_cannot_finish(model)
            if hopeless is not None:
                log.info("heal_unload_not_awaited", model=model, duration_ms=self._ms(step), cause=hopeless)
                return "not_awaited"
            if await self._is_gone(model):
                log.info("heal_unloaded", model=model, duration_ms=self._ms(step))
                return "gone"
            if self._clock() >= deadline:
                break
            await self._sleep(POLL_INTERVAL_S)
        # On Triton 2.51 an instance whose stub died (after requests reached it) or hangs in
        # execute() never finishes unloading; a load still starts a fresh instance next to the
        # stuck one, so carry on rather than give up on the model.
        log.warning("heal_unload_incomplete", model=model, waited_s=self._settings.unload_timeout_s,
                    cause="still unloading (a hung execute() keeps its instance); loading anyway")
        return "incomplete"

    async def _is_gone(self, model: str) -> bool:
        try:
            index = await self._triton.repository_index()
        except (TritonError, TritonUnavailable) as e:
            log.debug("heal_unload_poll_failed", model=model, cause=str(e))
            return False
        states = [e.get("state") for e in index if e.get("name") == model]
        return all(s not in ("READY", "UNLOADING", "LOADING") for s in states)

    async def _load(self, model: str) -> None:
        step = self._clock()
        log.info("heal_load_sent", model=model)
        try:
            await self._triton.load_model(model, timeout_s=self._settings.load_timeout_s)
        except (TritonError, TritonUnavailable) as e:
            raise HealStepFailed(f"load failed: {e}") from e
        deadline = self._clock() + self._settings.load_timeout_s
        while self._clock() < deadline:
            try:
                if await self._triton.model_ready(model):
                    log.info("heal_ready", model=model, duration_ms=self._ms(step))
                    return
            except (TritonError, TritonUnavailable):
                pass
            await self._sleep(POLL_INTERVAL_S)
        raise HealStepFailed(f"not ready {self._settings.load_timeout_s:g} s after load")

    def _ms(self, since: float) -> float:
        return round((self._clock() - since) * 1000, 1)

    async def _check_golden(self, model: str, step: Span) -> None:
        result = await self._verify(model)
        self._verified[model] = result
        step.set(round_attributes(result))
        if not result.ok:
            raise HealStepFailed(f"reloaded, but {result.cause}")
        log.info("heal_verified", model=model, duration_ms=round(result.duration_s * 1000, 1))
