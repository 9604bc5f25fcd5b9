"""The HTTP front: the KServe v2 / Open Inference Protocol over HTTP on the sidecar port.

It only decodes, calls the serving core (sidecar.serving) and encodes. Each proxied request goes
through one chain, in this order:

    request id + trace id (contextvars)  ->  telemetry: metrics, access log, JSON errors  (_proxied)
    -> route: allowlist (403 control API, 404 unknown path), model guarded (404)
    -> body: content type (415), size while it streams (413), client too slow (408)          (infer)
    -> ServingCore.infer: quarantine or hold -> validation -> breaker -> Triton -> screening
    -> encode: the answer, or the Refusal's status and JSON body

Health answers come from the sidecar's semantic view, not from Triton's: a model is ready only while
its golden requests pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import rapidjson
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from sidecar.fronts.appkeys import DOCUMENT_POOL, READINESS, SERVING, STATES, UPSTREAM_POOL, WATCH
from sidecar.fronts.tls import subject_of
from sidecar.messages import cut
from sidecar.protocol.answers import AnswerTensor, answer_tensors
from sidecar.protocol.triton_errors import StubUnhealthy, triton_error
from sidecar.serving.admission import UNKNOWN_LABEL
from sidecar.serving.core import OutputPolicy, Screened, ServingCore
from sidecar.serving.filtering import hide_in_config, hide_in_metadata, screen_infer_response
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.routing import VERSION_HEADER
from sidecar.serving.specs import FetchDocument, triton_error_message
from sidecar.serving.telemetry import HTTP, RequestContext
from sidecar.serving.validation import CheckedRequest, ModelSpec, validate_infer_request
from sidecar.upstream import UpstreamDropped, UpstreamError, UpstreamPool, UpstreamUnreachable

log = structlog.get_logger("sidecar.proxy")


#: Chunk (bytes) read at a time from a body of unknown length (chunked transfer encoding).
READ_CHUNK = 256 * 1024


_IDENTITY = {"Accept-Encoding": "identity"}


#: What the proxy reads: gzip, deflate and zstd inflated by the data plane's rule
#: (sidecar._dataplane.inflate), br by aiohttp (the Rust front's lane decodes it with the same words).
ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})


_JSON_TYPES = frozenset({"", "application/json", "application/octet-stream"})


#: Headers passed on to Triton; everything else (auth, cookies, the repository token) stays here.
_FORWARDED_HEADERS = ("traceparent", "tracestate")


#: Headers of Triton's infer answer the front reads: (name as passed on, lower-cased as parsed).
_KEPT_ANSWER_HEADERS = (("Content-Type", "content-type"),
                        ("Inference-Header-Content-Length", "inference-header-content-length"))


#: v2 extensions the proxy exposes, as advertised by GET /v2 (the control APIs are refused here).
EXPOSED_EXTENSIONS = frozenset({"classification", "sequence", "schedule_policy", "model_configuration",
                                "binary_tensor_data", "parameters"})


ProxyHandler = Callable[[web.Request, RequestContext], Awaitable[web.StreamResponse]]


#: (status, the headers the proxy keeps, body) of one Triton answer.
HttpAnswer = tuple[int, dict[str, str], bytes]


def add_http_routes(app: web.Application) -> None:
    """Register the proxied v2 endpoints on the sidecar's app (after its own /healthz etc.)."""
    # Outermost after the app's in-flight counter: unmatched paths and methods answer JSON too.
    app.middlewares.append(_json_router_errors)
    router = app.router
    router.add_get("/v2", _proxied(server_metadata))
    router.add_get("/v2/health/live", _proxied(server_live))
    router.add_get("/v2/health/ready", _proxied(server_ready))
    router.add_get("/v2/models/stats", _proxied(statistics))
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        router.add_post(prefix + "/infer", _proxied(infer))
        router.add_get(prefix, _proxied(model_metadata))
        router.add_get(prefix + "/ready", _proxied(model_ready))
        router.add_get(prefix + "/config", _proxied(model_config))
        router.add_get(prefix + "/stats", _proxied(statistics))
        # generate and generate_stream: sidecar.fronts.generate_routes (added by the app after these)
        for control in ("/trace/setting", "/infer_stream"):
            router.add_route("*", prefix + control, _proxied(forbidden))
    for control in ("/v2/repository{tail:.*}", "/v2/systemsharedmemory{tail:.*}",
                    "/v2/cudasharedmemory{tail:.*}", "/v2/logging", "/v2/trace/setting"):
        router.add_route("*", control, _proxied(forbidden))


def document_fetcher(app: web.Application) -> FetchDocument:
    """How the serving core reads a model's metadata and config: over the proxy's pool."""

    async def fetch(model: str, version: str, what: str) -> tuple[int, bytes]:
        suffix = "/config" if what == "config" else ""
        status, _, body = await _upstream_get(app, model_path(model, version) + suffix)
        return status, body

    return fetch


def refusal_response(refusal: Refusal) -> web.Response:
    response = web.json_response(refusal.body(), status=refusal.status)
    if refusal.retry_after is not None:
        response.headers["Retry-After"] = str(refusal.retry_after)
    return response


@web.middleware
async def _json_router_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as e:
        refusal = Refusal(Reason.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {cut(request.path)}; "
                                                     f"allowed: {', '.join(sorted(e.allowed_methods))}")
    except web.HTTPNotFound:
        refusal = Refusal(Reason.UNKNOWN_PATH, f"no such endpoint: {cut(request.path)} (the sidecar serves the "
                                               "v2 inference, metadata, config, readiness and health endpoints)")
    request.app[SERVING].requests.refuse_at_once(HTTP, refusal, method=request.method, path=request.path,
                                                 label=UNKNOWN_LABEL)
    return refusal_response(refusal)


def _proxied(handler: ProxyHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The outer part of the chain is the core's request scope; here only its HTTP encoding."""

    async def run(request: web.Request) -> web.StreamResponse:
        headers = request.headers
        resource = request.match_info.route.resource
        scope = request.app[SERVING].request(HTTP, headers.get("X-Request-ID"), headers.get("traceparent"),
                                             method=request.method, path=request.path,
                                             client=subject_of(request.get_extra_info("peercert")),
                                             tracestate=headers.get("tracestate"),
                                             route=resource.canonical if resource is not None else "")
        async with scope:
            response = await handler(request, scope)
            scope.answered(response.status)
        if scope.refusal is not None:
            response = refusal_response(scope.refusal)
        response.headers["X-Request-ID"] = scope.request_id
        if request.can_read_body and not request.content.is_eof():
            # Refused before its body was read: aiohttp drains and drops the rest (never
            # buffered); the connection must not be reused for another request.
            response.force_close()
        return response

    run.__name__ = handler.__name__
    return run


def live_refusal(app: web.Application) -> Refusal | None:
    """Why /v2/health/live fails now (None: it answers 200). The Rust front serves the same answer
    from what sidecar.fronts.http_front publishes."""
    watch = app[WATCH]
    return None if watch.live else Refusal(Reason.NOT_READY, f"Triton is not live: {watch.detail}")


def ready_refusal(app: web.Application) -> Refusal | None:
    """Why /v2/health/ready fails now (None: it answers 200)."""
    problems = app[READINESS].problems()
    return Refusal(Reason.NOT_READY, "; ".join(problems), problems=problems) if problems else None


def serving_status(app: web.Application, service: str) -> bool | None:
    """grpc.health.v1's status of `service`: True for SERVING, False for NOT_SERVING, None for a name
    that is neither "" (the pod's readiness) nor a guarded model's (that model's). The grpcio front's
    HealthService answers by it, and sidecar.fronts.http_front publishes it for the Rust gRPC front."""
    if not service:
        return not app[READINESS].problems()
    if service in app[STATES]:
        return not app[READINESS].model_problems(service)
    return None


def serving_statuses(app: web.Application) -> list[tuple[str, bool]]:
    """serving_status of every service it knows: "" and each guarded model."""
    statuses = [("", serving_status(app, "") is True)]
    statuses += [(model, serving_status(app, model) is True) for model in app[STATES].names()]
    return statuses


async def server_live(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    refusal = live_refusal(request.app)
    if refusal is not None:
        raise refusal
    return web.Response(status=200)


async def server_ready(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    refusal = ready_refusal(request.app)
    if refusal is not None:
        raise refusal
    return web.Response(status=200)


def model_ready_refusal(app: web.Application, model: str) -> Refusal | None:
    """Why a guarded model's /ready fails from the sidecar's view now (None: Triton is asked). The
    Rust front serves the same answer from what sidecar.fronts.http_front publishes."""
    problems = app[READINESS].model_problems(model)
    if not problems:
        return None
    health = app[STATES].get(model)
    state = {"state": health.state.value} if health is not None else {}
    return Refusal(Reason.NOT_READY, cut("; ".join(problems), 300), model=model, problems=problems, **state)


async def model_ready(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    model, version = _model_and_version(request, ctx)
    refusal = model_ready_refusal(request.app, model)
    if refusal is not None:
        raise refusal
    status, _, body = await _upstream_get(request.app, model_path(model, version) + "/ready", model)
    if status == 200:
        return web.Response(status=200)
    raise Refusal(Reason.NOT_READY, f"Triton says model {model} is not ready ({triton_error_message(body)})",
                  model=model, before_triton=False)


async def server_metadata(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    status, content_type, body = await _upstream_get(request.app, "/v2")
    if status != 200:
        return _passthrough(status, content_type, body)
    doc = rapidjson.loads(body)
    doc["extensions"] = exposed_extensions(request.app[SERVING], doc.get("extensions", []))
    return web.json_response(doc)


def exposed_extensions(core: ServingCore, extensions: list[str]) -> list[str]:
    exposed = exposed_extension_names(core)
    return [e for e in extensions if e in exposed]


def exposed_extension_names(core: ServingCore) -> frozenset[str]:
    """The v2 extensions GET /v2 may show (the Rust front is published the same set)."""
    return EXPOSED_EXTENSIONS | ({"statistics"} if core.settings.allow_statistics else frozenset())


async def model_metadata(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    return await _filtered_document(request, ctx, "", hide_in_metadata)


async def model_config(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    return await _filtered_document(request, ctx, "/config", hide_in_config)


async def _filtered_document(request: web.Request, ctx: RequestContext, suffix: str,
                             hide: Callable[[Any, Callable[[str], bool]], tuple[dict[str, Any], list[str]]]
                             ) -> web.StreamResponse:
    core = request.app[SERVING]
    model, version = _model_and_version(request, ctx)
    status, content_type, body = await _upstream_get(request.app, model_path(model, version) + suffix, model)
    is_hidden = core.filter.for_model(model)
    if status != 200 or is_hidden is None:
        return _passthrough(status, content_type, body)
    try:
        doc = rapidjson.loads(body)
    except ValueError as e:
        raise Refusal(Reason.TRITON_BAD_ANSWER, "Triton's answer is not JSON", model=model,
                      before_triton=False) from e
    doc, dropped = hide(doc, is_hidden)
    core.telemetry.filtered(model, dropped)
    return web.json_response(doc)


async def statistics(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    if not request.app[SERVING].settings.allow_statistics:
        raise Refusal(Reason.FORBIDDEN_ENDPOINT, "statistics are not exposed through the sidecar "
                                                 "(proxy.allow_statistics is off)")
    model, path = "", "/v2/models/stats"
    if "model" in request.match_info:
        model, version = _model_and_version(request, ctx)
        path = model_path(model, version) + "/stats"
    status, content_type, body = await _upstream_get(request.app, path, model)
    return _passthrough(status, content_type, body)


async def forbidden(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    raise Refusal(Reason.FORBIDDEN_ENDPOINT, f"{cut(request.path)} is part of Triton's control API, which stays "
                                             "inside the pod; only inference, metadata, config, readiness and "
                                             "health are served here")


async def _upstream_get(app: web.Application, path: str, model: str = "") -> tuple[int, str, bytes]:
    """GET one of Triton's documents over the proxy's pool: (status, media type, body); a failure to
    get any answer becomes the core's refusal."""
    core = app[SERVING]
    try:
        answer = await app[DOCUMENT_POOL].request("GET", path, _IDENTITY, timeout_s=core.config.triton.timeout_s)
    except (UpstreamError, TimeoutError, OSError) as e:
        raise core.upstream_refusal(model, upstream_failure(e), signal=False) from e
    content_type = answer.headers.get("content-type", "").split(";")[0].strip()
    return answer.status, content_type, answer.body


def upstream_failure(e: BaseException) -> UpstreamFailure:
    """A connection pool error, said the way the serving core understands."""
    if isinstance(e, TimeoutError):
        return UpstreamFailure(FailureKind.TIMEOUT)
    if isinstance(e, (ConnectionRefusedError, UpstreamUnreachable)):
        return UpstreamFailure(FailureKind.UNREACHABLE, str(e))
    if isinstance(e, UpstreamDropped):
        return UpstreamFailure(FailureKind.DROPPED, str(e))
    return UpstreamFailure(FailureKind.DROPPED, type(e).__name__)


def _passthrough(status: int, content_type: str, body: bytes) -> web.Response:
    if status >= 500:
        raise Refusal(Reason.TRITON_ERROR, f"Triton answered {status}: {triton_error_message(body)}",
                      before_triton=False, triton_status=status)
    return web.Response(status=status, body=body, content_type=content_type or "application/json")


async def infer(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    core = request.app[SERVING]
    model, path_version = _model_and_version(request, ctx)
    version = core.pinned(model, path_version, request.headers.get(VERSION_HEADER))
    header_length = parse_header_length(request.headers.get("Inference-Header-Content-Length"), model)
    body = await _read_body(request, core, model)

    def client_gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    exchange = HttpInferExchange(request.app[UPSTREAM_POOL], core.settings.upstream_timeout_s, ctx, model, version,
                                 body, header_length, forwarded_headers(request.headers, ctx), client_gone)
    status, headers, answer = await core.infer(model, version, exchange, cohort_of(core, model, request.headers),
                                               ctx=ctx)
    response = web.Response(status=status, body=answer, content_type=headers.get("Content-Type", "application/json"))
    if "Inference-Header-Content-Length" in headers:
        response.headers["Inference-Header-Content-Length"] = headers["Inference-Header-Content-Length"]
    return response


def cohort_of(core: ServingCore, model: str, headers: Mapping[str, str]) -> str:
    """The value of the model's rollout cohort_key header ("" = none; `headers` case-insensitive
    or lower-cased)."""
    key = core.router.cohort_key(model)
    return (headers.get(key) or headers.get(key.lower()) or "") if key else ""


def forwarded_headers(headers: Mapping[str, str], ctx: RequestContext) -> dict[str, str]:
    """The trace context Triton gets: the request's span as the parent when it is sampled (Triton's
    spans nest under it), else the client's own headers as it sent them (case-insensitive `headers`)."""
    if ctx.upstream_trace:
        return dict(ctx.upstream_trace)
    return {name: headers[name] for name in _FORWARDED_HEADERS if name in headers}


class HttpInferExchange:
    """One POST .../infer: the body is validated as it is and forwarded byte for byte."""

    def __init__(self, pool: UpstreamPool, timeout_s: float, ctx: RequestContext, model: str,
                 version: str, body: bytes, header_length: int | None, forwarded: Mapping[str, str],
                 client_gone: Callable[[], bool]) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.model = model
        self.body = body
        self.header_length = header_length
        self.client_gone = client_gone
        self.version = version
        self.path = model_path(model, version) + "/infer"
        # identity: the answer must be readable to be screened
        headers = {"X-Request-ID": ctx.request_id, "Accept-Encoding": "identity",
                   "Content-Type": "application/octet-stream" if header_length is not None else "application/json"}
        if header_length is not None:
            headers["Inference-Header-Content-Length"] = str(header_length)
        headers.update(forwarded)
        self.headers = headers

    def validate(self, spec: ModelSpec) -> CheckedRequest:
        return validate_infer_request(spec, self.body, self.header_length)

    async def send(self, version: str) -> HttpAnswer:
        """To the version the router chose (the client's bytes, another URL path). Runs in the
        request's own task: the server cancels it when its client disconnects (aiohttp's
        handler_cancellation, or the fast listener's connection_lost), which cancels this call and
        frees its Triton connection and breaker slot. A shadow call runs in its own task."""
        path = self.path if version == self.version else model_path(self.model, version) + "/infer"
        try:
            response = await self.pool.request("POST", path, self.headers, self.body, timeout_s=self.timeout_s)
        except asyncio.CancelledError:
            if self.client_gone():
                log.info("client_disconnected", model=self.model, cause="client closed the connection while "
                                                                        "Triton was answering; upstream call cancelled")
            raise
        except (UpstreamError, TimeoutError, OSError) as e:
            raise upstream_failure(e) from e
        status, answer, headers = response.status, response.body, response.headers
        kept = {name: headers[key] for name, key in _KEPT_ANSWER_HEADERS if key in headers}
        if status >= 500:
            message = triton_error_message(answer)
            raise UpstreamFailure(FailureKind.SERVER_ERROR, message, status=status,
                                  stub_dead=isinstance(triton_error(status, message), StubUnhealthy))
        return status, kept, answer

    def screen(self, answer: HttpAnswer, policy: OutputPolicy) -> Screened[HttpAnswer]:
        status, headers, body = answer
        content_type = headers.get("Content-Type", "application/json").split(";")[0]
        if status != 200:
            return Screened((status, {"Content-Type": content_type}, body), success=False)
        header_length = _int_or_none(headers.get("Inference-Header-Content-Length"))
        screened = screen_infer_response(body, header_length, is_hidden=policy.is_hidden,
                                         check_non_finite=policy.check_non_finite)
        kept = {"Content-Type": content_type}
        if screened.header_length is not None:
            kept["Inference-Header-Content-Length"] = str(screened.header_length)
        return Screened((200, kept, screened.body), dropped=screened.dropped, non_finite=screened.non_finite)

    @staticmethod
    def answer_tensors(answer: HttpAnswer) -> tuple[str, Sequence[AnswerTensor]] | None:
        status, headers, body = answer
        if status != 200:
            return None
        return answer_tensors(body, _int_or_none(headers.get("Inference-Header-Content-Length")))

    @staticmethod
    def answer_texts(answer: HttpAnswer) -> None:
        """Infer answers are tensors (answer_tensors)."""
        return None


def check_body_headers(content_type: str, content_encoding: str, model: str) -> str:
    """Refuse bodies the proxy cannot read (415); the encoding, lower-cased, when it can."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype not in _JSON_TYPES:
        raise Refusal(Reason.UNSUPPORTED_MEDIA_TYPE, f"Content-Type {cut(ctype)!r} is not accepted; send "
                                                     "application/json (or application/octet-stream with "
                                                     "Inference-Header-Content-Length)", model=model)
    encoding = content_encoding.strip().lower()
    if encoding not in ENCODINGS:
        raise Refusal(Reason.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {cut(encoding)!r} is not accepted; "
                                                     "send the body uncompressed, gzip, deflate, br or zstd",
                      model=model)
    return encoding


def body_too_large(limit: int, model: str) -> Refusal:
    return Refusal(Reason.BODY_TOO_LARGE, f"request body larger than {limit} bytes (validation.max_body_bytes)",
                   model=model)


def body_timeout(timeout_s: float, model: str) -> Refusal:
    return Refusal(Reason.BODY_TIMEOUT, f"request body not received within {timeout_s:g} s "
                                        "(proxy.client_body_timeout_s)", model=model)


def unreadable_body(encoding: str, e: BaseException, model: str) -> Refusal:
    return Refusal(Reason.MALFORMED, f"request body cannot be read ({encoding}): {cut(str(e))}", model=model)


async def _read_body(request: web.Request, core: ServingCore, model: str) -> bytes:
    """The whole body, refused with 413 as soon as it is known to be too large (never buffered past
    the limit) and with 408 when the client sends it too slowly."""
    limit = core.config.validation.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        raise body_too_large(limit, model)
    encoding = check_body_headers(request.headers.get("Content-Type", ""),
                                  request.headers.get("Content-Encoding", "identity"), model)
    # aiohttp inflates gzip/deflate bodies as they stream in; the limit counts inflated bytes (so a
    # zip bomb stops at max_body_bytes) and Triton gets the inflated body.
    compressed = encoding not in ("", "identity")
    content = request.content
    if declared is not None and not compressed and content.is_eof():
        # The whole body arrived with the headers (the common case): nothing to wait for, no timer.
        try:
            return await content.readexactly(declared) if declared else b""
        except asyncio.IncompleteReadError as e:
            raise _ended_early(e, declared, model) from e
    timeout_s = core.settings.client_body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            if declared is not None and not compressed:
                return await request.content.readexactly(declared) if declared else b""
            chunks, total = [], 0
            while True:
                chunk = await request.content.read(READ_CHUNK)
                if not chunk:
                    return b"".join(chunks)
                total += len(chunk)
                if total > limit:
                    raise body_too_large(limit, model)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timeout(timeout_s, model) from None
    except asyncio.IncompleteReadError as e:
        raise _ended_early(e, declared, model) from e
    except RequestPayloadError as e:
        raise unreadable_body(encoding, e, model) from e


def _ended_early(e: asyncio.IncompleteReadError, declared: int | None, model: str) -> Refusal:
    return Refusal(Reason.MALFORMED, f"request body ended after {len(e.partial)} of {declared} bytes", model=model)


def parse_header_length(raw: str | None, model: str) -> int | None:
    """Inference-Header-Content-Length: None without it (a JSON body), else a byte count."""
    if raw is None:
        return None
    value = _int_or_none(raw)
    if value is None:
        raise Refusal(Reason.MALFORMED, f"Inference-Header-Content-Length must be a byte count, got {cut(raw)!r}",
                      model=model)
    return value


def _model_and_version(request: web.Request, ctx: RequestContext) -> tuple[str, str]:
    model = request.match_info["model"]
    version = request.match_info.get("version", "")
    request.app[SERVING].resolve(ctx, model, version)
    return model, version


def model_path(model: str, version: str) -> str:
    path = f"/v2/models/{quote(model, safe='')}"
    return f"{path}/versions/{version}" if version else path


def _int_or_none(raw: str | None) -> int | None:
    if raw is None or not raw.strip().isdigit():
        return None
    return int(raw.strip())

