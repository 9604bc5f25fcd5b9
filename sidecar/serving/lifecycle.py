"""Draining on SIGTERM, as Knative's queue-proxy does: fail readiness first, let in-flight requests
finish, then stop. Pure bookkeeping; the CLI wires it to signals and the app to requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

#: After the last request, how long (s) the pod must stay quiet before draining may end early:
#: endpoints are removed from Services a moment after readiness fails, and stragglers arrive.
QUIET_PERIOD_S = 1.0


class Lifecycle:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.draining = False
        self.in_flight = 0
        self.last_request_at = clock()
        self._idle = asyncio.Event()
        self._idle.set()

    def begin_drain(self) -> None:
        self.draining = True

    def request_started(self) -> None:
        self.in_flight += 1
        self.last_request_at = self._clock()
        self._idle.clear()

    def request_finished(self) -> None:
        self.in_flight -= 1
        self.last_request_at = self._clock()
        if self.in_flight == 0:
            self._idle.set()

    async def wait_drained(self, limit_s: float) -> bool:
        """Wait until no request is in flight and none came for QUIET_PERIOD_S, at most limit_s.
        True when drained, False when the limit cut it short."""
        deadline = self._clock() + limit_s
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                return self.in_flight == 0
            if self.in_flight == 0:
                quiet_for = self._clock() - self.last_request_at
                if quiet_for >= min(QUIET_PERIOD_S, limit_s):
                    return True
                await asyncio.sleep(min(QUIET_PERIOD_S - quiet_for, remaining))
                continue
            try:
                async with asyncio.timeout(remaining):
                    await self._idle.wait()
            except TimeoutError:
                return False

