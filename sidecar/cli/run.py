"""`triton-sidecar run`: load and check everything, then serve until SIGTERM (drain first)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import structlog

from sidecar import __version__
from sidecar.app.factory import create_app
from sidecar.app.probe_port import ProbeListener
from sidecar.cli.arguments import EXIT_OK
from sidecar.cli.memory import release_after_start
from sidecar.config import SidecarConfig, load_config
from sidecar.fronts.appkeys import HEALER, LIFECYCLE, LIVE
from sidecar.fronts.http_front import http_server
from sidecar.golden.cases import load_golden_dir
from sidecar.logs import configure_logging

log = structlog.get_logger("sidecar.cli")

def load_everything(config_path: Path | None) -> tuple[SidecarConfig, dict]:
    """Config and golden files, validated once; raises with the file and key on the first problem."""
    config = load_config(config_path)
    golden = load_golden_dir(config.golden_dir)
    return config, golden


def cmd_run(args: argparse.Namespace) -> int:
    config, golden = load_everything(args.config)
    configure_logging(format=config.logging.format, level=config.logging.level)
    run_on_loop(serve(config, golden, config_path=args.config), config)
    return EXIT_OK


def event_loop_of(config: SidecarConfig) -> str:
    """The event loop the sidecar serves on: `listen.event_loop`, but asyncio's own with TLS on the
    Python front. Its listener hands each connection to TLS itself (fronts/tls.py: start_tls, to count
    handshake failures by reason and check SANs before a byte is served); uvloop starts reading a new
    connection before start_tls can take it over, so the ClientHello would reach the wrong protocol.
    The Rust front terminates TLS on its own runtime (rustls): Python's loop sees only plaintext."""
    python_terminates_tls = config.tls.enabled and config.listen.front == "python"
    return "asyncio" if python_terminates_tls else config.listen.event_loop


def loop_factory(config: SidecarConfig) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of the loop `event_loop_of(config)` names."""
    if event_loop_of(config) == "uvloop":
        import uvloop  # imported here: `check`, `validate` and `record` run on asyncio's loop

        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return asyncio.new_event_loop


def run_on_loop(main: Coroutine[Any, Any, None], config: SidecarConfig) -> None:
    """Run `main` to its end on a new loop of the kind `event_loop_of(config)` names."""
    with asyncio.Runner(loop_factory=loop_factory(config)) as runner:
        runner.run(main)


async def serve(config: SidecarConfig, golden: dict, *, stop: asyncio.Event | None = None,
                config_path: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), then drain: readiness fails at once, in-flight
    requests and heals get up to lifecycle.drain_s, then everything is closed. SIGHUP re-reads
    the config file and the golden files (they are also watched)."""
    app = create_app(config, golden=golden, config_path=config_path)
    listener = http_server(app)
    await listener.start(config.listen.host, config.listen.port)
    probes = ProbeListener(app)
    if config.listen.probe_port:
        await probes.start(config.listen.host, config.listen.probe_port)
    log.info("sidecar_started", version=__version__, listen=f"{config.listen.host}:{config.listen.port}",
             triton=config.triton.url, config=config.source, tls=config.tls.enabled,
             mutual_tls=bool(config.tls.client_ca_file), probe_port=config.listen.probe_port or None,
             event_loop=event_loop_of(config))
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    release_after_start(loop)
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
        await probes.close()
        await listener.close()
        log.info("sidecar_stopped")

