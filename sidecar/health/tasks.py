"""Supervised long-lived tasks: a crash is logged with its traceback, counted, and the task restarts
with backoff, as a Kubernetes controller's work loop is restarted.

A loop that raises and ends silently is the worst failure a guard can have: a model's probe loop that
dies leaves the model in its last state (usually HEALTHY, still served) and nobody sees it. So every
long-lived task of the sidecar runs under `supervise`: the exception is logged as `task_crashed` with
its traceback, counted in `triton_sidecar_task_crashes_total{task}` (the task's kind: supervisor,
triton_watch, discovery, reload; never a model name, so the label set stays bounded; which model is in
the log event and in /status), and the loop is started again after a backoff that doubles with each
crash in a row. Cancellation is never a crash: it is how the app stops its tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from sidecar.metrics import SidecarMetrics

log = structlog.get_logger("sidecar.tasks")

T = TypeVar("T")


#: Wait (s) before restarting a task after its first crash in a row: long enough that a loop that
#: crashes at once does not spin a core, short enough that a one-off bug costs one probe interval.
CRASH_BACKOFF_INITIAL_S = 0.1


#: Longest wait (s) between restarts: a loop that keeps crashing is still retried often enough to
#: recover by itself once the cause goes away (Triton answering again, a golden file fixed).
CRASH_BACKOFF_MAX_S = 10.0


#: A run this long (s) before its crash counts as having recovered: the backoff starts again from
#: the initial wait. Tasks that know better (a model supervisor after a completed round) say so
#: themselves through `CrashRecord.recovered`.
RECOVERED_AFTER_S = 60.0


@dataclass
class CrashRecord:
    """What /status shows of a supervised task's crashes."""

    #: Crashes since start.
    crashes: int = 0
    #: Crashes since the task last made progress: sets the backoff.
    in_a_row: int = 0
    #: "KeyError: 'inputs'" of the last crash ("" = none).
    last_error: str = ""

    def recovered(self) -> None:
        """The task made progress since its last crash: the next one waits the initial backoff."""
        self.in_a_row = 0


def crash_backoff(in_a_row: int, *, initial_s: float = CRASH_BACKOFF_INITIAL_S,
                  max_s: float = CRASH_BACKOFF_MAX_S) -> float:
    """Wait (s) before the restart that follows the `in_a_row`-th crash in a row (1, 2, ...)."""
    return min(initial_s * 2 ** max(0, in_a_row - 1), max_s)


async def supervise(
    run: Callable[[], Awaitable[T]],
    *,
    kind: str,
    name: str,
    metrics: SidecarMetrics,
    record: CrashRecord | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Run `run()` until it returns (its result is returned), restarting it after each exception."""
    record = record if record is not None else CrashRecord()
    while True:
        started = clock()
        try:
            return await run()
        except Exception as e:  # the point of this function; CancelledError is not an Exception
            if clock() - started >= RECOVERED_AFTER_S:
                record.recovered()
            record.crashes += 1
            record.in_a_row += 1
            record.last_error = f"{type(e).__name__}: {e}"[:300]
            delay = crash_backoff(record.in_a_row)
            metrics.task_crashes.labels(task=kind).inc()
            log.error("task_crashed", task=name, kind=kind, error=type(e).__name__, cause=str(e)[:300],
                      crashes_in_a_row=record.in_a_row, restart_in_s=delay, exc_info=e)
        await sleep(delay)
        log.info("task_restarted", task=name, kind=kind, crashes_in_a_row=record.in_a_row)


def spawn(run: Callable[[], Awaitable[T]], *, kind: str, name: str, metrics: SidecarMetrics,
          record: CrashRecord | None = None) -> asyncio.Task[T]:
    """A named task running `run` under `supervise`."""
    return asyncio.create_task(supervise(run, kind=kind, name=name, metrics=metrics, record=record), name=name)
