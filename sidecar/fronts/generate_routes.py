"""The generate extension on the HTTP front: POST .../generate and .../generate_stream.

LLM backends on Triton (vLLM, TensorRT-LLM, decoupled python models) answer through these. Each
request runs the serving core's chain, as /infer does, in this order:

    model guarded (404) -> body read (415, 413, 408) -> admission: quarantine 503 + Retry-After
    or hold -> the model's spec -> the generate body check (400 naming the field) -> breaker slot
    (held for the whole stream) -> Triton -> each answer screened -> passive signals

generate_stream is passed on event by event: each event is written to the client as soon as its
blank line arrives from Triton, never buffered behind the next. Once the 200 is sent, a failure can
only be said inside the stream: an error event `data: {"error", "reason", "model"}` (the shape of
Triton's own error events) ends it, for a stall longer than `generation.idle_timeout_s`, a stream
Triton breaks off, Triton's own error event, NaN/Inf in an event, or the model leaving service. A
client that disconnects cancels the upstream request (the connection to Triton is closed).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from sidecar.fronts.appkeys import METRICS, SERVING, UPSTREAM
from sidecar.fronts.http_routes import (
    _model_and_version,
    _proxied,
    _read_body,
    forwarded_headers,
    model_path,
    upstream_failure,
)
from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.sse import EventSplitter, sse_event
from sidecar.protocol.triton_errors import StubUnhealthy, triton_error
from sidecar.serving.core import OutputPolicy, ServingCore
from sidecar.serving.filtering import ResponseFormatError
from sidecar.serving.generation import (
    GenerateLimits,
    ScreenedEvent,
    check_generate_request,
    error_event,
    is_several_responses_error,
    needs_screening,
    screen_event,
)
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.specs import triton_error_message
from sidecar.serving.telemetry import RequestContext

log = structlog.get_logger("sidecar.proxy")


#: Largest error answer read from Triton before a stream begins (its error bodies are one line).
MAX_ERROR_BODY = 64 * 1024


#: Bytes read from Triton at a time: an event is a few hundred bytes; the read returns as soon as
#: any bytes are there, so this only bounds a burst.
READ_CHUNK = 64 * 1024


def add_generate_routes(app: web.Application) -> None:
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_post(prefix + "/generate", _proxied(generate))
        app.router.add_post(prefix + "/generate_stream", _proxied(generate_stream))


class _Request:
    """What both endpoints do before Triton: guard, read, admit, check."""

    def __init__(self, request: web.Request, ctx: RequestContext, endpoint: str) -> None:
        self.request = request
        self.ctx = ctx
        self.core: ServingCore = request.app[SERVING]
        self.model, self.version = _model_and_version(request, ctx)
        self.url = self.core.config.triton.url.rstrip("/") + model_path(self.model, self.version) + "/" + endpoint
        self.headers = {"X-Request-ID": ctx.request_id, "Accept-Encoding": "identity",
                        "Content-Type": "application/json", **forwarded_headers(request.headers)}

    async def checked_body(self) -> bytes:
        core = self.core
        body = await _read_body(self.request, core, self.model)
        spec = await core.admitted_spec(self.model, self.version)
        limits = GenerateLimits.for_model(core.config.generation, self.model,
                                          core.config.validation.max_bytes_element)
        check_generate_request(spec, body, limits)
        return body

    def failure(self, status: int, body: bytes) -> Refusal:
        """A refusal for Triton's error answer: its 4xx passed on, a server fault as the core's 502.
        A dead stub is a server fault whatever the status (generate_stream answers it with 400)."""
        message = _error_message(body)
        stub_dead = _stub_dead(status, message)
        if status >= 500 or stub_dead:
            failure = UpstreamFailure(FailureKind.SERVER_ERROR, message, status=status, stub_dead=stub_dead)
            return self.core.upstream_refusal(self.model, failure)
        return Refusal(Reason.TRITON_ERROR, message, model=self.model, before_triton=False, triton_status=status)


def _passed_on(status: int, body: bytes) -> bool:
    """Triton's 4xx for the client to read as it is: not a dead stub (Triton says that with 400 too)."""
    return status < 500 and not _stub_dead(status, _error_message(body))


def _stub_dead(status: int, message: str) -> bool:
    return isinstance(triton_error(status, message), StubUnhealthy)


def _error_message(body: bytes) -> str:
    """Triton's error text, from a JSON body or from a `data: {...}` event body."""
    text = body.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    return triton_error_message(text)


async def generate(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    call = _Request(request, ctx, "generate")
    core, model = call.core, call.model
    body = await call.checked_body()
    timeout = aiohttp.ClientTimeout(total=core.settings.upstream_timeout_s, connect=core.settings.connect_timeout_s)
    in_flight = core.telemetry.in_flight(model)
    async with core.breaker(model).slot(model, core.settings.upstream_timeout_s):
        in_flight.inc()
        try:
            async with request.app[UPSTREAM].post(call.url, data=body, headers=call.headers,
                                                  timeout=timeout) as response:
                status, answer = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise core.upstream_refusal(model, upstream_failure(e)) from e
        finally:
            in_flight.dec()
    if status != 200:
        if _passed_on(status, answer):
            return web.Response(status=status, body=answer, content_type="application/json")
        raise call.failure(status, answer)
    screened = _screen(core, model, answer)
    if screened.error:
        # Triton answers 200 with {"error": ...} when generate meets a model that sent several
        # responses (a decoupled model): the client must use generate_stream.
        if is_several_responses_error(screened.error):
            raise Refusal(Reason.STREAMING_MODEL, f"model {model} streams several responses per request: "
                                                  "call .../generate_stream (Triton said: "
                                                  f"{cut(screened.error, 200)})", model=model, before_triton=False)
        raise call.failure(502, answer)
    _refuse_non_finite(core, model, screened)
    core.signals.upstream_answered(model)
    return web.Response(status=200, body=screened.data, content_type="application/json")


def _screen(core: ServingCore, model: str, data: bytes) -> ScreenedEvent:
    policy = core.policy(model)
    try:
        screened = screen_event(data, is_hidden=policy.is_hidden, check_non_finite=policy.check_non_finite)
    except ResponseFormatError as e:
        core.signals.upstream_failed(model, str(e))
        raise Refusal(Reason.TRITON_BAD_ANSWER, f"model {model}: {e}", model=model, before_triton=False) from e
    if screened.dropped:
        core.telemetry.filtered(model, screened.dropped)
    return screened


def _refuse_non_finite(core: ServingCore, model: str, screened: ScreenedEvent) -> None:
    if screened.non_finite:
        core.non_finite_answer(model, screened.non_finite)


async def generate_stream(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    call = _Request(request, ctx, "generate_stream")
    core, model = call.core, call.model
    metrics: SidecarMetrics = request.app[METRICS]
    body = await call.checked_body()
    settings = core.settings
    # No total bound: a stream lasts as long as the model generates; the first event is bounded by
    # upstream_timeout_s and every later one by generation.idle_timeout_s, below.
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s)
    in_flight = metrics.streams_in_flight.labels(model=model)
    async with core.breaker(model).slot(model, settings.upstream_timeout_s):
        in_flight.inc()
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout(settings.upstream_timeout_s):
                    upstream = await request.app[UPSTREAM].post(call.url, data=body, headers=call.headers,
                                                                timeout=timeout)
                    if upstream.status != 200:
                        answer = await upstream.content.read(MAX_ERROR_BODY)
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                raise core.upstream_refusal(model, upstream_failure(e)) from e
            if upstream.status != 200:
                if _passed_on(upstream.status, answer):
                    return web.json_response({"error": _error_message(answer)}, status=upstream.status)
                raise call.failure(upstream.status, answer)
            return await _relay(request, call, upstream, metrics)
        finally:
            in_flight.dec()
            if upstream is not None:
                if upstream.content.at_eof():
                    upstream.release()  # read to its end: the connection goes back to the pool
                else:
                    upstream.close()  # cut short: Triton sees its connection close and ends the request


async def _relay(request: web.Request, call: _Request, upstream: aiohttp.ClientResponse,
                 metrics: SidecarMetrics) -> web.StreamResponse:
    core, model, ctx = call.core, call.model, call.ctx
    response = _EventStream(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                 "Cache-Control": "no-cache", "X-Request-ID": ctx.request_id})
    await response.prepare(request)
    ctx.answered(200)  # the status is sent: an unexpected error from here on can only cut the stream
    policy = core.policy(model)
    idle_s = core.config.generation.idle_timeout_s
    splitter = EventSplitter()
    events, last = 0, 0.0
    first_event = metrics.stream_first_event.labels(model=model)
    inter_event = metrics.stream_inter_event.labels(model=model)
    ending: Refusal | None = None
    content = upstream.content
    task = asyncio.current_task()
    assert task is not None
    watch = _IdleWatch(task, core.settings.upstream_timeout_s)
    # A model that stops being trusted ends its open streams at once, even a stalled one (between
    # events the check after each write does it).
    reading = False
    untrusted: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # stays pending
    if core.admission.serves(model):  # a stream admitted for its version alone is checked per event
        untrusted = asyncio.ensure_future(core.admission.until_untrusted(model))
        untrusted.add_done_callback(lambda f: task.cancel() if reading and not f.cancelled() else None)
    try:
        while ending is None:
            try:
                reading = True
                chunk = await content.readany()
            except asyncio.CancelledError:
                if untrusted.done() and not untrusted.cancelled() and task.uncancel() == 0:
                    ending = core.admission.quarantine_refusal(model)
                    ending.before_triton = False
                    break
                if not (watch.fired and task.uncancel() == 0):
                    raise  # the client left: aiohttp cancelled the handler
                waited = idle_s if events else core.settings.upstream_timeout_s
                ending = Refusal(Reason.STREAM_IDLE, f"model {model} sent no event for {waited:g} s after "
                                                     f"{events} event(s) (generation.idle_timeout_s); the stream "
                                                     "was ended", model=model, before_triton=False)
                core.signals.upstream_failed(model, ending.message)
                break
            except (aiohttp.ClientError, OSError) as e:
                ending = core.upstream_refusal(model, UpstreamFailure(FailureKind.DROPPED, type(e).__name__))
                break
            finally:
                reading = False
            if not chunk:
                if splitter.pending:
                    ending = core.upstream_refusal(model, UpstreamFailure(FailureKind.DROPPED,
                                                                          "stream ended inside an event"))
                break
            # Every event this chunk completed goes out in one write, now: nothing waits for more.
            out = []
            for data in splitter.feed(chunk):
                if needs_screening(data, is_hidden=policy.is_hidden, check_non_finite=policy.check_non_finite):
                    data, ending = _screen_stream_event(core, model, policy, data)
                    if ending is not None:
                        break
                out.append(sse_event(data))
            if out:
                await response.write(b"".join(out) if len(out) > 1 else out[0])
                now = time.perf_counter()
                if events:
                    inter_event.observe(now - last)
                else:
                    first_event.observe(now - ctx.started)
                events, last = events + len(out), now
                watch.extend(idle_s)
            if ending is None and not core.admission.trusted(model, call.version):
                ending = core.admission.quarantine_refusal(model)
                ending.before_triton = False
        if ending is not None:
            await response.write(error_event(ending))
        else:
            core.signals.upstream_answered(model)
        await response.write_eof()
    except (ConnectionError, asyncio.CancelledError) as e:
        # The client left (aiohttp cancels the handler, or the write fails): closing the upstream
        # response (the caller's finally) ends Triton's side of the stream.
        ending = Refusal(Reason.CLIENT_GONE, "client closed the stream", model=model, before_triton=False)
        log.info("client_disconnected", model=model, events=events,
                 cause="client closed the connection during a stream; upstream request cancelled")
        if isinstance(e, asyncio.CancelledError):
            raise
    finally:
        watch.close()
        untrusted.cancel()
        metrics.stream_events.labels(model=model).observe(events)
        outcome = "complete" if ending is None else ending.reason.value
        metrics.stream_endings.labels(model=model, outcome=outcome).inc()
        if ending is not None and ending.reason is not Reason.CLIENT_GONE:
            log.warning("stream_ended", model=model, reason=ending.reason.value, events=events,
                        cause=cut(ending.message, 300), request_id=ctx.request_id)
    return response


class _EventStream(web.StreamResponse):
    """The headers leave with the first event, in one write (aiohttp's Response does the same): the
    stream begins when Triton's first event is already here, so sending them apart only costs a
    syscall and a packet on the path to the first event."""

    _send_headers_immediately = False


class _IdleWatch:
    """Cancels the stream's task when no event came within the bound: one timer per stream, moved
    lazily (an event only sets a float), where a timeout context per read would schedule and cancel a
    timer for every event."""

    __slots__ = ("_armed_at", "_handle", "_loop", "_task", "deadline", "fired")

    def __init__(self, task: asyncio.Task[Any], first_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = task
        self.fired = False
        self.deadline = self._armed_at = self._loop.time() + first_s
        self._handle = self._loop.call_at(self.deadline, self._check)

    def extend(self, seconds: float) -> None:
        self.deadline = self._loop.time() + seconds
        if self.deadline < self._armed_at:  # a shorter bound (the first event's is longer): re-arm once
            self._arm()

    def _arm(self) -> None:
        self._handle.cancel()
        self._armed_at = self.deadline
        self._handle = self._loop.call_at(self.deadline, self._check)

    def _check(self) -> None:
        if self._loop.time() >= self.deadline:
            self.fired = True
            self._task.cancel()
        else:
            self._arm()

    def close(self) -> None:
        self._handle.cancel()


def _screen_stream_event(core: ServingCore, model: str, policy: OutputPolicy,
                         data: bytes) -> tuple[bytes, Refusal | None]:
    """(the event's bytes as they may be sent, None), or (b"", the refusal that ends the stream)."""
    try:
        screened = screen_event(data, is_hidden=policy.is_hidden, check_non_finite=policy.check_non_finite)
    except ResponseFormatError as e:
        core.signals.upstream_failed(model, str(e))
        return b"", Refusal(Reason.TRITON_BAD_ANSWER, f"model {model}: {e}", model=model, before_triton=False)
    if screened.error:
        return b"", core.upstream_refusal(model, UpstreamFailure(FailureKind.SERVER_ERROR,
                                                                 cut(screened.error, 300)))
    if screened.dropped:
        core.telemetry.filtered(model, screened.dropped)
    try:
        _refuse_non_finite(core, model, screened)
    except Refusal as e:
        return b"", e
    return screened.data, None

