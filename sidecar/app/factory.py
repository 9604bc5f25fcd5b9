"""The aiohttp application: kubelet endpoints, /status, /metrics, and the long-lived monitors.

`create_app(config, ...)` builds the very app production runs; tests swap only what they must
(the Triton client, the metrics registry, the golden cases).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.app.drift_references import ReferenceWatch, load_references
from sidecar.app.drift_routes import record_reference
from sidecar.app.kubelet import healthz, metrics_endpoint, readyz, status
from sidecar.app.request_counters import RequestCounters
from sidecar.config import SidecarConfig
from sidecar.fronts.appkeys import (
    CONFIG,
    DOCUMENT_POOL,
    ESCALATION,
    HEALER,
    HEARTBEATS,
    LIFECYCLE,
    LIVE,
    METRICS,
    PROBER,
    READINESS,
    ROSTER,
    SERVING,
    STATES,
    TLS,
    TRITON,
    TRITON_METRICS_POOL,
    UPSTREAM_POOL,
    WATCH,
)
from sidecar.fronts.generate_routes import add_generate_routes
from sidecar.fronts.http_routes import add_http_routes, document_fetcher
from sidecar.fronts.tls import ServerTls
from sidecar.golden.cases import GoldenCase, aim_unversioned, cases_for_version, load_golden_dir
from sidecar.health.escalation import RestartEscalation
from sidecar.health.escalation_record import EscalationRecord
from sidecar.health.healer import Healer
from sidecar.health.heartbeats import Heartbeats
from sidecar.health.probe_round import probe_model
from sidecar.health.prober import Prober
from sidecar.health.reload import GoldenStore, LiveConfig
from sidecar.health.roster import Roster
from sidecar.health.supervisor import Supervisors
from sidecar.health.tasks import spawn
from sidecar.health.triton_client import TritonClient
from sidecar.health.triton_watch import TritonWatch
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import ServingCore
from sidecar.serving.drift import DriftMonitor
from sidecar.serving.lifecycle import Lifecycle
from sidecar.serving.passive_signals import HealthEvents
from sidecar.serving.readiness import Readiness
from sidecar.serving.request_rules import load_schemas
from sidecar.serving.rollouts import GoldenGate
from sidecar.serving.telemetry import GRPC, HTTP
from sidecar.states import ModelStates, Transition
from sidecar.tracing.spans import NO_SPANS, HealthSpans
from sidecar.upstream import UpstreamPool

if TYPE_CHECKING:
    from sidecar.tracing.otel import OtelTracing

log = structlog.get_logger("sidecar.app")

#: The drift reference files' watch, compared in the reloader's pass (see _monitors).
REFERENCE_WATCH = web.AppKey("reference_watch", ReferenceWatch)


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
    references = load_references(config.drift)
        # No middleware counts requests for the drain: the serving core's request scope does, on every
    # front (the sidecar's own /healthz, /readyz, /status and /metrics are not traffic).
    app = web.Application()
    app[CONFIG] = config
    metrics = SidecarMetrics(registry or CollectorRegistry())
    app[METRICS] = metrics
    tracing = _tracing(app, config, metrics)
    health_spans: HealthSpans = tracing if tracing is not None else NO_SPANS
    if config.tls.enabled:  # a bad certificate, key or CA file stops the start here (TlsFileError)
        app[TLS] = ServerTls(config.tls, metrics=metrics)
        app.cleanup_ctx.append(app[TLS].watching)
    store = GoldenStore(config.golden_dir, golden if golden is not None else load_golden_dir(config.golden_dir),
                        metrics=metrics)
    app[LIVE] = LiveConfig(config, golden=store, metrics=metrics, path=config_path)
    app[LIFECYCLE] = Lifecycle(clock)
    app[HEARTBEATS] = Heartbeats()
    states = ModelStates(
        failure_threshold=config.probes.failure_threshold,
        success_threshold=config.probes.success_threshold,
        clock=clock,
        listener=_transition_listener(metrics),
    )
    app[STATES] = states
    if triton is None:
        triton = _triton_client(config, health_spans)
        app.cleanup_ctx.append(_close_on_exit(triton))
    app[TRITON] = triton
    app[WATCH] = TritonWatch(triton=triton, settings=config.probes, metrics=metrics, clock=clock)
    # Every event about a model goes to its supervisor, the only writer of its state: the prober's
    # late verdicts, the serving core's passive signals, golden files changed (see golden_changed).
    supervisors = Supervisors()
    app[PROBER] = Prober(triton=triton, cases_for=lambda model: _probed_cases(app, model), settings=config.probes,
                         metrics=metrics, on_late_verdict=supervisors.late_verdict, clock=clock)
    app[HEALER] = Healer(triton=triton, settings=config.healing, metrics=metrics, verify=app[PROBER].verify_round,
                         unanswered_for=app[PROBER].unanswered_for, clock=clock, spans=health_spans)
    # The record is opened first among the health loop's parts: a folder that is missing stops the
    # start (ConfigError naming healing.escalation_record_file).
    app[ESCALATION] = RestartEscalation(
        record=EscalationRecord.open(config.healing.escalation_record_file, source=config.source),
        metrics=metrics,
        config=lambda: app[LIVE].config, states=states, triton=triton, probe_soon=supervisors.probe_soon,
        guarded=lambda: [s.model for s in supervisors], clock=clock)
    drift = DriftMonitor(config.drift, references, count_nan=not config.validation.reject_non_finite)
    metrics.registry.register(drift.collector())
    app[REFERENCE_WATCH] = ReferenceWatch(drift, settings=lambda: app[LIVE].config.drift, metrics=metrics)
    app[SERVING] = ServingCore(
        config, states=states, metrics=metrics, fetch_document=document_fetcher(app), cases_for=store.cases_for,
        events=HealthEvents(probe_soon=supervisors.probe_soon, stub_dead=supervisors.stub_dead,
                            triton_unreachable=app[WATCH].mark_unreachable), rules=rules, drift=drift,
        golden_gate=_golden_gate(triton, store.cases_for, lambda: app[LIVE].config.probes.timeout_s), clock=clock,
        lifecycle=app[LIFECYCLE], spans=tracing)
    live = app[LIVE]
    app[READINESS] = Readiness(lifecycle=app[LIFECYCLE], states=states, triton=app[WATCH],
                               doubts=_health_doubts(app[LIVE], supervisors))
    app[ROSTER] = Roster(triton=triton, states=states, prober=app[PROBER], healer=app[HEALER],
                         escalation=app[ESCALATION], metrics=metrics,
                         config=lambda: live.config, cases_for=store.cases_for,
                         forget=app[SERVING].forget_model, supervisors=supervisors, clock=clock,
                         # The live requests rounds are paced by (probes.every_requests): the data
                         # plane's own counters, read by the supervisors, never per request.
                         served=RequestCounters(metrics).served, spans=health_spans)
    app[UPSTREAM_POOL] = UpstreamPool(config.triton.url, connect_timeout_s=config.proxy.connect_timeout_s)
    app[DOCUMENT_POOL] = UpstreamPool(config.triton.url, connect_timeout_s=config.proxy.connect_timeout_s,
                                      max_idle=4)
    # A scrape is one request now and then: one kept-alive connection is plenty.
    app[TRITON_METRICS_POOL] = UpstreamPool(config.triton.metrics_url, connect_timeout_s=config.proxy.connect_timeout_s,
                                            max_idle=1)
    app.cleanup_ctx.append(_upstream_pools)
    app.cleanup_ctx.append(_monitors)
    app.cleanup_ctx.append(_rollouts)
    # Last in, first out: the gRPC server stops (and drains) before the monitors and sessions.
    if config.listen.grpc_port:
        # Imported only with a gRPC port: its protobuf stubs (tritonclient.grpc, grpc.health.v1) are
        # about 4 MB of RSS an HTTP-only sidecar never needs (issue 18's idle budget).
        from sidecar.fronts.grpc_server import grpc_front

        app.cleanup_ctx.append(grpc_front)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_post("/drift/{model}/record", record_reference)
    add_http_routes(app)
    add_generate_routes(app)
    return app



def _tracing(app: web.Application, config: SidecarConfig, metrics: SidecarMetrics) -> OtelTracing | None:
    """The tracer providers when tracing.endpoint is set (the SDK is imported only then), shut down at
    exit after everything that makes spans has stopped: its cleanup is registered first, so it runs last."""
    if not config.tracing.enabled:
        return None
    from sidecar.tracing.otel import start_tracing

    # Every request the Python side answers: gRPC's, and over HTTP those the Rust front hands over (or
    # all, on listen.front: python); the front's lanes make their own spans (dataplane front/tracing.rs).
    tracing = start_tracing(config.tracing, metrics=metrics, protocols=frozenset({GRPC, HTTP}))

    async def shut_down(app: web.Application) -> AsyncIterator[None]:
        yield
        # Blocking (a last export, bounded by tracing.export_timeout_s): off the event loop.
        await asyncio.to_thread(tracing.shutdown)

    app.cleanup_ctx.append(shut_down)
    return tracing


def _triton_client(config: SidecarConfig, spans: HealthSpans) -> TritonClient:
    headers = {}
    if config.triton.repository_header:
        headers[config.triton.repository_header] = config.triton.repository_token
    longest = max(config.healing.load_timeout_s, config.healing.unload_timeout_s, config.triton.timeout_s)
    return TritonClient(config.triton.url, timeout_s=config.triton.timeout_s,
                        repository_headers=headers, max_call_s=longest + 5, trace_headers=spans.current_trace)


def _close_on_exit(triton: TritonClient) -> Callable[[web.Application], AsyncIterator[None]]:
    async def close(app: web.Application) -> AsyncIterator[None]:
        yield
        await triton.close()

    return close


def _health_doubts(live: LiveConfig, supervisors: Supervisors) -> Callable[[str], str]:
    """Readiness's view of the health loop: probes.require_golden (from the config in force, it
    reloads), and a model's supervisor that has completed no round within liveness.watchdog_stall_s
    (its state is no longer re-checked: /healthz fails for it too)."""

    def doubts(model: str) -> str:
        config = live.config
        if config.probes.require_golden and not live.golden.cases_for(model):
            return f"model {model} has no golden files under {live.golden.golden_dir / model} (probes.require_golden)"
        supervisor = supervisors.get(model)
        if supervisor is not None and supervisor.stalled_for() > config.liveness.watchdog_stall_s:
            return f"model {model}: its probe loop completed no round for {supervisor.stalled_for():.0f} s"
        return ""

    return doubts


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


async def _upstream_pools(app: web.Application) -> AsyncIterator[None]:
    """The connection pools to Triton (proxied traffic, documents, metrics scrapes), closed at exit."""
    try:
        yield
    finally:
        for pool in (app[UPSTREAM_POOL], app[DOCUMENT_POOL], app[TRITON_METRICS_POOL]):
            await pool.close()


async def _monitors(app: web.Application) -> AsyncIterator[None]:
    """The Triton watch, the roster of guarded models (one supervisor each) and the reloader:
    started with the app, each restarted after a crash (sidecar.health.tasks), cancelled at exit.
    The reloader's pass also compares the drift reference files: one timer for every watched file
    (issue 18's idle budget; bench/RESULTS.md §4c)."""
    metrics, live = app[METRICS], app[LIVE]

    def reload_files() -> Awaitable[None]:
        return live.run(apply_config=lambda c: apply_config(app, c),
                        golden_changed=lambda models: golden_changed(app, models),
                        also_compare=app[REFERENCE_WATCH].compare)

    tasks: list[asyncio.Task[None]] = [
        spawn(app[WATCH].run, kind="triton_watch", name="triton-watch", metrics=metrics),
        spawn(app[ROSTER].run, kind="discovery", name="discover-models", metrics=metrics),
        spawn(reload_files, kind="reload", name="reload-files", metrics=metrics),
    ]
    yield
    await app[HEALER].close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await app[ROSTER].close()
    await app[PROBER].close()  # golden requests still open for a late answer


def _probed_cases(app: web.Application, model: str) -> Sequence[GoldenCase]:
    """A model's golden cases as the prober runs them: with a rollout, unversioned cases probe the
    version unpinned traffic reaches (stable, the candidate once promoted), not Triton's highest.
    While the rollout gates or is aborted, the candidate's own cases are left to the gate: judged by
    the model's rounds, a candidate that fails them would quarantine the model and have the healer
    reload it (stable with it: Triton reloads every version) until it is FAILED and the pod
    restarted, for a version no client reaches unpinned."""
    cases = app[LIVE].golden.cases_for(model)
    rollout = app[SERVING].rollouts.get(model)
    if rollout is None:
        return cases
    if not rollout.candidate_in_service:
        cases = [c for c in cases if c.version != rollout.settings.candidate]
    return aim_unversioned(cases, rollout.serving_version)


def _golden_gate(triton: TritonClient, cases_for: Callable[[str], Sequence[GoldenCase]],
                 timeout_s: Callable[[], float]) -> GoldenGate:
    """The rollout's golden gate: the candidate's own cases (or the model's unversioned ones aimed at
    it), run by the prober's code against the candidate version, before it sees any traffic."""
    async def run(model: str, version: str) -> str | None:
        cases = cases_for_version(cases_for(model), version)
        if not cases:
            return (f"model {model} has no golden case for version {version} and no unversioned one to run "
                    "against it: a candidate gets traffic only after golden cases pass")
        result = await probe_model(triton, model, cases, timeout_s=timeout_s())
        return None if result.ok else result.cause

    return run


async def _rollouts(app: web.Application) -> AsyncIterator[None]:
    """The rollouts' decision loop (restarted after a crash); at exit it stops and every shadow call
    still running is cancelled."""
    core = app[SERVING]
    task = spawn(core.rollouts.run, kind="rollouts", name="rollouts", metrics=app[METRICS])
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await core.shadows.close()


def apply_config(app: web.Application, config: SidecarConfig) -> None:
    """Hand a reloaded config to every part that copied a section at start. The serving core goes
    first: it compiles the request schema files and raises ConfigError before anything changed."""
    app[SERVING].reconfigure(config)
    app[STATES].reconfigure(failure_threshold=config.probes.failure_threshold,
                            success_threshold=config.probes.success_threshold)
    app[PROBER].reconfigure(config.probes)  # the supervisors read the live config themselves
    app[WATCH].reconfigure(config.probes)
    app[HEALER].reconfigure(config.healing)
    app[ROSTER].sync_soon()  # `models` may have changed


def golden_changed(app: web.Application, models: Sequence[str]) -> None:
    """New cases: the serving core forgets what it derived from the old ones, and each model's
    supervisor runs its next round now."""
    for model in models:
        app[SERVING].forget_model(model)  # its output policy depends on the cases (NaN expected?)
    app[ROSTER].golden_changed(models)
