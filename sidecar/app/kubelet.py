"""The kubelet's and operators' endpoints: /healthz, /readyz, /status, /metrics."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import structlog
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sidecar.fronts.appkeys import (
    CONFIG,
    HEALER,
    LIFECYCLE,
    LIVE,
    METRICS,
    PROBER,
    STATES,
    TRITON_METRICS_POOL,
    WATCH,
)
from sidecar.fronts.upstream_pool import UpstreamError
from sidecar.health.reload import LiveConfig

log = structlog.get_logger("sidecar.app")


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
        # The pool's base path is the metrics URL's own path (/metrics).
        answer = await app[TRITON_METRICS_POOL].request("GET", "", {"Accept-Encoding": "identity"},
                                                        timeout_s=config.metrics.triton_timeout_s)
        if answer.status == 200:
            return answer.body
        cause = f"status {answer.status}"
    except (UpstreamError, TimeoutError, OSError) as e:
        cause = repr(e)
    log.warning("triton_metrics_unavailable", cause=cause)
    return b""

