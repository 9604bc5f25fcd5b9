"""Floors of the HTTP data plane's parts, measured side by side with the sidecar, Envoy and nginx (issue 18).

    .venv/bin/python -m bench.http_candidates [--rounds 2] [--duration 2]

Where does the sidecar's CPU per proxied HTTP request go: the wire (Python, its event loop, the HTTP
parser, the socket calls) or the sidecar's own work per request (the chain and its checks)? Each leg
below is one process in front of the same Triton, driven by the same wrk (1x128 FP32 JSON, c=1 and c=8,
on credit_risk_2ms and near-free credit_risk, the legs' order rotating each round):

- `bare-uvloop`: a pass-through proxy with nothing but the wire: uvloop, httptools, one keep-alive
  connection to Triton per client connection, bytes copied both ways. The floor of any Python proxy.
- `bare-asyncio`: the same on asyncio's own loop (what the sidecar ran on before listen.event_loop).
- `chain-uvloop`: bare-uvloop plus the shape of the sidecar's path without a single check: a task per
  request, five coroutine levels awaiting the answer, the sidecar's own UpstreamPool (sidecar.upstream).
- `sidecar`: `triton-sidecar run` with every check on, as in bench.dataplane (validation with NaN
  refusal, output filtering, quarantine, breaker, metrics, the sampled access log), on uvloop.
- `sidecar-asyncio`: the same with `listen.event_loop: asyncio`.
- `sidecar-unchecked`: the sidecar on uvloop with its two costliest checks made free, as if they were
  compiled: request validation accepts at once and the answer goes out unscreened (`run-unchecked`,
  a benchmark-only launcher; nothing ships like this). What is left is the chain's bookkeeping.
- `envoy` (bench/envoy.py, --concurrency 1, router only) and `nginx` (1 worker, upstream keep-alive).

CPU is each leg's processes from /proc around its run, net of the leg's idle rate (the sidecar's probes,
Envoy's timers), as in bench.dataplane. The table gives CPU ms per request (median of rounds) and
its ratio to Envoy's of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools

from bench.dataplane import MODELS, start_yardsticks
from bench.inference import features, json_request
from bench.machine import command_line, describe_machine, keep_logs, write_results
from bench.procfs import children, cpu_seconds
from bench.repository import BENCH_MODELS, credit_clones
from bench.sidecar_process import CREDIT_FILTER_RULE, SidecarProcess, sidecar_settings
from bench.wrk import Wrk
from sidecar.devtools.tritonserver import LocalTriton, free_port
from sidecar.upstream import UpstreamPool

BARE = ["bare-uvloop", "bare-asyncio", "chain-uvloop"]
SIDECARS = {"sidecar": "uvloop", "sidecar-asyncio": "asyncio", "sidecar-unchecked": "uvloop"}
LEGS = [*BARE, *SIDECARS, "envoy", "nginx"]
CONCURRENCY = [1, 8]


# -- the bare candidates (each `python -m bench.http_candidates serve KIND`) -------------------------------

class _Upstream(asyncio.Protocol):
    """The bare proxies' connection to Triton: whole answers are copied to the client."""

    def __init__(self, client: _BareClient) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        answer, self.chunks = b"".join(self.chunks), []
        self.client.answer(answer)


class _BareClient(asyncio.Protocol):
    """A client connection of the bare pass-through proxy (wrk sends one request at a time)."""

    def __init__(self, triton_port: int) -> None:
        self.triton_port = triton_port
        self.parser = httptools.HttpRequestParser(self)
        self.chunks: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.waiting: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        _, self.upstream = await asyncio.get_running_loop().create_connection(
            lambda: _Upstream(self), "127.0.0.1", self.triton_port)
        if self.waiting is not None:
            self._forward(self.waiting)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        request, self.chunks = b"".join(self.chunks), []
        if self.upstream is None:
            self.waiting = request
        else:
            self._forward(request)

    def _forward(self, request: bytes) -> None:
        assert self.upstream is not None and self.upstream.transport is not None
        self.upstream.transport.write(request)

    def answer(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


class _ChainClient(asyncio.Protocol):
    """A client connection of `chain-uvloop`: a task per request through five coroutine levels to the
    sidecar's UpstreamPool, no checks."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self._serve(self.url.decode(), body))

    async def _serve(self, path: str, body: bytes) -> None:
        status, answer = await self._level(path, body, 4)
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, len(answer), answer))

    async def _level(self, path: str, body: bytes, depth: int) -> tuple[int, bytes]:
        if depth:
            return await self._level(path, body, depth - 1)
        answer = await self.pool.request("POST", path, {"Content-Type": "application/json"}, body, timeout_s=30)
        return answer.status, answer.body


def serve(kind: str, port: int, triton_port: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        factory: Callable[[], asyncio.Protocol]
        if kind == "chain-uvloop":
            pool = UpstreamPool(f"http://127.0.0.1:{triton_port}", connect_timeout_s=5)
            factory = lambda: _ChainClient(pool)  # noqa: E731
        else:
            factory = lambda: _BareClient(triton_port)  # noqa: E731
        server = await loop.create_server(factory, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    if kind.endswith("uvloop"):
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        runner.run(main())


def run_unchecked(argv: list[str]) -> int:
    """`triton-sidecar ARGV` with request validation and answer screening made free (benchmark only)."""
    from sidecar.cli.main import main as sidecar_main
    from sidecar.fronts import http_routes
    from sidecar.serving.filtering import ScreenedResponse
    from sidecar.serving.validation import CheckedRequest

    http_routes.validate_infer_request = lambda spec, body, header_length=None: CheckedRequest(  # type: ignore[assignment]
        elements=0, requested_outputs=(), binary=header_length is not None)
    http_routes.screen_infer_response = lambda body, header_length, **_: ScreenedResponse(  # type: ignore[assignment]
        body, header_length)
    return sidecar_main(argv)


# -- the benchmark ---------------------------------------------------------------------------------------

def _wait_answering(url: str, body: bytes, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                if b'"scores"' in response.read():
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} gave no answer within {timeout_s} s")
        time.sleep(0.1)


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    built = credit_clones(workdir, list(MODELS.values()), sources={"credit_risk_2ms": BENCH_MODELS / "credit_risk_2ms"})
    models = list(MODELS.values())
    body = json_request(features(1))
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=built.repository, models=models, workdir=workdir / "triton")
        stack.callback(triton.stop)
        triton.start()
        machine = describe_machine(triton.url)
        urls: dict[str, str] = {}
        pids: dict[str, Callable[[], list[int]]] = {}
        for kind in BARE:
            port = free_port()
            process = subprocess.Popen([sys.executable, "-m", "bench.http_candidates", "serve", kind,
                                        "--port", str(port), "--triton-http", str(triton.ports.http)])
            stack.callback(process.wait, 10)
            stack.callback(process.terminate)
            urls[kind], pids[kind] = f"http://127.0.0.1:{port}", (lambda p=process: [p.pid])
        for kind, event_loop in SIDECARS.items():
            launcher = [sys.executable, "-m", "bench.http_candidates", "run-unchecked"] if kind.endswith("unchecked") \
                else None
            sidecar = SidecarProcess(sidecar_settings(
                triton, models=models, golden_dir=built.golden_dir, filtering={"rules": [CREDIT_FILTER_RULE]},
                validation={"reject_non_finite": True}, listen={"event_loop": event_loop},
                logging={"format": "json", "level": "info"}), workdir / kind, launcher=launcher)
            stack.callback(sidecar.stop)
            sidecar.start()
            urls[kind], pids[kind] = sidecar.url, (lambda s=sidecar: [s.pid])
        envoy, nginx = start_yardsticks(stack, triton, workdir)
        urls["envoy"], pids["envoy"] = envoy.url, lambda: [envoy.pid]
        urls["nginx"], pids["nginx"] = nginx.url, lambda: [nginx.pid, *children(nginx.pid)]
        wrk = Wrk(workdir / "wrk")
        for leg in LEGS:
            _wait_answering(f"{urls[leg]}/v2/models/credit_risk/infer", body.body)
            wrk.run(f"{urls[leg]}/v2/models/credit_risk/infer", body, connections=8, duration_s=1)  # warm-up

        def cpu(leg: str) -> float:
            return sum(cpu_seconds(pid) for pid in pids[leg]())

        # Idle rates (CPU s per s): the sidecars probe, Envoy ticks; subtracted from every run.
        before = {leg: cpu(leg) for leg in LEGS}
        time.sleep(args.idle)
        idle = {leg: (cpu(leg) - before[leg]) / args.idle for leg in LEGS}
        for round_ in range(args.rounds):
            for label, model in MODELS.items():
                for concurrency in CONCURRENCY:
                    shift = (round_ + concurrency + len(label)) % len(LEGS)
                    for leg in LEGS[shift:] + LEGS[:shift]:
                        started, at = cpu(leg), time.perf_counter()
                        result = wrk.run(f"{urls[leg]}/v2/models/{model}/infer", body, connections=concurrency,
                                         duration_s=args.duration)
                        wall = time.perf_counter() - at
                        used = max(0.0, cpu(leg) - started - idle[leg] * wall)
                        row = {"round": round_ + 1, "leg": leg, "model": label, "concurrency": concurrency,
                               **result.as_dict(),
                               "cpu_ms_per_request": round(1000 * used / max(result.requests, 1), 4)}
                        runs.append(row)
                        print(f"round {round_ + 1} {label:10} c={concurrency} {leg:16} {result.throughput:7.0f} req/s "
                              f"cpu {row['cpu_ms_per_request']:.3f} ms/req errors {result.error_count}", flush=True)
    return {"benchmark": "http_candidates", "command": command_line(), "machine": machine,
            "settings": {"rounds": args.rounds, "duration_s": args.duration, "idle_s": args.idle},
            "idle_cpu_share": {leg: round(v, 4) for leg, v in idle.items()}, "runs": runs,
            "summary": summarise(runs)}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and leg: median CPU ms per request and throughput over the rounds, and CPU vs Envoy's."""
    summary = []
    for label in MODELS:
        for concurrency in CONCURRENCY:
            case = [r for r in runs if r["model"] == label and r["concurrency"] == concurrency]
            cpu = {leg: statistics.median(r["cpu_ms_per_request"] for r in case if r["leg"] == leg) for leg in LEGS}
            rps = {leg: statistics.median(r["throughput_rps"] for r in case if r["leg"] == leg) for leg in LEGS}
            summary.append({"model": label, "concurrency": concurrency, "cpu_ms_per_request": cpu,
                            "throughput_rps": rps,
                            "cpu_vs_envoy": {leg: round(cpu[leg] / cpu["envoy"], 2) if cpu["envoy"] else None
                                             for leg in LEGS}})
    return summary


def markdown(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [f"`{result['command']}` ({machine['date']}, load average at start "
             f"{' / '.join(str(x) for x in machine['load_average_at_start'])}, {machine['cores']} cores)", "",
             "CPU ms per proxied request (× Envoy's in the same run):", "",
             "| case | " + " | ".join(LEGS) + " |", "|---|" + "---|" * len(LEGS)]
    for s in result["summary"]:
        cells = [f"{s['cpu_ms_per_request'][leg]:.3f} ({s['cpu_vs_envoy'][leg]:.2f}×)" for leg in LEGS]
        lines.append(f"| {s['model']}, c={s['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_candidates", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    serving = sub.add_parser("serve", help="run one bare candidate (the benchmark starts these itself)")
    serving.add_argument("kind", choices=BARE)
    serving.add_argument("--port", type=int, required=True)
    serving.add_argument("--triton-http", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the legs' order rotating (default 2)")
    parser.add_argument("--duration", type=int, default=2, help="seconds per leg and case (default 2)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds to measure each leg's idle CPU (default 5)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run-unchecked"]:
        return run_unchecked(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.kind, args.port, args.triton_http)
        return 0
    import tempfile
    with tempfile.TemporaryDirectory(prefix="bench-http-candidates-") as scratch:
        try:
            result = measure(args, Path(scratch))
        finally:
            keep_logs(Path(scratch), "http_candidates")
    table = markdown(result)
    path = write_results("http_candidates", result, table)
    print(f"\n{table}\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
