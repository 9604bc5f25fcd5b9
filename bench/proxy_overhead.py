"""Proxy overhead: direct Triton vs through the sidecar vs through nginx, alternating in one run.

    .venv/bin/python -m bench.proxy_overhead [--rounds 3] [--duration 5]

For each round, each model (near-free credit_risk, credit_risk_2ms), each request (1x128 JSON,
64x128 JSON, 64x128 binary) and each concurrency (1, 8), wrk drives every leg for --duration
seconds, the legs in a rotating order; figures are medians over rounds. The sidecar runs as
`triton-sidecar run` with validation and filtering on (income_prob dropped for credit_risk.*), and
its CPU time per request comes from /proc/<pid>/stat around each of its runs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.inference import binary_request, features, json_request, post
from bench.machine import OUT_DIR, command_line, describe_machine, overhead_parser, run_overhead_benchmark
from bench.nginx import NginxProxy
from bench.procfs import children, cpu_seconds
from bench.profile import finish_recording, start_recording, summarise_folded, verdicts_and_profile_markdown
from bench.repository import BENCH_MODELS, credit_clones, credit_risk_scores
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.wrk import RequestBody, Wrk
from sidecar.devtools.tritonserver import LocalTriton

MODELS = ["credit_risk", "credit_risk_2ms"]
#: The same sidecar with listen.fast_infer off: every request through aiohttp's server.
AIOHTTP_LEG = "sidecar-aiohttp"
CONCURRENCY = [1, 8]
#: Targets of issue 13 (sidecar CPU per request, ms, by (request, concurrency); nginx's order of cost).
TARGET_CPU_MS_PER_REQUEST = {("1x128 JSON", 1): 0.20, ("1x128 JSON", 8): 0.12, ("64x128 binary", 1): 0.25,
                             ("64x128 binary", 8): 0.25}
TARGET_ADDED_P50_MS = 0.25  # at c=1 on the near-free model
TARGET_THROUGHPUT_RATIO = 0.97  # of direct, on the 2 ms model at c=8


def build_requests() -> dict[str, tuple[RequestBody, np.ndarray]]:
    one, batch = features(1), features(64)
    return {
        "1x128 JSON": (json_request(one), one),
        "64x128 JSON": (json_request(batch), batch),
        "64x128 binary": (binary_request(batch), batch),
    }


def check_leg(name: str, base_url: str, model: str, request: RequestBody, x: np.ndarray) -> str | None:
    """None when the leg answers correctly (the sidecar must also have dropped income_prob), else why."""
    answer = post(f"{base_url}/v2/models/{model}/infer", request)
    if answer.status != 200:
        return f"{name}: {model} {request.name} answered {answer.status}: {answer.error}"
    scores = answer.outputs.get("scores")
    if scores is None or not np.allclose(scores, credit_risk_scores(x), atol=1e-5, rtol=1e-4):
        return f"{name}: {model} {request.name} answered wrong scores"
    filtered = "income_prob" not in answer.outputs
    if name.startswith("sidecar") and not filtered:
        return f"{name}: {model} {request.name}: income_prob was not filtered"
    if not name.startswith("sidecar") and filtered:
        return f"{name}: {model} {request.name}: income_prob missing (it should pass untouched)"
    return None


def nginx_cpu(nginx: NginxProxy) -> float:
    return sum(cpu_seconds(pid) for pid in [nginx.pid, *children(nginx.pid)])


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    built = credit_clones(workdir, MODELS, sources={"credit_risk_2ms": BENCH_MODELS / "credit_risk_2ms"})
    requests = build_requests()
    wrk = Wrk(workdir / "wrk")
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    profile: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=built.repository, models=MODELS, workdir=workdir / "triton")
        stack.callback(triton.stop)
        triton.start()
        nginx = NginxProxy(upstream_port=triton.ports.http, workdir=workdir / "nginx")
        stack.callback(nginx.stop)
        nginx.start()
        # Two sidecars, identical but for the HTTP front: the fast listener (production) and every
        # request through aiohttp (listen.fast_infer off), so the front's saving is measured in one run.
        sidecars: dict[str, SidecarProcess] = {}
        for leg, fast in (("sidecar", True), (AIOHTTP_LEG, False)):
            sidecars[leg] = SidecarProcess(sidecar_settings(
                triton, models=MODELS, golden_dir=built.golden_dir,
                filtering={"rules": [CREDIT_FILTER_RULE]},
                validation={"reject_non_finite": True},
                listen={"fast_infer": fast},
            ), workdir / leg)
            stack.callback(sidecars[leg].stop)
            sidecars[leg].start()
        sidecar = sidecars["sidecar"]
        legs: dict[str, str] = {"direct": triton.url, "nginx": nginx.url,
                                **{leg: process.url for leg, process in sidecars.items()}}
        probe = post(f"{sidecar.url}/v2/models/credit_risk/infer", requests["1x128 JSON"][0])
        if probe.status in (404, 405) and not args.require_sidecar:
            notes.append(f"the sidecar has no proxy yet (infer answered {probe.status}): sidecar leg skipped")
            del legs["sidecar"]
        for model in MODELS:
            for request, x in requests.values():
                for name, url in legs.items():
                    problem = check_leg(name, url, model, request, x)
                    if problem:
                        raise SystemExit(f"correctness check failed before measuring: {problem}")
        machine = describe_machine(triton.url)
        # Warm-up: first connections, the stub's first batches, the sidecar's first requests.
        for url in legs.values():
            for model in MODELS:
                wrk.run(f"{url}/v2/models/{model}/infer", requests["1x128 JSON"][0], connections=8, duration_s=1)
        scenarios = [(m, r, c) for m in MODELS for r in requests for c in CONCURRENCY]
        leg_names = list(legs)
        for round_no in range(args.rounds):
            for i, (model, request_name, concurrency) in enumerate(scenarios):
                shift = (round_no + i) % len(leg_names)
                for name in leg_names[shift:] + leg_names[:shift]:
                    url = f"{legs[name]}/v2/models/{model}/infer"
                    # The CPU of the sidecar this leg goes through (for direct: the production one, idle).
                    measured = sidecars.get(name, sidecar)
                    sidecar_before, nginx_before = cpu_seconds(measured.pid), nginx_cpu(nginx)
                    result = wrk.run(url, requests[request_name][0], connections=concurrency,
                                     duration_s=args.duration)
                    sidecar_cpu = cpu_seconds(measured.pid) - sidecar_before
                    nginx_used = nginx_cpu(nginx) - nginx_before
                    run = {"round": round_no, "model": model, "request": request_name,
                           "concurrency": concurrency, "leg": name, **result.as_dict(),
                           "sidecar_cpu_s": round(sidecar_cpu, 3), "nginx_cpu_s": round(nginx_used, 3)}
                    runs.append(run)
                    print(f"round {round_no + 1}/{args.rounds} {model:16} {request_name:14} c={concurrency} "
                          f"{name:15} {result.throughput:8.0f} req/s p50 {result.latency_us['p50'] / 1000:6.3f} ms "
                          f"p99 {result.latency_us['p99'] / 1000:6.3f} ms errors {result.error_count}", flush=True)
        if "sidecar" in legs and args.profile > 0:
            profile = profile_sidecar(sidecar, wrk, requests, args.profile)
        final_status = sidecar.status()
    return {"benchmark": "proxy_overhead", "command": command_line(), "machine": machine,
            "settings": {"rounds": args.rounds, "duration_s": args.duration, "load_generator": "wrk (Debian), 1 thread",
                         "models": MODELS, "concurrency": CONCURRENCY, "legs": list(legs)},
            "notes": notes, "runs": runs, "summary": summarise(runs), "profile": profile,
            "sidecar_states_at_end": {m: s["state"] for m, s in final_status["models"].items()}}


def profile_sidecar(sidecar: SidecarProcess, wrk: Wrk, requests: dict[str, tuple[RequestBody, np.ndarray]],
                    seconds: int) -> dict[str, Any]:
    """py-spy on the sidecar while wrk sends 1x128 JSON to credit_risk at concurrency 8."""
    folded = OUT_DIR / "proxy_overhead-profile.folded"
    recorder = start_recording(sidecar.pid, seconds, folded)
    if recorder is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    wrk.run(f"{sidecar.url}/v2/models/credit_risk/infer", requests["1x128 JSON"][0], connections=8,
            duration_s=seconds + 1)
    error = finish_recording(recorder)
    if error:
        return {"error": error}
    return {"scenario": "credit_risk 1x128 JSON c=8", "seconds": seconds, "folded_stacks": str(folded),
            **summarise_folded(folded)}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, request, concurrency): medians per leg and the sidecar's cost against direct,
    as medians of per-round differences and ratios (rounds alternate, so noise hits legs alike)."""
    rows = []
    keys = sorted({(r["model"], r["request"], r["concurrency"]) for r in runs},
                  key=lambda k: (MODELS.index(k[0]), k[1], k[2]))
    for model, request, concurrency in keys:
        mine = [r for r in runs if (r["model"], r["request"], r["concurrency"]) == (model, request, concurrency)]
        row: dict[str, Any] = {"model": model, "request": request, "concurrency": concurrency}
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for r in mine:
            by_round.setdefault(r["round"], {})[r["leg"]] = r
            if r["leg"] == "direct":
                by_round[r["round"]]["_sidecar_idle"] = r  # the sidecar's own background CPU
        for leg in ("direct", "nginx", "sidecar", AIOHTTP_LEG):
            legs = [r for r in mine if r["leg"] == leg]
            if not legs:
                continue
            row[leg] = {
                "throughput_rps": round(statistics.median(r["throughput_rps"] for r in legs), 1),
                "p50_ms": round(statistics.median(r["latency_ms"]["p50"] for r in legs), 3),
                "p99_ms": round(statistics.median(r["latency_ms"]["p99"] for r in legs), 3),
                "errors": sum(sum(r["errors"].values()) for r in legs),
            }
        for leg in ("nginx", "sidecar", AIOHTTP_LEG):
            pairs = [(rd["direct"], rd[leg]) for rd in by_round.values() if "direct" in rd and leg in rd]
            if not pairs:
                continue
            row[leg]["added_p50_ms"] = round(statistics.median(b["latency_ms"]["p50"] - a["latency_ms"]["p50"]
                                                               for a, b in pairs), 3)
            row[leg]["throughput_ratio"] = round(statistics.median(
                b["throughput_rps"] / a["throughput_rps"] for a, b in pairs if a["throughput_rps"]), 3)
            cpu_key = "sidecar_cpu_s" if leg.startswith("sidecar") else f"{leg}_cpu_s"
            row[leg]["cpu_ms_per_request"] = round(statistics.median(
                1000 * b[cpu_key] / b["requests"] for _, b in pairs if b["requests"]), 4)
            if leg in ("sidecar", AIOHTTP_LEG):
                # The probes' own CPU, measured while traffic went direct, subtracted per second.
                row[leg]["cpu_ms_per_request_net"] = round(statistics.median(
                    1000 * (b[cpu_key] - a["sidecar_cpu_s"] * b["duration_s"] / a["duration_s"]) / b["requests"]
                    for a, b in pairs if b["requests"]), 4)
        rows.append(row)
    return rows


def verdicts(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for row in summary:
        side = row.get("sidecar")
        if not side:
            continue
        label = f"{row['model']} {row['request']} c={row['concurrency']}"
        cpu = side["cpu_ms_per_request_net"]
        cpu_target = TARGET_CPU_MS_PER_REQUEST.get((row["request"], row["concurrency"]))
        if cpu_target is not None and row["model"] == "credit_risk":
            found.append({"target": f"sidecar CPU ≤ {cpu_target} ms/request (net)", "case": label,
                          "measured": cpu, "met": cpu <= cpu_target})
        if row["concurrency"] == 1 and row["model"] == "credit_risk":
            found.append({"target": f"added p50 ≤ {TARGET_ADDED_P50_MS} ms at c=1", "case": label,
                          "measured": side["added_p50_ms"], "met": side["added_p50_ms"] <= TARGET_ADDED_P50_MS})
        if row["model"] == "credit_risk_2ms" and row["concurrency"] == 8:
            found.append({"target": f"throughput ≥ {TARGET_THROUGHPUT_RATIO}× direct (2 ms model, c=8)",
                          "case": label, "measured": side["throughput_ratio"],
                          "met": side["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO})
    return found


def markdown(result: dict[str, Any]) -> str:
    lines = ["| model | request | c | direct req/s | nginx req/s | sidecar req/s | direct p50/p99 ms "
             "| nginx p50/p99 ms | sidecar p50/p99 ms | nginx +p50 ms | sidecar +p50 ms | sidecar/direct req/s "
             "| sidecar CPU ms/req (net) | nginx CPU ms/req | aiohttp-front +p50 ms | aiohttp-front CPU ms/req (net) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def leg(row: dict[str, Any], name: str, key: str) -> str:
        return str(row[name][key]) if name in row and key in row[name] else "–"

    def lat(row: dict[str, Any], name: str) -> str:
        return f"{row[name]['p50_ms']} / {row[name]['p99_ms']}" if name in row else "–"

    for row in result["summary"]:
        cpu = leg(row, "sidecar", "cpu_ms_per_request")
        if "sidecar" in row:
            cpu += f" ({row['sidecar']['cpu_ms_per_request_net']})"
        lines.append(
            f"| {row['model']} | {row['request']} | {row['concurrency']} | {leg(row, 'direct', 'throughput_rps')} "
            f"| {leg(row, 'nginx', 'throughput_rps')} | {leg(row, 'sidecar', 'throughput_rps')} "
            f"| {lat(row, 'direct')} | {lat(row, 'nginx')} | {lat(row, 'sidecar')} "
            f"| {leg(row, 'nginx', 'added_p50_ms')} | {leg(row, 'sidecar', 'added_p50_ms')} "
            f"| {leg(row, 'sidecar', 'throughput_ratio')} | {cpu} | {leg(row, 'nginx', 'cpu_ms_per_request')} "
            f"| {leg(row, AIOHTTP_LEG, 'added_p50_ms')} | {leg(row, AIOHTTP_LEG, 'cpu_ms_per_request_net')} |")
    lines += verdicts_and_profile_markdown(verdicts(result["summary"]), result.get("profile"))
    for note in result["notes"]:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = overhead_parser("python -m bench.proxy_overhead", __doc__, duration_type=int)
    parser.add_argument("--require-sidecar", action="store_true",
                        help="fail instead of skipping the sidecar leg when its proxy is missing")
    return run_overhead_benchmark("proxy_overhead", parser.parse_args(argv), measure, verdicts, markdown)

if __name__ == "__main__":
    sys.exit(main())
