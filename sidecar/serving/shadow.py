"""Shadow calls: a served request sent again to another version, fire and forget, to compare answers.

The client never waits for one: it is started after the client's answer is ready, runs in its own
task, holds no breaker slot, and is bounded by `proxy.upstream_timeout_s`. At most
`proxy.max_shadow_in_flight` run at once; one more is dropped and counted (comparing is worth less
than the traffic it would slow down). Every task still running is cancelled at shutdown (`close`,
from the app's cleanup).

The Rust front makes the shadows of the HTTP infer requests it serves itself
(dataplane/src/front/shadow.rs); `front_in_flight` gives its count of them (each counted until this
loop has heard its end), which the cap and `len` include.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from sidecar.metrics import SidecarMetrics

log = structlog.get_logger("sidecar.rollouts")


class ShadowCalls:
    def __init__(self, *, limit: int, timeout_s: float, metrics: SidecarMetrics) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        #: The Rust front's shadows not yet heard (HttpFront sets it when it starts).
        self.front_in_flight: Callable[[], int] = lambda: 0

    def __len__(self) -> int:
        return len(self._tasks) + self.front_in_flight()

    def has_room(self, model: str) -> bool:
        """Is there room for one more? When not, the drop is counted."""
        if self._closed:
            return False
        if len(self) < self.limit:
            return True
        self._metrics.requests.shadow_dropped(model)
        return False

    def start(self, model: str, call: Coroutine[Any, Any, None]) -> None:
        """Run `call` in the background within the time bound (call `has_room` first)."""
        task = asyncio.get_running_loop().create_task(self._bounded(model, call), name=f"shadow:{model}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bounded(self, model: str, call: Coroutine[Any, Any, None]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await call
        except TimeoutError:
            log.info("shadow_call_timed_out", model=model, timeout_s=self.timeout_s)
        except Exception as e:  # a shadow call must never break anything: say it and go on
            log.warning("shadow_call_failed", model=model, cause=repr(e)[:200])

    async def close(self) -> None:
        """Cancel every shadow call still running (shutdown)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
