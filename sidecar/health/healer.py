"""Self-healing: unload a broken model, wait until Triton has really let go of it, load it again,
wait until it is ready, and prove it with its golden requests.

A plain `load` of a loaded, unchanged model is a no-op in Triton (it does not restart a dead python
stub), hence unload first. One heal per model at a time; different models heal concurrently up to
`healing.max_concurrent`. A model whose fault returns after every heal (flapping) goes FAILED.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable

import structlog

from sidecar.config import HealingSection
from sidecar.health.probe_round import RoundResult
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import TritonError, TritonUnavailable
from sidecar.states import ModelState, ModelStates

log = structlog.get_logger("sidecar.healer")


#: How often (s) to ask Triton whether an unload or load has finished: often enough that a
#: 1.5 s reload is not stretched, rare enough to cost Triton nothing.
POLL_INTERVAL_S = 0.1


#: How old (s) Triton's verdict that a stub died may be and still say what broke the model now.
RECENT_ERROR_S = 30.0


class HealStepFailed(Exception):
    """One step of a heal attempt failed; the message says which and why."""


class Healer:
    def __init__(
        self,
        *,
        triton: TritonClient,
        states: ModelStates,
        settings: HealingSection,
        metrics: SidecarMetrics,
        verify: Callable[[str], Awaitable[RoundResult]],
        unanswered_for: Callable[[str], float | None] = lambda model: None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._triton = triton
        self._states = states
        self._settings = settings
        self._metrics = metrics
        self._verify = verify
        self._unanswered_for = unanswered_for
        self._sleep = sleep
        self._limit = asyncio.Semaphore(settings.max_concurrent)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._recent_heals: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self.attempts: dict[str, int] = collections.Counter()
        self.last_heal_s: dict[str, float] = {}
        self.accepting = True
        #: time.monotonic() when Triton last declared each model's stub dead (StubUnhealthy), to
        #: probes or to live traffic.
        self._stub_dead_at: dict[str, float] = {}

    def note_stub_dead(self, model: str) -> None:
        """Triton said the model's stub process died: its instance will never finish unloading."""
        self._stub_dead_at[model] = time.monotonic()

    def _unload_cannot_finish(self, model: str) -> str | None:
        """Why waiting for this model's unload is pointless, or None. Triton unloads an instance only
        once its requests are done: a dead stub's never are, and neither are a hung execute()'s."""
        if time.monotonic() - self._stub_dead_at.get(model, float("-inf")) <= RECENT_ERROR_S:
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

    def is_healing(self, model: str) -> bool:
        task = self._tasks.get(model)
        return task is not None and not task.done()

    def request_heal(self, model: str) -> None:
        """Start a heal episode for the model unless one runs already (never two at once)."""
        if not self._settings.enabled or not self.accepting or self.is_healing(model):
            return
        health = self._states.get(model)
        if health is None or health.state is ModelState.FAILED:
            return
        self._tasks[model] = asyncio.create_task(self._episode(model), name=f"heal:{model}")

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

    async def _episode(self, model: str) -> None:
        cause = self._states.get(model).cause  # type: ignore[union-attr]
        self._states.apply(model, lambda h, now: h.heal_started(f"healing after: {cause}", now))
        try:
            await self._attempts(model, cause)
        except Exception as e:  # the episode must end; a model left HEALING is never probed again
            self._count_error(model, e, where="heal episode")
            self._escalate(model, f"healing stopped by an unexpected {type(e).__name__}: {e}")

    def _count_error(self, model: str, e: Exception, *, where: str) -> None:
        """An exception no step foresaw (a bug, or an answer nobody expected): logged with its traceback
        and counted, so that it is fixed rather than hidden behind a retry."""
        self._metrics.heal_errors.labels(model=model).inc()
        log.error("heal_error", model=model, where=where, error=type(e).__name__, cause=str(e)[:300], exc_info=e)

    async def _attempts(self, model: str, cause: str) -> None:
        backoff = self._settings.backoff_initial_s
        error: str | None = cause
        async with self._limit:
            for attempt in range(1, self._settings.max_attempts + 1):
                self.attempts[model] += 1
                error = await self._attempt(model, attempt)
                if error is None:
                    self._after_success(model, attempt)
                    return
                if attempt < self._settings.max_attempts:
                    log.warning("heal_retry_scheduled", model=model, attempt=attempt, backoff_s=backoff, cause=error)
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, self._settings.backoff_max_s)
        self._escalate(model, f"healing exhausted after {self._settings.max_attempts} attempts; last: {error}")

    def _escalate(self, model: str, cause: str) -> None:
        """Give up on the model: FAILED fails /healthz, so the kubelet restarts the pod."""
        self._metrics.escalations.labels(model=model).inc()
        log.error("model_escalated", model=model, cause=cause)
        self._states.apply(model, lambda h, now: h.fail(cause, now))

    def _after_success(self, model: str, attempt: int) -> None:
        self._stub_dead_at.pop(model, None)  # that verdict was about the instance just replaced
        now = time.monotonic()
        recent = self._recent_heals[model]
        recent.append(now)
        while recent and now - recent[0] > self._settings.flap_window_s:
            recent.popleft()
        if len(recent) > self._settings.flap_max_heals:
            self._escalate(model, f"flapping: healed {len(recent)} times within {self._settings.flap_window_s:g} s;"
                                  " the fault returns after every reload")
            return
        self._states.apply(model, lambda h, t: h.heal_succeeded(
            f"healed by unload and reload (attempt {attempt}), golden requests pass", t))

    async def _attempt(self, model: str, attempt: int) -> str | None:
        """One unload -> load -> verify; None on success, else what went wrong."""
        started = time.perf_counter()
        log.info("heal_attempt_started", model=model, attempt=attempt)
        try:
            await self._unload(model)
            await self._load(model)
            await self._check_golden(model)
        except HealStepFailed as e:
            error = str(e)
        except Exception as e:  # an unforeseen failure fails this attempt; the episode goes on
            self._count_error(model, e, where=f"attempt {attempt}")
            error = f"unexpected {type(e).__name__} while healing: {str(e)[:200]}"
        else:
            error = None
        duration = time.perf_counter() - started
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

    async def _unload(self, model: str) -> None:
        step = time.perf_counter()
        try:
            await self._triton.unload_model(model, timeout_s=self._settings.unload_timeout_s)
        except (TritonError, TritonUnavailable) as e:
            # Someone else may have unloaded it already; then there is nothing to wait for.
            if not await self._is_gone(model):
                raise HealStepFailed(f"unload refused: {e}") from e
            log.info("heal_unloaded", model=model, duration_ms=_ms(step), cause="was not loaded")
            return
        log.info("heal_unload_sent", model=model, duration_ms=_ms(step))
        deadline = time.monotonic() + self._settings.unload_timeout_s
        while True:
            # Asked at every poll: Triton's verdict on a dead stub may arrive while the unload runs.
            hopeless = self._unload_cannot_finish(model)
            if hopeless is not None:
                log.info("heal_unload_not_awaited", model=model, duration_ms=_ms(step), cause=hopeless)
                return
            if await self._is_gone(model):
                log.info("heal_unloaded", model=model, duration_ms=_ms(step))
                return
            if time.monotonic() >= deadline:
                break
            await self._sleep(POLL_INTERVAL_S)
        # On Triton 2.51 an instance whose stub died (after requests reached it) or hangs in
        # execute() never finishes unloading; a load still starts a fresh instance next to the
        # stuck one, so carry on rather than give up on the model.
        log.warning("heal_unload_incomplete", model=model, waited_s=self._settings.unload_timeout_s,
                    cause="still unloading (a hung execute() keeps its instance); loading anyway")

    async def _is_gone(self, model: str) -> bool:
        try:
            index = await self._triton.repository_index()
        except (TritonError, TritonUnavailable) as e:
            log.debug("heal_unload_poll_failed", model=model, cause=str(e))
            return False
        states = [e.get("state") for e in index if e.get("name") == model]
        return all(s not in ("READY", "UNLOADING", "LOADING") for s in states)

    async def _load(self, model: str) -> None:
        step = time.perf_counter()
        log.info("heal_load_sent", model=model)
        try:
            await self._triton.load_model(model, timeout_s=self._settings.load_timeout_s)
        except (TritonError, TritonUnavailable) as e:
            raise HealStepFailed(f"load failed: {e}") from e
        deadline = time.monotonic() + self._settings.load_timeout_s
        while time.monotonic() < deadline:
            try:
                if await self._triton.model_ready(model):
                    log.info("heal_ready", model=model, duration_ms=_ms(step))
                    return
            except (TritonError, TritonUnavailable):
                pass
            await self._sleep(POLL_INTERVAL_S)
        raise HealStepFailed(f"not ready {self._settings.load_timeout_s:g} s after load")

    async def _check_golden(self, model: str) -> None:
        result = await self._verify(model)
        if not result.ok:
            raise HealStepFailed(f"reloaded, but {result.cause}")
        log.info("heal_verified", model=model, duration_ms=round(result.duration_s * 1000, 1))


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 1)

