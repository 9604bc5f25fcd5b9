"""Command line: `triton-sidecar run | demo | check | record | record-reference | validate`.

Exit codes: 0 fine, 1 a check found a broken model, 2 bad usage, config or golden files (one line on
stderr naming the file and key).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from sidecar import __version__
from sidecar.cli.arguments import EXIT_OK, EXIT_USAGE, UsageError
from sidecar.cli.check import add_check_parser
from sidecar.cli.demo import cmd_demo
from sidecar.cli.record import add_record_parser
from sidecar.cli.record_reference import add_record_reference_parser
from sidecar.cli.run import cmd_run
from sidecar.cli.validate import add_validate_parser
from sidecar.config import ConfigError
from sidecar.golden.cases import GoldenFileError

log = structlog.get_logger("sidecar.cli")


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
    run.set_defaults(handler=cmd_run)

    demo = commands.add_parser(
        "demo", help="start a real Triton with the example models and the sidecar in front of it",
        description=(
            "Start a real Triton Inference Server (CPU only, from the nvidia-pytriton wheel) with the\n"
            "example models and the sidecar in front of it, print the URLs to try and a command that\n"
            "breaks a model so you can watch it heal. Ctrl-C stops both (within a few seconds) and\n"
            "removes the demo's temporary folder. Run it from a source checkout (`make demo`)."
        ),
        epilog="example: triton-sidecar demo --port 8080",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--port", type=int, default=8080, help="the sidecar's port (default 8080)")
    demo.add_argument("--grpc-port", type=int, default=8081,
                      help="the sidecar's gRPC port (default 8081; 0: no gRPC front)")
    demo.add_argument("--duration", type=float, default=0,
                      help="stop after this many seconds (default: run until Ctrl-C)")
    demo.set_defaults(handler=cmd_demo)


    add_check_parser(commands)
    add_record_parser(commands)
    add_record_reference_parser(commands)
    add_validate_parser(commands)
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

