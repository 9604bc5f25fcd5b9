"""The per-model breaker (Knative queue-proxy's): a bounded number of requests at Triton, a bounded
queue behind them, and everything past that refused at once, so a slow model sheds load instead of
piling up requests that would all time out.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from sidecar.serving.refusals import Reason, Refusal


class Gauge(Protocol):
    def inc(self) -> None: ...

    def dec(self) -> None: ...


class Breaker:
    """At most `capacity` requests at Triton, at most `queue` waiting; more are refused at once."""

    def __init__(self, capacity: int, queue: int, queued: Gauge | None = None) -> None:
        self._slots = asyncio.Semaphore(capacity)
        self._queue = queue
        self.waiting = 0
        #: proxy_queued{model}: `waiting`, as operators (and the tests, whichever front) read it.
        self._queued = queued

    def slot(self, model: str, wait_s: float) -> Slot:
        """`async with breaker.slot(model, wait_s)`: a slot within wait_s, or Refusal(overloaded)."""
        return Slot(self, model, wait_s)

    async def acquire(self, model: str, wait_s: float) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            return
        if self.waiting >= self._queue:
            raise Refusal(Reason.OVERLOADED, f"model {model} has too many requests in flight and "
                                             f"{self.waiting} waiting; retry later", model=model, retry_after=1)
        self.waiting += 1
        if self._queued is not None:
            self._queued.inc()
        try:
            async with asyncio.timeout(wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise Refusal(Reason.OVERLOADED, f"model {model}: no free slot within {wait_s:g} s",
                          model=model, retry_after=1) from None
        finally:
            self.waiting -= 1
            if self._queued is not None:
                self._queued.dec()

    def release(self) -> None:
        self._slots.release()


class Slot:
    """A class, not an asynccontextmanager: cheaper on every proxied request."""

    __slots__ = ("_breaker", "_model", "_wait_s")

    def __init__(self, breaker: Breaker, model: str, wait_s: float) -> None:
        self._breaker, self._model, self._wait_s = breaker, model, wait_s

    async def __aenter__(self) -> None:
        await self._breaker.acquire(self._model, self._wait_s)

    async def __aexit__(self, *exc: object) -> None:
        self._breaker.release()

