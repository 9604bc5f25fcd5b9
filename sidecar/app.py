"""The aiohttp application: kubelet endpoints, /status, /metrics, and the long-lived monitors.

`create_app(config, ...)` builds the very app production runs; tests swap only what they must
(the Triton client, the metrics registry, the golden cases).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
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
    LIVE,
    METRICS,
    PROBER,
    ROSTER,
    SERVING,
    STATES,
    TRITON,
    UPSTREAM,
    UPSTREAM_POOL,
    WATCH,
)
from sidecar.config import SidecarConfig
from sidecar.generate_front import add_generate_routes
from sidecar.golden import GoldenCase, load_golden_dir
from sidecar.grpc_front import grpc_front
from sidecar.healer import Healer
from sidecar.http_front import add_http_routes, document_fetcher
from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from sidecar.probes import Prober, TritonWatch
from sidecar.reload import GoldenStore, LiveConfig
from sidecar.roster import Roster
from sidecar.serving import ServingCore
from sidecar.states import ModelStates, Transition
from sidecar.triton import TritonClient
from sidecar.upstream import UpstreamPool
from sidecar.validation import load_schemas

log = structlog.get_logger("sidecar.app")
#: Paths of the sidecar's own endpoints: not counted as traffic while draining.
OWN_PATHS = frozenset({"/healthz", "/readyz", "/status", "/metrics"})


def create_app(
    config: SidecarConfig,
    *,
    triton: TritonClient | None = None,
    registry: CollectorRegistry | None = None,
    golden: Mapping[str, Sequence[GoldenCase]] | None = None,
    config_path: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """`config_path` is the file `config` came from: watched and re-read on change and on SIGHUP
    (None: nothing to re-read; the golden directory is watched all the same)."""
    # Files first: a bad one stops the start (ConfigError) before any connection to Triton is opened.
    rules = load_schemas(config.validation)
    app = web.Application(middlewares=[_count_in_flight])
    app[CONFIG] = config
    metrics = SidecarMetrics(registry or CollectorRegistry())
    app[METRICS] = metrics
    store = GoldenStore(config.golden_dir, golden if golden is not None else load_golden_dir(config.golden_dir),
                        metrics=metrics)
    app[LIVE] = LiveConfig(config, golden=store, metrics=metrics, path=config_path)
    app[GOLDEN] = store.cases
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
                         metrics=metrics, on_unhealthy=lambda model: app[ROSTER].unhealthy(model),
                         on_stub_dead=lambda model: app[HEALER].note_stub_dead(model))
    app[HEALER] = Healer(triton=triton, states=states, settings=config.healing, metrics=metrics,
                         verify=app[PROBER].verify_round, unanswered_for=app[PROBER].unanswered_for)
    app[SERVING] = ServingCore(
        config, states=states, metrics=metrics, fetch_document=document_fetcher(app),
        cases_for=app[PROBER].cases_for, note_stub_dead=app[HEALER].note_stub_dead,
        probe_soon=app[PROBER].probe_soon, mark_unreachable=app[WATCH].mark_unreachable, rules=rules)
    app[ROSTER] = Roster(triton=triton, states=states, prober=app[PROBER], healer=app[HEALER], metrics=metrics,
                         config=lambda: app[LIVE].config, cases_for=store.cases_for,
                         forget=app[SERVING].forget_model)
    app[UPSTREAM_POOL] = UpstreamPool(config.triton.url, connect_timeout_s=config.proxy.connect_timeout_s)
    app.cleanup_ctx.append(_upstream_session)
    app.cleanup_ctx.append(_monitors)
    # Last in, first out: the gRPC server stops (and drains) before the monitors and sessions.
    app.cleanup_ctx.append(grpc_front)
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
    """One pooled HTTP session to Triton for documents and metrics scrapes; at exit it and the
    inference connection pool are closed."""
    proxy = app[CONFIG].proxy
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=proxy.upstream_timeout_s, connect=proxy.connect_timeout_s)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            app[UPSTREAM] = session
            yield
    finally:
        await app[UPSTREAM_POOL].close()


async def _monitors(app: web.Application) -> AsyncIterator[None]:
    """The Triton watch, the roster of guarded models (one probe loop each) and the reloader:
    started with the app, cancelled at exit."""
    tasks: list[asyncio.Task[None]] = [
        asyncio.create_task(app[WATCH].run(), name="triton-watch"),
        asyncio.create_task(app[ROSTER].run(), name="discover-models"),
        asyncio.create_task(app[LIVE].run(apply_config=lambda c: apply_config(app, c),
                                          golden_changed=lambda models: golden_changed(app, models)),
                            name="reload-files"),
    ]
    for task in tasks:
        task.add_done_callback(_log_crash)
    yield
    await app[HEALER].close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await app[ROSTER].close()
    await app[PROBER].close()  # golden requests still open for a late answer


def _log_crash(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background_task_crashed", task=task.get_name(), cause=repr(task.exception()))


def apply_config(app: web.Application, config: SidecarConfig) -> None:
    """Hand a reloaded config to every part that copied a section at start. The serving core goes
    first: it compiles the request schema files and raises ConfigError before anything changed."""
    app[SERVING].reconfigure(config)
    app[STATES].reconfigure(failure_threshold=config.probes.failure_threshold,
                            success_threshold=config.probes.success_threshold)
    app[PROBER].reconfigure(config.probes)
    app[WATCH].reconfigure(config.probes)
    app[HEALER].reconfigure(config.healing)
    app[ROSTER].sync_soon()  # `models` may have changed


def golden_changed(app: web.Application, models: Sequence[str]) -> None:
    """New cases count from the next round, which starts now: a case that fails on the running
    model is found within seconds, not one interval later."""
    for model in models:
        app[SERVING].forget_model(model)  # its output policy depends on the cases (NaN expected?)
        app[PROBER].probe_soon(model)
    app[ROSTER].golden_changed(models)


# ---- verdicts -------------------------------------------------------------------------------


def liveness_problems(app: web.Application) -> list[str]:
    """Reasons a restart is needed; empty while the sidecar and Triton are fine or fixable."""
    config = app[LIVE].config
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
    live = app[LIVE]
    if live.config.probes.require_golden:
        for model in states.names():
            if not live.golden.cases_for(model):
                problems.append(f"model {model} has no golden files under {live.golden.golden_dir / model} "
                                "(probes.require_golden)")
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
    prober, healer, watch, live = app[PROBER], app[HEALER], app[WATCH], app[LIVE]
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
            # While quarantined for some versions only: those; the others are still served.
            "broken_versions": sorted(health.broken_versions),
            "golden_cases": len(prober.cases_for(health.model)),
            "without_golden": not prober.cases_for(health.model),
            "golden_loaded_at": _iso(live.golden.loaded_at.get(health.model)),
            "golden_refused": _refusal(live, health.model),
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
        "config": {"source": str(live.path) if live.path else live.config.source,
                   "loaded_at": _iso(live.loaded_at), "needs_restart": list(live.needs_restart)},
        "models": models,
    }
    return web.json_response(body)


def _iso(wall: float | None) -> str | None:
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="seconds") if wall is not None else None


def _refusal(live: LiveConfig, model: str) -> dict[str, str | None] | None:
    refusal = live.golden.refused.get(model)
    return {"error": refusal.error, "at": _iso(refusal.at)} if refusal is not None else None


async def metrics_endpoint(request: web.Request) -> web.Response:
    app = request.app
    body = generate_latest(app[METRICS].registry)
    if app[LIVE].config.metrics.include_triton:
        body += await _triton_metrics(app)
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


async def _triton_metrics(app: web.Application) -> bytes:
    """Triton's own nv_* metrics, so that one scrape target serves both and Triton stays private."""
    config = app[LIVE].config
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
