"""Golden requests that outlived their probe: still listened to for Triton's late verdict."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from sidecar.golden.cases import GoldenCase
from sidecar.health.triton_client import InferOutcome, TritonClient
from sidecar.protocol.triton_errors import StubUnhealthy, TritonTimeout

log = structlog.get_logger("sidecar.probes")

#: How long (s) a golden request that outlived its probe is still listened to. Triton's verdict on a
#: dead stub comes after about 1 s; an answer later than this says nothing the probes have not already
#: acted on, and a hung execute() never answers, so the request must end some time.
LATE_ANSWER_S = 30.0


class StillUnanswered(Exception):
    """The model's previous golden request still has no answer; the message says for how long."""


@dataclass
class _OpenRequest:
    task: asyncio.Task[InferOutcome]
    sent_at: float
    #: Rounds that have waited on this request so far.
    rounds: int = 1
    #: A round is waiting on it right now, and reports its answer itself.
    awaited: bool = False


class LateAnswers:
    """Golden requests whose probe gave up (`probes.timeout_s`) while their answer is still awaited,
    at most one per model.

    The next round sends no new request behind an open one (a hung model is not fed more requests to
    hang on): it waits for the open one, one interval more than the round before, which is the time
    a round of its own would have had. So a slow answer is counted once, not by every round it
    overlaps, and a hung model fails its rounds at the probe interval, not at the timeout. An answer
    that comes while no round waits, if it is Triton's StubUnhealthy verdict, goes to `on_final`.
    """

    def __init__(self, *, interval_s: float, on_final: Callable[[str, StubUnhealthy], None],
                 listen_s: float = LATE_ANSWER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._on_final = on_final
        self._listen_s = listen_s
        self._clock = clock
        self._open: dict[str, _OpenRequest] = {}

    def unanswered_for(self, model: str) -> float | None:
        """Seconds the model's open request has waited, or None when none is open."""
        request = self._open.get(model)
        if request is None or request.task.done():
            return None
        return self._clock() - request.sent_at

    async def infer(self, triton: TritonClient, case: GoldenCase, timeout_s: float) -> InferOutcome:
        request = self._open.get(case.model)
        if request is not None and not request.task.done():
            deadline = request.sent_at + timeout_s + request.rounds * self._interval_s
            request.rounds += 1
            return await self._wait(case.model, request, deadline)
        request = _OpenRequest(asyncio.ensure_future(triton.infer_case(case, timeout_s=self._listen_s)),
                               self._clock())
        self._open[case.model] = request
        request.task.add_done_callback(lambda t: self._answered(case.model, request))
        return await self._wait(case.model, request, request.sent_at + timeout_s)

    async def _wait(self, model: str, request: _OpenRequest, deadline: float) -> InferOutcome:
        request.awaited = True
        try:
            async with asyncio.timeout(max(0.0, deadline - self._clock())):
                return await asyncio.shield(request.task)
        except TimeoutError:
            if request.rounds == 1:
                raise TritonTimeout("no answer within the time limit") from None
            raise StillUnanswered(f"the golden request sent {self._clock() - request.sent_at:.1f} s ago "
                                  "still has no answer") from None
        except asyncio.CancelledError:
            self.forget(model)  # the prober stops: nobody will listen any more
            raise
        finally:
            request.awaited = False

    def _answered(self, model: str, request: _OpenRequest) -> None:
        if self._open.get(model) is request:
            del self._open[model]
        if request.task.cancelled() or request.awaited:
            return
        error = request.task.exception()
        after_s = round(self._clock() - request.sent_at, 2)
        if isinstance(error, StubUnhealthy):
            log.warning("probe_late_answer", model=model, after_s=after_s, cause=error.message)
            self._on_final(model, error)
        else:
            log.info("probe_late_answer", model=model, after_s=after_s,
                     cause="answered" if error is None else str(error))

    def forget(self, model: str) -> None:
        """Stop listening for the model's open request (its instance was just replaced)."""
        request = self._open.pop(model, None)
        if request is not None:
            request.task.cancel()

    async def close(self) -> None:
        tasks = [request.task for request in self._open.values()]
        self._open.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

