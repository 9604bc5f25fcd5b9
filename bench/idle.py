"""Idle cost and scale: the sidecar's RSS and CPU with 1, 10 and 100 guarded models, no traffic.

    .venv/bin/python -m bench.idle [--seconds 60] [--models 1,10,100] [--cycle-seconds 60]

For each count, Triton loads that many clones of credit_risk (python models, three golden cases
each), the sidecar (`triton-sidecar run`, default probe settings: every 5 s ± 10%) guards them all;
after it is ready and one probe interval has passed, its RSS (VmRSS, sampled every second) and CPU
time (utime + stime from /proc/<pid>/stat) are read over --seconds. Nothing else talks to the sidecar
during that window. Then, at the largest count only, /status is read every 0.25 s for
--cycle-seconds: the time between two probe rounds of each model (the probe cycle, nominally 5 s)
and its spread (jitter), and each round's duration.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.machine import OUT_DIR, command_line, describe_machine, keep_logs, write_results
from bench.procfs import cpu_seconds, open_fds, rss_bytes
from bench.profile import finish_recording, start_recording, summarise_folded
from bench.profile import markdown as profile_markdown
from bench.repository import credit_clones
from bench.shutdown import interrupt_on_termination
from bench.sidecar_process import SidecarProcess, sidecar_settings
from sidecar.config import ProbesSection
from sidecar.devtools.tritonserver import LocalTriton, free_port

TARGET_RSS_MB_AT_10 = 70.0  # issue 30 (issue 18 had 80 MB)
TARGET_CPU_SHARE_AT_10 = 0.005  # issues 18 and 30: ≤ 0.5 % of a core (issue 7 had 1 %)
#: How often (s) /status is read to time probe rounds: well under the interval's ±10% jitter (0.5 s).
CYCLE_POLL_S = 0.25


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def measure_idle(sidecar: SidecarProcess, seconds: float) -> dict[str, Any]:
    rss_samples = []
    cpu_start, started = cpu_seconds(sidecar.pid), time.monotonic()
    while time.monotonic() - started < seconds:
        rss_samples.append(rss_bytes(sidecar.pid))
        time.sleep(1.0)
    elapsed = time.monotonic() - started
    cpu = cpu_seconds(sidecar.pid) - cpu_start
    return {"window_s": round(elapsed, 1), "cpu_s": round(cpu, 3), "cpu_share_of_a_core": round(cpu / elapsed, 5),
            "rss_mb_max": round(max(rss_samples) / 2**20, 2),
            "rss_mb_median": round(statistics.median(rss_samples) / 2**20, 2),
            "open_fds": open_fds(sidecar.pid)}


def measure_cycle(sidecar: SidecarProcess, seconds: float) -> dict[str, Any]:
    """Per model, the time between two consecutive rounds (seen as probe_rounds going up)."""
    # model -> (rounds, when that count was first seen, whether we saw it change to that count)
    last: dict[str, tuple[int, float, bool]] = {}
    intervals: list[float] = []
    round_ms: list[float] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        now = time.monotonic()
        for model, entry in sidecar.status()["models"].items():
            rounds = entry["probe_rounds"]
            seen = last.get(model)
            if seen is None:
                last[model] = (rounds, now, False)  # the round may have run long before this poll
            elif rounds > seen[0]:
                if rounds == seen[0] + 1 and seen[2]:
                    intervals.append(now - seen[1])
                round_ms.append(sum(p["duration_ms"] for p in entry["probes"].values()))
                last[model] = (rounds, now, True)
        time.sleep(max(0.0, CYCLE_POLL_S - (time.monotonic() - now)))
    nominal = ProbesSection().interval_s
    if not intervals:
        return {"intervals": 0}
    return {
        "nominal_interval_s": nominal, "jitter_setting": ProbesSection().jitter, "intervals": len(intervals),
        "interval_s_median": round(statistics.median(intervals), 3),
        "interval_s_p1": round(_percentile(intervals, 1), 3), "interval_s_p99": round(_percentile(intervals, 99), 3),
        "interval_s_stdev": round(statistics.pstdev(intervals), 3),
        "late_share": round(sum(i > nominal * (1 + ProbesSection().jitter) + CYCLE_POLL_S for i in intervals)
                            / len(intervals), 4),
        "round_ms_median": round(statistics.median(round_ms), 2) if round_ms else None,
        "round_ms_p99": round(_percentile(round_ms, 99), 2) if round_ms else None,
        "poll_resolution_s": CYCLE_POLL_S,
    }


def profile_idle(sidecar: SidecarProcess, seconds: int) -> dict[str, Any]:
    """py-spy at 1000 samples/s (the sidecar is busy ~1% of the time: 100/s would give a handful)."""
    folded = OUT_DIR / "idle-profile.folded"
    recorder = start_recording(sidecar.pid, seconds, folded, rate=1000)
    error = finish_recording(recorder, timeout_s=seconds + 60)
    if error:
        return {"error": error}
    return {"models": 10, "seconds": seconds, "folded_stacks": str(folded), **summarise_folded(folded)}


def run_count(count: int, args: argparse.Namespace, workdir: Path, cycle: bool) -> dict[str, Any]:
    names = [f"idle_{i:03d}" for i in range(count)]
    built = credit_clones(workdir, names)
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=built.repository, models=names, workdir=workdir / "triton")
        stack.callback(triton.stop, 5)
        started = time.monotonic()
        triton.start(timeout_s=900)
        triton_start_s = time.monotonic() - started
        # The benchmarks' sidecar has no gRPC front unless asked (sidecar_settings); the shipped
        # default serves gRPC on 8081, so --grpc measures the default.
        listen: dict[str, Any] = {"grpc_port": free_port()} if args.grpc else {}
        listen["front"] = args.front
        sidecar = SidecarProcess(sidecar_settings(triton, models=names, golden_dir=built.golden_dir, listen=listen),
                                 workdir / "sidecar")
        stack.callback(sidecar.stop)
        started = time.monotonic()
        sidecar.start(ready_timeout_s=300)
        ready_s = time.monotonic() - started
        time.sleep(ProbesSection().interval_s)  # every model through at least one steady round
        row = {"models": count, "triton_start_s": round(triton_start_s, 1), "sidecar_ready_s": round(ready_s, 2),
               **measure_idle(sidecar, args.seconds)}
        if cycle:
            row["probe_cycle"] = measure_cycle(sidecar, args.cycle_seconds)
        if count == 10 and args.profile > 0:
            row["profile"] = profile_idle(sidecar, args.profile)
        states = {e["state"] for e in sidecar.status()["models"].values()}
        row["states_at_end"] = sorted(states)
        print(f"{count:4} models: RSS {row['rss_mb_max']} MB, CPU {row['cpu_share_of_a_core']:.2%} of a core, "
              f"ready after {row['sidecar_ready_s']} s; states {row['states_at_end']}"
              + (f"; cycle {row['probe_cycle']}" if cycle else ""), flush=True)
        return row


def markdown(result: dict[str, Any]) -> str:
    lines = ["| models | RSS MB (max) | CPU, share of a core | CPU s in window | open fds | sidecar ready s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['models']} | {r['rss_mb_max']} | {r['cpu_share_of_a_core']:.2%} "
              f"| {r['cpu_s']} / {r['window_s']} s | {r['open_fds']} | {r['sidecar_ready_s']} |"
              for r in result["rows"]]
    for r in result["rows"]:
        c = r.get("probe_cycle")
        if c and c.get("intervals"):
            lines += ["", f"Probe cycle at {r['models']} models (nominal {c['nominal_interval_s']} s ± "
                          f"{c['jitter_setting']:.0%}; /status read every {c['poll_resolution_s']} s):", "",
                      "| rounds timed | interval median s | p1 / p99 s | stdev s | late share "
                      "| round ms median / p99 |",
                      "|---|---|---|---|---|---|",
                      f"| {c['intervals']} | {c['interval_s_median']} | {c['interval_s_p1']} / {c['interval_s_p99']} "
                      f"| {c['interval_s_stdev']} | {c['late_share']:.1%} "
                      f"| {c['round_ms_median']} / {c['round_ms_p99']} |"]
    for r in result["rows"]:
        if r.get("profile"):
            seconds = r["profile"].get("seconds")
            lines += ["", f"Profile of the idle sidecar at {r['models']} models (py-spy, {seconds} s):",
                      "", profile_markdown(r["profile"]) if "error" not in r["profile"]
                      else f"(no profile: {r['profile']['error']})"]
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {v['target']} | {v['measured']} | {'yes' if v['met'] else '**no**'} |" for v in result["verdicts"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="measuring window per count (default 60)")
    parser.add_argument("--models", default="1,10,100", help="model counts (default 1,10,100)")
    parser.add_argument("--profile", type=int, default=30,
                        help="seconds of py-spy on the sidecar at 10 models, if installed (default 30; 0: none)")
    parser.add_argument("--cycle-seconds", type=float, default=60.0,
                        help="probe-cycle timing at the largest count (default 60; 0 skips it)")
    parser.add_argument("--front", choices=("python", "rust"), default="rust",
                        help="what serves listen.port (listen.front; default rust, the shipped default)")
    parser.add_argument("--grpc", action="store_true",
                        help="with the gRPC front on, as the shipped default (listen.grpc_port 8081)")
    args = parser.parse_args(argv)
    interrupt_on_termination()
    counts = sorted(int(c) for c in args.models.split(","))
    rows = []
    machine = describe_machine()
    for count in counts:
        with tempfile.TemporaryDirectory(prefix=f"bench-idle-{count}-") as scratch:
            try:
                rows.append(run_count(count, args, Path(scratch), cycle=count == counts[-1] and args.cycle_seconds > 0))
            finally:
                keep_logs(Path(scratch), f"idle-{count}")
    verdicts = []
    at10 = next((r for r in rows if r["models"] == 10), None)
    if at10:
        verdicts = [
            {"target": f"≤ {TARGET_RSS_MB_AT_10:g} MB RSS at 10 models", "measured": at10["rss_mb_max"],
             "met": at10["rss_mb_max"] <= TARGET_RSS_MB_AT_10},
            {"target": f"≤ {TARGET_CPU_SHARE_AT_10:.1%} of a core at 10 models",
             "measured": f"{at10['cpu_share_of_a_core']:.2%}",
             "met": at10["cpu_share_of_a_core"] <= TARGET_CPU_SHARE_AT_10},
        ]
    result = {"benchmark": "idle", "command": command_line(), "machine": machine,
              "settings": {"seconds": args.seconds, "models": counts, "cycle_seconds": args.cycle_seconds,
                           "grpc_front": args.grpc,
                           "front": args.front,
                           "probes": "defaults (interval 5 s, jitter 0.1, timeout 2 s)", "golden_cases_per_model": 3},
              "rows": rows, "verdicts": verdicts}
    table = markdown(result)
    path = write_results("idle", result, table)
    print(f"\n{table}\nresults: {path}")
    return 0 if all(v["met"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
