"""A gRPC load generator (wrk has no gRPC): `concurrency` workers on one grpc.aio channel, each
sending the same serialized ModelInferRequest back to back for `duration` seconds. Run as its own
process so that its CPU is not the sidecar's:

    python -m bench.grpc_load --target 127.0.0.1:8081 --request FILE --concurrency 8 --duration 5

Prints one JSON object: requests, duration_s, throughput_rps, latency_ms {p50, p90, p99}, errors.
The request bytes are sent with identity serializers: the generator spends no CPU on protobuf.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def channel_to(target: str, ca: Path | None) -> grpc.aio.Channel:
    """Plaintext, or TLS that trusts `ca` (the certificate names localhost; the target may be an address)."""
    options = [("grpc.max_receive_message_length", -1)]
    if ca is None:
        return grpc.aio.insecure_channel(target, options=options)
    options.append(("grpc.ssl_target_name_override", "localhost"))
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca.read_bytes()), options=options)


async def drive(target: str, payload: bytes, concurrency: int, duration_s: float,
                ca: Path | None = None) -> dict[str, Any]:
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    async with channel_to(target, ca) as channel:
        infer = channel.unary_unary(METHOD)
        await infer(payload, timeout=30)  # the channel is connected before the clock starts
        started = time.perf_counter()
        deadline = started + duration_s

        async def worker() -> None:
            while True:
                sent = time.perf_counter()
                if sent >= deadline:
                    return
                try:
                    await infer(payload, timeout=30)
                    latencies.append(time.perf_counter() - sent)
                except grpc.aio.AioRpcError as e:
                    errors[e.code().name] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ms = np.asarray(latencies) * 1000 if latencies else np.zeros(1)
    return {"requests": len(latencies), "duration_s": round(elapsed, 3),
            "throughput_rps": round(len(latencies) / elapsed, 1),
            "latency_ms": {q: round(float(np.percentile(ms, p)), 3)
                           for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
            "errors": dict(errors)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="host:port")
    parser.add_argument("--request", required=True, type=Path, help="a serialized ModelInferRequest")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--ca", type=Path, help="speak TLS, trusting this CA certificate (PEM)")
    args = parser.parse_args(argv)
    result = asyncio.run(drive(args.target, args.request.read_bytes(), args.concurrency, args.duration, args.ca))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
