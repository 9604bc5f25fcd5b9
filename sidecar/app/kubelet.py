"""The kubelet's and operators' endpoints: /healthz, /readyz, /status, /metrics."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import structlog
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sidecar.fronts.appkeys import (
    CONFIG,
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
    TRITON_METRICS_POOL,
    WATCH,
)
from sidecar.health.reload import LiveConfig
from sidecar.health.supervisor import ModelSupervisor
from sidecar.health.tasks import CrashRecord
from sidecar.upstream import UpstreamError

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
    escalated = app[ESCALATION].problem()
    if escalated is not None:
        problems.append(escalated)
    for model in app[STATES].failed():
        problems.append(f"model {model} FAILED: {app[STATES].get(model).cause}")  # type: ignore[union-attr]
    stall_s = config.liveness.watchdog_stall_s
    watch_stalled = app[STATES].now() - watch.last_tick
    if watch_stalled > stall_s:
        problems.append(f"Triton watch stalled: no check finished for {watch_stalled:.0f} s")
    problems.extend(app[HEARTBEATS].problems(stall_s))
    for supervisor in app[ROSTER].supervisors:
        stalled = supervisor.stalled_for()
        if stalled > stall_s:
            problems.append(f"model {supervisor.model}: probe loop stalled: no probe round completed for "
                            f"{stalled:.0f} s (bound {stall_s:g} s){_crashes(supervisor.crashes)}")
    return problems


def _crashes(record: CrashRecord) -> str:
    if not record.in_a_row:
        return ""
    return f"; it crashed {record.in_a_row} time(s) in a row, last: {record.last_error}"


def readiness_problems(app: web.Application) -> list[str]:
    """The pod's readiness, as every other readiness endpoint answers it (sidecar.serving.readiness),
    and a stalled front (HEARTBEATS): /readyz may be answered on the probe port while listen.port
    serves nobody."""
    return app[READINESS].problems() + app[HEARTBEATS].problems(app[LIVE].config.liveness.watchdog_stall_s)


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
    clock_now = app[STATES].now()
    prober, healer, watch, live, supervisors = app[PROBER], app[HEALER], app[WATCH], app[LIVE], app[ROSTER].supervisors
    stall_s = live.config.liveness.watchdog_stall_s
    drift = app[SERVING].drift
    models = {}
    for health in app[STATES]:
        record = prober.records.get(health.model)
        supervisor = supervisors.get(health.model)
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
            "golden_cases": len(live.golden.cases_for(health.model)),
            "without_golden": not live.golden.cases_for(health.model),
            "golden_loaded_at": _iso(live.golden.loaded_at.get(health.model)),
            "golden_refused": _refusal(live, health.model),
            "probe_rounds": record.rounds if record else 0,
            "probes": probes,
            "heal_attempts": healer.attempts.get(health.model, 0),
            "last_heal_duration_s": round(healer.last_heal_s[health.model], 3)
            if health.model in healer.last_heal_s else None,
            "healing": healer.is_healing(health.model),
            # Advisory, under its own key: drift never changes the model's state or its serving.
            "drift": drift.status(health.model),
            # A failed round is being confirmed at once (sidecar.health.supervisor).
            "suspect": health.suspect,
            # Rounds paced by traffic (probes.every_requests): live requests served since the last
            # round began, and why that round started (time, traffic, confirmation, event).
            "requests_since_round": supervisor.requests_since_round() if supervisor is not None else None,
            "last_round_cause": supervisor.last_round_cause if supervisor is not None else None,
            "supervisor": _supervisor_status(supervisor, stall_s) if supervisor is not None else None,
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
        # Process-level faults escalated to a restart: this process's, and the pod's count, which
        # survives restarts (healing.escalation_record_file).
        "escalations": app[ESCALATION].status(),
        # Version rollouts by model: each pod decides on its own evidence (docs/rollouts.md).
        "rollouts": {rollout.model: rollout.status() for rollout in app[SERVING].rollouts},
    }
    return web.json_response(body)


def _supervisor_status(supervisor: ModelSupervisor, stall_s: float) -> dict[str, Any]:
    stalled_for = supervisor.stalled_for()
    return {"last_round_s_ago": round(stalled_for, 1), "stalled": stalled_for > stall_s,
            "crashes": supervisor.crashes.crashes, "crashes_in_a_row": supervisor.crashes.in_a_row,
            "last_crash": supervisor.crashes.last_error or None}


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

