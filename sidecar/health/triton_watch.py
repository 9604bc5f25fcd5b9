"""Whether Triton itself is live and ready: one loop, independent of any model."""

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
        self.live = False
        self.ready = False
        self.checked = False
        self.last_tick = clock()
        #: clock() when Triton was last seen live; starts at creation, so the grace covers start-up.
        self.last_live_at = clock()
        self.detail = "not checked yet"

    def reconfigure(self, settings: ProbesSection) -> None:
        self._settings = settings

    def not_live_for(self) -> float:
        return 0.0 if self.live else self._clock() - self.last_live_at

    async def check(self) -> None:
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
        self.live, self.ready, self.detail, self.checked = live, ready, detail, True
        if live:
            self.last_live_at = self._clock()
        self._metrics.triton_up.set(1 if live else 0)
        self._metrics.triton_ready.set(1 if ready else 0)
        self.last_tick = self._clock()

    def mark_unreachable(self, detail: str) -> None:
        """A proxied request could not reach Triton: stop calling the pod ready right away."""
        if self.ready:
            log.warning("triton_status_changed", live=False, ready=False, cause=detail)
        self.ready = False
        self.live = False
        self.detail = detail
        self._metrics.triton_up.set(0)
        self._metrics.triton_ready.set(0)

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._settings.interval_s)

