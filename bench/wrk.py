"""The load generator: Debian's wrk (C, epoll) driving POST bodies through a small Lua script.

Why wrk and not an aiohttp client: on this 2-core machine the load generator shares the CPU with
Triton, the stub and the proxy under test. wrk spends a few microseconds per request, an aiohttp
client 100-200 µs (as much as the overhead we want to measure), so a Python client would drown the
difference between the legs. wrk is a closed loop: concurrency = open connections (-c), each with
one request in flight; its latency histogram has 1 µs resolution.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.debian import ensure_debian_package

LUA_SCRIPT = r"""
-- POST the body in $BENCH_BODY (binary-safe) and write a JSON summary to $BENCH_RESULT.
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = os.getenv("BENCH_CONTENT_TYPE")
local header_length = os.getenv("BENCH_HEADER_LENGTH")
if header_length ~= nil and header_length ~= "" then
  wrk.headers["Inference-Header-Content-Length"] = header_length
end

function done(summary, latency, requests)
  local out = assert(io.open(os.getenv("BENCH_RESULT"), "w"))
  local e = summary.errors
  out:write(string.format(
    '{"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
    '"latency_us": {"min": %d, "mean": %.2f, "max": %d, "p50": %d, "p90": %d, "p99": %d, "p999": %d}}',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9)))
  out:close()
end
"""


@dataclass(frozen=True)
class RequestBody:
    """One inference request as bytes on the wire (JSON, or JSON header + binary tensors)."""

    name: str
    body: bytes
    content_type: str = "application/json"
    #: Length of the JSON header for the binary extension (Inference-Header-Content-Length).
    json_header_length: int | None = None


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_s: float
    errors: dict[str, int]
    latency_us: dict[str, float]

    @property
    def throughput(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "duration_s": round(self.duration_s, 3),
                "throughput_rps": round(self.throughput, 1), "errors": self.errors,
                "latency_ms": {k: round(v / 1000, 4) for k, v in self.latency_us.items()}}


class Wrk:
    """Runs `wrk` with the POST script; one instance per benchmark (the script is written once)."""

    def __init__(self, workdir: Path) -> None:
        self.binary = ensure_debian_package("wrk")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.script = self.workdir / "post.lua"
        self.script.write_text(LUA_SCRIPT)
        self._bodies: dict[str, Path] = {}

    def _body_file(self, request: RequestBody) -> Path:
        path = self._bodies.get(request.name)
        if path is None:
            path = self.workdir / f"{request.name}.body"
            path.write_bytes(request.body)
            self._bodies[request.name] = path
        return path

    def run(self, url: str, request: RequestBody, *, connections: int, duration_s: int,
            timeout_s: int = 10) -> WrkResult:
        """A closed loop of `connections` connections for `duration_s` seconds on one wrk thread."""
        result_path = self.workdir / "result.json"
        result_path.unlink(missing_ok=True)
        env = {**os.environ, "BENCH_BODY": str(self._body_file(request)), "BENCH_RESULT": str(result_path),
               "BENCH_CONTENT_TYPE": request.content_type,
               "BENCH_HEADER_LENGTH": "" if request.json_header_length is None else str(request.json_header_length)}
        # One thread: at 8 connections it is far from saturated, and a second would take the
        # second core from the servers under test.
        command = [self.binary, "-t1", f"-c{connections}", f"-d{duration_s}s", f"--timeout={timeout_s}s",
                   "-s", str(self.script), url]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=duration_s + timeout_s + 30)
        if done.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-1000:]}{done.stdout[-1000:]}")
        raw = json.loads(result_path.read_text())
        return WrkResult(requests=raw["requests"], duration_s=raw["duration_us"] / 1e6,
                         errors=raw["errors"], latency_us=raw["latency_us"])
