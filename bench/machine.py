"""What a result was measured on (CPU, cores, versions, date) and where results are written."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.shutdown import interrupt_on_termination

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _triton_server_version(triton_url: str | None) -> str:
    """The server's own answer on GET /v2 when one runs, else what the pinned wheel ships."""
    if triton_url:
        try:
            with urllib.request.urlopen(f"{triton_url}/v2", timeout=5) as response:
                return str(json.loads(response.read())["version"])
        except (OSError, ValueError, KeyError):
            pass
    pytriton = _version("nvidia-pytriton")
    return {"0.7.0": "2.51.0"}.get(pytriton, f"from nvidia-pytriton {pytriton}")


def _debian_version(binary: str, flag: str) -> str | None:
    try:
        done = subprocess.run([binary, flag], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (done.stdout + done.stderr).strip()
    match = re.search(r"\d+\.\d+(\.\d+)?", text)
    return match.group(0) if match else None


def describe_machine(triton_url: str | None = None) -> dict[str, Any]:
    """The facts RESULTS.md must quote next to every figure: this machine is shared and noisy."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "aiohttp": _version("aiohttp"),
        "tritonclient": _version("tritonclient"),
        "nvidia_pytriton": _version("nvidia-pytriton"),
        "triton_server": _triton_server_version(triton_url),
        "triton_sidecar": _version("triton-sidecar"),
        "nginx": _debian_version("nginx", "-v"),
        "wrk": _debian_version("wrk", "-v"),
        "kernel": platform.release(),
    }


def command_line() -> str:
    """The exact command that produced a result, as someone would type it from the repository root."""
    module = Path(sys.argv[0]).stem
    return " ".join([".venv/bin/python", "-m", f"bench.{module}", *map(shlex.quote, sys.argv[1:])])


def write_results(name: str, payload: dict[str, Any], table: str = "") -> Path:
    """bench/out/<name>-<UTC timestamp>.json and <name>-latest.json (gitignored), and the Markdown
    table as .md next to both."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    body = json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n"
    path = OUT_DIR / f"{name}-{stamp}.json"
    path.write_text(body)
    (OUT_DIR / f"{name}-latest.json").write_text(body)
    if table:
        path.with_suffix(".md").write_text(table)
        (OUT_DIR / f"{name}-latest.md").write_text(table)
    return path


def keep_logs(workdir: Path, name: str) -> Path:
    """Copy every *.log under a benchmark's temp dir to bench/out/logs/<name>/ before it is removed."""
    target = OUT_DIR / "logs" / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for log in Path(workdir).rglob("*.log"):
        relative = log.relative_to(workdir)
        shutil.copy(log, target / "_".join(relative.parts))
    return target


def overhead_parser(prog: str, doc: str | None, *, duration_type: type = float) -> argparse.ArgumentParser:
    """The options every overhead benchmark takes: --rounds, --duration, --profile (wrk wants
    whole seconds: `duration_type=int`)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--duration", type=duration_type, default=5, help="seconds per leg per scenario (default 5)")
    parser.add_argument("--profile", type=int, default=10,
                        help="seconds of py-spy on the sidecar at the end, if py-spy is installed (0: none)")
    return parser


def run_overhead_benchmark(name: str, args: argparse.Namespace,
                           measure: Callable[[argparse.Namespace, Path], dict[str, Any]],
                           verdicts: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
                           markdown: Callable[[dict[str, Any]], str]) -> int:
    """The frame of an overhead benchmark: measure in a scratch dir (its logs kept), judge the
    summary against the targets, write the results and print the table; 0 when every target is met."""
    interrupt_on_termination()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as scratch:
        try:
            result = measure(args, Path(scratch))
        finally:
            keep_logs(Path(scratch), name)
    result["wall_time_s"] = round(time.monotonic() - started, 1)
    result["verdicts"] = verdicts(result["summary"])
    table = markdown(result)
    path = write_results(name, result, table)
    print(f"\n{table}\nresults: {path}")
    return 0 if all(v["met"] for v in result["verdicts"]) else 1
