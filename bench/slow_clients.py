"""Slow-header clients against the fast listener: a normal client's success and latency while many
connections trickle their headers one byte a second (issue 19).

    .venv/bin/python -m bench.slow_clients [--slow 1000] [--header-timeout 5] [--seconds 4]

The sidecar runs as production does (`triton-sidecar run`, its own process) in front of the real
Triton, with `listen.header_timeout_s` set to --header-timeout. First a normal client alone sends
sequential 1x128 JSON inferences on one kept-alive connection (its baseline); then --slow
connections are opened, each sending one byte of a never-ending request head every second, and the
normal client keeps sending for --seconds while they are all open. Measured: the normal client's
success share and p50/p99 latency with and without the slow ones, when each slow connection was
closed by the sidecar (from its connect), and the sidecar's open descriptors before, at the peak
and after. Targets: >= 99 % success, p99 below 50 ms, every slow connection closed between the
header timeout and one second after it, descriptors back to their baseline. Exits 0 when all are met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.machine import command_line, describe_machine, keep_logs, write_results
from bench.procfs import open_fds
from bench.repository import EXAMPLES, copy_golden, copy_model
from bench.shutdown import interrupt_on_termination
from bench.sidecar_process import SidecarProcess, sidecar_settings
from sidecar.devtools.tritonserver import LocalTriton

MODEL = "credit_risk"
PATH = f"/v2/models/{MODEL}/infer".encode()
BODY = json.dumps({"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                               "data": [0.25] * 128}]}).encode()
REQUEST = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
           % (PATH, len(BODY))) + BODY
TARGET_SUCCESS = 0.99
TARGET_P99_MS = 50.0
#: A slow connection counts as closed "at the header timeout" up to this long after it (s): the
#: sidecar's one timer per connection is checked when it fires, plus the client's own read timing.
CLOSE_SLACK_S = 1.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def _normal_client(port: int, seconds: float) -> tuple[int, list[float]]:
    """(failures, latencies in s) of sequential requests on one kept-alive connection, reconnecting
    after a failure."""
    failures, latencies = 0, []
    deadline = time.monotonic() + seconds
    reader = writer = None
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert reader is not None
            writer.write(REQUEST)
            async with asyncio.timeout(5):
                status = int((await reader.readline()).split()[1])
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
            if status != 200:
                raise RuntimeError(f"status {status}")
            latencies.append(time.perf_counter() - started)
        except (OSError, RuntimeError, TimeoutError, asyncio.IncompleteReadError, IndexError, ValueError):
            failures += 1
            if writer is not None:
                writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()
    return failures, latencies


async def _slow_client(port: int, closed_after: list[float], connected: list[int]) -> None:
    """Trickle a request head one byte a second until the sidecar answers or closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened = time.monotonic()
    connected.append(1)
    head = b"POST " + PATH + b" HTTP/1.1\r\n" + b"X-Slow: yes\r\n" * 100
    try:
        for byte in head:
            writer.write(bytes([byte]))
            try:
                answer = await asyncio.wait_for(reader.read(65536), 1.0)
            except TimeoutError:
                continue
            if answer:
                while await asyncio.wait_for(reader.read(65536), 10):
                    pass
            break
    except (OSError, TimeoutError):
        pass
    finally:
        closed_after.append(time.monotonic() - opened)
        writer.close()


async def measure(port: int, pid: int, slow: int, header_timeout: float, seconds: float) -> dict[str, Any]:
    await _normal_client(port, 1.0)  # warm-up: the upstream connection, the model's spec
    alone_failures, alone = await _normal_client(port, seconds)
    fds_before = open_fds(pid)
    closed_after: list[float] = []
    connected: list[int] = []
    tasks = []
    for _ in range(slow):
        tasks.append(asyncio.create_task(_slow_client(port, closed_after, connected)))
        if len(tasks) % 100 == 0:
            await asyncio.sleep(0)  # let the connects go out in batches
    opened = time.monotonic()
    while len(connected) < slow and time.monotonic() - opened < 30:
        await asyncio.sleep(0.05)
    fds_peak = open_fds(pid)
    # The normal client runs while every slow connection is open (they close at the header timeout).
    window = max(0.5, min(seconds, header_timeout - (time.monotonic() - opened) - 0.5))
    loaded_failures, loaded = await _normal_client(port, window)
    fds_peak = max(fds_peak, open_fds(pid))
    await asyncio.gather(*tasks)
    settle = time.monotonic()
    while open_fds(pid) > fds_before and time.monotonic() - settle < 10:
        await asyncio.sleep(0.1)
    fds_after = open_fds(pid)

    def summary(failures: int, latencies: list[float]) -> dict[str, Any]:
        total = failures + len(latencies)
        return {"requests": total, "success_share": len(latencies) / total if total else 0.0,
                "p50_ms": statistics.median(latencies) * 1000 if latencies else None,
                "p99_ms": _percentile(latencies, 99) * 1000 if latencies else None}

    return {
        "slow_connections": slow, "slow_connected": len(connected), "connect_s": round(time.monotonic() - opened, 2),
        "header_timeout_s": header_timeout, "window_s": round(window, 2),
        "normal_alone": summary(alone_failures, alone), "normal_with_slow": summary(loaded_failures, loaded),
        "slow_closed_after_s": {"min": min(closed_after), "p50": statistics.median(closed_after),
                                "p99": _percentile(closed_after, 99), "max": max(closed_after)},
        "sidecar_fds": {"before": fds_before, "peak": fds_peak, "after": fds_after},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", type=int, default=1000, help="slow-header connections (default 1000)")
    parser.add_argument("--header-timeout", type=float, default=5.0, help="listen.header_timeout_s (default 5)")
    parser.add_argument("--seconds", type=float, default=4.0, help="normal client's window (default 4)")
    args = parser.parse_args(argv)
    interrupt_on_termination()
    scratch = Path(tempfile.mkdtemp(prefix="bench-slow-clients-"))
    repository, golden = scratch / "models", scratch / "golden"
    copy_model(EXAMPLES / MODEL, repository, MODEL)
    copy_golden(MODEL, golden, MODEL)
    triton = LocalTriton(model_repository=repository, models=[MODEL], workdir=scratch / "triton")
    sidecar: SidecarProcess | None = None
    try:
        triton.start()
        settings = sidecar_settings(triton, models=[MODEL], golden_dir=golden, probes={"interval_s": 60},
                                    listen={"header_timeout_s": args.header_timeout,
                                            "max_connections": args.slow + 100},
                                    logging={"format": "json", "level": "warning"})
        sidecar = SidecarProcess(settings, scratch / "sidecar").start()
        result = asyncio.run(measure(settings["listen"]["port"], sidecar.pid, args.slow, args.header_timeout,
                                     args.seconds))
    finally:
        if sidecar is not None:
            sidecar.stop()
        triton.stop()
        keep_logs(scratch, "slow_clients")
        shutil.rmtree(scratch, ignore_errors=True)
    loaded, closed, fds = result["normal_with_slow"], result["slow_closed_after_s"], result["sidecar_fds"]
    met = {
        "success": loaded["success_share"] >= TARGET_SUCCESS,
        "p99": loaded["p99_ms"] is not None and loaded["p99_ms"] < TARGET_P99_MS,
        "closed_at_header_timeout": (closed["min"] >= args.header_timeout - 0.1
                                     and closed["max"] <= args.header_timeout + CLOSE_SLACK_S),
        "fds_back": fds["after"] <= fds["before"],
    }
    payload = {"command": command_line(), "machine": describe_machine(), "settings": vars(args), **result,
               "targets_met": met}
    write_results("slow_clients", payload)
    alone = result["normal_alone"]
    print(f"normal client alone: {alone['requests']} requests, p50 {alone['p50_ms']:.2f} ms, "
          f"p99 {alone['p99_ms']:.2f} ms")
    print(f"with {result['slow_connected']} slow connections ({result['window_s']} s): {loaded['requests']} requests, "
          f"success {loaded['success_share']:.2%} (target >= {TARGET_SUCCESS:.0%}), p50 {loaded['p50_ms']:.2f} ms, "
          f"p99 {loaded['p99_ms']:.2f} ms (target < {TARGET_P99_MS:g} ms)")
    print(f"slow connections closed after {closed['min']:.2f} .. {closed['max']:.2f} s (p50 {closed['p50']:.2f}; "
          f"header timeout {args.header_timeout:g} s)")
    print(f"sidecar descriptors: {fds['before']} before, {fds['peak']} at the peak, {fds['after']} after")
    print("targets met" if all(met.values()) else f"targets missed: {[k for k, v in met.items() if not v]}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
