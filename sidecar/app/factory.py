"""The aiohttp application: kubelet endpoints, /status, /metrics, and the long-lived monitors.

`create_app(config, ...)` builds the very app production runs; tests swap only what they must
(the Triton client, the metrics registry, the golden cases).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.app.kubelet import healthz, metrics_endpoint, readyz, status
from sidecar.config import SidecarConfig
from sidecar.fronts.appkeys import (
    CONFIG,
    DOCUMENT_POOL,
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
    TRITON_METRICS_POOL,
    UPSTREAM_POOL,
    WATCH,
)
from sidecar.fronts.generate_routes import add_generate_routes
from sidecar.fronts.grpc_server import grpc_front
from sidecar.fronts.http_routes import add_http_routes, document_fetcher
from sidecar.fronts.upstream_pool import UpstreamPool
from sidecar.golden.cases import GoldenCase, load_golden_dir
from sidecar.health.healer import Healer
from sidecar.health.prober import Prober
from sidecar.health.reload import GoldenStore, LiveConfig
from sidecar.health.roster import Roster
from sidecar.health.triton_client import TritonClient
from sidecar.health.triton_watch import TritonWatch
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import ServingCore
from sidecar.serving.lifecycle import Lifecycle
from sidecar.serving.request_rules import load_schemas
from sidecar.states import ModelStates, Transition

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
    app[DOCUMENT_POOL] = UpstreamPool(config.triton.url, connect_timeout_s=config.proxy.connect_timeout_s,
                                      max_idle=4)
    # A scrape is one request now and then: one kept-alive connection is plenty.
    app[TRITON_METRICS_POOL] = UpstreamPool(config.triton.metrics_url, connect_timeout_s=config.proxy.connect_timeout_s,
                                            max_idle=1)
    app.cleanup_ctx.append(_upstream_pools)
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


async def _upstream_pools(app: web.Application) -> AsyncIterator[None]:
    """The connection pools to Triton (proxied traffic, metrics scrapes), closed at exit."""
    try:
        yield
    finally:
        for pool in (app[UPSTREAM_POOL], app[DOCUMENT_POOL], app[TRITON_METRICS_POOL]):
            await pool.close()


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
