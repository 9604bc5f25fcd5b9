"""What tracing costs (issue 32): three sidecars side by side in front of the same Triton, identical
but for `tracing`: off, on at sample rate 0.01, on at 1.0, the two traced ones exporting OTLP/HTTP to
a sink in this process that takes every batch (200, as a collector does), so export is paid in full.

Legs alternate in each round, the order rotating so a shared machine's drifts hit all alike; the
rounds of one scenario run together, after a pause in which every exporter's queue empties, so no
leg pays for another wire's spans.
Scenarios: the ~2 ms model (`credit_risk_2ms`), c=8 and c=1, over HTTP (wrk, 1x128 FP32 JSON, the
Rust front's spans) and gRPC (bench/grpc_load.py, 1x128 raw: grpcio's calls, their spans opened through
the Rust front's tracer (sidecar/tracing/front_spans.py); the Rust gRPC front's own with
`--grpc-front rust`). CPU per request
is the sidecar process's (its exporter threads included) from /proc around each run. Exits 0 when
issue 32's targets are met: at 0.01 no more than 1.02x the CPU per request of tracing off, at 1.0
no more than 1.15x (HTTP and gRPC, c=8).

    .venv/bin/python -m bench.tracing_cost [--rounds 3 --duration 5] [--grpc-front rust]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.grpc_overhead import infer_request, run_load
from bench.inference import features, json_request
from bench.machine import command_line, describe_machine, overhead_parser, run_overhead_benchmark
from bench.procfs import cpu_seconds
from bench.profile import verdicts_and_profile_markdown
from bench.repository import BENCH_MODELS, credit_clones
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.wrk import Wrk
from sidecar.config import SidecarConfig
from sidecar.devtools.tritonserver import LocalTriton, free_port

MODEL = "credit_risk_2ms"
CONCURRENCY = [8, 1]
#: Leg -> tracing.sample_rate (None: tracing off).
LEGS: dict[str, float | None] = {"off": None, "0.01": 0.01, "1.0": 1.0}
#: Issue 32's bounds on CPU per request, as ratios to tracing off (c=8).
BOUNDS = {"0.01": 1.02, "1.0": 1.15}


class OtlpSink:
    """A collector that takes every export (HTTP 200, empty body) and counts what it was sent."""

    def __init__(self) -> None:
        sink = self
        self.posts = 0
        self.bytes = 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                with sink._lock:
                    sink.posts += 1
                    sink.bytes += length
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    built = credit_clones(workdir, [MODEL], sources={MODEL: BENCH_MODELS / MODEL})
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        sink = OtlpSink()
        sink.start()
        stack.callback(sink.stop)
        triton = LocalTriton(model_repository=built.repository, models=[MODEL], workdir=workdir / "triton")
        stack.callback(triton.stop)
        triton.start()
        sidecars: dict[str, SidecarProcess] = {}
        for leg, rate in LEGS.items():
            tracing = {} if rate is None else {"endpoint": sink.endpoint, "sample_rate": rate}
            sidecar = SidecarProcess(sidecar_settings(
                triton, models=[MODEL], golden_dir=built.golden_dir, filtering={"rules": [CREDIT_FILTER_RULE]},
                validation={"reject_non_finite": True},
                listen={"grpc_port": free_port(), "grpc_front": args.grpc_front}, tracing=tracing,
                logging={"format": "json", "level": "info"}), workdir / f"sidecar-{leg}")
            stack.callback(sidecar.stop)
            sidecar.start()
            sidecars[leg] = sidecar
        x = features(1)
        body = json_request(x)
        grpc_file = workdir / "1x128.bin"
        grpc_file.write_bytes(infer_request(MODEL, x).SerializeToString())
        wrk = Wrk(workdir / "wrk")

        def load(sidecar: SidecarProcess, wire: str, concurrency: int, duration_s: int) -> dict[str, Any]:
            if wire == "http":
                return wrk.run(f"{sidecar.url}/v2/models/{MODEL}/infer", body, connections=concurrency,
                               duration_s=duration_s).as_dict()
            return run_load(f"127.0.0.1:{sidecar.settings['listen']['grpc_port']}", grpc_file, concurrency,
                            duration_s)

        machine = describe_machine(triton.url)
        legs = list(LEGS)
        # Scenario by scenario, every round of one before the next: a traced sidecar exports its spans
        # after the requests that made them (a batch when 512 are queued, the rest within
        # tracing.export_delay_s), so a leg also pays for the tail of its own previous leg, which the
        # rotation evens out. Spans of another wire must not land in a leg: the Python SDK's gRPC
        # spans cost many times the Rust front's to export, and when the scenarios alternated they
        # were exported during the HTTP legs that followed (1.29x at 1.0 in one run, 1.01x without).
        # So each scenario starts with a warm-up of every leg, then a wait of one export delay and a
        # second, in which every traced sidecar's queue empties, unmeasured.
        settle_s = SidecarConfig().tracing.export_delay_s + 1.0
        for wire, concurrency in [(w, c) for w in ("http", "grpc") for c in CONCURRENCY]:
            for sidecar in sidecars.values():  # warm-up: connections, specs, the lanes
                load(sidecar, wire, concurrency, 1)
            time.sleep(settle_s)
            for round_no in range(args.rounds):
                shift = round_no % len(legs)
                for leg in legs[shift:] + legs[:shift]:
                    sidecar = sidecars[leg]
                    before = cpu_seconds(sidecar.pid)
                    result = load(sidecar, wire, concurrency, args.duration)
                    cpu = cpu_seconds(sidecar.pid) - before
                    runs.append({"round": round_no, "wire": wire, "concurrency": concurrency, "leg": leg, **result,
                                 "cpu_s": round(cpu, 4)})
                    print(f"round {round_no + 1}/{args.rounds} {wire:4} c={concurrency} {leg:4} "
                          f"{result['requests'] / result['duration_s']:7.0f} req/s "
                          f"cpu {1000 * cpu / max(result['requests'], 1):.4f} ms/req", flush=True)
        exported = {"posts": sink.posts, "bytes": sink.bytes}
    return {"benchmark": "tracing_cost", "command": command_line(), "machine": machine,
            "settings": {"rounds": args.rounds, "duration_s": args.duration, "model": MODEL, "legs": LEGS,
                         "grpc_front": args.grpc_front},
            "sink": exported, "runs": runs, "summary": summarise(runs)}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per wire, concurrency and leg: median throughput, p50 and CPU per request across rounds."""
    out = []
    for wire, concurrency, leg in sorted({(r["wire"], r["concurrency"], r["leg"]) for r in runs},
                                         key=lambda k: (k[0], -k[1], list(LEGS).index(k[2]))):
        mine = [r for r in runs if (r["wire"], r["concurrency"], r["leg"]) == (wire, concurrency, leg)]
        out.append({"wire": wire, "concurrency": concurrency, "leg": leg,
                    "throughput_rps": round(statistics.median(r["requests"] / r["duration_s"] for r in mine), 1),
                    "p50_ms": round(statistics.median(r["latency_ms"]["p50"] for r in mine), 3),
                    "cpu_ms_per_request": round(statistics.median(
                        1000 * r["cpu_s"] / max(r["requests"], 1) for r in mine), 4)})
    return out


def verdicts(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(s["wire"], s["concurrency"], s["leg"]): s for s in summary}
    checks = []
    for wire in ("http", "grpc"):
        off = by.get((wire, 8, "off"))
        for leg, bound in BOUNDS.items():
            on = by.get((wire, 8, leg))
            if off is None or on is None:
                continue
            ratio = on["cpu_ms_per_request"] / off["cpu_ms_per_request"]
            checks.append({"target": f"CPU/request at {leg} ≤ {bound}× tracing off", "case": f"{wire} c=8",
                           "measured": f"{on['cpu_ms_per_request']:.4f} vs {off['cpu_ms_per_request']:.4f} ms "
                                       f"({ratio:.2f}×)",
                           "met": ratio <= bound})
    return checks


def markdown(result: dict[str, Any]) -> str:
    lines = ["| wire | c | tracing | req/s | p50 ms | CPU ms/req |", "|---|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| {s['wire']} | {s['concurrency']} | {s['leg']} | {s['throughput_rps']:.0f} | "
                     f"{s['p50_ms']:.3f} | {s['cpu_ms_per_request']:.4f} |")
    sink = result["sink"]
    lines.append(f"\nThe sink took {sink['posts']} exports, {sink['bytes']} bytes.")
    lines += verdicts_and_profile_markdown(result["verdicts"], None)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = overhead_parser("python -m bench.tracing_cost", __doc__, duration_type=int)
    parser.add_argument("--grpc-front", choices=["python", "rust"], default="python",
                        help="what serves the sidecars' listen.grpc_port (listen.grpc_front; default python, the "
                             "shipped one): with rust, gRPC spans are the Rust front's too")
    return run_overhead_benchmark("tracing_cost", parser.parse_args(argv), measure, verdicts, markdown)


if __name__ == "__main__":
    sys.exit(main())
