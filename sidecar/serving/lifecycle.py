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

#: How often (s) a drain looks at a front that counts its own requests (the Rust front's atomics).
FRONT_POLL_S = 0.02


class Lifecycle:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.draining = False
        self.in_flight = 0
        self.last_request_at = clock()
        self._idle = asyncio.Event()
        self._idle.set()
        #: Fronts that serve requests without this loop (the Rust front): (in flight, served so far).
        self._fronts: list[tuple[Callable[[], int], Callable[[], int]]] = []
        self._drain_listeners: list[Callable[[], None]] = []

    def watch_front(self, in_flight: Callable[[], int], served: Callable[[], int],
                    on_drain: Callable[[], None] | None = None) -> None:
        """A front that counts its own requests: a drain waits for its requests in flight and for
        its traffic to go quiet too. `on_drain` is told at once when the drain begins (the Rust
        front's /v2/health/ready must fail now, not at its next tick)."""
        self._fronts.append((in_flight, served))
        if on_drain is not None:
            self._drain_listeners.append(on_drain)

    def begin_drain(self) -> None:
        self.draining = True
        for listener in self._drain_listeners:
            listener()

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
        if self._fronts:
            return await self._wait_drained_polling(limit_s)
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


    async def _wait_drained_polling(self, limit_s: float) -> bool:
        """wait_drained with fronts whose requests this loop never sees: their counters are read
        every FRONT_POLL_S, a change in what they served counting as a request."""
        deadline = self._clock() + limit_s
        served = None
        front_last = float("-inf")
        while True:
            now = self._clock()
            busy = self.in_flight + sum(in_flight() for in_flight, _ in self._fronts)
            total = sum(count() for _, count in self._fronts)
            if busy or (served is not None and total != served):
                front_last = now
            served = total
            if now >= deadline:
                return busy == 0
            if busy == 0 and now - max(self.last_request_at, front_last) >= min(QUIET_PERIOD_S, limit_s):
                return True
            await asyncio.sleep(min(FRONT_POLL_S, deadline - now))
