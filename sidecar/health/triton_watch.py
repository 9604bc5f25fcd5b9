"""Whether Triton itself is live and ready: one loop, independent of any model.

The loop (`check`) is the only writer of what it found. A proxied request that could not connect is
an event (`mark_unreachable`) kept beside it: until the next check starts, the watch reports Triton
unreachable, so the pod stops being ready at once rather than at the next interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from sidecar.config import ProbesSection
from sidecar.health.triton_client import TritonClient
from sidecar.metrics import SidecarMetrics
from sidecar.protocol.triton_errors import TritonError, TritonUnavailable

log = structlog.get_logger("sidecar.probes")


class TritonWatch:
    """Watches the server itself: live and ready, and since when it has not been live."""

    def __init__(self, *, triton: TritonClient, settings: ProbesSection, metrics: SidecarMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._triton = triton
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        # Written by the loop only.
        self._live = False
        self._ready = False
        self._detail = "not checked yet"
        self.checked = False
        #: clock() when the last check started: a report of an unreachable Triton older than this is
        #: superseded by that check.
        self._checked_from = float("-inf")
        self.last_tick = clock()
        #: clock() when Triton was last seen live; starts at creation, so the grace covers start-up.
        self.last_live_at = clock()
        # Written by mark_unreachable only: (clock() of the report, what the request saw).
        self._reported: tuple[float, str] | None = None
        #: Told after every check and report that changed live, ready or the detail (the Rust front
        #: serves /v2/health/* from what it was last told).
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _status(self) -> tuple[bool, bool, str]:
        return self.live, self.ready, self.detail

    def _changed(self, before: tuple[bool, bool, str]) -> None:
        if self._status() != before:
            for listener in self._listeners:
                listener()

    def _report_stands(self) -> bool:
        return self._reported is not None and self._reported[0] >= self._checked_from

    @property
    def live(self) -> bool:
        return self._live and not self._report_stands()

    @property
    def ready(self) -> bool:
        return self._ready and not self._report_stands()

    @property
    def detail(self) -> str:
        return self._reported[1] if self._reported is not None and self._report_stands() else self._detail

    def reconfigure(self, settings: ProbesSection) -> None:
        self._settings = settings

    def not_live_for(self) -> float:
        return 0.0 if self.live else self._clock() - self.last_live_at

    async def check(self) -> None:
        started = self._clock()
        timeout = self._settings.timeout_s
        try:
            live = await self._triton.server_live(timeout)
            ready = live and await self._triton.server_ready(timeout)
            detail = "ready" if ready else "live, not ready" if live else "answers not live"
        except (TritonUnavailable, TritonError) as e:
            live = ready = False
            detail = f"unreachable: {e}"
        if live != self.live or ready != self.ready or not self.checked:
            log.info("triton_status_changed", live=live, ready=ready, cause=detail)
        before = self._status()
        self._live, self._ready, self._detail, self.checked = live, ready, detail, True
        self._checked_from = started
        self._changed(before)
        if live:
            self.last_live_at = self._clock()
        self._metrics.triton_up.set(1 if live else 0)
        self._metrics.triton_ready.set(1 if ready else 0)
        self.last_tick = self._clock()

    def mark_unreachable(self, detail: str) -> None:
        """A proxied request could not reach Triton: stop calling the pod ready right away."""
        if self.ready:
            log.warning("triton_status_changed", live=False, ready=False, cause=detail)
        before = self._status()
        self._reported = (self._clock(), detail)
        self._changed(before)
        self._metrics.triton_up.set(0)
        self._metrics.triton_ready.set(0)

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._settings.interval_s)
