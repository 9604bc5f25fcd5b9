"""The aiohttp application: kubelet endpoints, /status, /metrics, and the long-lived monitors.

`create_app(config, ...)` builds the very app production runs; tests swap only what they must
(the Triton client, the metrics registry, the golden cases).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sidecar.appkeys import (
    CONFIG,
    GOLDEN,
    HEALER,
    LIFECYCLE,
    METRICS,
    PROBER,
    SERVING,
    STATES,
    TRITON,
    UPSTREAM,
    WATCH,
)
from sidecar.config import SidecarConfig
from sidecar.generate_front import add_generate_routes
from sidecar.golden import GoldenCase, load_golden_dir
from sidecar.healer import Healer
from sidecar.http_front import add_http_routes, document_fetcher
from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from sidecar.probes import Prober, TritonWatch
from sidecar.serving import ServingCore
from sidecar.states import ModelStates, Transition
from sidecar.triton import TritonClient, TritonError, TritonUnavailable

log = structlog.get_logger("sidecar.app")

#: How often (s) to retry model discovery while Triton is not answering yet (it loads models first).
DISCOVERY_RETRY_S = 1.0
#: Paths of the sidecar's own endpoints: not counted as traffic while draining.
OWN_PATHS = frozenset({"/healthz", "/readyz", "/status", "/metrics"})


def create_app(
    config: SidecarConfig,
    *,
    triton: TritonClient | None = None,
    registry: CollectorRegistry | None = None,
    golden: Mapping[str, Sequence[GoldenCase]] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    app = web.Application(middlewares=[_count_in_flight])
    app[CONFIG] = config
    metrics = SidecarMetrics(registry or CollectorRegistry())
    app[METRICS] = metrics
    app[GOLDEN] = dict(golden if golden is not None else load_golden_dir(config.golden_dir))
    app[LIFECYCLE] = Lifecycle(clock)
    states = ModelStates(
        failure_threshold=config.probes.failure_threshold,
        success_threshold=config.probes.success_threshold,
        clock=clock,
        listener=_transition_listener(metrics),
    )
    app[STATES] = states
    if triton is None:
        triton = _triton_client(config)
        app.cleanup_ctx.append(_close_on_exit(triton))
    app[TRITON] = triton
    app[WATCH] = TritonWatch(triton=triton, settings=config.probes, metrics=metrics, clock=clock)
    app[PROBER] = Prober(triton=triton, states=states, cases=app[GOLDEN], settings=config.probes,
                         metrics=metrics, on_unhealthy=lambda model: app[HEALER].request_heal(model))
    app[HEALER] = Healer(triton=triton, states=states, settings=config.healing, metrics=metrics,
                         verify=app[PROBER].run_round)
    app[SERVING] = ServingCore(
        config, states=states, metrics=metrics, fetch_document=document_fetcher(app),
        cases_for=app[PROBER].cases_for, note_triton_error=app[HEALER].note_triton_error,
        probe_soon=app[PROBER].probe_soon, mark_unreachable=app[WATCH].mark_unreachable)
    app.cleanup_ctx.append(_upstream_session)
    app.cleanup_ctx.append(_monitors)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics_endpoint)
    add_http_routes(app)
    add_generate_routes(app)
    return app


def app_runner(app: web.Application) -> web.AppRunner:
    """How the sidecar is served. handler_cancellation: aiohttp cancels the handler of a client that
    disconnects, so its upstream call to Triton is cancelled and its breaker slot freed at once.
    Signals are the CLI's (drain first); the proxy writes its own sampled access log."""
    return web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)


def _triton_client(config: SidecarConfig) -> TritonClient:
    headers = {}
    if config.triton.repository_header:
        headers[config.triton.repository_header] = config.triton.repository_token
    longest = max(config.healing.load_timeout_s, config.healing.unload_timeout_s, config.triton.timeout_s)
    return TritonClient(config.triton.url, timeout_s=config.triton.timeout_s,
                        repository_headers=headers, max_call_s=longest + 5)


def _close_on_exit(triton: TritonClient) -> Callable[[web.Application], AsyncIterator[None]]:
    async def close(app: web.Application) -> AsyncIterator[None]:
        yield
        await triton.close()

    return close


def _transition_listener(metrics: SidecarMetrics) -> Callable[[Transition], None]:
    def on_transition(t: Transition) -> None:
        metrics.set_state(t.model, t.state_to)
        if t.recovered_after_s is not None:
            metrics.time_to_recover.labels(model=t.model).observe(t.recovered_after_s)
        fields: dict[str, Any] = {"model": t.model, "state_from": t.state_from.value,
                                  "state_to": t.state_to.value, "cause": t.cause}
        if t.recovered_after_s is not None:
            fields["duration_ms"] = round(t.recovered_after_s * 1000, 1)
        level = "warning" if t.state_to.quarantined else "info"
        getattr(log, level)("model_state_changed", **fields)

    return on_transition


@web.middleware
async def _count_in_flight(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path in OWN_PATHS:
        return await handler(request)
    lifecycle = request.app[LIFECYCLE]
    lifecycle.request_started()
    try:
        return await handler(request)
    finally:
        lifecycle.request_finished()


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    """One pooled HTTP session to Triton for proxied traffic and metrics scrapes."""
    proxy = app[CONFIG].proxy
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=proxy.upstream_timeout_s, connect=proxy.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        app[UPSTREAM] = session
        yield


async def _monitors(app: web.Application) -> AsyncIterator[None]:
    """The Triton watch and one probe loop per model: started with the app, cancelled at exit."""
    tasks: list[asyncio.Task[None]] = [
        asyncio.create_task(app[WATCH].run(), name="triton-watch"),
        asyncio.create_task(_discover_and_probe(app), name="discover-models"),
    ]
    for task in tasks:
        task.add_done_callback(_log_crash)
    yield
    await app[HEALER].close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _log_crash(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background_task_crashed", task=task.get_name(), cause=repr(task.exception()))


async def _discover_and_probe(app: web.Application) -> None:
    config = app[CONFIG]
    models = list(config.models) or await _discover_models(app[TRITON])
    golden = app[GOLDEN]
    probe_tasks = []
    for model in models:
        app[STATES].track(model)
        app[METRICS].track_model(model)
        if not golden.get(model):
            log.warning("model_without_golden_requests", model=model,
                        cause=f"no files under {config.golden_dir / model}: only readiness and metadata are probed")
        task = asyncio.create_task(app[PROBER].run_model(model), name=f"probe:{model}")
        task.add_done_callback(_log_crash)
        probe_tasks.append(task)
    log.info("monitoring_started", models=models, golden_cases=sum(len(golden.get(m, ())) for m in models))
    try:
        await asyncio.gather(*probe_tasks)
    finally:
        for task in probe_tasks:
            task.cancel()
        await asyncio.gather(*probe_tasks, return_exceptions=True)


async def _discover_models(triton: TritonClient) -> list[str]:
    """Every model Triton has loaded; waits (retrying) until Triton answers."""
    while True:
        try:
            index = await triton.repository_index()
        except (TritonUnavailable, TritonError) as e:
            log.info("model_discovery_waiting", cause=str(e))
            await asyncio.sleep(DISCOVERY_RETRY_S)
            continue
        return sorted({entry["name"] for entry in index if entry.get("state") == "READY"})


# ---- verdicts -------------------------------------------------------------------------------


def liveness_problems(app: web.Application) -> list[str]:
    """Reasons a restart is needed; empty while the sidecar and Triton are fine or fixable."""
    config = app[CONFIG]
    watch = app[WATCH]
    problems = []
    down_for = watch.not_live_for()
    if down_for > config.liveness.triton_unreachable_grace_s:
        grace = config.liveness.triton_unreachable_grace_s
        problems.append(f"Triton not live for {down_for:.0f} s (grace {grace:g} s): {watch.detail}")
    for model in app[STATES].failed():
        problems.append(f"model {model} FAILED: {app[STATES].get(model).cause}")  # type: ignore[union-attr]
    now = time.monotonic()
    stalled = max(now - watch.last_tick, now - app[PROBER].last_tick if len(app[STATES]) else 0.0)
    if stalled > config.liveness.watchdog_stall_s:
        problems.append(f"probe loop stalled: no probe finished for {stalled:.0f} s")
    return problems


def readiness_problems(app: web.Application) -> list[str]:
    problems = []
    if app[LIFECYCLE].draining:
        problems.append("shutting down")
    watch = app[WATCH]
    if not watch.ready:
        problems.append(f"Triton not ready: {watch.detail}")
    states = app[STATES]
    if not len(states):
        problems.append("no models discovered yet")
    for health in states:
        if not health.state.serves_traffic:
            problems.append(f"model {health.model} {health.state.value}: {health.cause}")
    return problems


def _models_summary(app: web.Application) -> dict[str, dict[str, str]]:
    return {h.model: {"state": h.state.value, "reason": h.cause} for h in app[STATES]}


async def healthz(request: web.Request) -> web.Response:
    problems = liveness_problems(request.app)
    body = {"status": "fail" if problems else "ok", "problems": problems, "models": _models_summary(request.app)}
    return web.json_response(body, status=503 if problems else 200)


async def readyz(request: web.Request) -> web.Response:
    problems = readiness_problems(request.app)
    body = {"status": "fail" if problems else "ok", "problems": problems, "models": _models_summary(request.app)}
    return web.json_response(body, status=503 if problems else 200)


async def status(request: web.Request) -> web.Response:
    app = request.app
    clock_now = time.monotonic()
    prober, healer, watch = app[PROBER], app[HEALER], app[WATCH]
    models = {}
    for health in app[STATES]:
        record = prober.records.get(health.model)
        probes = {}
        if record is not None:
            probes = {key: {"ok": r.ok, "result": r.result, "duration_ms": round(r.duration_s * 1000, 2),
                            "detail": r.detail} for key, r in record.last_by_probe.items()}
        models[health.model] = {
            "state": health.state.value,
            "reason": health.cause,
            "in_state_for_s": round(clock_now - health.since, 1) if health.since else None,
            "consecutive_failures": health.consecutive_failures,
            "golden_cases": len(prober.cases_for(health.model)),
            "probe_rounds": record.rounds if record else 0,
            "probes": probes,
            "heal_attempts": healer.attempts.get(health.model, 0),
            "last_heal_duration_s": round(healer.last_heal_s[health.model], 3)
            if health.model in healer.last_heal_s else None,
            "healing": healer.is_healing(health.model),
        }
    body = {
        "live": not liveness_problems(app),
        "ready": not readiness_problems(app),
        "draining": app[LIFECYCLE].draining,
        "triton": {"url": app[CONFIG].triton.url, "live": watch.live, "ready": watch.ready,
                   "detail": watch.detail, "not_live_for_s": round(watch.not_live_for(), 1)},
        "models": models,
    }
    return web.json_response(body)


async def metrics_endpoint(request: web.Request) -> web.Response:
    app = request.app
    body = generate_latest(app[METRICS].registry)
    if app[CONFIG].metrics.include_triton:
        body += await _triton_metrics(app)
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


async def _triton_metrics(app: web.Application) -> bytes:
    """Triton's own nv_* metrics, so that one scrape target serves both and Triton stays private."""
    config = app[CONFIG]
    try:
        async with app[UPSTREAM].get(
            config.triton.metrics_url, timeout=aiohttp.ClientTimeout(total=config.metrics.triton_timeout_s)
        ) as response:
            if response.status == 200:
                return await response.read()
            cause = f"status {response.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        cause = repr(e)
    log.warning("triton_metrics_unavailable", cause=cause)
    return b""
