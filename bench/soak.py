"""Soak with faults, counted as users feel them: clients at full speed with random inputs, a fault every
--fault-every seconds, every answer checked against the model's true function.

    .venv/bin/python -m bench.soak [--minutes 4] [--clients 4] [--fault-every 20]
                                   [--faults kill,nan,drift,hang] [--hold-while-suspect-ms 50]
                                   [--probe-interval 0.5] [--every-requests 50 [--min-interval 0.05]]

Two models behind the sidecar (`triton-sidecar run`, probes every 0.5 s, failure threshold 2, the flap
guard raised for the planned faults): one copy of tests/models/faulty (the victim) and one steady
credit_risk clone. --clients closed-loop clients send back to back to the victim (about 1,000 req/s
on this machine), each request with one of 512 random inputs; one client sends --steady-rate req/s to
the steady model. Every answer is judged against credit_risk's function (bench/repository.py):
correct, wrong (finite but not the right scores, or a filtered output leaked), NaN served, 503 with
Retry-After, 502, another status, a client timeout (--client-timeout, 10 s), a connection error.
With --every-requests N the sidecar also starts a golden round once the victim has served N live
requests since its last round began (`probes.every_requests`, issue 35), no sooner than
--min-interval after it (`probes.min_interval_s`; unset: the sidecar's default).

Faults cycle through --faults (kill: stub SIGKILL; nan: NaN weights; drift: scaled weights, finite
but wrong answers; hang: execute() blocks forever; unload: by someone else), and each waits until
the victim is HEALTHY again. Per fault the report gives what users got (wrong answers served, NaN
served, 503, 502, client timeouts) and the fault's window: from the first bad answer to the moment
the sidecar quarantined the model (the first 503 it answered, or /status, whichever came first).
Wrong answers are also given as seconds of the victim's traffic (wrong ÷ its correct answers per
second while no fault lasted).

What passes: no NaN served, no client timeout, no other status or connection error, the steady
model answers correctly every time, every fault healed, RSS grows by less than 10% and the open
descriptors do not grow past where they were. Wrong answers during a drift fault are reported against
issue 23's targets (≤ 0.2 s of traffic, ≤ 0.02 s with --hold-while-suspect-ms 50), not failed on:
they depend on the probe timing of the machine; with --every-requests, against issue 35's (≤ 100
wrong answers per drift fault on average, ≤ 200 at worst). The report also gives the golden inferences
the sidecar sent to the victim (its /metrics at the end) as a share of the victim's live requests, and
its rounds by cause (time, traffic, confirmation, event). Exit code 0 on pass, 1 on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.faults import FAULT_DESCRIPTIONS, FAULT_KINDS, FaultyModel
from bench.inference import json_request
from bench.machine import command_line, describe_machine, keep_logs, write_results
from bench.procfs import describe_fds, open_fds, rss_bytes
from bench.repository import EXAMPLES, FAULTY_TEMPLATE, copy_golden, copy_model, credit_risk_scores
from bench.shutdown import interrupt_on_termination
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.traffic import count as count_categories
from bench.traffic import open_loop
from sidecar.devtools.tritonserver import LocalTriton

VICTIM = "credit_risk_faulty"
STEADY = "credit_risk_steady"
#: What users can get, in the order the report lists them.
CORRECT, WRONG, NAN, RETRY_LATER, BAD_GATEWAY = "correct", "wrong", "nan_served", "503_retry_after", "502"
OTHER_STATUS, CLIENT_TIMEOUT, CONNECTION_ERROR = "other_status", "client_timeout", "connection_error"
CATEGORIES = (CORRECT, WRONG, NAN, RETRY_LATER, BAD_GATEWAY, OTHER_STATUS, CLIENT_TIMEOUT, CONNECTION_ERROR)
#: Answers that say the model is broken before the sidecar has said so (the start of a fault's window).
BAD = frozenset({WRONG, NAN, BAD_GATEWAY, OTHER_STATUS, CLIENT_TIMEOUT})
#: Random inputs the clients choose from: enough that a cached answer could not pass, few enough to
#: encode once.
INPUTS = 512
#: Pass criteria.
MAX_RSS_GROWTH = 0.10
#: Open descriptors, both counted idle (before the load and after it has settled), may grow by this
#: many: a leak leaves one per failed request or per heal instead.
FD_TOLERANCE = 3
#: /status is read this often (s) to time quarantine and recovery.
POLL_S = 0.05
QUARANTINED = ("UNHEALTHY", "HEALING", "FAILED")
#: Issue 23's targets for wrong answers per drift fault, in seconds of traffic (without / with hold).
DRIFT_TARGET_S, DRIFT_TARGET_HOLD_S = 0.2, 0.02
#: Issue 35's targets for wrong answers per drift fault with probes.every_requests (requests: mean, worst).
DRIFT_TARGET_MEAN_REQUESTS, DRIFT_TARGET_WORST_REQUESTS = 100, 200


@dataclass
class SoakSettings:
    duration_s: float = 240.0
    #: Closed-loop clients sending to the victim back to back.
    clients: int = 4
    fault_every_s: float = 20.0
    faults: tuple[str, ...] = ("kill", "nan", "drift", "hang")
    #: Requests per second to the steady model (its answers must all be correct).
    steady_rate: float = 20.0
    #: Warm-up (s) of load before the start figures (RSS, fds) are taken and faults begin.
    warmup_s: float = 5.0
    probe_interval_s: float = 0.5
    failure_threshold: int = 2
    #: probes.every_requests (0: off, rounds by time only) and probes.min_interval_s (None: the default).
    every_requests: int = 0
    min_interval_s: float | None = None
    #: proxy.upstream_timeout_s; None keeps the sidecar's default (30 s), as a user would run it.
    upstream_timeout_s: float | None = None
    #: proxy.hold_while_suspect_ms; None leaves it unset (the sidecar's default).
    hold_while_suspect_ms: float | None = None
    #: healing.unload_timeout_s for the sidecar; None keeps the sidecar's default.
    unload_timeout_s: float | None = None
    #: A client gives up on an answer after this long (s), as a client service would.
    client_timeout_s: float = 10.0
    #: Longest wait (s) for the faulted model to be HEALTHY again before the soak fails.
    heal_deadline_s: float = 120.0
    #: Idle time (s) after the load before the end count of descriptors: pooled connections to Triton
    #: close after 15 s idle, client keep-alive connections at the client's pace.
    settle_s: float = 20.0


@dataclass(frozen=True)
class Outcome:
    model: str
    started: float
    finished: float
    category: str
    status: int
    detail: str = ""


@dataclass
class FaultRecord:
    kind: str
    action: str
    injected_at: float
    quarantined_at: float | None = None
    healthy_at: float | None = None
    #: Until the next fault was injected (or the load stopped): the answers this fault is blamed for.
    ends_at: float | None = None


@dataclass
class SoakReport:
    passed: bool
    failures: list[str]
    victim_rate: float
    counts: dict[str, int]
    counts_steady: dict[str, int]
    counts_victim: dict[str, int]
    faults: list[dict[str, Any]]
    by_kind: dict[str, dict[str, Any]]
    drift_verdict: str
    rss_start_mb: float
    rss_end_mb: float
    fds_start: int
    fds_end: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    examples_of_failures: list[dict[str, Any]] = field(default_factory=list)
    fd_kinds_start: dict[str, int] = field(default_factory=dict)
    fd_kinds_end: dict[str, int] = field(default_factory=dict)
    #: The sidecar's probes of the victim from its /metrics at the end: golden inferences, rounds by
    #: cause, and the golden inferences per live request the victim was sent.
    probes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Inputs:
    """The random requests the clients choose from, and each one's correct scores."""

    bodies: tuple[bytes, ...]
    scores: tuple[np.ndarray, ...]

    @classmethod
    def random(cls, count: int, seed: int = 23) -> Inputs:
        rng = np.random.default_rng(seed)
        xs = np.round(rng.standard_normal((count, 1, 128)), 4).astype(np.float32)
        return cls(tuple(json_request(x).body for x in xs), tuple(credit_risk_scores(x).ravel() for x in xs))


def judge(status: int, headers: Any, body: bytes, expected: np.ndarray) -> tuple[str, str]:
    """What the user got, said in one of CATEGORIES (and a detail for the report's examples)."""
    if status == 503 and headers.get("Retry-After"):
        return RETRY_LATER, ""
    if status == 502:
        return BAD_GATEWAY, body[:160].decode(errors="replace")
    if status != 200:
        return OTHER_STATUS, f"{status}: {body[:160].decode(errors='replace')}"
    try:
        outputs = {o["name"]: o for o in json.loads(body)["outputs"]}
        scores = np.asarray([math.nan if v is None else v for v in outputs["scores"]["data"]], dtype=np.float64)
    except (ValueError, KeyError, TypeError) as e:
        return WRONG, f"undecodable answer: {e!r}"
    if "income_prob" in outputs:
        return WRONG, "the filtered output income_prob was in the answer"
    if not np.isfinite(scores).all():
        return NAN, "NaN/Inf in scores"
    if scores.shape != expected.shape or not np.allclose(scores, expected, atol=1e-5, rtol=1e-4):
        return WRONG, f"scores {scores[:2]} instead of {expected[:2]}"
    return CORRECT, ""


class Clients:
    """The load: closed-loop clients on the victim, a fixed rate on the steady model."""

    def __init__(self, session: aiohttp.ClientSession, url: str, inputs: Inputs, timeout_s: float) -> None:
        self.session, self.url, self.inputs = session, url, inputs
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.outcomes: list[Outcome] = []
        self._headers = {"Content-Type": "application/json"}

    async def call(self, model: str, index: int) -> None:
        started = time.monotonic()
        try:
            async with self.session.post(f"{self.url}/v2/models/{model}/infer", data=self.inputs.bodies[index],
                                         headers=self._headers, timeout=self.timeout) as response:
                body = await response.read()
                category, detail = judge(response.status, response.headers, body, self.inputs.scores[index])
                status = response.status
        except TimeoutError:
            category, detail, status = CLIENT_TIMEOUT, "", 0
        except (aiohttp.ClientError, OSError) as e:
            category, detail, status = CONNECTION_ERROR, repr(e)[:160], 0
        self.outcomes.append(Outcome(model, started, time.monotonic(), category, status, detail))

    async def closed_loop(self, model: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while True:
            await self.call(model, int(rng.integers(len(self.inputs.bodies))))

    async def fixed_rate(self, model: str, rate: float) -> None:
        await open_loop(lambda sent: self.call(model, sent % len(self.inputs.bodies)), rate)


def count(outcomes: Iterable[Outcome]) -> dict[str, int]:
    return count_categories(outcomes, CATEGORIES)


def _exposed(outcome: Outcome, fault: FaultRecord) -> bool:
    """The request was sent between the fault's injection and the sidecar's quarantine of the model."""
    judged_at = fault.quarantined_at or fault.ends_at or math.inf
    return outcome.model == VICTIM and fault.injected_at <= outcome.started < judged_at


def _fault_figures(fault: FaultRecord, victim: Sequence[Outcome], victim_rate: float) -> dict[str, Any]:
    """What users got while this fault lasted, and its window."""
    mine = [o for o in victim if fault.injected_at <= o.started < (fault.ends_at or math.inf)]
    counted = count(mine)
    first_bad = min((o.started for o in mine if o.category in BAD), default=None)
    first_refusal = min((o.finished for o in mine if o.category == RETRY_LATER), default=None)
    quarantined = min((t for t in (fault.quarantined_at, first_refusal) if t is not None), default=None)
    window = None if first_bad is None or quarantined is None else max(0.0, quarantined - first_bad)
    return {
        "kind": fault.kind, "action": fault.action, **counted,
        "window_s": _round(window),
        "quarantined_after_s": _round(None if quarantined is None else quarantined - fault.injected_at),
        "healthy_after_s": _round(None if fault.healthy_at is None else fault.healthy_at - fault.injected_at),
        "wrong_s_of_traffic": _round(counted[WRONG] / victim_rate if victim_rate else None, 4),
    }


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _by_kind(faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault kind: totals, and the mean window and wrong answers per fault."""
    kinds: dict[str, dict[str, Any]] = {}
    for f in faults:
        k = kinds.setdefault(f["kind"], {"faults": 0, **{c: 0 for c in CATEGORIES if c != CORRECT},
                                         "windows_s": [], "wrong_s_per_fault": [], "wrong_per_fault": []})
        k["faults"] += 1
        for c in CATEGORIES:
            if c != CORRECT:
                k[c] += f[c]
        if f["window_s"] is not None:
            k["windows_s"].append(f["window_s"])
        if f["wrong_s_of_traffic"] is not None:
            k["wrong_s_per_fault"].append(f["wrong_s_of_traffic"])
        k["wrong_per_fault"].append(f[WRONG])
    for k in kinds.values():
        k["mean_window_s"] = _round(float(np.mean(k["windows_s"])) if k["windows_s"] else None)
        k["max_wrong_s_per_fault"] = max(k["wrong_s_per_fault"], default=None)
        k["mean_wrong_s_per_fault"] = (round(float(np.mean(k["wrong_s_per_fault"])), 4)
                                       if k["wrong_s_per_fault"] else None)
        k["mean_wrong_per_fault"] = round(float(np.mean(k["wrong_per_fault"])), 1) if k["wrong_per_fault"] else None
        k["max_wrong_per_fault"] = max(k["wrong_per_fault"], default=None)
    return kinds


def healthy_rate(correct: Sequence[Outcome], faults: Sequence[FaultRecord]) -> float:
    """The victim's correct answers per second while no fault lasted (injection to HEALTHY again):
    the traffic a fault's wrong answers are counted against. Counting the quarantines in would
    understate the rate (nothing is correct then) and overstate a fault's seconds of traffic."""
    if len(correct) < 2:
        return 0.0
    start, end = min(o.started for o in correct), max(o.finished for o in correct)
    spans = [(f.injected_at, f.healthy_at or f.ends_at or end) for f in faults]
    faulted = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)
    healthy = [o for o in correct if not any(a <= o.started < b for a, b in spans)]
    return len(healthy) / (end - start - faulted) if end - start > faulted else 0.0


def judge_soak(outcomes: list[Outcome], faults: list[FaultRecord], settings: SoakSettings, *,
               rss: tuple[int, int], fds: tuple[int, int], samples: list[dict[str, Any]]) -> SoakReport:
    victim = [o for o in outcomes if o.model == VICTIM]
    steady = [o for o in outcomes if o.model == STEADY]
    correct = [o for o in victim if o.category == CORRECT]
    victim_rate = healthy_rate(correct, faults)
    failures = []
    counted = count(outcomes)
    for category, what in ((NAN, "NaN answers served"), (CLIENT_TIMEOUT, "client timeouts")):
        if counted[category]:
            failures.append(f"{counted[category]} {what}")
    # Before the sidecar has judged a fault, Triton's own answers reach the client (a 400 for a model
    # someone unloaded): that is the fault's window, reported per fault. After it, or outside any
    # fault, every answer must be correct, 502 or 503 + Retry-After.
    judged = [o for o in outcomes if not any(_exposed(o, f) for f in faults)]
    for category, what in ((OTHER_STATUS, "answers with another status"), (CONNECTION_ERROR, "connection errors")):
        found = [o for o in judged if o.category == category]
        if found:
            first = found[0]
            since = [f"{first.started - f.injected_at:+.3f} s from the {f.kind} fault" for f in faults
                     if f.injected_at <= first.started < (f.ends_at or math.inf)]
            failures.append(f"{len(found)} {what} outside a fault's window, the first {first.status} "
                            f"{first.detail!r} ({', '.join(since) or 'outside any fault'})")
    steady_counted = count(steady)
    if steady_counted["correct"] != steady_counted["sent"]:
        failures.append(f"the steady model answered {steady_counted['sent'] - steady_counted['correct']} of "
                        f"{steady_counted['sent']} requests other than correctly")
    wrong_outside = [o for o in victim if o.category == WRONG and not any(
        f.injected_at <= o.started < (f.ends_at or math.inf) for f in faults)]
    if wrong_outside:
        failures.append(f"{len(wrong_outside)} wrong answers outside any fault")
    growth = (rss[1] - rss[0]) / rss[0]
    if growth >= MAX_RSS_GROWTH:
        failures.append(f"RSS grew {growth:.1%} ({rss[0] / 2**20:.1f} -> {rss[1] / 2**20:.1f} MB)")
    # A leak is growth. Fewer at the end is the start's transient connections gone idle (discovery's
    # and the first spec fetches' keep-alive connections to Triton; since heals load over Triton's
    # gRPC port, nothing reopens the HTTP session's after them): seen once as 27 -> 22 in CI.
    if fds[1] - fds[0] > FD_TOLERANCE:
        failures.append(f"open descriptors went {fds[0]} -> {fds[1]}")
    unhealed = [f.kind for f in faults if f.healthy_at is None]
    if unhealed:
        failures.append(f"faults not healed: {unhealed}")
    if not faults:
        failures.append("no fault was injected (duration too short?)")
    if not correct:
        failures.append("no correct answer at all")
    figures = [_fault_figures(f, victim, victim_rate) for f in faults]
    by_kind = _by_kind(figures)
    bad = [o for o in judged if o.category not in (CORRECT, RETRY_LATER, WRONG, BAD_GATEWAY)]
    bad += [o for o in outcomes if o.category in (NAN, CLIENT_TIMEOUT)]
    return SoakReport(
        passed=not failures, failures=failures, victim_rate=round(victim_rate, 1), counts=counted,
        counts_steady=steady_counted, counts_victim=count(victim), faults=figures, by_kind=by_kind,
        drift_verdict=_drift_verdict(by_kind, settings),
        rss_start_mb=round(rss[0] / 2**20, 2), rss_end_mb=round(rss[1] / 2**20, 2),
        fds_start=fds[0], fds_end=fds[1], samples=samples,
        examples_of_failures=[{"model": o.model, "category": o.category, "status": o.status, "detail": o.detail}
                              for o in bad[:10]],
    )


def _drift_verdict(by_kind: dict[str, dict[str, Any]], settings: SoakSettings) -> str:
    drift = by_kind.get("drift")
    if drift is None or drift["max_wrong_s_per_fault"] is None:
        return "no drift fault"
    hold = bool(settings.hold_while_suspect_ms)
    target = DRIFT_TARGET_HOLD_S if hold else DRIFT_TARGET_S
    worst, mean = drift["max_wrong_s_per_fault"], drift["mean_wrong_s_per_fault"]
    if settings.every_requests:
        worst_n, mean_n = drift["max_wrong_per_fault"], drift["mean_wrong_per_fault"]
        met = mean_n <= DRIFT_TARGET_MEAN_REQUESTS and worst_n <= DRIFT_TARGET_WORST_REQUESTS
        return (f"{'met' if met else 'missed'}: {mean_n:g} wrong answers per drift fault on average, {worst_n} at "
                f"worst ({mean:.3f} / {worst:.3f} s of traffic) with every_requests {settings.every_requests} "
                f"(target ≤ {DRIFT_TARGET_MEAN_REQUESTS} on average, ≤ {DRIFT_TARGET_WORST_REQUESTS} at worst)")
    return (f"{'met' if worst <= target else 'missed'}: at most {worst:.3f} s of traffic answered wrongly per "
            f"drift fault, {mean:.3f} s on average (target ≤ {target} s"
            f"{' with hold_while_suspect_ms' if hold else ''})")


async def _victim_state(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(f"{url}/status", timeout=aiohttp.ClientTimeout(total=5)) as response:
            return (await response.json())["models"][VICTIM]["state"]
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        return "UNREACHABLE"


async def _inject_and_follow(session: aiohttp.ClientSession, sidecar: SidecarProcess, model: FaultyModel,
                             kind: str, settings: SoakSettings) -> FaultRecord:
    record = FaultRecord(kind=kind, action="", injected_at=time.monotonic())
    record.action = await asyncio.to_thread(model.inject, kind)
    deadline = record.injected_at + settings.heal_deadline_s
    while time.monotonic() < deadline:
        state = await _victim_state(session, sidecar.url)
        now = time.monotonic()
        if record.quarantined_at is None and state in QUARANTINED:
            record.quarantined_at = now
        if state == "HEALTHY" and record.quarantined_at is not None:
            record.healthy_at = now
            break
        await asyncio.sleep(POLL_S)
    print(f"  fault {kind}: {record.action}; quarantined after "
          f"{'-' if record.quarantined_at is None else f'{record.quarantined_at - record.injected_at:.2f} s'}, "
          f"HEALTHY after {'-' if record.healthy_at is None else f'{record.healthy_at - record.injected_at:.2f} s'}",
          flush=True)
    return record


def _sample(started: float, pid: int, **extra: Any) -> dict[str, Any]:
    return {"t_s": round(time.monotonic() - started, 1), "rss_mb": round(rss_bytes(pid) / 2**20, 2),
            "fds": open_fds(pid), **extra}


async def _soak(settings: SoakSettings, triton: LocalTriton, sidecar: SidecarProcess,
                model: FaultyModel) -> SoakReport:
    inputs = Inputs.random(INPUTS)
    faults: list[FaultRecord] = []
    samples: list[dict[str, Any]] = []
    fds_start = open_fds(sidecar.pid)  # idle, before any load: compared with idle after it
    fd_kinds_start = _group_ports(describe_fds(sidecar.pid), sidecar, triton)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = Clients(session, sidecar.url, inputs, settings.client_timeout_s)
        load = [asyncio.create_task(clients.closed_loop(VICTIM, seed), name=f"client-{seed}")
                for seed in range(settings.clients)]
        load.append(asyncio.create_task(clients.fixed_rate(STEADY, settings.steady_rate), name="steady"))
        stop_at = started + settings.duration_s
        try:
            await asyncio.sleep(settings.warmup_s)
            rss_start = rss_bytes(sidecar.pid)
            samples.append(_sample(started, sidecar.pid))
            next_fault_at = time.monotonic()
            while time.monotonic() < stop_at:
                if time.monotonic() >= next_fault_at and stop_at - time.monotonic() > 5:
                    kind = settings.faults[len(faults) % len(settings.faults)]
                    if faults:
                        faults[-1].ends_at = time.monotonic()
                    faults.append(await _inject_and_follow(session, sidecar, model, kind, settings))
                    next_fault_at = faults[-1].injected_at + settings.fault_every_s
                    if faults[-1].healthy_at is None:
                        break  # never healed: stop early, the report says so
                samples.append(_sample(started, sidecar.pid))
                await asyncio.sleep(min(1.0, max(0.0, min(next_fault_at, stop_at) - time.monotonic())))
            rss_end = rss_bytes(sidecar.pid)
        finally:
            if faults:
                faults[-1].ends_at = time.monotonic()
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
        probes = await _victim_probes(session, sidecar.url)
    # Idle again: what is still open after the pools' idle timeouts is a leak.
    await asyncio.sleep(settings.settle_s)
    fds_end = open_fds(sidecar.pid)
    fd_kinds_end = _group_ports(describe_fds(sidecar.pid), sidecar, triton)
    samples.append(_sample(started, sidecar.pid, idle=True))
    report = judge_soak(clients.outcomes, faults, settings, rss=(rss_start, rss_end), fds=(fds_start, fds_end),
                        samples=samples)
    report.fd_kinds_start, report.fd_kinds_end = fd_kinds_start, fd_kinds_end
    # Live traffic is what reached the victim and came back as an answer (503s never reached Triton).
    served = report.counts_victim[CORRECT] + report.counts_victim[WRONG]
    report.probes = {**probes, "live_requests": served,
                     "golden_per_live_request": round(probes["golden_inferences"] / served, 4) if served else None}
    return report


async def _victim_probes(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The golden inferences the sidecar sent to the victim and its rounds by cause, from /metrics."""
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
        text = await response.text()
    golden, rounds = 0.0, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != VICTIM or not sample.name.endswith("_total"):
                continue
            if family.name == "triton_sidecar_probes" and sample.labels.get("probe") == "golden":
                golden += sample.value
            elif family.name == "triton_sidecar_probe_rounds":
                rounds[sample.labels["cause"]] = int(sample.value)
    return {"golden_inferences": int(golden), "rounds_by_cause": rounds}


def _group_ports(kinds: dict[str, int], sidecar: SidecarProcess, triton: LocalTriton) -> dict[str, int]:
    """Name the ports: which connections are to Triton, which from clients."""
    names = {str(triton.ports.http): "triton-http", str(triton.ports.metrics): "triton-metrics",
             str(sidecar.settings["listen"]["port"]): "sidecar"}
    grouped: dict[str, int] = {}
    for kind, n in kinds.items():
        if kind.startswith("tcp "):
            _, state, local, remote = kind.split(" ")
            local_port, remote_port = local.split(":")[1], remote.split(":")[1]
            if remote_port in names:
                kind = f"tcp {state} to {names[remote_port]}"
            elif local_port in names:
                kind = f"tcp {state} on {names[local_port]}"
        grouped[kind] = grouped.get(kind, 0) + n
    return grouped


def run_soak(settings: SoakSettings, workdir: Path) -> SoakReport:
    """Start Triton and the sidecar, soak, stop everything; the report says whether it passed."""
    repository, golden_dir = workdir / "model_repository", workdir / "golden"
    copy_model(EXAMPLES / "credit_risk", repository, STEADY)
    copy_golden("credit_risk", golden_dir, STEADY)
    copy_model(FAULTY_TEMPLATE, repository, VICTIM)
    copy_golden("credit_risk", golden_dir, VICTIM)
    models = [STEADY, VICTIM]
    # The soak breaks the model on purpose every fault_every_s: to the flap guard (more than
    # flap_max_heals heals an hour -> FAILED) that looks like a fault that returns after every reload,
    # so allow one heal per planned fault, and a few more.
    planned_faults = int(settings.duration_s // settings.fault_every_s) + 1
    healing: dict[str, Any] = {"backoff_initial_s": 0.5, "flap_max_heals": planned_faults + 5}
    if settings.unload_timeout_s is not None:
        healing["unload_timeout_s"] = settings.unload_timeout_s
    probes: dict[str, Any] = {"interval_s": settings.probe_interval_s, "timeout_s": 2,
                              "failure_threshold": settings.failure_threshold,
                              "every_requests": settings.every_requests}
    if settings.min_interval_s is not None:
        probes["min_interval_s"] = settings.min_interval_s
    proxy: dict[str, Any] = {"retry_after_s": 1}
    if settings.upstream_timeout_s is not None:
        proxy["upstream_timeout_s"] = settings.upstream_timeout_s
    if settings.hold_while_suspect_ms is not None:
        proxy["hold_while_suspect_ms"] = settings.hold_while_suspect_ms
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=repository, models=models, workdir=workdir / "triton")
        stack.callback(triton.stop, 3)
        triton.start()
        sidecar = SidecarProcess(sidecar_settings(
            triton, models=models, golden_dir=golden_dir,
            probes=probes,
            healing=healing, proxy=proxy, filtering={"rules": [CREDIT_FILTER_RULE]},
            logging={"format": "json", "level": "info", "access_log_sample_rate": 0.0},
        ), workdir / "sidecar")
        stack.callback(sidecar.stop)
        sidecar.start()
        return asyncio.run(_soak(settings, triton, sidecar, FaultyModel(triton, VICTIM, repository / VICTIM)))


def markdown(result: dict[str, Any]) -> str:
    r = result["report"]
    columns = [c for c in CATEGORIES if c != CORRECT]
    lines = ["| fault kind | faults | " + " | ".join(columns)
             + " | mean window s | wrong per fault: mean / worst | wrong per fault, s of traffic: mean / worst |",
             "|---|---|" + "---|" * (len(columns) + 3)]
    for kind, k in r["by_kind"].items():
        lines.append(f"| {kind} | {k['faults']} | " + " | ".join(str(k[c]) for c in columns)
                     + f" | {k['mean_window_s']} | {k['mean_wrong_per_fault']} / {k['max_wrong_per_fault']}"
                     + f" | {k.get('mean_wrong_s_per_fault')} / {k['max_wrong_s_per_fault']} |")
    victim, steady = r["counts_victim"], r["counts_steady"]
    lines += ["", f"Victim: {victim['sent']} requests at {r['victim_rate']} correct answers/s: "
                  + ", ".join(f"{c} {victim[c]}" for c in CATEGORIES) + ".",
              f"Steady model: {steady['correct']} of {steady['sent']} correct.",
              f"Drift: {r['drift_verdict']}.",
              f"Probes of the victim: {r['probes'].get('golden_inferences')} golden inferences for "
              f"{r['probes'].get('live_requests')} live requests answered "
              f"({r['probes'].get('golden_per_live_request')} per request); rounds by cause "
              f"{r['probes'].get('rounds_by_cause')}.",
              f"RSS under load {r['rss_start_mb']} → {r['rss_end_mb']} MB; open fds idle {r['fds_start']} → "
              f"{r['fds_end']}; verdict: {'PASS' if r['passed'] else 'FAIL: ' + '; '.join(r['failures'])}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4.0, help="length of the soak (default 4)")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients on the victim (default 4)")
    parser.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults (default 20)")
    parser.add_argument("--faults", default="kill,nan,drift,hang",
                        help=f"fault kinds in turn, from {','.join(FAULT_KINDS)} (default kill,nan,drift,hang)")
    parser.add_argument("--hold-while-suspect-ms", type=float, default=None,
                        help="proxy.hold_while_suspect_ms for the sidecar (default: unset)")
    parser.add_argument("--probe-interval", type=float, default=0.5,
                        help="probes.interval_s for the sidecar (default 0.5): the drift window's floor")
    parser.add_argument("--every-requests", type=int, default=0,
                        help="probes.every_requests for the sidecar (default 0: off, rounds by time only)")
    parser.add_argument("--min-interval", type=float, default=None,
                        help="probes.min_interval_s for the sidecar (default: the sidecar's own)")
    parser.add_argument("--upstream-timeout", type=float, default=None,
                        help="proxy.upstream_timeout_s for the sidecar (default: the sidecar's own, 30 s)")
    parser.add_argument("--unload-timeout", type=float, default=None,
                        help="healing.unload_timeout_s for the sidecar (default: the sidecar's own)")
    args = parser.parse_args(argv)
    faults = tuple(args.faults.split(","))
    unknown = [f for f in faults if f not in FAULT_KINDS]
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; known: {', '.join(FAULT_KINDS)}")
    interrupt_on_termination()
    settings = SoakSettings(duration_s=args.minutes * 60, clients=args.clients, fault_every_s=args.fault_every,
                            faults=faults, hold_while_suspect_ms=args.hold_while_suspect_ms,
                            probe_interval_s=args.probe_interval, every_requests=args.every_requests,
                            min_interval_s=args.min_interval,
                            upstream_timeout_s=args.upstream_timeout, unload_timeout_s=args.unload_timeout)
    machine = describe_machine()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as scratch:
        try:
            report = run_soak(settings, Path(scratch))
        finally:
            keep_logs(Path(scratch), "soak")
    result = {"benchmark": "soak", "command": command_line(), "machine": machine, "settings": asdict(settings),
              "fault_kinds": FAULT_DESCRIPTIONS, "report": asdict(report)}
    table = markdown(result)
    path = write_results("soak", result, table)
    print(f"\n{table}\nresults: {path}")
    if not report.passed:
        print(json.dumps(report.examples_of_failures, indent=1), file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
