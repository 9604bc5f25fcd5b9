"""Which models the sidecar guards, as they come and go.

With `models` listed in the config, exactly those are guarded; a reload that removes one releases
it. With `models` empty, every model Triton's repository index shows READY is guarded, checked
once per probe interval, so a model a pipeline loads after start is probed, proxied and healed
within one interval. A guarded model that is no longer READY is healed like any broken model while
it has golden files; without golden files it is taken as unloaded on purpose by its owner and
released instead of reloaded (deleting a model's golden files is how an owner says "I retire it").

Each guarded model has one `ModelSupervisor`, run as a supervised task (crash logged, counted,
restarted with backoff): the roster starts and stops them, and hands them their events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog

from sidecar.config import SidecarConfig
from sidecar.golden.cases import GoldenCase
from sidecar.health.escalation import RestartEscalation
from sidecar.health.healer import Healer
from sidecar.health.prober import Prober
from sidecar.health.supervisor import UNLOADED_ON_PURPOSE, ModelSupervisor, ProbeSoon, Supervisors
from sidecar.health.tasks import supervise
from sidecar.health.traffic_pace import ServedRequests
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import TritonError, TritonUnavailable
from sidecar.states import ModelState, ModelStates
from sidecar.tracing.spans import NO_SPANS, HealthSpans

log = structlog.get_logger("sidecar.roster")


#: How often (s) to retry model discovery while Triton is not answering yet (it loads models first).
DISCOVERY_RETRY_S = 1.0


class Roster:
    """The guarded models and their supervisors: one supervised task per model, started and ended here."""

    def __init__(
        self,
        *,
        triton: TritonClient,
        states: ModelStates,
        prober: Prober,
        healer: Healer,
        escalation: RestartEscalation,
        metrics: SidecarMetrics,
        config: Callable[[], SidecarConfig],
        cases_for: Callable[[str], Sequence[GoldenCase]],
        forget: Callable[[str], None],
        supervisors: Supervisors,
        clock: Callable[[], float] = time.monotonic,
        served: ServedRequests | None = None,
        spans: HealthSpans = NO_SPANS,
    ) -> None:
        """`served`: the data plane's live requests per model and version, for rounds paced by
        traffic (probes.every_requests); None counts none. `spans`: the supervisors' probe rounds as
        traces (sidecar.tracing)."""
        self._spans = spans
        self._triton = triton
        self._states = states
        self._prober = prober
        self._healer = healer
        self._escalation = escalation
        self._metrics = metrics
        self._config = config
        self._cases_for = cases_for
        self._forget = forget
        self._clock = clock
        self._served = served
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.supervisors = supervisors
        self._wake = asyncio.Event()
        #: True once the first list of models is known (discovery answered, or the config's list).
        self.discovered = False

    @property
    def models(self) -> list[str]:
        return sorted(self._tasks)

    def sync_soon(self) -> None:
        """Look again now (a config reload may have changed `models`)."""
        self._wake.set()

    def golden_changed(self, models: Sequence[str]) -> None:
        """New cases count from the next round, which starts now: a case that fails on the running
        model is found within milliseconds, not one interval later."""
        for model in models:
            if model in self._tasks:
                self._flag_golden(model)
                self.supervisors.tell(model, ProbeSoon("golden files changed"))

    async def run(self) -> None:
        """Sync at once, then every probe interval (every DISCOVERY_RETRY_S while Triton is silent)."""
        while True:
            config = self._config()
            try:
                synced = await self.sync(config)
            except Exception as e:  # a bug here must not end the guarding of the models already guarded
                log.error("model_discovery_failed", cause=repr(e))
                synced = False
            wait = config.probes.interval_s if synced else DISCOVERY_RETRY_S
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def sync(self, config: SidecarConfig) -> bool:
        """One pass: guard what should be, release what should not; False when Triton did not answer."""
        if config.models:
            wanted = list(config.models)
            for model in [m for m in self._tasks if m not in config.models]:
                await self.release(model, "removed from models in the configuration")
        else:
            try:
                index = await self._triton.repository_index()
            except (TritonUnavailable, TritonError) as e:
                if not self.discovered:
                    log.info("model_discovery_waiting", cause=str(e))
                return False
            ready = {entry["name"] for entry in index if entry.get("state") == "READY" and entry.get("name")}
            for model in sorted(set(self._tasks) - ready):
                if self._unloaded_on_purpose(model):
                    await self.release(model, UNLOADED_ON_PURPOSE)
            wanted = sorted(ready)
        for model in wanted:
            if model not in self._tasks:
                self.guard(model)
        if not self.discovered:
            self.discovered = True
            log.info("monitoring_started", models=self.models,
                     golden_cases=sum(len(self._cases_for(m)) for m in self._tasks))
        return True

    def _unloaded_on_purpose(self, model: str) -> bool:
        health = self._states.get(model)
        healing = self._healer.is_healing(model) or (health is not None and health.state is ModelState.HEALING)
        # The healer's own unload makes a model not READY for a moment: never release mid-heal.
        return not self._cases_for(model) and not healing

    def guard(self, model: str) -> None:
        self._states.track(model)
        self._metrics.track_model(model)
        self._flag_golden(model)
        cases = len(self._cases_for(model))
        if not cases:
            log.warning("model_without_golden_requests", model=model,
                        cause=f"no files under {self._config().golden_dir / model}: only readiness and metadata "
                              "are probed")
        if self.discovered:
            log.info("model_guarded", model=model, golden_cases=cases)
        supervisor = ModelSupervisor(model, states=self._states, prober=self._prober, healer=self._healer,
                                     escalation=self._escalation, triton=self._triton, metrics=self._metrics,
                                     config=self._config, cases_for=self._cases_for, clock=self._clock,
                                     served=self._served, spans=self._spans)
        self.supervisors.add(supervisor)
        self._tasks[model] = asyncio.create_task(self._supervised(supervisor), name=f"supervisor:{model}")

    async def _supervised(self, supervisor: ModelSupervisor) -> None:
        """The model's supervisor, restarted after each crash; released when it decides so."""
        release = await supervise(supervisor.run, kind="supervisor", name=f"supervisor:{supervisor.model}",
                                  metrics=self._metrics, record=supervisor.crashes, clock=self._clock)
        if release is not None:
            await self.release(supervisor.model, release)

    async def release(self, model: str, cause: str) -> None:
        """Stop guarding: its supervisor and heal end, its state and gauges go, the proxy answers 404."""
        task = self._tasks.pop(model, None)
        self.supervisors.remove(model)
        if task is not None and task is not asyncio.current_task():  # the supervisor may release itself
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._healer.forget(model)
        self._escalation.forget(model)
        self._prober.records.pop(model, None)
        self._states.forget(model)
        self._metrics.forget_model(model)
        self._forget(model)
        log.info("model_released", model=model, cause=cause)

    def _flag_golden(self, model: str) -> None:
        self._metrics.model_without_golden.labels(model=model).set(0 if self._cases_for(model) else 1)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

