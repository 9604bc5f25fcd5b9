"""Probes: ask Triton what a user would, and judge the answers.

One round for a model is (a) server ready, (b) model ready and its metadata declares the inputs and
outputs the golden requests use, (c) every golden case: infer and compare. Each call is bounded by
`probes.timeout_s`; each model has its own loop, so a hung model never delays another's probes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from sidecar.config import ProbesSection
from sidecar.golden import GoldenCase, compare_outputs
from sidecar.metrics import SidecarMetrics
from sidecar.states import ModelState, ModelStates
from sidecar.triton import TritonClient, TritonError, TritonUnavailable

log = structlog.get_logger("sidecar.probes")

SERVER_READY = "server_ready"
MODEL_READY = "model_ready"
METADATA = "metadata"
GOLDEN = "golden"


@dataclass(frozen=True)
class ProbeResult:
    probe: str
    ok: bool
    duration_s: float
    detail: str = ""
    case: str = ""
    timed_out: bool = False

    @property
    def result(self) -> str:
        return "success" if self.ok else "timeout" if self.timed_out else "failure"


@dataclass(frozen=True)
class RoundResult:
    """One probe round of one model. `conclusive` is False when Triton itself did not answer:
    a model cannot be judged (nor healed) while its server is down."""

    model: str
    results: tuple[ProbeResult, ...] = ()
    conclusive: bool = True
    started_at: float = 0.0
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.conclusive and all(r.ok for r in self.results)

    @property
    def cause(self) -> str:
        failed = next((r for r in self.results if not r.ok), None)
        if failed is None:
            return "all probes passed"
        where = f"golden case {failed.case}" if failed.case else failed.probe.replace("_", " ")
        return f"{where}: {failed.detail}"


class _Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


async def probe_model(
    triton: TritonClient, model: str, cases: Sequence[GoldenCase], *, timeout_s: float,
    stop_at_first_failure: bool = False,
) -> RoundResult:
    """Run one probe round against a model and say what passed and what did not. The sidecar stops
    at the first failed case (one is enough to judge, and a sick model need not be hit more); the
    `check` command runs every case to report them all."""
    started = time.time()
    results: list[ProbeResult] = []

    async def step(probe: str, call: Awaitable[str | None], case: str = "") -> ProbeResult:
        timer = _Timer()
        try:
            problem = await call
        except TritonUnavailable as e:
            timed_out = "time limit" in str(e)
            detail = f"no answer within {timeout_s:g} s" if timed_out else f"Triton unreachable: {e}"
            result = ProbeResult(probe, False, timer.elapsed, detail, case, timed_out)
        except TritonError as e:
            result = ProbeResult(probe, False, timer.elapsed, f"Triton answered {e.status}: {e.message}", case)
        else:
            result = ProbeResult(probe, problem is None, timer.elapsed, problem or "", case)
        results.append(result)
        return result

    def finish(conclusive: bool = True) -> RoundResult:
        return RoundResult(model, tuple(results), conclusive, started, time.time() - started)

    server = await step(SERVER_READY, _server_ready(triton, timeout_s))
    if not server.ok:
        return finish(conclusive=False)
    if not (await step(MODEL_READY, _model_ready(triton, model, timeout_s))).ok:
        return finish()
    if not (await step(METADATA, _metadata_matches(triton, model, cases, timeout_s))).ok:
        return finish()
    for case in cases:
        outcome = await step(GOLDEN, _golden_case(triton, case, timeout_s), case=case.name)
        if outcome.timed_out or (stop_at_first_failure and not outcome.ok):
            break  # a hung model would make every further case wait the full bound too
    return finish()


async def _server_ready(triton: TritonClient, timeout_s: float) -> str | None:
    # Under strict readiness (Triton's default) one model that failed to load makes the whole server
    # "not ready"; that must not stop the other models from being judged, so live is enough here.
    # The pod's readiness still requires a ready server (TritonWatch).
    if await triton.server_ready(timeout_s) or await triton.server_live(timeout_s):
        return None
    return "Triton answers neither ready nor live"


async def _model_ready(triton: TritonClient, model: str, timeout_s: float) -> str | None:
    if await triton.model_ready(model, timeout_s=timeout_s):
        return None
    return "Triton says the model is not ready (not loaded, unloaded, or failed to load)"


async def _metadata_matches(
    triton: TritonClient, model: str, cases: Sequence[GoldenCase], timeout_s: float
) -> str | None:
    metadata = await triton.model_metadata(model, timeout_s=timeout_s)
    declared_inputs = {t["name"]: t["datatype"] for t in metadata.get("inputs", [])}
    declared_outputs = {t["name"]: t["datatype"] for t in metadata.get("outputs", [])}
    for case in cases:
        if case.text is not None and case.text.field not in declared_outputs:
            return f"golden case {case.name} reads output {case.text.field!r}, which the model does not declare"
        for name, datatype in case.input_datatypes.items():
            if name not in declared_inputs:
                return f"golden case {case.name} sends input {name!r}, which the model does not declare"
            if declared_inputs[name] != datatype:
                return (f"golden case {case.name} sends input {name!r} as {datatype}, "
                        f"the model declares {declared_inputs[name]}")
        for name, expected in case.outputs.items():
            if declared_outputs.get(name) != expected.datatype:
                return (f"golden case {case.name} expects output {name!r} as {expected.datatype}, "
                        f"the model declares {declared_outputs.get(name, 'no such output')}")
    return None


async def _golden_case(triton: TritonClient, case: GoldenCase, timeout_s: float) -> str | None:
    if case.is_generate:
        return await _generate_case(triton, case, timeout_s)
    outcome = await triton.infer_case(case, timeout_s=timeout_s)
    if case.expects_error:
        if outcome.status != case.expect_status:
            got = "a normal answer" if outcome.status == 200 else f"{outcome.status}: {outcome.error}"
            return f"expected a {case.expect_status} rejection, got {got}"
        if case.error_contains and case.error_contains not in outcome.error:
            return f"expected the error to mention {case.error_contains!r}, got {outcome.error!r}"
        return None
    if outcome.status != 200:
        return f"Triton answered {outcome.status}: {outcome.error}"
    mismatches = compare_outputs(case, outcome.outputs)
    return "; ".join(str(m) for m in mismatches) if mismatches else None


async def _generate_case(triton: TritonClient, case: GoldenCase, timeout_s: float) -> str | None:
    """A generate case: its status, Triton's error events, the text and the time bounds. A stream
    that stalls is cut by timeout_s (the probe then counts as timed out)."""
    outcome = await triton.generate_case(case, timeout_s=timeout_s)
    if case.expects_error:
        if outcome.status != case.expect_status:
            got = "a normal answer" if outcome.status == 200 else f"{outcome.status}: {outcome.error}"
            return f"expected a {case.expect_status} rejection, got {got}"
        if case.error_contains and case.error_contains not in outcome.error:
            return f"expected the error to mention {case.error_contains!r}, got {outcome.error!r}"
        return None
    if outcome.status != 200:
        return f"Triton answered {outcome.status}: {outcome.error}"
    if outcome.error:
        return f"Triton's answer ended in an error after {outcome.events} event(s): {outcome.error}"
    if case.max_first_event_s is not None and (outcome.first_event_s is None
                                                or outcome.first_event_s > case.max_first_event_s):
        got = "no event" if outcome.first_event_s is None else f"{outcome.first_event_s:.3f} s"
        return f"first event expected within {case.max_first_event_s:g} s, got {got}"
    if case.max_total_s is not None and outcome.total_s > case.max_total_s:
        return f"whole answer expected within {case.max_total_s:g} s, took {outcome.total_s:.3f} s"
    if case.text is not None:
        return case.text.mismatch(outcome.text)
    return None


@dataclass
class ProbeRecord:
    """What /status shows of a model's probes."""

    last_round: RoundResult | None = None
    rounds: int = 0
    last_by_probe: dict[str, ProbeResult] = field(default_factory=dict)


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
        rng: random.Random | None = None,
    ) -> None:
        self._triton = triton
        self._states = states
        self._cases = cases
        self._settings = settings
        self._metrics = metrics
        self._on_unhealthy = on_unhealthy
        self._rng = rng or random.Random()  # noqa: S311 - schedule jitter, not secrets
        self._wake: dict[str, asyncio.Event] = {}
        self.records: dict[str, ProbeRecord] = {}
        #: time.monotonic() of the last finished round of any model: the watchdog's heartbeat.
        self.last_tick = time.monotonic()

    def cases_for(self, model: str) -> Sequence[GoldenCase]:
        return self._cases.get(model, ())

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
                                   stop_at_first_failure=True)
        record = self.records.setdefault(model, ProbeRecord())
        record.last_round, record.rounds = result, record.rounds + 1
        for probe in result.results:
            record.last_by_probe[probe.probe if not probe.case else f"{GOLDEN}:{probe.case}"] = probe
            self._metrics.probes.labels(model=model, probe=probe.probe, result=probe.result).inc()
            self._metrics.probe_duration.labels(model=model, probe=probe.probe).observe(probe.duration_s)
        self.last_tick = time.monotonic()
        return result

    def apply_round(self, model: str, result: RoundResult) -> None:
        if not result.conclusive:
            return  # Triton itself is down: the liveness grace handles that, not the healer
        if result.ok:
            self._states.apply(model, lambda h, now: h.probe_passed(now))
        else:
            failed = next(r for r in result.results if not r.ok)
            log.warning("probe_failed", model=model, probe=failed.probe, case=failed.case or None,
                        cause=result.cause, duration_ms=round(failed.duration_s * 1000, 1))
            self._states.apply(model, lambda h, now: h.probe_failed(result.cause, now))
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


class TritonWatch:
    """Watches the server itself: live and ready, and since when it has not been live."""

    def __init__(self, *, triton: TritonClient, settings: ProbesSection, metrics: SidecarMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._triton = triton
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self.live = False
        self.ready = False
        self.checked = False
        self.last_tick = clock()
        #: clock() when Triton was last seen live; starts at creation, so the grace covers start-up.
        self.last_live_at = clock()
        self.detail = "not checked yet"

    def not_live_for(self) -> float:
        return 0.0 if self.live else self._clock() - self.last_live_at

    async def check(self) -> None:
        timeout = self._settings.timeout_s
        try:
            live = await self._triton.server_live(timeout)
            ready = live and await self._triton.server_ready(timeout)
            detail = "ready" if ready else "live, not ready" if live else "answers not live"
        except (TritonUnavailable, TritonError) as e:
            live = ready = False
            detail = f"unreachable: {e}"
        if live != self.live or ready != self.ready or not self.checked:
            log.info("triton_status_changed", live=live, ready=ready, cause=detail)
        self.live, self.ready, self.detail, self.checked = live, ready, detail, True
        if live:
            self.last_live_at = self._clock()
        self._metrics.triton_up.set(1 if live else 0)
        self._metrics.triton_ready.set(1 if ready else 0)
        self.last_tick = self._clock()

    def mark_unreachable(self, detail: str) -> None:
        """A proxied request could not reach Triton: stop calling the pod ready right away."""
        if self.ready:
            log.warning("triton_status_changed", live=False, ready=False, cause=detail)
        self.ready = False
        self.live = False
        self.detail = detail
        self._metrics.triton_up.set(0)
        self._metrics.triton_ready.set(0)

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._settings.interval_s)
