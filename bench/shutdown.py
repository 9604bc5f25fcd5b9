"""Every benchmark cleans up what it started on Ctrl-C, `kill` or failure: SIGTERM and SIGHUP are
turned into KeyboardInterrupt, so the same `finally` blocks run as for Ctrl-C."""

from __future__ import annotations

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def interrupt_on_termination() -> None:
    """Call once at the start of a benchmark's main(). SIGINT is set too: a shell starts background
    jobs with SIGINT ignored, and `kill -INT` must still stop the benchmark cleanly."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
