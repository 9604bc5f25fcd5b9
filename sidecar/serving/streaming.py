"""Streams, wire-free: one stream from admission to its last event, whatever the wire.

HTTP generate_stream (server-sent events) and gRPC ModelStreamInfer both run through `OpenStream`,
made by `ServingCore.stream(exchange)`. The front decodes its request and encodes events; the rules
live here, written once:

    join(model): admission (quarantine, hold) -> spec -> validate -> breaker slot held for the
    stream -> streams_in_flight  |  open: Triton  |  each event: screened (hidden outputs removed,
    NaN/Inf, Triton's own error events) -> passive signals  |  ends: Triton's end, a drop, a
    silence longer than the exchange's bound (generation.idle_timeout_s), or at once when a joined
    model stops being trusted (Admission.until_untrusted)

Between Triton's side (a pump task reading the exchange) and the client's (the front iterating the
stream) sits a bounded queue: a client that reads slower than the model generates stops the pump
after `QUEUE_BATCHES` batches, so the upstream socket stops being read and Triton is slowed down,
instead of the sidecar buffering the whole generation in memory (issue 19).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import structlog

from sidecar.messages import cut
from sidecar.serving.filtering import ResponseFormatError
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.validation import ModelSpec

if TYPE_CHECKING:
    from sidecar.serving.core import OutputPolicy, ServingCore

log = structlog.get_logger("sidecar.proxy")

EventT = TypeVar("EventT")


#: Batches of events (one per read from Triton, usually one event each) queued for a slow client
#: before the pump stops reading Triton: enough to ride out a client's short stall, bounded so one
#: stuck client holds at most this many reads' worth of memory (each read is at most 64 KiB on HTTP).
QUEUE_BATCHES = 64


@dataclass
class EventVerdict(Generic[EventT]):
    """What screening found in one event that needed a look (the exchange's `screen`)."""

    #: The event as it may leave the pod (hidden outputs removed).
    event: EventT
    #: The model that answered ("" when the event does not say: the stream's model is meant).
    model: str = ""
    dropped: list[str] = field(default_factory=list)
    non_finite: list[str] = field(default_factory=list)
    #: Triton's own error event, and whether it is Triton's verdict that the model's stub died.
    error: str = ""
    stub_dead: bool = False
    #: The request the event answers, when the wire names it (gRPC's infer_response.id).
    request_id: str = ""


class StreamExchange(Protocol[EventT]):
    """One stream on one wire: the front's upstream calls and its event codec."""

    async def open(self) -> bool:
        """Send the request to Triton. True once the stream began; False when Triton refused it
        with an answer the front passes on itself. Raise UpstreamFailure when no answer came."""

    async def receive(self) -> Sequence[EventT]:
        """The events that arrived, waiting for at least one; empty at the stream's end. Raise
        UpstreamFailure when the stream breaks."""

    def screen(self, event: EventT, policy_for: Callable[[str], OutputPolicy]) -> EventVerdict[EventT] | None:
        """None when the event leaves as it is (the common case, kept cheap); raise
        ResponseFormatError when it is not the wire's format."""

    def in_stream(self, refusal: Refusal, verdict: EventVerdict[EventT] | None) -> EventT | None:
        """The event that says `refusal` inside the stream and lets it go on, or None: the
        refusal ends the stream."""

    def silence_bound(self, events: int) -> float | None:
        """Longest wait (s) for the next event after `events` were sent; None while the stream
        owes nothing (a gRPC stream whose requests were all answered)."""

    def close(self) -> None:
        """End Triton's side unless it ended by itself (the upstream connection is aborted)."""


class OpenStream(Generic[EventT]):
    """`async with core.stream(exchange) as stream`: join, open, then `async for batch in stream`.

    `ending` is None after a complete stream, else the Refusal that ended it (to be said in-stream
    when the front already began answering)."""

    def __init__(self, core: ServingCore, exchange: StreamExchange[EventT], *, started: float) -> None:
        self._core = core
        self._exchange = exchange
        self._started = started
        self._loop = asyncio.get_running_loop()
        self.ending: Refusal | None = None
        self.events = 0
        #: (model, version) joined, in order; the first is the stream's model.
        self._joined: list[tuple[str, str]] = []
        self._slots: list[str] = []
        self._watchers: list[asyncio.Future[None]] = []
        self._batches: collections.deque[list[EventT]] = collections.deque()
        self._ended = False
        self._began = False
        self._getter: asyncio.Future[None] | None = None
        self._putter: asyncio.Future[None] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._reading = False
        self._last = self._loop.time()
        self._last_sent = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._counts = core.metrics.requests
        self._armed_at = 0.0
        #: Events read from Triton (self.events counts those the client took).
        self._received = 0

    @property
    def model(self) -> str:
        return self._joined[0][0] if self._joined else ""

    async def __aenter__(self) -> OpenStream[EventT]:
        return self

    async def join(self, model: str, version: str, validate: Callable[[ModelSpec], None]) -> ModelSpec:
        """Admit one request of the stream (every request of a gRPC stream comes here): the model's
        spec, the request checked against it; the first request for a model takes its breaker slot
        for the rest of the stream and counts in its streams_in_flight."""
        core = self._core
        spec = await core.admitted_spec(model, version)
        validate(spec)
        if (model, version) in self._joined:
            return spec
        if model not in self._slots:
            await core.breaker(model).acquire(model, core.settings.upstream_timeout_s)
            self._slots.append(model)
            core.metrics.requests.stream_opened(model, 1)
            if core.admission.serves(model):  # a model trusted for this version alone is checked per batch
                watcher = asyncio.ensure_future(core.admission.until_untrusted(model))
                watcher.add_done_callback(lambda f, m=model: None if f.cancelled() else self._untrusted(m))
                self._watchers.append(watcher)
        self._joined.append((model, version))
        return spec

    async def open(self) -> bool:
        """Open Triton's side; False when Triton refused with an answer the front passes on. Once
        open, the events flow to `async for`."""
        try:
            began = await self._exchange.open()
        except UpstreamFailure as e:
            raise self._core.upstream_refusal(self.model, e) from e
        if began:
            self._began = True
            self._last = self._loop.time()
            self._pump = asyncio.ensure_future(self._run_pump())
            self._arm(self._exchange.silence_bound(0))
        return began

    def emit(self, event: EventT) -> None:
        """An event of the sidecar's own (a gRPC request refused in-stream): queued past the bound,
        as it answers a request the client sent."""
        if not self._ended:
            self._batches.append([event])
            self._wake_getter()

    def end(self, refusal: Refusal) -> None:
        """End the stream at once with `refusal` (queued events are dropped)."""
        self._finish(refusal, at_once=True)

    def touch(self) -> None:
        """The silence bound counts from now (a request was just sent on a stream that owed nothing)."""
        self._last = self._loop.time()
        if self._began:
            self._tighten()

    # -- the client's side ------------------------------------------------------------------------------

    def __aiter__(self) -> OpenStream[EventT]:
        return self

    async def __anext__(self) -> list[EventT]:
        while not self._batches:
            if self._ended:
                raise StopAsyncIteration
            self._getter = self._loop.create_future()
            try:
                await self._getter
            finally:
                self._getter = None
        batch = self._batches.popleft()
        putter = self._putter
        if putter is not None and not putter.done():
            putter.set_result(None)
        self._observe(len(batch))
        return batch

    def _observe(self, count: int) -> None:
        now = time.perf_counter()
        # The data plane's families (atomics), shared with the Rust front's generate_stream.
        if self.events:
            self._counts.stream_inter_event(self.model, now - self._last_sent)
        else:
            self._counts.stream_first_event(self.model, now - self._started)
        self.events += count
        self._last_sent = now

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        if kind is not None and not self._ended and issubclass(kind, (ConnectionError, asyncio.CancelledError)):
            self.ending = Refusal(Reason.CLIENT_GONE, "client closed the stream", model=self.model,
                                  before_triton=False)
            log.info("client_disconnected", model=self.model, events=self.events,
                     cause="client closed the connection during a stream; upstream request cancelled")
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        self._exchange.close()
        for watcher in self._watchers:
            watcher.cancel()
        core = self._core
        for model in self._slots:
            core.breaker(model).release()
            core.metrics.requests.stream_opened(model, -1)
        if not self._began or not self._joined:
            return  # refused before it began (the front answered a status), or no request was admitted
        model, ending = self.model, self.ending
        core.metrics.requests.stream_ended(model, self.events, "complete" if ending is None else ending.reason.value)
        if ending is not None and ending.reason is not Reason.CLIENT_GONE:
            log.warning("stream_ended", model=model, reason=ending.reason.value, events=self.events,
                        cause=cut(ending.message, 300))

    # -- Triton's side ----------------------------------------------------------------------------------

    async def _run_pump(self) -> None:
        """Read, screen and queue events until the stream ends; the queue bounds how far it runs ahead."""
        exchange, core = self._exchange, self._core
        try:
            while not self._ended:
                self._reading = True
                try:
                    events = await exchange.receive()
                finally:
                    self._reading = False
                if not events:
                    for model, _ in self._joined:
                        core.signals.upstream_answered(model)
                    self._finish(None)
                    return
                self._last = self._loop.time()
                self._received += len(events)
                out, ending = self._screened(events)
                if out:
                    self._batches.append(out)
                    self._wake_getter()
                    self._tighten()
                if ending is None:
                    ending = self._distrusted()
                if ending is not None:
                    self._finish(ending)
                    return
                if len(self._batches) >= QUEUE_BATCHES:
                    await self._room()
        except UpstreamFailure as e:
            self._finish(core.upstream_refusal(self.model, e))
        except asyncio.CancelledError:
            if not self._ended:
                raise
        except Exception as e:
            # A pump that dies must still end its stream (the client would wait for ever).
            log.error("stream_pump_crashed", model=self.model, cause=repr(e), exc_info=True)
            self._finish(Refusal(Reason.TRITON_BAD_ANSWER, f"the stream from model {self.model} could not be "
                                                           f"relayed: {cut(repr(e))}", model=self.model,
                                 before_triton=False))

    async def _room(self) -> None:
        """Wait until the client took a batch (back-pressure); the silence bound restarts after."""
        while len(self._batches) >= QUEUE_BATCHES and not self._ended:
            self._putter = self._loop.create_future()
            try:
                await self._putter
            finally:
                self._putter = None
        self._last = self._loop.time()

    def _screened(self, events: Sequence[EventT]) -> tuple[list[EventT], Refusal | None]:
        exchange, policy_for = self._exchange, self._core.policy
        out: list[EventT] = []
        for event in events:
            try:
                verdict = exchange.screen(event, policy_for)
            except ResponseFormatError as e:
                self._core.signals.upstream_failed(self.model, str(e))
                refusal = Refusal(Reason.TRITON_BAD_ANSWER, f"model {self.model}: {e}", model=self.model,
                                  before_triton=False)
                verdict = None
            else:
                if verdict is None:
                    out.append(event)
                    continue
                refusal = self._judge(verdict)
                if refusal is None:
                    out.append(verdict.event)
                    continue
            said = exchange.in_stream(refusal, verdict)
            if said is None:
                return out, refusal
            out.append(said)
        return out, None

    def _judge(self, verdict: EventVerdict[EventT]) -> Refusal | None:
        """The refusal an event carries (Triton's error, NaN/Inf withheld), after its signals."""
        core = self._core
        model = verdict.model or (self.model if len(self._slots) == 1 else "")
        if verdict.dropped:
            core.telemetry.filtered(model, verdict.dropped)
        if verdict.error:
            failure = UpstreamFailure(FailureKind.SERVER_ERROR, cut(verdict.error, 300), stub_dead=verdict.stub_dead)
            return core.upstream_refusal(model, failure, signal=bool(model))
        if verdict.non_finite:
            try:
                core.non_finite_answer(model, verdict.non_finite)
            except Refusal as refusal:
                return refusal
        elif model:
            core.signals.upstream_answered(model)
        return None

    def _distrusted(self) -> Refusal | None:
        admission = self._core.admission
        for model, version in self._joined:
            if not admission.trusted(model, version):
                return self._quarantined(model)
        return None

    def _quarantined(self, model: str) -> Refusal:
        refusal = self._core.admission.quarantine_refusal(model)
        refusal.before_triton = False
        return refusal

    def _untrusted(self, model: str) -> None:
        if not self._ended:
            self.end(self._quarantined(model))

    # -- silence --------------------------------------------------------------------------------------------

    def _arm(self, bound: float | None) -> None:
        """One timer per stream, moved lazily: an event only sets a float (`_last`), where a timeout
        per read would schedule and cancel a timer for every event."""
        if self._timer is not None:
            self._timer.cancel()
        wait = bound if bound is not None else self._core.config.generation.idle_timeout_s
        self._armed_at = max(self._last + wait, self._loop.time() + 0.01)
        self._timer = self._loop.call_at(self._armed_at, self._check_silence)

    def _tighten(self) -> None:
        """Re-arm only when the bound now ends before the timer does (the first event's bound is
        longer than the next ones'): once per stream, not once per event."""
        bound = self._exchange.silence_bound(self._received)
        if bound is not None and self._last + bound < self._armed_at and not self._ended:
            self._arm(bound)

    def _check_silence(self) -> None:
        self._timer = None
        if self._ended:
            return
        bound = self._exchange.silence_bound(self._received)
        if bound is not None and self._reading and self._loop.time() >= self._last + bound:
            model = self.model
            ending = Refusal(Reason.STREAM_IDLE, f"model {model} sent no event for {bound:g} s after {self.events} "
                                                 "event(s) (generation.idle_timeout_s); the stream was ended",
                             model=model, before_triton=False)
            if model:
                self._core.signals.upstream_failed(model, ending.message)
            self._finish(ending)
            return
        self._arm(bound)

    # -- ending ----------------------------------------------------------------------------------------------

    def _finish(self, ending: Refusal | None, *, at_once: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        self.ending = ending
        if at_once:
            self._batches.clear()
        pump = self._pump
        if pump is not None and not pump.done() and pump is not asyncio.current_task():
            pump.cancel()  # Triton's side stops now; the exchange's close() ends it upstream
        putter = self._putter
        if putter is not None and not putter.done():
            putter.set_result(None)
        self._wake_getter()

    def _wake_getter(self) -> None:
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)
