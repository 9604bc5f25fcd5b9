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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import structlog

from sidecar.config import ProbesSection
from sidecar.golden import GoldenCase, compare_outputs
from sidecar.metrics import SidecarMetrics
from sidecar.states import ModelState, ModelStates
from sidecar.triton import (
    InferOutcome,
    StubUnhealthy,
    TritonClient,
    TritonError,
    TritonTimeout,
    TritonUnavailable,
)

log = structlog.get_logger("sidecar.probes")

SERVER_READY = "server_ready"
MODEL_READY = "model_ready"
METADATA = "metadata"
GOLDEN = "golden"

#: How long (s) a golden request that outlived its probe is still listened to. Triton's verdict on a
#: dead stub comes after about 1 s; an answer later than this says nothing the probes have not already
#: acted on, and a hung execute() never answers, so the request must end some time.
LATE_ANSWER_S = 30.0


@dataclass(frozen=True)
class ProbeResult:
    probe: str
    ok: bool
    duration_s: float
    detail: str = ""
    case: str = ""
    timed_out: bool = False
    #: Triton declared the fault final (StubUnhealthy): only a reload helps.
    final: bool = False
    #: The model version a golden case named ("" = the version the server routes to).
    version: str = ""

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
    #: What the round could not check and why (e.g. metadata that declares no inputs): warnings.
    notes: tuple[str, ...] = ()
    #: The versions the model's metadata lists as available (Triton: every loaded version).
    versions: tuple[str, ...] = ()

    @property
    def default_version(self) -> str:
        """The version unversioned requests reach: Triton routes them to the highest loaded one."""
        numbered = [v for v in self.versions if v.isdigit()]
        return max(numbered, key=int) if numbered else ""

    @property
    def broken_versions(self) -> frozenset[str]:
        """The versions a failed golden case blames; empty = the whole model (its readiness or
        metadata failed, or the failed case's version is unknown)."""
        failed = next((r for r in self.results if not r.ok), None)
        if failed is None or failed.probe != GOLDEN:
            return frozenset()
        version = failed.version or self.default_version
        return frozenset({version}) if version else frozenset()

    @property
    def ok(self) -> bool:
        return self.conclusive and all(r.ok for r in self.results)

    @property
    def final(self) -> bool:
        return any(r.final for r in self.results)

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


class StillUnanswered(Exception):
    """The model's previous golden request still has no answer; the message says for how long."""


@dataclass
class _OpenRequest:
    task: asyncio.Task[InferOutcome]
    sent_at: float
    #: Rounds that have waited on this request so far.
    rounds: int = 1
    #: A round is waiting on it right now, and reports its answer itself.
    awaited: bool = False


class LateAnswers:
    """Golden requests whose probe gave up (`probes.timeout_s`) while their answer is still awaited,
    at most one per model.

    The next round sends no new request behind an open one (a hung model is not fed more requests to
    hang on): it waits for the open one, one interval more than the round before, which is the time
    a round of its own would have had. So a slow answer is counted once, not by every round it
    overlaps, and a hung model fails its rounds at the probe interval, not at the timeout. An answer
    that comes while no round waits, if it is Triton's StubUnhealthy verdict, goes to `on_final`.
    """

    def __init__(self, *, interval_s: float, on_final: Callable[[str, StubUnhealthy], None],
                 listen_s: float = LATE_ANSWER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._on_final = on_final
        self._listen_s = listen_s
        self._clock = clock
        self._open: dict[str, _OpenRequest] = {}

    def unanswered_for(self, model: str) -> float | None:
        """Seconds the model's open request has waited, or None when none is open."""
        request = self._open.get(model)
        if request is None or request.task.done():
            return None
        return self._clock() - request.sent_at

    async def infer(self, triton: TritonClient, case: GoldenCase, timeout_s: float) -> InferOutcome:
        request = self._open.get(case.model)
        if request is not None and not request.task.done():
            deadline = request.sent_at + timeout_s + request.rounds * self._interval_s
            request.rounds += 1
            return await self._wait(case.model, request, deadline)
        request = _OpenRequest(asyncio.ensure_future(triton.infer_case(case, timeout_s=self._listen_s)),
                               self._clock())
        self._open[case.model] = request
        request.task.add_done_callback(lambda t: self._answered(case.model, request))
        return await self._wait(case.model, request, request.sent_at + timeout_s)

    async def _wait(self, model: str, request: _OpenRequest, deadline: float) -> InferOutcome:
        request.awaited = True
        try:
            async with asyncio.timeout(max(0.0, deadline - self._clock())):
                return await asyncio.shield(request.task)
        except TimeoutError:
            if request.rounds == 1:
                raise TritonTimeout("no answer within the time limit") from None
            raise StillUnanswered(f"the golden request sent {self._clock() - request.sent_at:.1f} s ago "
                                  "still has no answer") from None
        except asyncio.CancelledError:
            self.forget(model)  # the prober stops: nobody will listen any more
            raise
        finally:
            request.awaited = False

    def _answered(self, model: str, request: _OpenRequest) -> None:
        if self._open.get(model) is request:
            del self._open[model]
        if request.task.cancelled() or request.awaited:
            return
        error = request.task.exception()
        after_s = round(self._clock() - request.sent_at, 2)
        if isinstance(error, StubUnhealthy):
            log.warning("probe_late_answer", model=model, after_s=after_s, cause=error.message)
            self._on_final(model, error)
        else:
            log.info("probe_late_answer", model=model, after_s=after_s,
                     cause="answered" if error is None else str(error))

    def forget(self, model: str) -> None:
        """Stop listening for the model's open request (its instance was just replaced)."""
        request = self._open.pop(model, None)
        if request is not None:
            request.task.cancel()

    async def close(self) -> None:
        tasks = [request.task for request in self._open.values()]
        self._open.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def probe_model(
    triton: TritonClient, model: str, cases: Sequence[GoldenCase], *, timeout_s: float,
    stop_at_first_failure: bool = False, late: LateAnswers | None = None,
) -> RoundResult:
    """Run one probe round against a model and say what passed and what did not. The sidecar stops
    at the first failed case (one is enough to judge, and a sick model need not be hit more); the
    `check` command runs every case to report them all. With `late`, a golden request that outlives
    `timeout_s` is kept open for Triton's late verdict; without, it is cancelled."""
    started = time.time()
    results: list[ProbeResult] = []
    notes: list[str] = []
    versions: list[str] = []

    async def step(probe: str, call: Awaitable[str | None], case: str = "", version: str = "") -> ProbeResult:
        timer = _Timer()
        try:
            problem = await call
        except TritonTimeout:
            result = ProbeResult(probe, False, timer.elapsed, f"no answer within {timeout_s:g} s", case, True)
        except StillUnanswered as e:
            result = ProbeResult(probe, False, timer.elapsed, str(e), case, timed_out=True)
        except TritonUnavailable as e:
            result = ProbeResult(probe, False, timer.elapsed, f"Triton unreachable: {e}", case)
        except StubUnhealthy as e:
            result = ProbeResult(probe, False, timer.elapsed, f"Triton answered {e.status}: {e.message}", case,
                                 final=True)
        except TritonError as e:
            result = ProbeResult(probe, False, timer.elapsed, f"Triton answered {e.status}: {e.message}", case)
        else:
            result = ProbeResult(probe, problem is None, timer.elapsed, problem or "", case)
        if version:
            result = replace(result, version=version)
        results.append(result)
        return result

    def finish(conclusive: bool = True) -> RoundResult:
        return RoundResult(model, tuple(results), conclusive, started, time.time() - started, tuple(notes),
                           tuple(versions))

    server = await step(SERVER_READY, _server_ready(triton, timeout_s))
    if not server.ok:
        return finish(conclusive=False)
    if not (await step(MODEL_READY, _model_ready(triton, model, timeout_s))).ok:
        return finish()
    if not (await step(METADATA, _metadata_matches(triton, model, cases, timeout_s, notes, versions))).ok:
        return finish()
    for case in cases:
        outcome = await step(GOLDEN, _golden_case(triton, case, timeout_s, late), case=case.name,
                             version=case.version)
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
    triton: TritonClient, model: str, cases: Sequence[GoldenCase], timeout_s: float, notes: list[str],
    versions: list[str],
) -> str | None:
    metadata = await triton.model_metadata(model, timeout_s=timeout_s)
    versions.extend(str(v) for v in metadata.get("versions") or ())
    declared_inputs = {t["name"]: t["datatype"] for t in metadata.get("inputs", [])}
    declared_outputs = {t["name"]: t["datatype"] for t in metadata.get("outputs", [])}
    # Other v2 servers (MLServer with a custom runtime) may declare nothing: then the golden cases
    # alone judge the model. Declaring nothing is not a fault; declaring something else is.
    for kind, declared in (("inputs", declared_inputs), ("outputs", declared_outputs)):
        if not declared:
            notes.append(f"the model's metadata declares no {kind}: its golden cases alone check them")
    for case in cases:
        if case.text is not None and declared_outputs and case.text.field not in declared_outputs:
            return f"golden case {case.name} reads output {case.text.field!r}, which the model does not declare"
        for name, datatype in case.input_datatypes.items() if declared_inputs else ():
            if name not in declared_inputs:
                return f"golden case {case.name} sends input {name!r}, which the model does not declare"
            if declared_inputs[name] != datatype:
                return (f"golden case {case.name} sends input {name!r} as {datatype}, "
                        f"the model declares {declared_inputs[name]}")
        for name, expected in case.outputs.items() if declared_outputs else ():
            if declared_outputs.get(name) != expected.datatype:
                return (f"golden case {case.name} expects output {name!r} as {expected.datatype}, "
                        f"the model declares {declared_outputs.get(name, 'no such output')}")
    return None


async def _golden_case(triton: TritonClient, case: GoldenCase, timeout_s: float,
                       late: LateAnswers | None) -> str | None:
    if case.is_generate:
        return await _generate_case(triton, case, timeout_s)
    if late is None:
        outcome = await triton.infer_case(case, timeout_s=timeout_s)
    else:
        outcome = await late.infer(triton, case, timeout_s)
    problem = _judge_status(case, outcome.status, outcome.error)
    if problem is not None or case.expects_error:
        return problem
    mismatches = compare_outputs(case, outcome.outputs)
    return "; ".join(str(m) for m in mismatches) if mismatches else None


def _judge_status(case: GoldenCase, status: int, error: str) -> str | None:
    """What is wrong with an answer's status (None: nothing); for an error case, its whole verdict."""
    if case.expects_error:
        if status != case.expect_status:
            got = "a normal answer" if status == 200 else f"{status}: {error}"
            return f"expected a {case.expect_status} rejection, got {got}"
        if case.error_contains and case.error_contains not in error:
            return f"expected the error to mention {case.error_contains!r}, got {error!r}"
        return None
    if status != 200:
        return f"Triton answered {status}: {error}"
    return None


async def _generate_case(triton: TritonClient, case: GoldenCase, timeout_s: float) -> str | None:
    """A generate case: its status, Triton's error events, the text and the time bounds. A stream
    that stalls is cut by timeout_s (the probe then counts as timed out)."""
    outcome = await triton.generate_case(case, timeout_s=timeout_s)
    problem = _judge_status(case, outcome.status, outcome.error)
    if problem is not None or case.expects_error:
        return problem
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

    def reconfigure(self, settings: ProbesSection) -> None:
        self._settings = settings

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
