"""The generate extension on the HTTP front: POST .../generate and .../generate_stream.

LLM backends on Triton (vLLM, TensorRT-LLM, decoupled python models) answer through these. Each
request runs the serving core's chain, as /infer does, in this order:

    model guarded (404) -> body read (415, 413, 408) -> admission: quarantine 503 + Retry-After
    or hold -> the model's spec -> the generate body check (400 naming the field) -> breaker slot
    (held for the whole stream) -> Triton -> each answer screened -> passive signals

generate is an exchange through `ServingCore.infer`, as /infer is; generate_stream a stream through
`ServingCore.stream` (sidecar.serving.streaming), shared with gRPC ModelStreamInfer. Both read
Triton through the proxy's connection pool (`UpstreamPool`; streams in its streaming mode).

generate_stream is passed on event by event: each event is written to the client as soon as its
blank line arrives from Triton, never buffered behind the next. Once the 200 is sent, a failure can
only be said inside the stream: an error event `data: {"error", "reason", "model"}` (the shape of
Triton's own error events) ends it, for a stall longer than `generation.idle_timeout_s`, a stream
Triton breaks off, Triton's own error event, NaN/Inf in an event, or the model leaving service. A
client that disconnects cancels the upstream request (the connection to Triton is aborted).

With `listen.front: rust`, generate and generate_stream to a lane model are served by the data
plane's front (dataplane/src/front/generate.rs and generate_stream.rs) with these rules, this
module being their reference; the routes here answer everything else (a pinned version, a rollout,
a model on hold, a compressed body) and the Python front.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import rapidjson
from aiohttp import web

from sidecar.fronts.appkeys import SERVING, UPSTREAM_POOL
from sidecar.fronts.http_routes import (
    _model_and_version,
    _proxied,
    _read_body,
    cohort_of,
    forwarded_headers,
    model_path,
    upstream_failure,
)
from sidecar.messages import cut
from sidecar.protocol.sse import EventSplitter, sse_event
from sidecar.protocol.triton_errors import StubUnhealthy, triton_error
from sidecar.serving.core import OutputPolicy, Screened, ServingCore
from sidecar.serving.generation import (
    check_generate_request,
    error_event,
    is_several_responses_error,
    needs_screening,
    screen_event,
)
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.specs import triton_error_message
from sidecar.serving.streaming import EventVerdict
from sidecar.serving.telemetry import RequestContext
from sidecar.serving.validation import ModelSpec
from sidecar.upstream import UpstreamError, UpstreamStream

#: Largest error answer read from Triton before a stream begins (its error bodies are one line).
MAX_ERROR_BODY = 64 * 1024


#: (status, body) of Triton's answer to generate.
GenerateAnswer = tuple[int, bytes]


#: Keys of a generate answer that are not the model's outputs.
_NOT_OUTPUTS = frozenset({"model_name", "model_version", "id"})


def add_generate_routes(app: web.Application) -> None:
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_post(prefix + "/generate", _proxied(generate))
        app.router.add_post(prefix + "/generate_stream", _proxied(generate_stream))


class _GenerateCall:
    """What generate and generate_stream share: the upstream request, and the body check."""

    def __init__(self, request: web.Request, ctx: RequestContext, endpoint: str, model: str, version: str,
                 body: bytes) -> None:
        self.core: ServingCore = request.app[SERVING]
        self.pool = request.app[UPSTREAM_POOL]
        self.model, self.version = model, version
        self.body = body
        self.endpoint = endpoint
        self.path = model_path(self.model, self.version) + "/" + endpoint
        self.headers = {"X-Request-ID": ctx.request_id, "Accept-Encoding": "identity",
                        "Content-Type": "application/json", **forwarded_headers(request.headers, ctx)}

    def validate(self, spec: ModelSpec) -> None:
        check_generate_request(spec, self.body, self.core.generate_limits(self.model))

    def server_fault(self, status: int, body: bytes) -> UpstreamFailure | None:
        """Triton's error answer as a server fault (None: a 4xx that is the client's to read). A dead
        stub is a server fault whatever the status (generate_stream answers it with 400)."""
        message = _error_message(body)
        stub_dead = isinstance(triton_error(status, message), StubUnhealthy)
        if status >= 500 or stub_dead:
            return UpstreamFailure(FailureKind.SERVER_ERROR, message, status=status, stub_dead=stub_dead)
        return None


def _error_message(body: bytes) -> str:
    """Triton's error text, from a JSON body or from a `data: {...}` event body."""
    text = body.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    return triton_error_message(text)


async def _call(request: web.Request, ctx: RequestContext, endpoint: str) -> _GenerateCall:
    """The model guarded (404), then the body read (415, 413, 408)."""
    model, version = _model_and_version(request, ctx)
    body = await _read_body(request, request.app[SERVING], model)
    return _GenerateCall(request, ctx, endpoint, model, version, body)


# -- generate: one answer --------------------------------------------------------------------------------------


class GenerateExchange:
    """POST .../generate through ServingCore.infer: the body checked, forwarded, the answer screened."""

    def __init__(self, call: _GenerateCall) -> None:
        self.call = call

    def validate(self, spec: ModelSpec) -> None:
        self.call.validate(spec)

    async def send(self, version: str) -> GenerateAnswer:
        """To the version the core's router chose (the client's own when it named one)."""
        call = self.call
        path = call.path if version == call.version else model_path(call.model, version) + "/" + call.endpoint
        try:
            answer = await call.pool.request("POST", path, call.headers, call.body,
                                             timeout_s=call.core.settings.upstream_timeout_s)
        except (UpstreamError, TimeoutError, OSError) as e:
            raise upstream_failure(e) from e
        status, body = answer.status, answer.body
        if status != 200:
            fault = call.server_fault(status, body)
            if fault is not None:
                raise fault
        elif b'"error"' in body:
            self._refuse_error_answer(body)
        return status, body

    @staticmethod
    def answer_tensors(answer: GenerateAnswer) -> None:
        """Generate answers are text: not measured for drift."""
        return None

    @staticmethod
    def answer_texts(answer: GenerateAnswer) -> dict[str, str] | None:
        """Each output of a successful answer as its JSON text, for a rollout's compare (the version
        that answered and the request's id are not outputs)."""
        status, body = answer
        if status != 200:
            return None
        try:
            doc = rapidjson.loads(body)
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        return {name: rapidjson.dumps(value) for name, value in doc.items() if name not in _NOT_OUTPUTS}

    def _refuse_error_answer(self, body: bytes) -> None:
        """Triton answers 200 with {"error": ...}: for a model that sent several responses (a decoupled
        model: the client must use generate_stream), or for its own failure (a server fault)."""
        try:
            doc = rapidjson.loads(body)
        except ValueError:
            return  # not JSON: screening says so
        if not isinstance(doc, dict) or "error" not in doc:
            return
        error, model = str(doc["error"]), self.call.model
        if is_several_responses_error(error):
            raise Refusal(Reason.STREAMING_MODEL, f"model {model} streams several responses per request: call "
                                                  f".../generate_stream (Triton said: {cut(error, 200)})",
                          model=model, before_triton=False)
        raise UpstreamFailure(FailureKind.SERVER_ERROR, cut(error, 300))

    def screen(self, answer: GenerateAnswer, policy: OutputPolicy) -> Screened[GenerateAnswer]:
        status, body = answer
        if status != 200:
            return Screened(answer, success=False)
        screened = screen_event(body, is_hidden=policy.is_hidden, check_non_finite=policy.check_non_finite)
        return Screened((200, screened.data), dropped=screened.dropped, non_finite=screened.non_finite)


async def generate(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    call = await _call(request, ctx, "generate")
    status, body = await call.core.infer(call.model, call.version, GenerateExchange(call),
                                         cohort_of(call.core, call.model, request.headers), ctx=ctx)
    return web.Response(status=status, body=body, content_type="application/json")


# -- generate_stream: server-sent events -----------------------------------------------------------------------


class SseStreamExchange:
    """POST .../generate_stream through ServingCore.stream, read with the pool's streaming mode."""

    def __init__(self, call: _GenerateCall) -> None:
        self.call = call
        self.upstream: UpstreamStream | None = None
        #: Triton's refusal before the stream began, for the client as it is: (status, error text).
        self.refused: tuple[int, str] | None = None
        self._splitter = EventSplitter()
        settings = call.core.settings
        self._first_s = settings.upstream_timeout_s
        self._idle_s = call.core.config.generation.idle_timeout_s

    async def open(self) -> bool:
        call = self.call
        # The head within upstream_timeout_s; then no total bound: a stream lasts as long as the model
        # generates, each event bounded by silence_bound.
        try:
            upstream = self.upstream = await call.pool.stream("POST", call.path, call.headers, call.body,
                                                              timeout_s=self._first_s)
            if upstream.status == 200:
                return True
            answer = await upstream.read_all(MAX_ERROR_BODY)
        except (UpstreamError, TimeoutError, OSError) as e:
            raise upstream_failure(e) from e
        fault = call.server_fault(upstream.status, answer)
        if fault is not None:
            raise fault
        self.refused = (upstream.status, _error_message(answer))
        return False

    async def receive(self) -> Sequence[bytes]:
        upstream = self.upstream
        assert upstream is not None
        while True:
            try:
                chunk = await upstream.read()
            except (UpstreamError, OSError) as e:
                raise upstream_failure(e) from e
            if not chunk:
                if self._splitter.pending:
                    raise UpstreamFailure(FailureKind.DROPPED, "stream ended inside an event")
                return ()
            # Every event this chunk completed goes out in one write, now: nothing waits for more.
            events = list(self._splitter.feed(chunk))
            if events:
                return events

    def screen(self, data: bytes, policy_for: Callable[[str], OutputPolicy]) -> EventVerdict[bytes] | None:
        policy = policy_for(self.call.model)
        if not needs_screening(data, is_hidden=policy.is_hidden, check_non_finite=policy.check_non_finite):
            return None
        screened = screen_event(data, is_hidden=policy.is_hidden, check_non_finite=policy.check_non_finite)
        stub_dead = bool(screened.error) and isinstance(triton_error(500, screened.error), StubUnhealthy)
        return EventVerdict(screened.data, self.call.model, dropped=screened.dropped,
                            non_finite=screened.non_finite, error=screened.error, stub_dead=stub_dead)

    @staticmethod
    def in_stream(refusal: Refusal, verdict: EventVerdict[bytes] | None) -> bytes | None:
        return None  # an SSE stream says a failure with its last event (error_event) and ends

    def silence_bound(self, events: int) -> float:
        return self._idle_s if events else self._first_s

    def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()  # read to its end: pooled; cut short: aborted, Triton ends the request


async def generate_stream(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    call = await _call(request, ctx, "generate_stream")
    exchange = SseStreamExchange(call)
    response = _EventStream(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                 "Cache-Control": "no-cache", "X-Request-ID": ctx.request_id})
    try:
        async with call.core.stream(exchange, started=ctx.started) as stream:
            await stream.join(call.model, call.version, call.validate)
            if not await stream.open():
                assert exchange.refused is not None
                status, message = exchange.refused
                return web.json_response({"error": message}, status=status)
            await response.prepare(request)
            ctx.answered(200)  # the status is sent: an unexpected error from here on can only cut the stream
            async for batch in stream:
                await response.write(sse_event(batch[0]) if len(batch) == 1 else b"".join(map(sse_event, batch)))
            if stream.ending is not None:
                await response.write(error_event(stream.ending))
            await response.write_eof()
    except ConnectionError:
        pass  # the client left mid-stream: the stream counted it (client_disconnected) and ended Triton's side
    return response


class _EventStream(web.StreamResponse):
    """The headers leave with the first event, in one write (aiohttp's Response does the same): the
    stream begins when Triton's first event is already here, so sending them apart only costs a
    syscall and a packet on the path to the first event."""

    _send_headers_immediately = False

