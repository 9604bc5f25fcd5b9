"""The serving core: one proxied inference from admission to answer, whatever the wire.

Each front (HTTP in sidecar.fronts.http_routes, gRPC in sidecar.fronts.grpc_server) only decodes its
request into an `Exchange`, calls `ServingCore.infer` (unary: infer and generate) or
`ServingCore.stream` (generate_stream and ModelStreamInfer), and encodes what comes back: an answer,
or a `Refusal` whose `Reason` names the HTTP status and the gRPC code. Nothing here imports aiohttp or grpc
(import-linter contract "The serving core is wire-free").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from sidecar.config import SidecarConfig
from sidecar.golden.cases import GoldenCase
from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.serving.admission import Admission
from sidecar.serving.breaker import Breaker
from sidecar.serving.filtering import IsHidden, OutputFilter, ResponseFormatError
from sidecar.serving.passive_signals import PassiveSignals
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.request_rules import RequestRules, load_schemas
from sidecar.serving.specs import FetchDocument, SpecCache
from sidecar.serving.streaming import EventT, OpenStream, StreamExchange
from sidecar.serving.telemetry import RequestContext, RequestTelemetry
from sidecar.serving.validation import Limits, ModelSpec
from sidecar.states import ModelStates

AnswerT = TypeVar("AnswerT")


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

    def validate(self, spec: ModelSpec) -> None:
        """Raise InvalidRequest (a Refusal) when the request is not one the model accepts."""

    async def send(self) -> AnswerT:
        """Forward the request to Triton; raise UpstreamFailure when no usable answer comes."""

    def screen(self, answer: AnswerT, policy: OutputPolicy) -> Screened[AnswerT]:
        """Remove hidden outputs and find non-finite ones; raise ResponseFormatError if not v2."""


class ServingCore:
    """Admission, specs, breakers, screening decisions, passive signals and telemetry, shared by
    every front of one sidecar."""

    def __init__(self, config: SidecarConfig, *, states: ModelStates, metrics: SidecarMetrics,
                 fetch_document: FetchDocument, cases_for: Callable[[str], Sequence[GoldenCase]],
                 note_stub_dead: Callable[[str], None], probe_soon: Callable[[str], None],
                 mark_unreachable: Callable[[str], None],
                 rules: Mapping[str, RequestRules] | None = None) -> None:
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
                                      note_stub_dead=note_stub_dead, probe_soon=probe_soon)
        self.telemetry = RequestTelemetry(metrics=metrics,
                                          access_log_sample_rate=config.logging.access_log_sample_rate)
        self._cases_for = cases_for
        self._mark_unreachable = mark_unreachable
        self._breakers: dict[str, Breaker] = {}
        self._policies: dict[str, OutputPolicy] = {}

    # -- the chain of one inference, in order ------------------------------------------------------------

    def resolve(self, ctx: RequestContext, model: str, version: str = "") -> None:
        """Name the request's model in its telemetry, and refuse models the sidecar does not guard."""
        ctx.label = self.admission.label(model)
        self.admission.tracked(model)
        self.admission.check_version(model, version)

    async def infer(self, model: str, version: str, exchange: Exchange[AnswerT]) -> AnswerT:
        """admit (quarantine, hold) -> spec -> validate -> breaker -> Triton -> screen -> signals."""
        spec = await self.admitted_spec(model, version)
        exchange.validate(spec)
        in_flight = self.telemetry.in_flight(model)
        async with self.breaker(model).slot(model, self.settings.upstream_timeout_s):
            in_flight.inc()
            try:
                answer = await exchange.send()
            except UpstreamFailure as e:
                raise self.upstream_refusal(model, e) from e
            finally:
                in_flight.dec()
        return self.screen(model, answer, exchange)

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

    # -- pieces ---------------------------------------------------------------------------------------------

    def breaker(self, model: str) -> Breaker:
        breaker = self._breakers.get(model)
        if breaker is None:
            breaker = self._breakers[model] = Breaker(self.settings.max_in_flight_per_model,
                                                      self.settings.queue_size_per_model)
        return breaker

    def policy(self, model: str) -> OutputPolicy:
        policy = self._policies.get(model)
        if policy is None:
            allows_non_finite = any(c.allows_non_finite for c in self._cases_for(model))
            policy = self._policies[model] = OutputPolicy(self.filter.for_model(model), not allows_non_finite)
        return policy

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
        self._policies.clear()

    def forget_model(self, model: str) -> None:
        """Drop what is cached about a model whose golden files or spec changed."""
        self._policies.pop(model, None)
        self.specs.forget(model)

    def upstream_refusal(self, model: str, failure: UpstreamFailure, *, signal: bool = True) -> Refusal:
        """The refusal for a call to Triton that gave no usable answer, and the signal it sends."""
        if failure.kind is FailureKind.UNREACHABLE:
            self._mark_unreachable(f"proxied request could not connect: {cut(failure.detail, 160)}")
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

