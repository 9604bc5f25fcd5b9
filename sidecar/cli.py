"""Command line: `triton-sidecar run | demo | check | record | validate`.

Exit codes: 0 fine, 1 a check found a broken model, 2 bad usage, config or golden files (one line on
stderr naming the file and key).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import structlog

from sidecar import __version__
from sidecar.app import create_app
from sidecar.appkeys import HEALER, LIFECYCLE, LIVE
from sidecar.config import ConfigError, SidecarConfig, load_config
from sidecar.golden import GoldenFileError, load_golden_dir
from sidecar.http_listener import SidecarListener
from sidecar.logs import configure_logging

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
REPO_ROOT = Path(__file__).resolve().parent.parent

log = structlog.get_logger("sidecar.cli")


class UsageError(Exception):
    """Bad arguments, config or golden files: exit 2 with one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triton-sidecar",
        description="Semantic health checks, self-healing and a guarding proxy for NVIDIA Triton.",
    )
    parser.add_argument("--version", action="version", version=f"triton-sidecar {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run", help="run the sidecar next to Triton",
        description="Probe every model, answer /healthz and /readyz, heal broken models, proxy traffic.",
        epilog="example: triton-sidecar run --config /etc/triton-sidecar/sidecar.yaml\n"
               "        SIDECAR_TRITON_URL=http://127.0.0.1:8000 triton-sidecar run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", type=Path, help="YAML config file (default: built-in defaults)")
    run.set_defaults(handler=_cmd_run)

    demo = commands.add_parser(
        "demo", help="start a real Triton with the example models and the sidecar in front of it",
        epilog="example: triton-sidecar demo --port 8080",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--port", type=int, default=8080, help="the sidecar's port (default 8080)")
    demo.add_argument("--grpc-port", type=int, default=8081,
                      help="the sidecar's gRPC port (default 8081; 0: no gRPC front)")
    demo.add_argument("--duration", type=float, default=0,
                      help="stop after this many seconds (default: run until Ctrl-C)")
    demo.set_defaults(handler=_cmd_demo)

    from sidecar import commands as operator_commands

    operator_commands.add_parsers(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (UsageError, ConfigError, GoldenFileError) as e:
        print(f"triton-sidecar: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


def load_everything(config_path: Path | None) -> tuple[SidecarConfig, dict]:
    """Config and golden files, validated once; raises with the file and key on the first problem."""
    config = load_config(config_path)
    golden = load_golden_dir(config.golden_dir)
    return config, golden


def _cmd_run(args: argparse.Namespace) -> int:
    config, golden = load_everything(args.config)
    configure_logging(format=config.logging.format, level=config.logging.level)
    asyncio.run(serve(config, golden, config_path=args.config))
    return EXIT_OK


async def serve(config: SidecarConfig, golden: dict, *, stop: asyncio.Event | None = None,
                config_path: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), then drain: readiness fails at once, in-flight
    requests and heals get up to lifecycle.drain_s, then everything is closed. SIGHUP re-reads
    the config file and the golden files (they are also watched)."""
    app = create_app(config, golden=golden, config_path=config_path)
    listener = SidecarListener(app)
    await listener.start(config.listen.host, config.listen.port)
    log.info("sidecar_started", version=__version__, listen=f"{config.listen.host}:{config.listen.port}",
             triton=config.triton.url, config=config.source)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app[LIVE].request_reload)
    try:
        await stop.wait()
        drain_s = app[LIVE].config.lifecycle.drain_s  # as reloaded, if it was
        log.info("drain_started", drain_s=drain_s)
        app[LIFECYCLE].begin_drain()
        app[HEALER].accepting = False
        drained = await app[LIFECYCLE].wait_drained(drain_s)
        await app[HEALER].wait_idle(max(0.0, drain_s / 2))
        log.info("drain_finished", drained=drained, in_flight=app[LIFECYCLE].in_flight)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await listener.close()
        log.info("sidecar_stopped")


def _cmd_demo(args: argparse.Namespace) -> int:
    from sidecar.tritonserver import LocalTriton, TritonServerError, stub_pids

    repository = REPO_ROOT / "examples" / "model_repository"
    golden_dir = REPO_ROOT / "golden_requests"
    config_path = REPO_ROOT / "examples" / "sidecar.demo.yaml"
    if not repository.is_dir():
        raise UsageError(f"{repository}: the example model repository is missing (run from a source checkout)")
    base = load_config(config_path)
    triton = LocalTriton(model_repository=repository, models=["credit_risk", "image_classifier", "text_echo"],
                         workdir=Path(tempfile.mkdtemp(prefix="triton-sidecar-demo-")))
    print(f"Starting Triton (log: {triton.log_path}) ...", flush=True)
    try:
        triton.start()
    except TritonServerError as e:
        raise UsageError(str(e)) from e
    config = replace(
        base,
        triton=replace(base.triton, url=triton.url, metrics_url=triton.metrics_url,
                       grpc_url=f"127.0.0.1:{triton.ports.grpc}"),
        listen=replace(base.listen, host="127.0.0.1", port=args.port, grpc_port=args.grpc_port),
        golden_dir=golden_dir,
    )
    url = f"http://127.0.0.1:{args.port}"
    grpc_line = (f"\n  gRPC     127.0.0.1:{args.grpc_port} (KServe v2 and grpc.health.v1), e.g. with tritonclient.grpc"
                 if args.grpc_port else "")
    stub = ", ".join(str(p) for p in stub_pids("credit_risk", parent=triton.pid)) or "?"
    print(f"""
Triton {triton.url} (pid {triton.pid}) is running the example models; the sidecar listens on {url}
  status   curl -s {url}/status | python3 -m json.tool
  liveness curl -i {url}/healthz
  ready    curl -i {url}/readyz
  metrics  curl -s {url}/metrics | grep triton_sidecar_model_state
  infer    curl -s {url}/v2/models/credit_risk/infer -H 'Content-Type: application/json' \\
             -d @examples/requests/credit_risk.json
  stream   curl -sN {url}/v2/models/text_echo/generate_stream -H 'Content-Type: application/json' \\
             -d '{{"text_input": "one word per event", "max_tokens": 8}}'{grpc_line}

Break a model and watch it heal (Triton itself keeps saying ready):
  kill -9 {stub}     # the credit_risk python stub; or: pkill -9 -f credit_risk/1/model.py
  watch -n 0.5 "curl -s {url}/readyz"
Ctrl-C stops both.
""", flush=True)
    configure_logging(format="console", level=config.logging.level)
    golden = load_golden_dir(config.golden_dir)

    async def run_demo() -> None:
        stop = asyncio.Event()
        if args.duration:
            asyncio.get_running_loop().call_later(args.duration, stop.set)
        await serve(config, golden, stop=stop)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run_demo())
    finally:
        triton.stop()
    return EXIT_OK
