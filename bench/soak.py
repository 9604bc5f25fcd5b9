"""Soak with faults: steady proxied load at a bounded rate while a fault of another kind hits a model
every --fault-every seconds.

    .venv/bin/python -m bench.soak [--minutes 10] [--rate 50] [--fault-every 30]

Three models behind the sidecar (`triton-sidecar run`, probe interval 1 s, failure threshold 2):
two steady credit_risk clones and one copy of tests/models/faulty. The client sends --rate
requests/s round robin to all three, through the sidecar only (127.0.0.1), and judges every answer:
correct, wrong (bad scores, or income_prob not filtered), 503 with Retry-After, anything else.
Faults cycle through nan, drift, unload (by someone else), kill (stub SIGKILL), hang; the next one
waits until the model is HEALTHY again.

What passes: zero "anything else" and zero wrong answers, except for requests to the faulted model
that overlap its exposure window (from the injection until the sidecar has quarantined the model:
nobody can know before the probes do; those are reported apart); from quarantine on, every answer
of the faulted model must be correct or a 503 with Retry-After. The sidecar's RSS must grow by less
than 10% and its open descriptors stay within a few of their start.
Exit code 0 on pass, 1 on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.faults import FAULT_DESCRIPTIONS, FAULT_KINDS, FaultyModel
from bench.inference import features, json_request
from bench.machine import command_line, describe_machine, keep_logs, write_results
from bench.procfs import describe_fds, open_fds, rss_bytes
from bench.repository import EXAMPLES, FAULTY_TEMPLATE, copy_golden, copy_model, credit_risk_scores
from bench.shutdown import interrupt_on_termination
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.traffic import CORRECT, OTHER, RETRY_LATER, WRONG, ModelCall, Outcome, Traffic, count
from sidecar.devtools.tritonserver import LocalTriton

STEADY = ["credit_risk_steady_0", "credit_risk_steady_1"]
VICTIM = "credit_risk_faulty"
#: Pass criteria.
MAX_RSS_GROWTH = 0.10
#: Open descriptors, both counted idle (before the load and after it has settled), may differ by
#: this many: a leak leaves one per failed request or per heal instead.
FD_TOLERANCE = 3
#: /status is read this often (s) to time quarantine and recovery.
POLL_S = 0.1
#: A request that overlaps this long (s) after the quarantine was seen is still counted as exposed:
#: the poll may see the state change up to POLL_S late.
EXPOSURE_MARGIN_S = POLL_S * 2
QUARANTINED = ("UNHEALTHY", "HEALING", "FAILED")


@dataclass
class SoakSettings:
    duration_s: float = 600.0
    rate: float = 50.0
    fault_every_s: float = 30.0
    #: Warm-up (s) of load before the start figures (RSS, fds) are taken and faults begin.
    warmup_s: float = 5.0
    #: Bound (s) on one proxied request to Triton: a hung model costs this much per request.
    upstream_timeout_s: float = 5.0
    #: healing.unload_timeout_s for the sidecar; None keeps the sidecar's default.
    unload_timeout_s: float | None = None
    #: Longest wait (s) for the faulted model to be HEALTHY again before the soak fails.
    heal_deadline_s: float = 120.0
    #: Idle time (s) after the load before the end count of descriptors: aiohttp closes a pooled
    #: connection idle for keepalive_timeout (15 s) at its next cleanup pass, which runs every 15 s,
    #: so a connection may stay open up to 30 s after its last use.
    settle_s: float = 32.0


@dataclass
class FaultRecord:
    kind: str
    action: str
    injected_at: float
    quarantined_at: float | None = None
    healthy_at: float | None = None

    def exposure_end(self) -> float:
        return (self.quarantined_at or self.healthy_at or time.monotonic()) + EXPOSURE_MARGIN_S


@dataclass
class SoakReport:
    passed: bool
    failures: list[str]
    counts: dict[str, int]
    counts_steady: dict[str, int]
    counts_victim_judged: dict[str, int]
    counts_victim_exposed: dict[str, int]
    faults: list[dict[str, Any]]
    rss_start_mb: float
    rss_end_mb: float
    fds_start: int
    fds_end: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    examples_of_failures: list[dict[str, Any]] = field(default_factory=list)
    skipped_sends: int = 0
    fd_kinds_start: dict[str, int] = field(default_factory=dict)
    fd_kinds_end: dict[str, int] = field(default_factory=dict)


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 2)


def _overlaps(outcome: Outcome, start: float, end: float) -> bool:
    return outcome.started < end and outcome.finished >= start


def judge_soak(outcomes: list[Outcome], faults: list[FaultRecord], settings: SoakSettings, *,
               rss: tuple[int, int], fds: tuple[int, int], skipped: int,
               samples: list[dict[str, Any]]) -> SoakReport:
    exposed, judged = [], []
    for o in outcomes:
        if o.model == VICTIM and any(_overlaps(o, f.injected_at, f.exposure_end()) for f in faults):
            exposed.append(o)
        else:
            judged.append(o)
    counted = count(judged)
    failures = []
    bad = [o for o in judged if o.category in (WRONG, OTHER)]
    if counted[OTHER]:
        failures.append(f"{counted[OTHER]} answers were neither correct nor a 503 with Retry-After")
    if counted[WRONG]:
        failures.append(f"{counted[WRONG]} wrong answers")
    steady_503 = [o for o in judged if o.model != VICTIM and o.category == RETRY_LATER]
    if steady_503:
        failures.append(f"{len(steady_503)} requests to steady models were refused with 503")
    growth = (rss[1] - rss[0]) / rss[0]
    if growth >= MAX_RSS_GROWTH:
        failures.append(f"RSS grew {growth:.1%} ({rss[0] / 2**20:.1f} -> {rss[1] / 2**20:.1f} MB)")
    if abs(fds[1] - fds[0]) > FD_TOLERANCE:
        failures.append(f"open descriptors went {fds[0]} -> {fds[1]}")
    unhealed = [f.kind for f in faults if f.healthy_at is None]
    if unhealed:
        failures.append(f"faults not healed: {unhealed}")
    if not faults:
        failures.append("no fault was injected (duration too short?)")
    if skipped:
        failures.append(f"{skipped} sends skipped: too many requests in flight")
    if not counted[CORRECT]:
        failures.append("no correct answer at all")
    return SoakReport(
        passed=not failures, failures=failures, counts=count(outcomes),
        counts_steady=count(o for o in judged if o.model != VICTIM),
        counts_victim_judged=count(o for o in judged if o.model == VICTIM),
        counts_victim_exposed=count(exposed),
        faults=[{"kind": f.kind, "action": f.action,
                 "quarantined_after_s": _since(f.injected_at, f.quarantined_at),
                 "healthy_after_s": _since(f.injected_at, f.healthy_at),
                 "exposed": count(o for o in exposed if _overlaps(o, f.injected_at, f.exposure_end()))}
                for f in faults],
        rss_start_mb=round(rss[0] / 2**20, 2), rss_end_mb=round(rss[1] / 2**20, 2),
        fds_start=fds[0], fds_end=fds[1], samples=samples, skipped_sends=skipped,
        examples_of_failures=[{"model": o.model, "category": o.category, "status": o.status, "detail": o.detail}
                              for o in bad[:10]],
    )


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


async def _soak(settings: SoakSettings, triton: LocalTriton, sidecar: SidecarProcess,
                model: FaultyModel) -> SoakReport:
    x = features(1, seed=11)
    body = json_request(x).body
    expected = credit_risk_scores(x)
    calls = [ModelCall(m, body, expected, forbidden_outputs=("income_prob",)) for m in [*STEADY, VICTIM]]
    faults: list[FaultRecord] = []
    samples: list[dict[str, Any]] = []
    fds_start = open_fds(sidecar.pid)  # idle, before any load: compared with idle after it
    fd_kinds_start = _group_ports(describe_fds(sidecar.pid), sidecar, triton)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        traffic = Traffic(session, sidecar.url, timeout_s=settings.upstream_timeout_s * 2 + 5)
        load = asyncio.create_task(traffic.fixed_rate(calls, settings.rate), name="soak-load")
        started = time.monotonic()
        stop_at = started + settings.duration_s
        try:
            await asyncio.sleep(settings.warmup_s)
            rss_start = rss_bytes(sidecar.pid)
            samples.append({"t_s": round(time.monotonic() - started, 1), "rss_mb": round(rss_start / 2**20, 2),
                            "fds": open_fds(sidecar.pid)})
            next_fault_at, kind_index = time.monotonic(), 0
            while time.monotonic() < stop_at:
                if time.monotonic() >= next_fault_at and stop_at - time.monotonic() > 5:
                    kind = FAULT_KINDS[kind_index % len(FAULT_KINDS)]
                    kind_index += 1
                    faults.append(await _inject_and_follow(session, sidecar, model, kind, settings))
                    next_fault_at = faults[-1].injected_at + settings.fault_every_s
                    if faults[-1].healthy_at is None:
                        break  # never healed: stop early, the report says so
                samples.append({"t_s": round(time.monotonic() - started, 1),
                                "rss_mb": round(rss_bytes(sidecar.pid) / 2**20, 2), "fds": open_fds(sidecar.pid)})
                await asyncio.sleep(min(1.0, max(0.0, min(next_fault_at, stop_at) - time.monotonic())))
            rss_end = rss_bytes(sidecar.pid)
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
    # Idle again: the sidecar's keep-alive connections to Triton (a pool that grows while a dead stub
    # makes every answer take a second) close after the client's keep-alive timeout; what is still
    # open after that is a leak.
    await asyncio.sleep(settings.settle_s)
    fds_end = open_fds(sidecar.pid)
    fd_kinds_end = _group_ports(describe_fds(sidecar.pid), sidecar, triton)
    samples.append({"t_s": round(time.monotonic() - started, 1), "rss_mb": round(rss_bytes(sidecar.pid) / 2**20, 2),
                    "fds": fds_end, "idle": True})
    report = judge_soak(traffic.outcomes, faults, settings, rss=(rss_start, rss_end), fds=(fds_start, fds_end),
                        skipped=traffic.skipped, samples=samples)
    report.fd_kinds_start, report.fd_kinds_end = fd_kinds_start, fd_kinds_end
    return report


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
    for name in STEADY:
        copy_model(EXAMPLES / "credit_risk", repository, name)
        copy_golden("credit_risk", golden_dir, name)
    copy_model(FAULTY_TEMPLATE, repository, VICTIM)
    copy_golden("credit_risk", golden_dir, VICTIM)
    models = [*STEADY, VICTIM]
    # The soak breaks the model on purpose every fault_every_s, each time in a new way: to the flap
    # guard (more than flap_max_heals heals an hour -> FAILED) that looks like a fault that returns
    # after every reload, so allow one heal per planned fault, and a few more.
    planned_faults = int(settings.duration_s // settings.fault_every_s) + 1
    healing: dict[str, Any] = {"backoff_initial_s": 0.5, "flap_max_heals": planned_faults + 5}
    if settings.unload_timeout_s is not None:
        healing["unload_timeout_s"] = settings.unload_timeout_s
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=repository, models=models, workdir=workdir / "triton")
        stack.callback(triton.stop, 3)
        triton.start()
        sidecar = SidecarProcess(sidecar_settings(
            triton, models=models, golden_dir=golden_dir,
            probes={"interval_s": 1, "timeout_s": 2, "failure_threshold": 2},
            healing=healing,
            proxy={"upstream_timeout_s": settings.upstream_timeout_s, "retry_after_s": 1},
            filtering={"rules": [CREDIT_FILTER_RULE]},
        ), workdir / "sidecar")
        stack.callback(sidecar.stop)
        sidecar.start()
        return asyncio.run(_soak(settings, triton, sidecar, FaultyModel(triton, VICTIM, repository / VICTIM)))


def markdown(result: dict[str, Any]) -> str:
    r = result["report"]
    lines = ["| requests | sent | correct | 503 + Retry-After | anything else | wrong |", "|---|---|---|---|---|---|"]
    for label, key in (("all", "counts"), ("steady models", "counts_steady"),
                       ("faulted model, outside exposure", "counts_victim_judged"),
                       ("faulted model, exposed (not judged)", "counts_victim_exposed")):
        c = r[key]
        lines.append(f"| {label} | {c['sent']} | {c['correct']} | {c['503_retry_after']} | {c['anything_else']} "
                     f"| {c['wrong']} |")
    lines += ["", "| fault | quarantined after s | HEALTHY after s | exposed: sent / correct / 503 / else / wrong |",
              "|---|---|---|---|"]
    for f in r["faults"]:
        e = f["exposed"]
        lines.append(f"| {f['kind']} | {f['quarantined_after_s']} | {f['healthy_after_s']} | {e['sent']} / "
                     f"{e['correct']} / {e['503_retry_after']} / {e['anything_else']} / {e['wrong']} |")
    lines += ["", f"RSS under load {r['rss_start_mb']} → {r['rss_end_mb']} MB; open fds idle {r['fds_start']} → "
                  f"{r['fds_end']}; "
                  f"verdict: {'PASS' if r['passed'] else 'FAIL: ' + '; '.join(r['failures'])}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the soak (default 10)")
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second in all (default 50)")
    parser.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults (default 30)")
    parser.add_argument("--unload-timeout", type=float, default=None,
                        help="healing.unload_timeout_s for the sidecar (default: the sidecar's own)")
    args = parser.parse_args(argv)
    interrupt_on_termination()
    settings = SoakSettings(duration_s=args.minutes * 60, rate=args.rate, fault_every_s=args.fault_every,
                            unload_timeout_s=args.unload_timeout)
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
