"""generate_stream direct vs through the sidecar: time to first event, whole stream, CPU per event.

    .venv/bin/python -m bench.generate_stream [--streams 40] [--words 50] [--delay-ms 5]

The example `text_echo` model (a copy with `delay_ms` set) streams `--words` events per request;
streams alternate between Triton and the sidecar (one at a time, so each leg sees the same machine).
The sidecar runs as production does, in its own process (`triton-sidecar run`), with probes every
60 s so that its CPU time is the streams'. Targets (issue 11): at most 1 ms added to the first event
(median), at most 0.1 ms of sidecar CPU per event. Exits 0 when both are met, 1 otherwise.
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

import aiohttp

from bench.procfs import cpu_seconds
from bench.sidecar_process import SidecarProcess, sidecar_settings
from bench.stream_load import sse_stream
from sidecar.devtools.tritonserver import LocalTriton

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
MODEL = "text_echo"
TARGET_FIRST_EVENT_MS = 1.0
TARGET_CPU_PER_EVENT_MS = 0.1


async def measure(triton_url: str, sidecar_url: str, sidecar_pid: int, streams: int, words: int) -> dict[str, Any]:
    path = f"/v2/models/{MODEL}/generate_stream"
    body = {"text_input": " ".join(f"w{i}" for i in range(words)), "max_tokens": words}
    results: dict[str, list[tuple[float, float, int]]] = {"direct": [], "sidecar": []}
    cpu = {"direct": 0.0, "sidecar": 0.0}
    wall = {"direct": 0.0, "sidecar": 0.0}
    async with aiohttp.ClientSession() as session:
        for url in (triton_url, sidecar_url):  # warm-up: connections, specs
            await sse_stream(session, url + path, body)
        for i in range(streams * 2):
            leg = "direct" if i % 2 == 0 else "sidecar"
            url = triton_url if leg == "direct" else sidecar_url
            before, started = cpu_seconds(sidecar_pid), time.perf_counter()
            results[leg].append(await sse_stream(session, url + path, body))
            cpu[leg] += cpu_seconds(sidecar_pid) - before
            wall[leg] += time.perf_counter() - started
    summary: dict[str, Any] = {}
    for leg, rows in results.items():
        summary[leg] = {"first_event_ms_p50": statistics.median(r[0] for r in rows) * 1000,
                        "stream_ms_p50": statistics.median(r[1] for r in rows) * 1000,
                        "events": sum(r[2] for r in rows)}
    summary["added_first_event_ms"] = summary["sidecar"]["first_event_ms_p50"] - summary["direct"]["first_event_ms_p50"]
    summary["added_stream_ms"] = summary["sidecar"]["stream_ms_p50"] - summary["direct"]["stream_ms_p50"]
    # The sidecar's CPU while the direct legs run is its idle cost (event loop, timers): subtracted
    # at the same rate from the sidecar legs, so what is left is the streams' own.
    idle_rate = cpu["direct"] / wall["direct"]
    summary["sidecar_idle_cpu_share"] = idle_rate
    summary["sidecar_cpu_ms_per_event_raw"] = cpu["sidecar"] * 1000 / summary["sidecar"]["events"]
    summary["sidecar_cpu_ms_per_event"] = max(0.0, cpu["sidecar"] - idle_rate * wall["sidecar"]) * 1000 / (
        summary["sidecar"]["events"])
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=40, help="streams per leg (default 40)")
    parser.add_argument("--words", type=int, default=50, help="events per stream (default 50)")
    parser.add_argument("--delay-ms", type=float, default=5, help="the model's time per event (default 5 ms)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    repository = scratch / "models"
    shutil.copytree(REPO / "examples" / "model_repository" / MODEL, repository / MODEL)
    config = repository / MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "20"', f'string_value: "{args.delay_ms:g}"'))
    golden = scratch / "golden"
    shutil.copytree(REPO / "golden_requests" / MODEL, golden / MODEL)
    triton = LocalTriton(model_repository=repository, models=[MODEL], workdir=scratch / "triton")
    sidecar: SidecarProcess | None = None
    try:
        triton.start()
        settings = sidecar_settings(triton, models=[MODEL], golden_dir=golden, probes={"interval_s": 60},
                                    logging={"format": "json", "level": "warning"})
        sidecar = SidecarProcess(settings, scratch / "sidecar").start()
        summary = asyncio.run(measure(triton.url, sidecar.url, sidecar.pid, args.streams, args.words))
    finally:
        if sidecar is not None:
            sidecar.stop()
        triton.stop()
    summary["settings"] = vars(args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "generate_stream-latest.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"first event p50: direct {summary['direct']['first_event_ms_p50']:.2f} ms, sidecar "
          f"{summary['sidecar']['first_event_ms_p50']:.2f} ms (added {summary['added_first_event_ms']:+.2f} ms, "
          f"target <= {TARGET_FIRST_EVENT_MS} ms)")
    print(f"whole stream p50 ({args.words} events): direct {summary['direct']['stream_ms_p50']:.1f} ms, sidecar "
          f"{summary['sidecar']['stream_ms_p50']:.1f} ms (added {summary['added_stream_ms']:+.2f} ms)")
    print(f"sidecar CPU per event: {summary['sidecar_cpu_ms_per_event']:.4f} ms "
          f"(target <= {TARGET_CPU_PER_EVENT_MS} ms; raw {summary['sidecar_cpu_ms_per_event_raw']:.4f} ms, "
          f"idle CPU share {summary['sidecar_idle_cpu_share']:.1%})")
    met = (summary["added_first_event_ms"] <= TARGET_FIRST_EVENT_MS
           and summary["sidecar_cpu_ms_per_event"] <= TARGET_CPU_PER_EVENT_MS)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
