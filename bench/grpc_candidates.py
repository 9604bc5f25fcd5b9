"""Candidate designs for the gRPC front, measured side by side before one is built (issue 18).

    .venv/bin/python -m bench.grpc_candidates [--duration 2]

Each candidate is a bare server in its own process (`serve KIND`), with none of the sidecar's checks:
what it costs is the floor of that design. The same load generator as bench.dataplane
(bench/grpc_load.py: grpc.aio, identity serializers, 1x128 FP32 raw) drives each at c=1 and c=8 on
near-free credit_risk and on credit_risk_2ms; CPU per request is the server process's, from /proc.

Candidates:
- `aio-canned` / `sync-canned`: grpc.aio server / grpcio's synchronous server on a thread pool,
  answering a canned ModelInferResponse (no upstream): the server side alone.
- `aio-grpc`: grpc.aio server -> grpc.aio channel to Triton (bytes passed through): the present design.
- `sync-grpc`: synchronous server -> synchronous channel to Triton, on the pool's threads.
- `aio-http`: grpc.aio server -> the sidecar's HTTP pool (sidecar.upstream) with Triton's
  binary tensor extension: decode the protobuf, one HTTP request, encode the answer.
- `sync-http`: synchronous server -> a blocking keep-alive HTTP/1.1 socket per thread (httptools-
  parsed), binary tensor extension.
- `sync-loop-http`: synchronous server whose threads hand each request to one asyncio loop
  (run_coroutine_threadsafe), which calls Triton through the HTTP pool: the sidecar's core stays on its
  loop, gRPC's threads only carry bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httptools
from tritonclient.grpc import service_pb2 as pb

from bench.grpc_overhead import infer_request, run_load
from bench.inference import features
from bench.machine import command_line, describe_machine, write_results
from bench.procfs import cpu_seconds
from bench.repository import BENCH_MODELS, credit_clones
from sidecar.devtools.tritonserver import LocalTriton, free_port
from sidecar.upstream import UpstreamPool

SERVICE = "inference.GRPCInferenceService"
CANDIDATES = ["aio-canned", "sync-canned", "aio-grpc", "sync-grpc", "aio-http", "sync-http", "sync-loop-http"]
MODELS = {"near-free": "credit_risk", "2 ms model": "credit_risk_2ms"}
THREADS = 16


# -- the protobuf <-> binary tensor extension conversion every HTTP candidate pays -------------------------

def to_http(payload: bytes) -> tuple[str, bytes, int]:
    """(path, body, JSON header length) of a ModelInferRequest with raw contents."""
    request = pb.ModelInferRequest.FromString(payload)
    inputs = [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
               "parameters": {"binary_data_size": len(raw)}}
              for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)]
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return f"/v2/models/{request.model_name}/infer", header + b"".join(request.raw_input_contents), len(header)


def from_http(body: bytes, header_length: int) -> bytes:
    """The ModelInferResponse of Triton's binary answer."""
    document = json.loads(body[:header_length])
    response = pb.ModelInferResponse(model_name=document["model_name"], model_version=document.get("model_version", ""),
                                     id=document.get("id", ""))
    at = header_length
    for output in document["outputs"]:
        size = output["parameters"]["binary_data_size"]
        response.outputs.add(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        response.raw_output_contents.append(body[at:at + size])
        at += size
    return response.SerializeToString()


class BlockingHttp:
    """One keep-alive HTTP/1.1 connection on a blocking socket, answers parsed by httptools."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    def post(self, path: str, body: bytes, header_length: int) -> tuple[bytes, int]:
        self.headers, self.body, self.done = {}, [], False
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: triton\r\nInference-Header-Content-Length: %d\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), header_length, len(body), body))
        while not self.done:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("Triton closed the connection")
            self.parser.feed_data(data)
        return b"".join(self.body), int(self.headers[b"inference-header-content-length"])


# -- the servers ---------------------------------------------------------------------------------------------

def serve(kind: str, port: int, triton_http: int, triton_grpc: int) -> None:
    canned = pb.ModelInferResponse(model_name="credit_risk", outputs=[pb.ModelInferResponse.InferOutputTensor(
        name="scores", datatype="FP32", shape=[1, 1])], raw_output_contents=[b"\0\0\0\0"]).SerializeToString()
    if kind.startswith("aio"):
        asyncio.run(_serve_aio(kind, port, triton_http, triton_grpc, canned))
        return
    local = threading.local()
    loop: asyncio.AbstractEventLoop | None = None
    if kind == "sync-grpc":
        channel = grpc.insecure_channel(f"127.0.0.1:{triton_grpc}")
        upstream = channel.unary_unary(f"/{SERVICE}/ModelInfer")
    if kind == "sync-loop-http":
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        pool = UpstreamPool(f"http://127.0.0.1:{triton_http}", connect_timeout_s=5)

        async def via_pool(payload: bytes) -> bytes:
            path, body, length = to_http(payload)
            answer = await pool.request("POST", path, {"Inference-Header-Content-Length": str(length)}, body,
                                        timeout_s=30)
            return from_http(answer.body, int(answer.headers["inference-header-content-length"]))

    def handler(payload: bytes, context: grpc.ServicerContext) -> bytes:
        if kind == "sync-canned":
            return canned
        if kind == "sync-grpc":
            return upstream(payload, timeout=30)  # type: ignore[no-any-return]
        if kind == "sync-http":
            connection = getattr(local, "connection", None)
            if connection is None:
                connection = local.connection = BlockingHttp(triton_http)
            return from_http(*connection.post(*to_http(payload)))
        return asyncio.run_coroutine_threadsafe(via_pool(payload), loop).result()  # type: ignore[arg-type]

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(THREADS), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(handler)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


async def _serve_aio(kind: str, port: int, triton_http: int, triton_grpc: int, canned: bytes) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{triton_grpc}")
    upstream = channel.unary_unary(f"/{SERVICE}/ModelInfer")
    pool = UpstreamPool(f"http://127.0.0.1:{triton_http}", connect_timeout_s=5)

    async def handler(payload: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if kind == "aio-canned":
            return canned
        if kind == "aio-grpc":
            return await upstream(payload, timeout=30)  # type: ignore[no-any-return]
        path, body, length = to_http(payload)
        answer = await pool.request("POST", path, {"Inference-Header-Content-Length": str(length)}, body,
                                    timeout_s=30)
        return from_http(answer.body, int(answer.headers["inference-header-content-length"]))

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(handler)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


# -- the measurement -----------------------------------------------------------------------------------------

def _wait_answering(port: int, payload: bytes, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        while True:
            try:
                answer = pb.ModelInferResponse.FromString(call(payload, timeout=2))
                if answer.outputs:
                    return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    built = credit_clones(workdir, list(MODELS.values()), sources={"credit_risk_2ms": BENCH_MODELS / "credit_risk_2ms"})
    x = features(1)
    files = {}
    for label, model in MODELS.items():
        files[label] = workdir / f"{model}.bin"
        files[label].write_bytes(infer_request(model, x).SerializeToString())
    runs = []
    with contextlib.ExitStack() as stack:
        triton = LocalTriton(model_repository=built.repository, models=list(MODELS.values()), workdir=workdir / "t")
        stack.callback(triton.stop)
        triton.start()
        machine = describe_machine(triton.url)
        for kind in args.candidates:
            port = free_port()
            server = subprocess.Popen([sys.executable, "-m", "bench.grpc_candidates", "serve", kind,
                                       "--port", str(port),
                                       "--triton-http", str(triton.ports.http), "--triton-grpc",
                                       str(triton.ports.grpc)])
            try:
                _wait_answering(port, files["near-free"].read_bytes())
                run_load(f"127.0.0.1:{port}", files["near-free"], 8, 1)  # warm-up
                for label in MODELS:
                    if kind.endswith("canned") and label != "near-free":
                        continue  # no upstream: the model does not matter
                    for concurrency in (1, 8):
                        before = cpu_seconds(server.pid)
                        result = run_load(f"127.0.0.1:{port}", files[label], concurrency, args.duration)
                        cpu = cpu_seconds(server.pid) - before
                        row = {"candidate": kind, "model": label, "concurrency": concurrency, **result,
                               "cpu_ms_per_request": round(1000 * cpu / max(result["requests"], 1), 4)}
                        runs.append(row)
                        print(f"{kind:15} {label:10} c={concurrency} {result['throughput_rps']:8.0f} req/s "
                              f"p50 {result['latency_ms']['p50']:6.3f} ms cpu {row['cpu_ms_per_request']:.3f} ms/req "
                              f"errors {result['errors']}", flush=True)
            finally:
                server.terminate()
                server.wait(10)
    return {"benchmark": "grpc_candidates", "command": command_line(), "machine": machine,
            "settings": {"duration_s": args.duration, "threads": THREADS}, "runs": runs}


def markdown(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [f"`{result['command']}` ({machine['date']}, load average at start "
             f"{' / '.join(str(x) for x in machine['load_average_at_start'])})", "",
             "| candidate | model | c | req/s | p50 ms | server CPU ms/req |", "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['candidate']} | {r['model']} | {r['concurrency']} | {r['throughput_rps']:.0f} "
                     f"| {r['latency_ms']['p50']:.3f} | {r['cpu_ms_per_request']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_candidates", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    serving = sub.add_parser("serve", help="run one candidate server (the benchmark starts these itself)")
    serving.add_argument("kind", choices=CANDIDATES)
    serving.add_argument("--port", type=int, required=True)
    serving.add_argument("--triton-http", type=int, required=True)
    serving.add_argument("--triton-grpc", type=int, required=True)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per case (default 2)")
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=CANDIDATES)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.kind, args.port, args.triton_http, args.triton_grpc)
        return 0
    import tempfile
    with tempfile.TemporaryDirectory(prefix="bench-grpc-candidates-") as scratch:
        result = measure(args, Path(scratch))
    table = markdown(result)
    path = write_results("grpc_candidates", result, table)
    print(f"\n{table}\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
