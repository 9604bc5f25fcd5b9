"""The inference proxy on the sidecar port (KServe v2 / Open Inference Protocol over HTTP).

Clients and the Kubernetes Service talk to this port; Triton's own ports stay inside the pod. Each
proxied request goes through one chain, composed in `_proxied` and the handlers, in this order:

    request id + trace id (contextvars)  ->  timing, metrics, access log, JSON errors
    -> route: allowlist (403 control API, 404 unknown path), model known (404)
    -> body: content type (415), size while it streams (413), client too slow (408)
    -> quarantine: 503 + Retry-After, or hold up to proxy.hold_during_heal_s
    -> validation against the model's spec (400/403/413), before anything reaches Triton
    -> breaker: per-model in-flight bound with a bounded queue (503 when full)
    -> Triton, one pooled session; a client that disconnects cancels its upstream call
    -> answer: Triton 5xx -> 502, timeout -> 504, unreachable -> 503; hidden outputs removed;
       NaN/Inf answers blocked (502) and reported to the prober (passive signals)

Health answers come from the sidecar's semantic view, not from Triton's: a model is ready only while
its golden requests pass.
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import rapidjson
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from sidecar.appkeys import CONFIG, HEALER, LIFECYCLE, METRICS, PROBER, STATES, UPSTREAM, WATCH
from sidecar.config import SidecarConfig
from sidecar.filtering import (
    OutputFilter,
    ResponseFormatError,
    hide_in_config,
    hide_in_metadata,
    screen_infer_response,
)
from sidecar.states import ModelState, Transition
from sidecar.validation import (
    BODY_TOO_LARGE,
    MALFORMED,
    UNKNOWN_MODEL,
    UNSUPPORTED_MEDIA_TYPE,
    InvalidRequest,
    Limits,
    ModelSpec,
    RequestRules,
    build_model_spec,
    load_request_rules,
    validate_infer_request,
)

log = structlog.get_logger("sidecar.proxy")

# Reasons of the proxy's own answers (validation's reasons are in sidecar.validation).
FORBIDDEN_ENDPOINT = "forbidden_endpoint"  # 403
UNKNOWN_PATH = "unknown_path"  # 404
METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
BODY_TIMEOUT = "body_timeout"  # 408
QUARANTINED = "quarantined"  # 503
NOT_VERIFIED = "not_verified"  # 503: not probed yet (start-up)
MODEL_UNAVAILABLE = "model_unavailable"  # 503: tracked, but Triton does not serve it right now
NOT_READY = "not_ready"  # 503: health endpoints
OVERLOADED = "overloaded"  # 503
TRITON_UNREACHABLE = "triton_unreachable"  # 503
TRITON_ERROR = "triton_error"  # 502: Triton answered 5xx
TRITON_BAD_ANSWER = "triton_bad_answer"  # 502: connection dropped, or an answer that is not v2
NON_FINITE_OUTPUT = "non_finite_output"  # 502
TRITON_TIMEOUT = "triton_timeout"  # 504
CLIENT_GONE = "client_disconnected"  # 499 (nginx's code): counted, never seen by the client

#: Model label for requests that name no model, and for names the sidecar does not track: metric
#: labels stay bounded whatever paths clients send.
SERVER_LABEL = "_server_"
UNKNOWN_LABEL = "_unknown_"
#: Chunk (bytes) read at a time from a body of unknown length (chunked transfer encoding).
READ_CHUNK = 256 * 1024
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_IDENTITY = {"Accept-Encoding": "identity"}
#: What aiohttp inflates itself (br/zstd when their libraries are installed, else a 400 on read).
_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})
_JSON_TYPES = frozenset({"", "application/json", "application/octet-stream"})
#: Headers passed on to Triton; everything else (auth, cookies, the repository token) stays here.
_FORWARDED_HEADERS = ("traceparent", "tracestate")
#: v2 extensions the proxy exposes, as advertised by GET /v2 (the control APIs are refused here).
_EXPOSED_EXTENSIONS = frozenset({"classification", "sequence", "schedule_policy", "model_configuration",
                                 "binary_tensor_data", "parameters"})

ProxyHandler = Callable[[web.Request, "RequestContext"], Awaitable[web.StreamResponse]]


class Refusal(Exception):
    """An answer the proxy gives itself: status, reason and a message a person can act on."""

    def __init__(self, status: int, reason: str, message: str, *, model: str = "",
                 retry_after: int | None = None, before_triton: bool = True, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.model = model
        self.retry_after = retry_after
        self.before_triton = before_triton
        self.extra = extra

    @classmethod
    def from_invalid(cls, e: InvalidRequest) -> Refusal:
        refusal = cls(e.status, e.reason, e.message, model=e.model)
        if e.input:
            refusal.extra["input"] = e.input
        return refusal

    def response(self) -> web.Response:
        body: dict[str, Any] = {"error": self.message, "reason": self.reason}
        if self.model:
            body["model"] = self.model
        body.update(self.extra)
        response = web.json_response(body, status=self.status)
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after)
        return response


@dataclass
class RequestContext:
    request_id: str
    trace_id: str
    #: Bounded model label for metrics: a tracked model's name, SERVER_LABEL or UNKNOWN_LABEL.
    label: str = SERVER_LABEL


class Breaker:
    """At most `capacity` requests at Triton, at most `queue` waiting; more are refused at once
    (Knative queue-proxy's breaker): a slow model sheds load instead of piling up requests."""

    def __init__(self, capacity: int, queue: int) -> None:
        self._slots = asyncio.Semaphore(capacity)
        self._queue = queue
        self.waiting = 0

    def slot(self, model: str, wait_s: float) -> _Slot:
        return _Slot(self, model, wait_s)

    async def _acquire(self, model: str, wait_s: float) -> None:
        if self._slots.locked():
            if self.waiting >= self._queue:
                raise Refusal(503, OVERLOADED, f"model {model} has too many requests in flight and "
                                               f"{self.waiting} waiting; retry later", model=model, retry_after=1)
            self.waiting += 1
            try:
                async with asyncio.timeout(wait_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise Refusal(503, OVERLOADED, f"model {model}: no free slot within {wait_s:g} s",
                              model=model, retry_after=1) from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()


class _Slot:
    """`async with breaker.slot(...)`: a class, not an asynccontextmanager (cheaper per request)."""

    __slots__ = ("_breaker", "_model", "_wait_s")

    def __init__(self, breaker: Breaker, model: str, wait_s: float) -> None:
        self._breaker, self._model, self._wait_s = breaker, model, wait_s

    async def __aenter__(self) -> None:
        await self._breaker._acquire(self._model, self._wait_s)

    async def __aexit__(self, *exc: object) -> None:
        self._breaker._slots.release()


class Proxy:
    """Everything the proxy keeps between requests: specs, breakers, gates, passive counters."""

    def __init__(self, app: web.Application) -> None:
        config: SidecarConfig = app[CONFIG]
        self.app = app
        self.config = config
        self.settings = config.proxy
        self.filter = OutputFilter(config.filtering.rules)
        self.limits = Limits.from_settings(config.validation)
        # JSON Schemas are compiled once, here; a bad file stops the start (ConfigError names it).
        self.rules: dict[str, RequestRules] = {
            model: load_request_rules(path) for model, path in config.validation.schemas.items()
        }
        self.triton_url = config.triton.url.rstrip("/")
        self._specs: dict[tuple[str, str], ModelSpec] = {}
        self._fetching: dict[tuple[str, str], asyncio.Task[ModelSpec]] = {}
        self._generation: collections.Counter[str] = collections.Counter()
        self._breakers: dict[str, Breaker] = {}
        self._gates: dict[str, asyncio.Event] = {}
        self._failures: collections.Counter[str] = collections.Counter()
        self._non_finite_ok: dict[str, bool] = {}
        self._rng = random.Random()  # noqa: S311 - log sampling and request ids, not secrets
        self._sample_rate = config.logging.access_log_sample_rate
        # Metric children per label set: labels() costs a lock and a dict lookup on every call.
        self._metrics = app[METRICS]
        self._requests_children: dict[tuple[str, int], Any] = {}
        self._duration_children: dict[str, Any] = {}
        self._rejection_children: dict[tuple[str, str], Any] = {}
        self._in_flight_children: dict[str, Any] = {}
        app[STATES].add_listener(self._on_transition)

    # -- model state ------------------------------------------------------------------------------

    def _on_transition(self, t: Transition) -> None:
        gate = self._gates.get(t.model)
        if gate is not None:
            if t.state_to.serves_traffic:
                gate.set()
            else:
                gate.clear()
        if t.state_to is ModelState.HEALING or (t.state_to.serves_traffic and not t.state_from.serves_traffic):
            # A reload may change the model's inputs: build its spec again on the next request.
            self._generation[t.model] += 1
            for key in [k for k in self._specs if k[0] == t.model]:
                del self._specs[key]
        self._failures[t.model] = 0

    def label(self, model: str) -> str:
        return model if model in self.app[STATES] else UNKNOWN_LABEL

    def tracked(self, model: str) -> None:
        """404 unless the sidecar guards this model (untracked models would bypass quarantine)."""
        states = self.app[STATES]
        if model in states:
            return
        if not len(states):
            raise Refusal(503, NOT_VERIFIED, "the sidecar has not discovered Triton's models yet",
                          retry_after=self.settings.retry_after_s)
        raise Refusal(404, UNKNOWN_MODEL, f"unknown model {_cut(model)!r}; served: {', '.join(states.names())}")

    async def admit(self, model: str) -> None:
        """Let a request through only while the model's answers are trusted (HEALTHY or DEGRADED)."""
        health = self.app[STATES].get(model)
        assert health is not None
        if health.state.serves_traffic:
            return
        metrics = self.app[METRICS]
        hold_s = self.settings.hold_during_heal_s
        if hold_s > 0 and health.state is not ModelState.FAILED:
            gate = self._gate(model)
            try:
                async with asyncio.timeout(hold_s):
                    while not self._serves(model):
                        await gate.wait()
            except TimeoutError:
                metrics.quarantined.labels(model=model, outcome="held_timeout").inc()
            else:
                metrics.quarantined.labels(model=model, outcome="held_released").inc()
                return
        else:
            metrics.quarantined.labels(model=model, outcome="rejected").inc()
        health = self.app[STATES].get(model)
        assert health is not None
        reason = QUARANTINED if health.state.quarantined else NOT_VERIFIED
        raise Refusal(503, reason, f"model {model} is {health.state.value} ({_cut(health.cause, 200)}); "
                                   "its answers are not trusted right now", model=model,
                      retry_after=self.settings.retry_after_s, state=health.state.value)

    def _serves(self, model: str) -> bool:
        health = self.app[STATES].get(model)
        return health is not None and health.state.serves_traffic

    def _gate(self, model: str) -> asyncio.Event:
        """Set while the model serves traffic; held requests wait on it (kept by _on_transition)."""
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = asyncio.Event()
            if self._serves(model):
                gate.set()
        return gate

    def breaker(self, model: str) -> Breaker:
        breaker = self._breakers.get(model)
        if breaker is None:
            breaker = self._breakers[model] = Breaker(self.settings.max_in_flight_per_model,
                                                      self.settings.queue_size_per_model)
        return breaker

    def allows_non_finite(self, model: str) -> bool:
        allowed = self._non_finite_ok.get(model)
        if allowed is None:
            cases = self.app[PROBER].cases_for(model)
            allowed = self._non_finite_ok[model] = any(c.allows_non_finite for c in cases)
        return allowed

    # -- passive signals ---------------------------------------------------------------------------

    def upstream_failed(self, model: str, cause: str) -> None:
        # Under load a dead stub makes probes time out behind queued requests; clients' answers still
        # carry Triton's own diagnosis, which tells the healer not to wait for the unload.
        self.app[HEALER].note_triton_error(model, cause)
        self._failures[model] += 1
        if self._failures[model] >= self.settings.passive_failure_threshold:
            self._failures[model] = 0
            log.warning("passive_signal", model=model, signal="consecutive_failures", cause=cause)
            self.app[PROBER].probe_soon(model)

    def upstream_answered(self, model: str) -> None:
        self._failures[model] = 0

    def non_finite_answer(self, model: str, outputs: list[str]) -> None:
        log.warning("passive_signal", model=model, signal="non_finite_output", outputs=outputs)
        self.app[PROBER].probe_soon(model)

    # -- model specs ---------------------------------------------------------------------------------

    async def spec(self, model: str, version: str) -> ModelSpec:
        """The model's request spec, fetched from Triton once and cached until the model is reloaded."""
        key = (model, version)
        spec = self._specs.get(key)
        if spec is not None:
            return spec
        task = self._fetching.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch_spec(model, version, self._generation[model]),
                                       name=f"spec:{model}:{version}")
            self._fetching[key] = task
            task.add_done_callback(lambda _t: self._fetching.pop(key, None))
        # shield: one client giving up must not cancel the fetch other requests wait on
        return await asyncio.shield(task)

    async def _fetch_spec(self, model: str, version: str, generation: int) -> ModelSpec:
        path = _model_path(model, version)
        metadata = await self._get_json(model, path, what="metadata")
        config = await self._get_json(model, path + "/config", what="config")
        spec = build_model_spec(model, version, metadata, config, limits=self.limits,
                                is_hidden=self.filter.for_model(model), rules=self.rules.get(model))
        if self._generation[model] == generation:
            self._specs[(model, version)] = spec
        return spec

    async def _get_json(self, model: str, path: str, *, what: str) -> dict[str, Any]:
        session = self.app[UPSTREAM]
        timeout = aiohttp.ClientTimeout(total=self.config.triton.timeout_s)
        try:
            async with session.get(self.triton_url + path, headers=_IDENTITY, timeout=timeout) as response:
                body = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise self.unreachable(model, e) from e
        if status == 200:
            try:
                doc = rapidjson.loads(body)
            except ValueError as e:
                raise Refusal(502, TRITON_BAD_ANSWER, f"Triton's {what} of {model} is not JSON", model=model,
                              before_triton=False) from e
            if isinstance(doc, dict):
                return doc
        message = _triton_error(body)
        if status in (400, 404) and "/versions/" in path:
            raise Refusal(404, UNKNOWN_MODEL, f"model {model}: {message}", model=model)
        raise Refusal(503, MODEL_UNAVAILABLE, f"Triton does not serve model {model} right now "
                                              f"({status}: {message})", model=model,
                      retry_after=self.settings.retry_after_s, before_triton=False)

    def unreachable(self, model: str, e: BaseException) -> Refusal:
        if isinstance(e, TimeoutError):
            return Refusal(504, TRITON_TIMEOUT, f"Triton did not answer within the time limit ({model or 'server'})",
                           model=model, before_triton=False)
        if isinstance(e, (aiohttp.ClientConnectorError, ConnectionRefusedError)):
            detail = f"proxied request could not connect: {_cut(str(e), 160)}"
            self.app[WATCH].mark_unreachable(detail)
            return Refusal(503, TRITON_UNREACHABLE, "Triton is unreachable from the sidecar", model=model,
                           retry_after=self.settings.retry_after_s, before_triton=False)
        return Refusal(502, TRITON_BAD_ANSWER, f"Triton dropped the connection: {_cut(type(e).__name__)}",
                       model=model, before_triton=False)

    # -- metrics (children cached per label set) ----------------------------------------------------

    def count_request(self, label: str, status: int, duration_s: float) -> None:
        key = (label, status)
        counter = self._requests_children.get(key)
        if counter is None:
            counter = self._requests_children[key] = self._metrics.proxy_requests.labels(model=label,
                                                                                        code=str(status))
        counter.inc()
        histogram = self._duration_children.get(label)
        if histogram is None:
            histogram = self._duration_children[label] = self._metrics.proxy_duration.labels(model=label)
        histogram.observe(duration_s)

    def count_rejection(self, label: str, reason: str) -> None:
        key = (label, reason)
        counter = self._rejection_children.get(key)
        if counter is None:
            counter = self._rejection_children[key] = self._metrics.proxy_rejections.labels(model=label,
                                                                                           reason=reason)
        counter.inc()

    def in_flight(self, model: str) -> Any:
        gauge = self._in_flight_children.get(model)
        if gauge is None:
            gauge = self._in_flight_children[model] = self._metrics.in_flight.labels(model=model)
        return gauge

    def new_request_id(self) -> str:
        """A random 32-hex-digit id (uuid4's shape, without its urandom syscall per request)."""
        return f"{self._rng.getrandbits(128):032x}"

    # -- access log ----------------------------------------------------------------------------------

    def access_log(self, request: web.Request, ctx: RequestContext, status: int, duration_s: float,
                   reason: str) -> None:
        if status < 400:
            rate = self._sample_rate
            # No random draw when the answer is fixed: rate 0 logs none, rate 1 logs all.
            if rate <= 0 or (rate < 1 and self._rng.random() >= rate):
                return
        fields: dict[str, Any] = {
            "request_id": ctx.request_id, "trace_id": ctx.trace_id, "model": ctx.label,
            "method": request.method, "path": _cut(request.path, 200), "status": status,
            "duration_ms": round(duration_s * 1000, 2),
        }
        if reason:
            fields["reason"] = reason
        (log.warning if status >= 500 else log.info)("proxy_request", **fields)


# ---- wiring ---------------------------------------------------------------------------------------------

PROXY = web.AppKey("proxy", Proxy)

def add_proxy_routes(app: web.Application) -> None:
    """Register the proxied v2 endpoints on the sidecar's app (after its own /healthz etc.)."""
    proxy = Proxy(app)
    app[PROXY] = proxy
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
        for control in ("/trace/setting", "/generate", "/generate_stream", "/infer_stream"):
            router.add_route("*", prefix + control, _proxied(forbidden))
    for control in ("/v2/repository{tail:.*}", "/v2/systemsharedmemory{tail:.*}",
                    "/v2/cudasharedmemory{tail:.*}", "/v2/logging", "/v2/trace/setting"):
        router.add_route("*", control, _proxied(forbidden))


@web.middleware
async def _json_router_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as e:
        refusal = Refusal(405, METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {_cut(request.path)}; "
                                                   f"allowed: {', '.join(sorted(e.allowed_methods))}")
    except web.HTTPNotFound:
        refusal = Refusal(404, UNKNOWN_PATH, f"no such endpoint: {_cut(request.path)} (the sidecar serves the "
                                             "v2 inference, metadata, config, readiness and health endpoints)")
    response = refusal.response()
    app = request.app
    app[METRICS].proxy_requests.labels(model=UNKNOWN_LABEL, code=str(refusal.status)).inc()
    app[METRICS].proxy_rejections.labels(model=UNKNOWN_LABEL, reason=refusal.reason).inc()
    return response


def _proxied(handler: ProxyHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The outer part of the chain: request identity, JSON errors, metrics and the access log."""

    async def run(request: web.Request) -> web.StreamResponse:
        proxy = request.app[PROXY]
        started = time.perf_counter()
        headers = request.headers
        raw_id = headers.get("X-Request-ID")
        ctx = RequestContext(raw_id if raw_id and _REQUEST_ID.fullmatch(raw_id) else proxy.new_request_id(),
                             _trace_id(headers.get("traceparent")))

        def record(status: int, reason: str) -> None:
            duration = time.perf_counter() - started
            proxy.count_request(ctx.label, status, duration)
            proxy.access_log(request, ctx, status, duration, reason)

        reason = ""
        # bind + reset by token: bound_contextvars() copies the whole context on every request
        tokens = structlog.contextvars.bind_contextvars(request_id=ctx.request_id, trace_id=ctx.trace_id)
        try:
            try:
                response = await handler(request, ctx)
            except InvalidRequest as e:
                response, reason = Refusal.from_invalid(e).response(), e.reason
                proxy.count_rejection(ctx.label, reason)
            except Refusal as e:
                response, reason = e.response(), e.reason
                if e.before_triton:
                    proxy.count_rejection(ctx.label, reason)
            except asyncio.CancelledError:
                # The server cancels handlers of gone clients when run with handler_cancellation.
                record(499, CLIENT_GONE)
                raise
            response.headers["X-Request-ID"] = ctx.request_id
            if request.can_read_body and not request.content.is_eof():
                # Refused before its body was read: aiohttp drains and drops the rest (never
                # buffered); the connection must not be reused for another request.
                response.force_close()
            record(499 if reason == CLIENT_GONE else response.status, reason)
        finally:
            structlog.contextvars.reset_contextvars(**tokens)
        return response

    run.__name__ = handler.__name__
    return run


# ---- health and metadata ----------------------------------------------------------------------------------


async def server_live(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    watch = request.app[WATCH]
    if watch.live:
        return web.Response(status=200)
    raise Refusal(503, NOT_READY, f"Triton is not live: {watch.detail}")


async def server_ready(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    app = request.app
    problems = []
    if app[LIFECYCLE].draining:
        problems.append("shutting down")
    if not app[WATCH].ready:
        problems.append(f"Triton not ready: {app[WATCH].detail}")
    if not len(app[STATES]):
        problems.append("no models discovered yet")
    problems += [f"model {h.model} {h.state.value}" for h in app[STATES] if not h.state.serves_traffic]
    if problems:
        raise Refusal(503, NOT_READY, "; ".join(problems), problems=problems)
    return web.Response(status=200)


async def model_ready(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    proxy = request.app[PROXY]
    model, version = _model_and_version(request, ctx)
    health = request.app[STATES].get(model)
    assert health is not None
    if not health.state.serves_traffic:
        raise Refusal(503, NOT_READY, f"model {model} is {health.state.value}: {_cut(health.cause, 200)}",
                      model=model, state=health.state.value)
    status, _, body = await _upstream_get(proxy, model, _model_path(model, version) + "/ready")
    if status == 200:
        return web.Response(status=200)
    raise Refusal(503, NOT_READY, f"Triton says model {model} is not ready ({_triton_error(body)})", model=model,
                  before_triton=False)


async def server_metadata(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    proxy = request.app[PROXY]
    status, content_type, body = await _upstream_get(proxy, "", "/v2")
    if status != 200:
        return _passthrough(status, content_type, body)
    doc = rapidjson.loads(body)
    exposed = set(_EXPOSED_EXTENSIONS) | ({"statistics"} if proxy.settings.allow_statistics else set())
    doc["extensions"] = [e for e in doc.get("extensions", []) if e in exposed]
    return web.json_response(doc)


async def model_metadata(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    return await _filtered_document(request, ctx, "", hide_in_metadata)


async def model_config(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    return await _filtered_document(request, ctx, "/config", hide_in_config)


async def _filtered_document(request: web.Request, ctx: RequestContext, suffix: str,
                             hide: Callable[[Any, Callable[[str], bool]], tuple[dict[str, Any], list[str]]]
                             ) -> web.StreamResponse:
    proxy = request.app[PROXY]
    model, version = _model_and_version(request, ctx)
    status, content_type, body = await _upstream_get(proxy, model, _model_path(model, version) + suffix)
    is_hidden = proxy.filter.for_model(model)
    if status != 200 or is_hidden is None:
        return _passthrough(status, content_type, body)
    try:
        doc = rapidjson.loads(body)
    except ValueError as e:
        raise Refusal(502, TRITON_BAD_ANSWER, "Triton's answer is not JSON", model=model,
                      before_triton=False) from e
    doc, dropped = hide(doc, is_hidden)
    for name in dropped:
        request.app[METRICS].outputs_filtered.labels(model=model, output=name).inc()
    return web.json_response(doc)


async def statistics(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    proxy = request.app[PROXY]
    if not proxy.settings.allow_statistics:
        raise Refusal(403, FORBIDDEN_ENDPOINT, "statistics are not exposed through the sidecar "
                                               "(proxy.allow_statistics is off)")
    model, path = "", "/v2/models/stats"
    if "model" in request.match_info:
        model, version = _model_and_version(request, ctx)
        path = _model_path(model, version) + "/stats"
    status, content_type, body = await _upstream_get(proxy, model, path)
    return _passthrough(status, content_type, body)


async def forbidden(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    raise Refusal(403, FORBIDDEN_ENDPOINT, f"{_cut(request.path)} is part of Triton's control API, which stays "
                                           "inside the pod; only inference, metadata, config, readiness and "
                                           "health are served here")


async def _upstream_get(proxy: Proxy, model: str, path: str) -> tuple[int, str, bytes]:
    try:
        async with proxy.app[UPSTREAM].get(proxy.triton_url + path, headers=_IDENTITY,
                                           timeout=aiohttp.ClientTimeout(total=proxy.config.triton.timeout_s)
                                           ) as response:
            return response.status, response.content_type, await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise proxy.unreachable(model, e) from e


def _passthrough(status: int, content_type: str, body: bytes) -> web.Response:
    if status >= 500:
        raise Refusal(502, TRITON_ERROR, f"Triton answered {status}: {_triton_error(body)}", before_triton=False,
                      triton_status=status)
    return web.Response(status=status, body=body, content_type=content_type or "application/json")


# ---- inference ----------------------------------------------------------------------------------------------


async def infer(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    app = request.app
    proxy = app[PROXY]
    model, version = _model_and_version(request, ctx)
    header_length = _header_length(request, model)
    body = await _read_body(request, proxy, model)
    await proxy.admit(model)
    spec = await proxy.spec(model, version)
    validate_infer_request(spec, body, header_length)

    # identity: the client session would ask for gzip, and the answer must be readable to be screened
    headers = {"X-Request-ID": ctx.request_id, "Accept-Encoding": "identity",
               "Content-Type": "application/octet-stream" if header_length is not None else "application/json"}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    for name in _FORWARDED_HEADERS:
        if name in request.headers:
            headers[name] = request.headers[name]
    url = proxy.triton_url + _model_path(model, version) + "/infer"
    in_flight = proxy.in_flight(model)
    async with proxy.breaker(model).slot(model, proxy.settings.upstream_timeout_s):
        in_flight.inc()
        try:
            status, upstream_headers, answer = await _call_triton(
                request, proxy, model, _post(proxy, url, body, headers))
        finally:
            in_flight.dec()
    return _answer(proxy, model, status, upstream_headers, answer)


async def _post(proxy: Proxy, url: str, body: bytes, headers: dict[str, str]
                ) -> tuple[int, dict[str, str], bytes]:
    async with proxy.app[UPSTREAM].post(url, data=body, headers=headers) as response:
        answer = await response.read()
        keep = {k: response.headers[k] for k in ("Content-Type", "Inference-Header-Content-Length")
                if k in response.headers}
        return response.status, keep, answer


async def _call_triton(request: web.Request, proxy: Proxy, model: str,
                       call: Awaitable[tuple[int, dict[str, str], bytes]]) -> tuple[int, dict[str, str], bytes]:
    """Run the upstream call in the handler's own task: the server cancels the handler when its client
    disconnects (handler_cancellation, see sidecar.app.app_runner), which cancels the upstream call
    and frees its Triton connection and breaker slot."""
    try:
        return await call
    except asyncio.CancelledError:
        transport = request.transport
        if transport is None or transport.is_closing():
            log.info("client_disconnected", model=model, cause="client closed the connection while "
                                                                "Triton was answering; upstream call cancelled")
        raise
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        refusal = proxy.unreachable(model, e)
        if refusal.status != 503:
            proxy.upstream_failed(model, refusal.message)
        raise refusal from e


def _answer(proxy: Proxy, model: str, status: int, headers: dict[str, str], body: bytes) -> web.Response:
    if status >= 500:
        message = _triton_error(body)
        proxy.upstream_failed(model, f"Triton answered {status}: {message}")
        raise Refusal(502, TRITON_ERROR, f"Triton answered {status} for model {model}: {message}", model=model,
                      before_triton=False, triton_status=status)
    content_type = headers.get("Content-Type", "application/json").split(";")[0]
    if status != 200:
        proxy.upstream_answered(model)
        return web.Response(status=status, body=body, content_type=content_type)
    header_length = _int_or_none(headers.get("Inference-Header-Content-Length"))
    check_non_finite = not proxy.allows_non_finite(model)
    try:
        screened = screen_infer_response(body, header_length, is_hidden=proxy.filter.for_model(model),
                                         check_non_finite=check_non_finite)
    except ResponseFormatError as e:
        proxy.upstream_failed(model, str(e))
        raise Refusal(502, TRITON_BAD_ANSWER, f"model {model}: {e}", model=model, before_triton=False) from e
    metrics = proxy.app[METRICS]
    for name in screened.dropped:
        metrics.outputs_filtered.labels(model=model, output=name).inc()
    if screened.non_finite:
        proxy.non_finite_answer(model, screened.non_finite)
        if proxy.settings.block_non_finite_outputs:
            raise Refusal(502, NON_FINITE_OUTPUT, f"model {model} answered NaN/Inf in "
                                                  f"{', '.join(screened.non_finite)}; the answer was withheld "
                                                  "and the model is being re-checked", model=model,
                          before_triton=False, outputs=screened.non_finite)
    else:
        proxy.upstream_answered(model)
    response = web.Response(status=200, body=screened.body, content_type=content_type)
    if screened.header_length is not None:
        response.headers["Inference-Header-Content-Length"] = str(screened.header_length)
    return response


async def _read_body(request: web.Request, proxy: Proxy, model: str) -> bytes:
    """The whole body, refused with 413 as soon as it is known to be too large (never buffered past
    the limit) and with 408 when the client sends it too slowly."""
    limit = proxy.config.validation.max_body_bytes
    too_large = Refusal(413, BODY_TOO_LARGE, f"request body larger than {limit} bytes "
                                             "(validation.max_body_bytes)", model=model)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large
    ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if ctype not in _JSON_TYPES:
        raise Refusal(415, UNSUPPORTED_MEDIA_TYPE, f"Content-Type {_cut(ctype)!r} is not accepted; send "
                                                   "application/json (or application/octet-stream with "
                                                   "Inference-Header-Content-Length)", model=model)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in _ENCODINGS:
        raise Refusal(415, UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {_cut(encoding)!r} is not accepted; "
                                                   "send the body uncompressed, gzip, deflate or br", model=model)
    # aiohttp inflates gzip/deflate bodies as they stream in; the limit counts inflated bytes (so a
    # zip bomb stops at max_body_bytes) and Triton gets the inflated body.
    compressed = encoding not in ("", "identity")
    content = request.content
    if declared is not None and not compressed and content.is_eof():
        # The whole body arrived with the headers (the common case): nothing to wait for, no timer.
        try:
            return await content.readexactly(declared) if declared else b""
        except asyncio.IncompleteReadError as e:
            raise Refusal(400, MALFORMED, f"request body ended after {len(e.partial)} of {declared} bytes",
                          model=model) from e
    try:
        async with asyncio.timeout(proxy.settings.client_body_timeout_s):
            if declared is not None and not compressed:
                return await request.content.readexactly(declared) if declared else b""
            chunks, total = [], 0
            while True:
                chunk = await request.content.read(READ_CHUNK)
                if not chunk:
                    return b"".join(chunks)
                total += len(chunk)
                if total > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise Refusal(408, BODY_TIMEOUT, f"request body not received within "
                                         f"{proxy.settings.client_body_timeout_s:g} s "
                                         "(proxy.client_body_timeout_s)", model=model) from None
    except asyncio.IncompleteReadError as e:
        raise Refusal(400, MALFORMED, f"request body ended after {len(e.partial)} of {declared} bytes",
                      model=model) from e
    except RequestPayloadError as e:
        raise Refusal(400, MALFORMED, f"request body cannot be read ({encoding}): {_cut(str(e))}",
                      model=model) from e


def _header_length(request: web.Request, model: str) -> int | None:
    raw = request.headers.get("Inference-Header-Content-Length")
    if raw is None:
        return None
    value = _int_or_none(raw)
    if value is None:
        raise Refusal(400, MALFORMED, f"Inference-Header-Content-Length must be a byte count, got {_cut(raw)!r}",
                      model=model)
    return value


# ---- small pieces -----------------------------------------------------------------------------------------------


def _model_and_version(request: web.Request, ctx: RequestContext) -> tuple[str, str]:
    proxy = request.app[PROXY]
    model = request.match_info["model"]
    ctx.label = proxy.label(model)
    proxy.tracked(model)
    version = request.match_info.get("version", "")
    if version and not version.isdigit():
        raise Refusal(404, UNKNOWN_MODEL, f"model {model} has no version {_cut(version)!r} "
                                          "(versions are numbers)", model=model)
    return model, version


def _model_path(model: str, version: str) -> str:
    path = f"/v2/models/{quote(model, safe='')}"
    return f"{path}/versions/{version}" if version else path


def _trace_id(traceparent: str | None) -> str:
    if traceparent:
        match = _TRACEPARENT.fullmatch(traceparent.strip())
        if match and match.group(1) != "0" * 32:
            return match.group(1)
    return ""


def _int_or_none(raw: str | None) -> int | None:
    if raw is None or not raw.strip().isdigit():
        return None
    return int(raw.strip())


def _triton_error(body: bytes) -> str:
    try:
        doc = rapidjson.loads(body)
        message = doc.get("error", "") if isinstance(doc, dict) else ""
    except ValueError:
        message = ""
    return _cut(str(message or body[:200].decode(errors="replace") or "(empty answer)"), 300)


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
