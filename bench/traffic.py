"""Client traffic that judges every answer: correct, wrong, 503 with Retry-After, or anything else.

An aiohttp client in the benchmark's process: these benchmarks count answers at tens of requests
per second, so the client's own CPU cost does not matter here (proxy_overhead.py uses wrk instead).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
import numpy as np

CORRECT, WRONG, RETRY_LATER, OTHER = "correct", "wrong", "503_retry_after", "anything_else"
CATEGORIES = (CORRECT, WRONG, RETRY_LATER, OTHER)


@dataclass(frozen=True)
class ModelCall:
    """What to send to one model and what a correct answer is."""

    model: str
    body: bytes
    expected_scores: np.ndarray
    #: Outputs that must never appear in an answer (filtered by the sidecar).
    forbidden_outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    model: str
    started: float
    finished: float
    category: str
    status: int
    detail: str = ""


def judge(call: ModelCall, status: int, headers: dict[str, str], body: bytes) -> tuple[str, str]:
    if status == 503 and headers.get("Retry-After"):
        return RETRY_LATER, ""
    if status != 200:
        return OTHER, f"{status}: {body[:200].decode(errors='replace')}"
    try:
        outputs = {o["name"]: o for o in json.loads(body)["outputs"]}
        scores = np.asarray(outputs["scores"]["data"], dtype=np.float32).reshape(call.expected_scores.shape)
    except (ValueError, KeyError, TypeError) as e:
        return WRONG, f"undecodable answer: {e!r}"
    leaked = [name for name in call.forbidden_outputs if name in outputs]
    if leaked:
        return WRONG, f"forbidden outputs in the answer: {leaked}"
    if not np.allclose(scores, call.expected_scores, atol=1e-5, rtol=1e-4):
        return WRONG, f"scores {scores.ravel()[:3]} instead of {call.expected_scores.ravel()[:3]}"
    return CORRECT, ""


@dataclass
class Traffic:
    """Sends requests and keeps every outcome with its start and end time (time.monotonic())."""

    session: aiohttp.ClientSession
    base_url: str
    timeout_s: float = 30.0
    outcomes: list[Outcome] = field(default_factory=list)
    #: Sends fixed_rate() left out because max_in_flight requests were already waiting.
    skipped: int = 0

    async def call(self, call: ModelCall, base_url: str | None = None) -> Outcome:
        started = time.monotonic()
        url = f"{base_url or self.base_url}/v2/models/{call.model}/infer"
        try:
            async with self.session.post(url, data=call.body, headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
                body = await response.read()
                category, detail = judge(call, response.status, dict(response.headers), body)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            category, detail, status = OTHER, repr(e)[:200], 0
        outcome = Outcome(call.model, started, time.monotonic(), category, status, detail)
        self.outcomes.append(outcome)
        return outcome

    async def closed_loop(self, call: ModelCall, pause_s: float) -> None:
        """One request at a time to `call.model`, `pause_s` apart, until cancelled."""
        while True:
            await self.call(call)
            await asyncio.sleep(pause_s)

    async def fixed_rate(self, calls: list[ModelCall], rate: float, max_in_flight: int = 256) -> None:
        """`rate` requests per second in all, round robin over `calls`, each in its own task, until
        cancelled; an open loop, so a slow answer does not slow the sending down (bounded in flight)."""

        def skipped() -> None:
            self.skipped += 1

        await open_loop(lambda sent: self.call(calls[sent % len(calls)]), rate, max_in_flight=max_in_flight,
                        on_skip=skipped)


async def open_loop(send: Callable[[int], Awaitable[object]], rate: float, *, max_in_flight: int | None = None,
                on_skip: Callable[[], None] | None = None) -> None:
    """`send(n)` for n = 0, 1, 2, ... at `rate` per second, each in its own task, until cancelled:
    an open loop, so a slow answer does not slow the sending down. Past `max_in_flight` unanswered,
    a send is skipped (`on_skip`); the tasks still running are cancelled at the end."""
    interval, sent = 1.0 / rate, 0
    in_flight: set[asyncio.Task[object]] = set()
    start = time.monotonic()
    try:
        while True:
            if max_in_flight is None or len(in_flight) < max_in_flight:
                task = asyncio.create_task(send(sent))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            elif on_skip is not None:
                on_skip()
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * interval - time.monotonic()))
    finally:
        for task in list(in_flight):
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)


def count(outcomes: Iterable[Outcome], categories: Iterable[str] = CATEGORIES) -> dict[str, int]:
    counted = collections.Counter(o.category for o in outcomes)
    return {"sent": sum(counted.values()), **{c: counted.get(c, 0) for c in categories}}


def started_between(outcomes: Iterable[Outcome], start: float, end: float,
                    models: Iterable[str] | None = None) -> list[Outcome]:
    wanted = set(models) if models is not None else None
    return [o for o in outcomes if start <= o.started < end and (wanted is None or o.model in wanted)]


def correct_share(outcomes: list[Outcome]) -> float | None:
    return round(sum(o.category == CORRECT for o in outcomes) / len(outcomes), 4) if outcomes else None
