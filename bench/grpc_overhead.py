"""gRPC proxy overhead: direct Triton gRPC vs through the sidecar's gRPC front, alternating in one run.

    .venv/bin/python -m bench.grpc_overhead [--rounds 3] [--duration 5]

For each round, each model (near-free credit_risk, credit_risk_2ms), each request (1x128 and 64x128
FP32 in raw_input_contents) and each concurrency (1, 8), bench/grpc_load.py (a process of its own,
identity serializers) drives both legs for --duration seconds, in a rotating order; figures are
medians over rounds. The sidecar runs as `triton-sidecar run` with validation and filtering on
(income_prob dropped), and its CPU time per request comes from /proc/<pid>/stat around each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

from bench.inference import features
from bench.machine import OUT_DIR, command_line, describe_machine, overhead_parser, run_overhead_benchmark
from bench.procfs import cpu_seconds
from bench.profile import finish_recording, start_recording, summarise_folded, verdicts_and_profile_markdown
from bench.repository import BENCH_MODELS, credit_clones, credit_risk_scores
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from sidecar.devtools.tritonserver import LocalTriton, free_port

MODELS = ["credit_risk", "credit_risk_2ms"]
CONCURRENCY = [1, 8]
ROWS = {"1x128 raw": 1, "64x128 raw": 64}
#: Issue 10's targets: sidecar CPU per unary 1x128 request, and throughput on the 2 ms model at c=8.
TARGET_CPU_MS_PER_REQUEST = 0.3
TARGET_THROUGHPUT_RATIO = 0.95


def infer_request(model: str, x: np.ndarray) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
    return pb.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[x.astype("<f4").tobytes()])


def check_leg(name: str, target: str, model: str, x: np.ndarray) -> str | None:
    """None when the leg answers correctly (the sidecar must also have dropped income_prob), else why."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        try:
            answer = call(infer_request(model, x), timeout=30)
        except grpc.RpcError as e:
            return f"{name}: {model} answered {e.code().name}: {e.details()}"
    names = [o.name for o in answer.outputs]
    scores = np.frombuffer(answer.raw_output_contents[names.index("scores")], dtype="<f4").reshape(-1, 1)
    if not np.allclose(scores, credit_risk_scores(x), atol=1e-5, rtol=1e-4):
        return f"{name}: {model} answered wrong scores"
    if (name == "sidecar") == ("income_prob" in names):
        return f"{name}: {model}: income_prob {'not filtered' if name == 'sidecar' else 'missing'}"
    return None


def run_load(target: str, request_file: Path, concurrency: int, duration_s: float,
             ca: Path | None = None) -> dict[str, Any]:
    tls = ["--ca", str(ca)] if ca is not None else []
    out = subprocess.run([sys.executable, "-m", "bench.grpc_load", "--target", target, "--request", str(request_file),
                          "--concurrency", str(concurrency), "--duration", str(duration_s), *tls],
                         capture_output=True, text=True, check=True, timeout=duration_s + 60)
    return json.loads(out.stdout)


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    built = credit_clones(workdir, MODELS, sources={"credit_risk_2ms": BENCH_MODELS / "credit_risk_2ms"})
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=built.repository, models=MODELS, workdir=workdir / "triton")
        stack.callback(triton.stop)
        triton.start()
        grpc_port = free_port()
        sidecar = SidecarProcess(sidecar_settings(
            triton, models=MODELS, golden_dir=built.golden_dir, filtering={"rules": [CREDIT_FILTER_RULE]},
            validation={"reject_non_finite": True}, listen={"grpc_port": grpc_port}), workdir / "sidecar")
        stack.callback(sidecar.stop)
        sidecar.start()
        legs = {"direct": f"127.0.0.1:{triton.ports.grpc}", "sidecar": f"127.0.0.1:{grpc_port}"}
        request_files: dict[tuple[str, str], Path] = {}
        for model in MODELS:
            for request_name, rows in ROWS.items():
                x = features(rows)
                for name, target in legs.items():
                    problem = check_leg(name, target, model, x)
                    if problem:
                        raise SystemExit(f"correctness check failed before measuring: {problem}")
                path = workdir / f"{model}-{rows}.bin"
                path.write_bytes(infer_request(model, x).SerializeToString())
                request_files[(model, request_name)] = path
        machine = describe_machine(triton.url)
        for target in legs.values():  # warm-up: channels, the stub's first batches, the sidecar's specs
            run_load(target, request_files[("credit_risk", "1x128 raw")], 8, 1)
        scenarios = [(m, r, c) for m in MODELS for r in ROWS for c in CONCURRENCY]
        names = list(legs)
        for round_no in range(args.rounds):
            for i, (model, request_name, concurrency) in enumerate(scenarios):
                shift = (round_no + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    before = cpu_seconds(sidecar.pid)
                    result = run_load(legs[name], request_files[(model, request_name)], concurrency, args.duration)
                    runs.append({"round": round_no, "model": model, "request": request_name,
                                 "concurrency": concurrency, "leg": name, **result,
                                 "sidecar_cpu_s": round(cpu_seconds(sidecar.pid) - before, 3)})
                    print(f"round {round_no + 1}/{args.rounds} {model:16} {request_name:11} c={concurrency} "
                          f"{name:8} {result['throughput_rps']:8.0f} req/s p50 {result['latency_ms']['p50']:6.3f} ms "
                          f"errors {result['errors']}", flush=True)
        profile = profile_sidecar(sidecar, legs["sidecar"], request_files[("credit_risk", "1x128 raw")],
                                  args.profile) if args.profile > 0 else {}
        final_status = sidecar.status()
    return {"benchmark": "grpc_overhead", "command": command_line(), "machine": machine, "profile": profile,
            "settings": {"rounds": args.rounds, "duration_s": args.duration, "models": MODELS,
                         "concurrency": CONCURRENCY, "load_generator": "bench/grpc_load.py (grpc.aio, one process)"},
            "runs": runs, "summary": summarise(runs),
            "sidecar_states_at_end": {m: s["state"] for m, s in final_status["models"].items()}}


def profile_sidecar(sidecar: SidecarProcess, target: str, request_file: Path, seconds: int) -> dict[str, Any]:
    """py-spy on the sidecar while the load generator sends 1x128 raw to credit_risk at concurrency 8."""
    folded = OUT_DIR / "grpc_overhead-profile.folded"
    recorder = start_recording(sidecar.pid, seconds, folded)
    if recorder is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    run_load(target, request_file, 8, seconds + 1)
    error = finish_recording(recorder)
    if error:
        return {"error": error}
    return {"scenario": "credit_risk 1x128 raw c=8", "seconds": seconds, "folded_stacks": str(folded),
            **summarise_folded(folded)}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, request, concurrency): medians per leg; the sidecar against direct as medians of
    per-round differences and ratios; the sidecar's CPU net of what it burns while traffic goes direct."""
    rows = []
    keys = sorted({(r["model"], r["request"], r["concurrency"]) for r in runs},
                  key=lambda k: (MODELS.index(k[0]), k[1], k[2]))
    for key in keys:
        mine = [r for r in runs if (r["model"], r["request"], r["concurrency"]) == key]
        row: dict[str, Any] = dict(zip(("model", "request", "concurrency"), key, strict=True))
        for leg in ("direct", "sidecar"):
            legs = [r for r in mine if r["leg"] == leg]
            row[leg] = {"throughput_rps": round(statistics.median(r["throughput_rps"] for r in legs), 1),
                        "p50_ms": round(statistics.median(r["latency_ms"]["p50"] for r in legs), 3),
                        "p99_ms": round(statistics.median(r["latency_ms"]["p99"] for r in legs), 3),
                        "errors": sum(sum(r["errors"].values()) for r in legs)}
        pairs = [(a, b) for a in mine for b in mine
                 if a["round"] == b["round"] and a["leg"] == "direct" and b["leg"] == "sidecar"]
        side = row["sidecar"]
        side["added_p50_ms"] = round(statistics.median(b["latency_ms"]["p50"] - a["latency_ms"]["p50"]
                                                       for a, b in pairs), 3)
        side["throughput_ratio"] = round(statistics.median(b["throughput_rps"] / a["throughput_rps"]
                                                           for a, b in pairs if a["throughput_rps"]), 3)
        side["cpu_ms_per_request_net"] = round(statistics.median(
            1000 * (b["sidecar_cpu_s"] - a["sidecar_cpu_s"] * b["duration_s"] / a["duration_s"]) / b["requests"]
            for a, b in pairs if b["requests"]), 4)
        rows.append(row)
    return rows


def verdicts(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for row in summary:
        label = f"{row['model']} {row['request']} c={row['concurrency']}"
        side = row["sidecar"]
        if row["model"] == "credit_risk" and row["request"] == "1x128 raw":
            found.append({"target": f"sidecar CPU ≤ {TARGET_CPU_MS_PER_REQUEST} ms/request (net)", "case": label,
                          "measured": side["cpu_ms_per_request_net"],
                          "met": side["cpu_ms_per_request_net"] <= TARGET_CPU_MS_PER_REQUEST})
        if row["model"] == "credit_risk_2ms" and row["concurrency"] == 8:
            found.append({"target": f"throughput ≥ {TARGET_THROUGHPUT_RATIO}× direct (2 ms model, c=8)", "case": label,
                          "measured": side["throughput_ratio"],
                          "met": side["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO})
    return found


def markdown(result: dict[str, Any]) -> str:
    lines = ["| model | request | c | direct req/s | sidecar req/s | direct p50/p99 ms | sidecar p50/p99 ms "
             "| sidecar +p50 ms | sidecar/direct req/s | sidecar CPU ms/req (net) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["summary"]:
        d, s = row["direct"], row["sidecar"]
        lines.append(f"| {row['model']} | {row['request']} | {row['concurrency']} | {d['throughput_rps']} "
                     f"| {s['throughput_rps']} | {d['p50_ms']} / {d['p99_ms']} | {s['p50_ms']} / {s['p99_ms']} "
                     f"| {s['added_p50_ms']} | {s['throughput_ratio']} | {s['cpu_ms_per_request_net']} |")
    lines += verdicts_and_profile_markdown(result["verdicts"], result.get("profile"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = overhead_parser("python -m bench.grpc_overhead", __doc__)
    return run_overhead_benchmark("grpc_overhead", parser.parse_args(argv), measure, verdicts, markdown)

if __name__ == "__main__":
    sys.exit(main())
