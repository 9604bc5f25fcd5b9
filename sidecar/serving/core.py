"""The serving core: one proxied inference from admission to answer, whatever the wire.

Each front (HTTP in sidecar.fronts.http_routes and http_listener, gRPC in sidecar.fronts.grpc_server)
opens the request's scope (`ServingCore.request`, sidecar.serving.request: ids, log context, drain,
telemetry, refusals, unexpected exceptions), decodes its request into an `Exchange`, calls
`ServingCore.infer` (unary: infer and generate) or `ServingCore.stream` (generate_stream and
ModelStreamInfer), and encodes what comes back: an answer, or a `Refusal` whose `Reason` names the
HTTP status and the gRPC code. Nothing here imports aiohttp or grpc
(import-linter contract "The serving core is wire-free").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import structlog

from sidecar.config import SidecarConfig
from sidecar.golden.cases import GoldenCase
from sidecar.golden.compare import Mismatch
from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.serving.admission import Admission
from sidecar.serving.breaker import Breaker
from sidecar.serving.drift import DriftMonitor, Tensor
from sidecar.serving.filtering import IsHidden, OutputFilter, ResponseFormatError
from sidecar.serving.generation import GenerateLimits
from sidecar.serving.lifecycle import Lifecycle
from sidecar.serving.passive_signals import HealthEvents, PassiveSignals
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.request import RequestWrapper
from sidecar.serving.request_rules import RequestRules, load_schemas
from sidecar.serving.rollouts import GoldenGate, Rollout, Rollouts, compare_answers, compare_texts, tensor_values
from sidecar.serving.routing import DEFAULT, PINNED, SHADOW, Route, Router, pinned_version
from sidecar.serving.shadow import ShadowCalls
from sidecar.serving.specs import FetchDocument, SpecCache
from sidecar.serving.streaming import EventT, OpenStream, StreamExchange
from sidecar.serving.telemetry import RequestContext, RequestTelemetry
from sidecar.serving.validation import CheckedRequest, Limits, ModelSpec
from sidecar.states import ModelStates
from sidecar.tracing.spans import RequestSpans

# numpy is imported inside the functions that use it: a running sidecar (gRPC off) loads none (issue 30).

AnswerT = TypeVar("AnswerT")
PairT = TypeVar("PairT")


def _nothing_hidden(output: str) -> bool:
    return False


def _pair_differences(mine: PairT | None, theirs: PairT | None, served: str, target: str, stable_first: bool,
                      compare: Callable[[PairT, PairT], list[Mismatch]]) -> list[Mismatch]:
    """How the served answer and its shadow differ: one of them refused, or `compare(stable's,
    candidate's)`."""
    if mine is None or theirs is None:
        refused = served if mine is None else target
        return [Mismatch("(status)", f"version {refused} refused a request the other version answered")]
    stable, candidate = (mine, theirs) if stable_first else (theirs, mine)
    return compare(stable, candidate)


def _non_finite(tensors: Sequence[Tensor]) -> bool:
    """Does a decoded answer hold NaN/Inf in a float output?"""
    import numpy as np

    return any(t[1].startswith("FP") and not np.isfinite(tensor_values(t)[3]).all() for t in tensors)


log = structlog.get_logger("sidecar.serving")


@dataclass(frozen=True)
class OutputPolicy:
    """What leaves the pod from one model's answers."""

    #: None when no filtering rule names the model.
    is_hidden: IsHidden | None
    #: Look for NaN/Inf in float outputs (off when the model's golden files expect them).
    check_non_finite: bool


@dataclass
class Screened(Generic[AnswerT]):
    """An answer as it may leave the pod, and what screening found in it."""

    answer: AnswerT
    #: False for an error Triton answered that is the client's to fix (passed on as is).
    success: bool = True
    dropped: list[str] = field(default_factory=list)
    non_finite: list[str] = field(default_factory=list)


class Exchange(Protocol[AnswerT]):
    """One inference on one wire: the front's decoding, upstream call and encoding."""

    def validate(self, spec: ModelSpec) -> CheckedRequest:
        """Raise InvalidRequest (a Refusal) when the request is not one the model accepts."""

    async def send(self, version: str) -> AnswerT:
        """Forward the request to `version` of the model ("" = unversioned: Triton picks), the
        version the router chose; raise UpstreamFailure when no usable answer comes. Called a second
        time, in the background, for a shadow call to another version."""

    def screen(self, answer: AnswerT, policy: OutputPolicy) -> Screened[AnswerT]:
        """Remove hidden outputs and find non-finite ones; raise ResponseFormatError if not v2."""

    def answer_tensors(self, answer: AnswerT) -> tuple[str, Sequence[Tensor]] | None:
        """(version that answered, numeric outputs) of a screened successful answer, for the drift
        monitor; None for an answer that is not a success. Called only for measured requests."""

    def answer_texts(self, answer: AnswerT) -> Mapping[str, str] | None:
        """The outputs of a successful generate answer as text (name -> its JSON), which a rollout
        compares equal / not equal; None for tensor answers (see answer_tensors) and failures."""


class ServingCore:
    """Admission, specs, breakers, screening decisions, passive signals and telemetry, shared by
    every front of one sidecar."""

    def __init__(self, config: SidecarConfig, *, states: ModelStates, metrics: SidecarMetrics,
                 fetch_document: FetchDocument, cases_for: Callable[[str], Sequence[GoldenCase]],
                 events: HealthEvents, rules: Mapping[str, RequestRules] | None = None,
                 drift: DriftMonitor | None = None, golden_gate: GoldenGate | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 lifecycle: Lifecycle | None = None, spans: RequestSpans | None = None) -> None:
        self.config = config
        self.settings = config.proxy
        self.metrics = metrics
        self.filter = OutputFilter(config.filtering.rules)
        self.admission = Admission(states=states, settings=config.proxy, metrics=metrics)
        # JSON Schemas are compiled once, at start; a bad file stops the start (ConfigError names it).
        if rules is None:
            rules = load_schemas(config.validation)
        self.specs = SpecCache(fetch=fetch_document, states=states, limits=Limits.from_settings(config.validation),
                               output_filter=self.filter, rules=rules, retry_after_s=config.proxy.retry_after_s)
        self.signals = PassiveSignals(states=states, failure_threshold=config.proxy.passive_failure_threshold,
                                      events=events)
        self.telemetry = RequestTelemetry(metrics=metrics,
                                          access_log_sample_rate=config.logging.access_log_sample_rate)
        #: Models without a reference cost one set lookup per request (`DriftMonitor.wants`).
        self.drift = drift if drift is not None else DriftMonitor(
            config.drift, {}, count_nan=not config.validation.reject_non_finite)
        #: In-flight accounting for the drain on SIGTERM (the app's, shared with /readyz).
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()
        self.requests = RequestWrapper(telemetry=self.telemetry, lifecycle=self.lifecycle, spans=spans)
        #: `async with core.request(protocol, request_id, traceparent, method=..., path=...) as scope`:
        #: the outer part of every request on every front (sidecar.serving.request).
        self.request = self.requests.open
        self._cases_for = cases_for
        self._events = events
        self._metrics = metrics
        self._states = states
        #: Version rollouts and the router: which version answers; their decision loop runs from the
        #: app (`Rollouts.run`), the candidate's golden gate is the app's injected function.
        self.rollouts = Rollouts(config.rollouts, metrics=metrics, clock=clock, golden_gate=golden_gate,
                                 states=states)
        self.router = Router(states=states, rollouts=self.rollouts, fallback=lambda: self.settings.version_fallback)
        self.shadows = ShadowCalls(limit=config.proxy.max_shadow_in_flight, timeout_s=config.proxy.upstream_timeout_s,
                                   metrics=metrics)
        self.rollouts.add_listener(self.changed)
        self._breakers: dict[str, Breaker] = {}
        self._policies: dict[str, OutputPolicy] = {}
        self._generate_limits: dict[str, GenerateLimits] = {}
        #: Called after what decides how a model is served changed (a reload, a spec dropped): the
        #: Rust front publishes its lanes again at once.
        self._change_listeners: list[Callable[[], None]] = []

    def add_change_listener(self, listener: Callable[[], None]) -> None:
        self._change_listeners.append(listener)

    def changed(self) -> None:
        for listener in self._change_listeners:
            listener()

    # -- the chain of one inference, in order ------------------------------------------------------------

    def resolve(self, ctx: RequestContext, model: str, version: str = "") -> None:
        """Name the request's model in its telemetry, and refuse models the sidecar does not guard."""
        ctx.label = self.admission.label(model)
        self.admission.tracked(model)
        self.admission.check_version(model, version)

    def pinned(self, model: str, path_version: str, header_version: str | None) -> str:
        """The version a request is pinned to (path or `x-model-version`; "" = none), checked."""
        version = pinned_version(path_version, header_version, model)
        self.admission.check_version(model, version)
        return version

    async def infer(self, model: str, version: str, exchange: Exchange[AnswerT], cohort: str = "", *,
                    ctx: RequestContext | None = None) -> AnswerT:
        """route (pin, split, fallback) -> admit (quarantine, hold) -> spec -> validate -> breaker ->
        Triton -> screen -> signals -> drift -> shadow (after the answer, in the background).
        `version` is the client's pin ("" = none), `cohort` the value of the rollout's cohort_key.
        `ctx`: the request's, whose span (when it is traced) gets the route and an event per phase."""
        route = self.router.route(model, version, cohort)
        if route.reason != DEFAULT:
            self.count_route(model, route.version, route.reason)
        # One check for an untraced request; a traced one's span says which version and why, and
        # each phase's end (the Rust lane's events, and the admission's wait: a hold while suspect).
        traced = ctx if ctx is not None and ctx.span is not None else None
        if traced is not None:
            phase = self.requests.phase
            routed: dict[str, str] = {"sidecar.routing.reason": route.reason}
            if route.version:
                routed["sidecar.model.version"] = route.version
            self.requests.annotate(traced, routed)
        try:
            spec = await self.admitted_spec(model, route.version)
        finally:
            if traced is not None:
                phase(traced, "admission")
        checked = exchange.validate(spec)
        if traced is not None:
            phase(traced, "validation")
        in_flight = self.telemetry.in_flight(model)
        rollout = route.rollout
        async with self.breaker(model).slot(model, self.settings.upstream_timeout_s):
            if traced is not None:
                phase(traced, "breaker wait")
            in_flight.inc()
            at_triton = self.admission.sent(model, route.version)
            started = time.perf_counter()
            try:
                answer = await exchange.send(route.version)
                if traced is not None:
                    phase(traced, "upstream call")
            except UpstreamFailure as e:
                if rollout is not None:
                    rollout.answered(route.version, time.perf_counter() - started, error=True)
                raise self.upstream_refusal(model, e) from e
            except asyncio.CancelledError:
                # Cancelled by the model's quarantine (and by nothing else, such as a gone client):
                # answered 503 with Retry-After like any request to a quarantined model.
                task = asyncio.current_task()
                if at_triton.ended is not None and task is not None and task.uncancel() == 0:
                    raise at_triton.ended from None
                raise
            finally:
                self.admission.done(model, at_triton)
                in_flight.dec()
        latency_s = time.perf_counter() - started
        try:
            screened = self.screen(model, answer, exchange)
        except Refusal:
            if rollout is not None:
                rollout.answered(route.version, latency_s, error=True)
            raise
        finally:
            if traced is not None:
                phase(traced, "screening")
        if rollout is not None:
            rollout.answered(route.version, latency_s, error=False)
            target = self.router.shadow_target(route)
            if target and self.shadows.has_room(model):
                self.shadows.start(model, self.shadow(model, route, target, exchange, answer))
        if self.drift.wants(model):
            self.measure_drift(model, spec, checked, screened, exchange)
        return screened

    def count_route(self, model: str, version: str, reason: str) -> None:
        """routed_total; a pinned version the server has not loaded is counted as "other" (metric
        labels stay bounded whatever versions clients name)."""
        if reason == PINNED:
            health = self._states.get(model)
            if health is None or version not in health.loaded_versions:
                version = "other"
        self._metrics.requests.routed(model, version or "default", reason)

    async def shadow(self, model: str, route: Route, target: str, exchange: Exchange[AnswerT], served: AnswerT
                     ) -> None:
        """Send the served request to `target` too and compare the two answers (stable's is the
        reference). Runs after the client got its answer; filtered outputs are compared here and
        never leave the pod."""
        rollout = route.rollout
        assert rollout is not None
        self.count_route(model, target, SHADOW)
        started = time.perf_counter()
        try:
            other = await exchange.send(target)
        except UpstreamFailure:
            rollout.answered(target, time.perf_counter() - started, error=True, served=False)
            return
        latency_s = time.perf_counter() - started
        policy = self.policy(model)
        stable_first = route.version == rollout.settings.stable
        mine, theirs = exchange.answer_tensors(served), exchange.answer_tensors(other)
        if mine is not None or theirs is not None:
            nan = theirs is not None and policy.check_non_finite and _non_finite(theirs[1])
            rollout.answered(target, latency_s, error=nan, served=False)
            differences = _pair_differences(mine, theirs, route.version, target, stable_first,
                                            lambda s, c: compare_answers(s[1], c[1], rollout.settings))
        else:
            # Generate answers are text: equal or not (their NaN screening is the client path's).
            mine_text, theirs_text = exchange.answer_texts(served), exchange.answer_texts(other)
            if mine_text is None and theirs_text is None:
                return  # both refused the request (the client's to fix): nothing to compare
            rollout.answered(target, latency_s, error=False, served=False)
            differences = _pair_differences(mine_text, theirs_text, route.version, target, stable_first,
                                            compare_texts)
        self._count_compared(model, rollout, differences)

    def _count_compared(self, model: str, rollout: Rollout, differences: Sequence[Mismatch]) -> None:
        """One compared pair as evidence (either half's shadow): the rollout's counts and decision,
        and rollout_compared_total. A filtered output's difference is named, never quoted."""
        hidden = self.policy(model).is_hidden or _nothing_hidden
        differs = rollout.compared(differences, hidden=hidden)
        if differs is None:
            return  # the rollout moved on (aborted, promoted) while this call ran
        self._metrics.rollout_compared.labels(model=model, candidate=rollout.settings.candidate,
                                              outcome="differs" if differs else "same").inc()

    def front_answered(self, model: str, version: str, latency_s: float, error: bool) -> None:
        """A rollout model's answer the Rust front served (dataplane/src/front/shadow.rs)."""
        rollout = self.rollouts.get(model)
        if rollout is not None:
            rollout.answered(version, latency_s, error=error)

    def front_shadow_ended(self, model: str, target: str, latency_s: float, outcome: str, nan: bool,
                           differences: Sequence[tuple[str, str]]) -> None:
        """A shadow call the Rust front made ended: `outcome` failed (no answer: the target's
        error), nothing (both versions refused the request) or compared (`differences` as
        (output, message), `nan`: NaN/Inf in the target's answer), as `shadow` judges its own."""
        rollout = self.rollouts.get(model)
        if rollout is None or outcome == "nothing":
            return
        if outcome == "failed":
            rollout.answered(target, latency_s, error=True, served=False)
            return
        rollout.answered(target, latency_s, error=nan, served=False)
        self._count_compared(model, rollout, [Mismatch(output, message) for output, message in differences])

    def stream(self, exchange: StreamExchange[EventT], *, started: float) -> OpenStream[EventT]:
        """A stream (HTTP generate_stream, gRPC ModelStreamInfer): `async with` it, `join` each
        request's model, `open` it, then iterate its events (sidecar.serving.streaming).
        `started` is the request's perf_counter start, for the first-event histogram."""
        return OpenStream(self, exchange, started=started)

    async def admitted_spec(self, model: str, version: str) -> ModelSpec:
        """Wait for admission, then the model's spec (streams call this for every request)."""
        await self.admission.admit(model, version)
        try:
            return await self.specs.get(model, version)
        except UpstreamFailure as e:
            raise self.upstream_refusal(model, e, signal=False) from e

    def screen(self, model: str, answer: AnswerT, exchange: Exchange[AnswerT]) -> AnswerT:
        """The answer as it may leave the pod; a NaN/Inf answer is withheld and reported."""
        try:
            screened = exchange.screen(answer, self.policy(model))
        except ResponseFormatError as e:
            self.signals.upstream_failed(model, str(e))
            raise Refusal(Reason.TRITON_BAD_ANSWER, f"model {model}: {e}", model=model, before_triton=False) from e
        if screened.dropped:
            self.telemetry.filtered(model, screened.dropped)
        if screened.non_finite:
            self.non_finite_answer(model, screened.non_finite)
        else:
            self.signals.upstream_answered(model)
        return screened.answer

    def non_finite_answer(self, model: str, outputs: Sequence[str]) -> None:
        """An answer holding NaN/Inf in `outputs`: re-check the model, and withhold the answer
        (Refusal) with proxy.block_non_finite_outputs."""
        self.signals.non_finite_answer(model, outputs)
        if self.settings.block_non_finite_outputs:
            raise Refusal(Reason.NON_FINITE_OUTPUT, f"model {model} answered NaN/Inf in {', '.join(outputs)}; the "
                                                    "answer was withheld and the model is being re-checked",
                          model=model, before_triton=False, outputs=list(outputs))

    def measure_drift(self, model: str, spec: ModelSpec, checked: CheckedRequest, answer: AnswerT,
                      exchange: Exchange[AnswerT]) -> None:
        """Count a sampled answered request in the model's drift window. Measuring never fails a
        request: an unexpected error is logged (no tensor data) and the answer goes out."""
        try:
            decoded = exchange.answer_tensors(answer)
            if decoded is None:
                return
            answered_version, outputs = decoded
            self.drift.observe(model, answered_version or spec.version, checked.inputs, outputs,
                               batched=spec.max_batch_size > 0)
        except Exception as e:
            log.warning("drift_measure_failed", model=model, cause=repr(e)[:200])

    # -- pieces ---------------------------------------------------------------------------------------------

    def breaker(self, model: str) -> Breaker:
        breaker = self._breakers.get(model)
        if breaker is None:
            breaker = self._breakers[model] = Breaker(self.settings.max_in_flight_per_model,
                                                      self.settings.queue_size_per_model,
                                                      self.telemetry.queued(model))
        return breaker

    def policy(self, model: str) -> OutputPolicy:
        policy = self._policies.get(model)
        if policy is None:
            allows_non_finite = any(c.allows_non_finite for c in self._cases_for(model))
            policy = self._policies[model] = OutputPolicy(self.filter.for_model(model), not allows_non_finite)
        return policy

    def generate_limits(self, model: str) -> GenerateLimits:
        """What a generate request to `model` may ask for, built once per model and configuration
        (its data-plane copy with it)."""
        limits = self._generate_limits.get(model)
        if limits is None:
            limits = self._generate_limits[model] = GenerateLimits.for_model(
                self.config.generation, model, self.config.validation.max_bytes_element)
        return limits

    def reconfigure(self, config: SidecarConfig) -> None:
        """Validation and filtering from a reloaded config. The request schema files are compiled
        first: a broken one raises ConfigError and nothing changes. Triton's URL and the proxy's
        settings are start-up only (the reload keeps them), so breakers and admission stay."""
        output_filter = OutputFilter(config.filtering.rules)
        rules = load_schemas(config.validation)
        self.config = config
        self.filter = output_filter
        self.specs.reconfigure(limits=Limits.from_settings(config.validation), output_filter=output_filter,
                               rules=rules)
        self.drift.reconfigure(config.drift, count_nan=not config.validation.reject_non_finite)
        self.rollouts.reconfigure(config.rollouts)
        self._policies.clear()
        self._generate_limits.clear()
        self.changed()

    def forget_model(self, model: str) -> None:
        """Drop what is cached about a model whose golden files or spec changed."""
        self._policies.pop(model, None)
        self.specs.forget(model)
        self.changed()

    def upstream_refusal(self, model: str, failure: UpstreamFailure, *, signal: bool = True) -> Refusal:
        """The refusal for a call to Triton that gave no usable answer, and the signal it sends."""
        if failure.kind is FailureKind.UNREACHABLE:
            self._events.triton_unreachable(f"proxied request could not connect: {cut(failure.detail, 160)}")
            return Refusal(Reason.TRITON_UNREACHABLE, "Triton is unreachable from the sidecar", model=model,
                           retry_after=self.settings.retry_after_s, before_triton=False)
        extra: dict[str, int] = {}
        if failure.kind is FailureKind.TIMEOUT:
            refusal = Refusal(Reason.TRITON_TIMEOUT, f"Triton did not answer within the time limit "
                                                     f"({model or 'server'})", model=model, before_triton=False)
            cause = refusal.message
        elif failure.kind is FailureKind.SERVER_ERROR:
            answered = str(failure.status) if failure.status else "with an error"
            cause = f"Triton answered {answered}: {failure.detail}"
            if failure.status:
                extra["triton_status"] = failure.status
            refusal = Refusal(Reason.TRITON_ERROR, f"Triton answered {answered} for model {model}: {failure.detail}",
                              model=model, before_triton=False, **extra)
        else:
            refusal = Refusal(Reason.TRITON_BAD_ANSWER, f"Triton dropped the connection: {cut(failure.detail)}",
                              model=model, before_triton=False)
            cause = refusal.message
        if signal and model:
            self.signals.upstream_failed(model, cause, stub_dead=failure.stub_dead)
        return refusal

