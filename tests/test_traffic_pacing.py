"""Golden rounds paced by traffic as well as by time (issue 35, `probes.every_requests`), against the
real Triton: a round starts once the model has served N live requests since its last round began,
none starts without traffic beyond the time schedule, `probes.min_interval_s` holds under a burst,
and a drifted model is quarantined within about N requests however long the interval is."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from bench.repository import credit_risk_scores
from sidecar.states import ModelState
from tests.harness import GOLDEN, looked_after, sidecar_config, wait_for
from tests.proxy_support import credit_json, features

MODEL = "credit_risk"
#: Long enough that no round of the time schedule falls inside a test that counts traffic rounds.
LONG_INTERVAL_S = 60.0


def _paced(triton, every: int, *, interval_s: float = LONG_INTERVAL_S, min_interval_s: float = 0.05,  # type: ignore[no-untyped-def]
           model: str = MODEL, golden_dir=GOLDEN):  # type: ignore[no-untyped-def]
    # jitter 0: the first round runs at once, so the count starts from a known round.
    return sidecar_config(triton, models=[model], golden_dir=golden_dir,
                          probes={"interval_s": interval_s, "jitter": 0.0, "every_requests": every,
                                  "min_interval_s": min_interval_s})


def _rounds(sidecar, cause: str, model: str = MODEL) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("triton_sidecar_probe_rounds_total", model=model, cause=cause) or 0.0


async def _infer(sidecar, model: str = MODEL, seed: int = 0) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    async with sidecar.session.post(f"{sidecar.url}/v2/models/{model}/infer", json=credit_json(seed=seed)) as answer:
        return answer.status, await answer.json()


async def _first_round_done(sidecar, model: str = MODEL) -> None:  # type: ignore[no-untyped-def]
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    assert _rounds(sidecar, "time", model) == 1 and _rounds(sidecar, "traffic", model) == 0


async def test_a_round_starts_once_the_model_has_served_n_requests_since_the_last_one_began(triton, start):
    every = 20
    sidecar = await start(_paced(triton, every))
    await _first_round_done(sidecar)

    for i in range(every - 1):
        status, body = await _infer(sidecar, seed=i)
        assert status == 200, body
        # Fewer than N requests since the last round began: no round for traffic yet.
        assert _rounds(sidecar, "traffic") == 0, f"a traffic round started after {i + 1} requests"
    await looked_after(sidecar, time.monotonic(), MODEL)
    assert _rounds(sidecar, "traffic") == 0, f"a traffic round started after {every - 1} requests"
    status, _ = await _infer(sidecar, seed=every)
    assert status == 200

    await wait_for(lambda: _rounds(sidecar, "traffic") == 1, 2, interval=0.005, what="a round paced by traffic")

    async def second_round_recorded() -> dict | None:
        _, state = await sidecar.get("/status")
        return state["models"][MODEL] if state["models"][MODEL]["probe_rounds"] == 2 else None

    model = await wait_for(second_round_recorded, 5, what="the traffic round recorded")
    assert model["last_round_cause"] == "traffic" and model["requests_since_round"] == 0, model
    assert model["state"] == "HEALTHY" and _rounds(sidecar, "time") == 1


async def test_without_traffic_rounds_keep_the_time_schedule(triton, start):
    interval_s = 0.3
    sidecar = await start(_paced(triton, 5, interval_s=interval_s))
    await _first_round_done(sidecar)
    began = time.monotonic()

    await wait_for(lambda: _rounds(sidecar, "time") >= 5, 10, what="four more rounds of the time schedule")
    elapsed = time.monotonic() - began
    assert _rounds(sidecar, "traffic") == 0
    assert _rounds(sidecar, "time") <= 1 + elapsed / interval_s + 1, "more rounds than the time schedule gives"
    _, state = await sidecar.get("/status")
    assert state["models"][MODEL]["last_round_cause"] == "time"
    assert state["models"][MODEL]["requests_since_round"] == 0


async def test_the_floor_holds_under_a_burst(triton, start):
    """N = 1: every request would ask for a round; probes.min_interval_s (0.2 s) decides."""
    floor_s = 0.2
    sidecar = await start(_paced(triton, 1, min_interval_s=floor_s))
    await _first_round_done(sidecar)
    stop = asyncio.Event()
    served = 0

    async def client(seed: int) -> None:
        nonlocal served
        while not stop.is_set():
            status, body = await _infer(sidecar, seed=seed)
            assert status == 200, body
            served += 1

    clients = [asyncio.create_task(client(seed)) for seed in range(4)]
    began = time.monotonic()
    try:
        await wait_for(lambda: _rounds(sidecar, "traffic") >= 8, 20, interval=0.01, what="eight traffic rounds")
    finally:
        stop.set()
        await asyncio.gather(*clients)
    elapsed = time.monotonic() - began
    rounds = _rounds(sidecar, "traffic")
    # Traffic asked for a round every request (hundreds a second); the floor allows one per 0.2 s.
    assert served > 10 * rounds, (served, rounds)
    assert rounds <= elapsed / floor_s + 1, f"{rounds:.0f} traffic rounds in {elapsed:.2f} s with a {floor_s} s floor"
    assert _rounds(sidecar, "time") == 1


@pytest.mark.fault
async def test_a_drifted_model_is_quarantined_within_about_n_requests_with_a_long_interval(
        triton, fresh_model, start):
    every = 25
    model = fresh_model.name
    sidecar = await start(_paced(triton, every, model=model, golden_dir=fresh_model.golden_dir))
    await _first_round_done(sidecar, model)

    fresh_model.inject("drift")
    wrong = 0
    for i in range(20 * every):
        status, body = await _infer(sidecar, model, seed=i)
        if status == 503:
            break
        assert status == 200, body
        scores = np.asarray(next(o for o in body["outputs"] if o["name"] == "scores")["data"], dtype=np.float32)
        if not np.allclose(scores, credit_risk_scores(features(1, seed=i)).ravel(), atol=1e-5, rtol=1e-4):
            wrong += 1
    else:
        pytest.fail(f"still served after {20 * every} requests")
    # N since the last round began, plus those served while the supervisor's next look at the count
    # was due (aimed from the rate it saw, at most 0.1 s late) and while the failing round and its
    # confirmation ran: 51 was seen once on a loaded machine. Time alone (60 s) would serve them all.
    assert 0 < wrong <= 4 * every, f"{wrong} wrong answers served with every_requests {every}"
    assert _rounds(sidecar, "traffic", model) >= 1 and _rounds(sidecar, "time", model) == 1
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 30, what=f"{model} healed")
