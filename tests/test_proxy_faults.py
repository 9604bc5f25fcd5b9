"""The proxy while things break for real: quarantine during a heal under concurrent traffic, passive
signals from traffic, hung models, and a Triton that goes away."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import aiohttp
import numpy as np
import pytest
from structlog.testing import capture_logs

from sidecar.fronts.appkeys import SERVING, STATES, WATCH
from sidecar.fronts.http_front import HttpFront
from sidecar.states import ModelState
from tests.harness import wait_for
from tests.proxy_support import (
    PythonEntries,
    credit_json,
    proxy_config,
    served_by_front,
    served_like_production,
    started_and_healthy,
)

pytestmark = pytest.mark.fault


def _infer_path(model: str) -> str:
    return f"/v2/models/{model}/infer"


async def _direct_scores(triton, model: str, body: dict) -> np.ndarray:  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.post(triton.url + _infer_path(model), json=body) as r:
        assert r.status == 200
        doc = await r.json()
    return np.array(next(o["data"] for o in doc["outputs"] if o["name"] == "scores"))


class Traffic:
    """Clients sending the same request in a loop; every answer is kept with its status and headers."""

    def __init__(self, sidecar, model: str, body: dict, clients: int = 4) -> None:  # type: ignore[no-untyped-def]
        self.sidecar, self.path, self.body = sidecar, _infer_path(model), body
        self.answers: list[tuple[float, int, dict, dict]] = []
        self._tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.post(self.sidecar.url + self.path, json=self.body) as r:
                    self.answers.append((time.monotonic(), r.status, dict(r.headers), await r.json()))
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _check_answers(answers, expected: np.ndarray, *, allow_503: bool) -> dict[int, int]:  # type: ignore[no-untyped-def]
    counts: dict[int, int] = {}
    for _, status, headers, doc in answers:
        counts[status] = counts.get(status, 0) + 1
        if status == 200:
            scores = np.array(next(o["data"] for o in doc["outputs"] if o["name"] == "scores"))
            assert np.all(np.isfinite(scores)), "a NaN answer reached a client"
            assert np.allclose(scores, expected, atol=1e-6), "a wrong answer reached a client"
        elif status == 502:
            assert doc["reason"] == "non_finite_output", doc
        elif status == 503 and allow_503:
            assert doc["reason"] == "quarantined" and int(headers["Retry-After"]) == 5, doc
        else:
            raise AssertionError(f"unexpected answer {status}: {doc}")
    return counts


async def _traffic_through_a_nan_heal(sidecar, triton, fresh_model, seed: int) -> tuple[list, np.ndarray]:  # type: ignore[no-untyped-def]
    """Concurrent clients on the model while its weights turn NaN and it is healed; every answer, and
    the correct scores."""
    model = fresh_model.name
    body = credit_json(rows=4, seed=seed)
    expected = await _direct_scores(triton, model, body)
    traffic = Traffic(sidecar, model, body)
    await wait_for(lambda: len(traffic.answers) >= 10, 10, what="traffic flowing")
    fresh_model.inject("nan")
    broken = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 20, what="UNHEALTHY")
    healed = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=broken.at),
                            40, what="healed")
    await wait_for(lambda: sum(1 for a in traffic.answers if a[0] > healed.at and a[1] == 200) >= 10, 10,
                   what="correct answers after the heal")
    await traffic.stop()
    return traffic.answers, expected


async def test_quarantine_during_a_real_heal_never_lets_a_nan_through(triton, fresh_model, start):
    model = fresh_model.name
    sidecar = await started_and_healthy(start, proxy_config(triton, models=[model],
                                                            golden_dir=fresh_model.golden_dir))
    answers, expected = await _traffic_through_a_nan_heal(sidecar, triton, fresh_model, seed=7)
    counts = _check_answers(answers, expected, allow_503=True)
    assert counts.get(503, 0) >= 1, counts
    assert counts.get(200, 0) >= 20, counts
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="rejected") >= 1


async def test_holding_requests_during_a_heal_turns_errors_into_latency(triton, fresh_model, start):
    model = fresh_model.name
    sidecar = await started_and_healthy(start, proxy_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                                                            proxy={"hold_during_heal_s": 30}))
    answers, expected = await _traffic_through_a_nan_heal(sidecar, triton, fresh_model, seed=8)
    counts = _check_answers(answers, expected, allow_503=False)  # no 503 at all
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="held_released") >= 1
    # Held requests were answered after the heal, correctly (checked above), not refused.
    assert counts.get(200, 0) >= 20


async def test_requests_held_during_a_heal_are_held_and_served_by_the_front_without_python(
        triton, fresh_model, start):
    """The same heal on the Rust front: its admission holds the requests that come while the model
    is quarantined and healed (Admission.holding counts them), they are answered after the heal with
    the right scores, and not one of them is handed to the Python app or enters its chain."""
    model = fresh_model.name
    config = proxy_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                          proxy={"hold_during_heal_s": 30})
    sidecar = await started_and_healthy(start, replace(config, listen=replace(config.listen, front="rust")))
    front = sidecar.server
    assert isinstance(front, HttpFront)
    await served_by_front(front, model, 5, settled=False)
    admission = sidecar.app[SERVING].admission
    holding: list[int] = []

    async def watch_holding() -> None:
        while True:
            holding.append(admission.holding[model])
            await asyncio.sleep(0.005)

    handovers = front.handovers
    with PythonEntries(sidecar.app[SERVING]) as entries:
        watcher = asyncio.create_task(watch_holding())
        answers, expected = await _traffic_through_a_nan_heal(sidecar, triton, fresh_model, seed=9)
        watcher.cancel()
    counts = _check_answers(answers, expected, allow_503=False)  # no 503 at all
    assert counts.get(200, 0) >= 20, counts
    assert max(holding) >= 1, "no request was held by the front"
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="held_released") >= 1
    assert front.handovers == handovers, f"{front.handovers - handovers} requests handed to the Python app"
    assert entries.count == 0, f"{entries.count} entries into the Python request chain"
    assert not admission.holding, admission.holding


async def test_a_client_that_leaves_while_held_by_the_front_frees_its_hold_and_is_counted_499(
        triton, fresh_model, start):
    """A request held for a heal that does not come (healing off): its client gives up, and the
    front's hold ends with it (Admission.holding back to zero, 499 counted), long before the bound."""
    model = fresh_model.name
    config = proxy_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                          healing={"enabled": False}, proxy={"hold_during_heal_s": 60})
    sidecar = await started_and_healthy(start, replace(config, listen=replace(config.listen, front="rust")))
    front = sidecar.server
    assert isinstance(front, HttpFront)
    await served_by_front(front, model, 5, settled=False)
    fresh_model.inject("nan")
    await wait_for(lambda: sidecar.state(model) is ModelState.UNHEALTHY, 20, what="UNHEALTHY")
    admission = sidecar.app[SERVING].admission
    handovers = front.handovers

    async def post() -> None:
        async with aiohttp.ClientSession() as s, s.post(sidecar.url + _infer_path(model), json=credit_json()) as r:
            await r.read()

    held = asyncio.create_task(post())
    await wait_for(lambda: admission.holding[model] == 1, 10, what="the request held by the front")
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    await wait_for(lambda: not admission.holding, 5, what="the hold ended with its client")
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http", model=model,
                                          code="499") == 1, 5, what="499 counted")
    assert front.handovers == handovers
    assert not sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="held_timeout")


@pytest.mark.parametrize("fault", ["nan", "kill_stub"])
async def test_passive_signals_detect_a_fault_long_before_the_probe_interval(fault, triton, fresh_model, start):
    model = fresh_model.name
    interval = 30.0
    sidecar = await started_and_healthy(start, proxy_config(
        triton, models=[model], golden_dir=fresh_model.golden_dir,
        # Probes give up before Triton reports a dead stub (1 s), as they do behind queued requests
        # under load: only clients' answers carry Triton's diagnosis.
        probes={"interval_s": interval, "jitter": 0.0, "failure_threshold": 2, "timeout_s": 0.8},
        healing={"unload_timeout_s": 10.0}))
    await asyncio.sleep(0)  # the first round is done; the next is due in 30 s
    traffic = Traffic(sidecar, model, credit_json(rows=2), clients=2)
    await wait_for(lambda: len(traffic.answers) >= 5, 10, what="traffic flowing")
    injected_at = time.monotonic()
    if fault == "nan":
        fresh_model.inject("nan")
    else:
        fresh_model.kill_stub()
    detected = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 10,
                              what="UNHEALTHY thanks to traffic")
    await traffic.stop()
    # A NaN answer is a signal at once; a killed stub takes Triton itself a few seconds to report.
    bound = 5.0 if fault == "nan" else interval / 3
    assert detected.at - injected_at < bound, f"detected after {detected.at - injected_at:.1f} s"
    bad = [a for a in traffic.answers if a[1] != 200]
    reasons = {a[3].get("reason") for a in bad}
    assert reasons <= {"non_finite_output", "triton_error", "quarantined"}, reasons
    assert ("non_finite_output" if fault == "nan" else "triton_error") in reasons
    if fault != "nan":
        # Clients' answers carried Triton's "Stub process ... is not healthy": the healer loads at once
        # instead of waiting unload_timeout_s (10 s) for an instance that never finishes unloading.
        await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=detected.at), 30,
                       what="healed")
        assert sidecar.metric("triton_sidecar_heal_duration_seconds_sum", model=model) < 8.0


async def test_a_hung_model_gets_504_the_breaker_sheds_load_and_gone_clients_free_their_slot(
        triton, fresh_model, start):
    model = fresh_model.name
    sidecar = await started_and_healthy(start, proxy_config(
        triton, models=[model], golden_dir=fresh_model.golden_dir,
        probes={"interval_s": 3600, "jitter": 0.0},
        proxy={"upstream_timeout_s": 2.0, "max_in_flight_per_model": 1, "queue_size_per_model": 1}))
    fresh_model.inject("hang")
    url = sidecar.url + _infer_path(model)
    data = json.dumps(credit_json()).encode()

    async def post(timeout: float = 30) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.post(url, data=data, timeout=aiohttp.ClientTimeout(timeout)) as r:
            return r.status, await r.json()

    first = asyncio.create_task(post())
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_in_flight", model=model) == 1, 5, what="in flight")
    queued = asyncio.create_task(post())
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_queued", model=model) == 1, 5,
                   what="one request queued")
    started = time.monotonic()
    status, doc = await post()
    assert (status, doc["reason"]) == (503, "overloaded") and time.monotonic() - started < 1.0
    status, doc = await first
    assert (status, doc["reason"]) == (504, "triton_timeout")
    status, doc = await queued
    assert (status, doc["reason"]) == (504, "triton_timeout")

    # A client that gives up cancels its upstream call: the slot is free long before the 2 s bound.
    with pytest.raises(asyncio.TimeoutError):
        await post(timeout=0.3)
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_in_flight", model=model) == 0, 1.0,
                   what="in-flight back to 0 after the client left")
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_requests_total",
                          protocol="http", model=model, code="499") == 1, 1.0,
                   what="499 counted")

    # A queued client that gives up leaves the queue at once: its place is not kept, so later
    # requests are not refused as overloaded by clients long gone.
    holder = asyncio.create_task(post(timeout=10))
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_in_flight", model=model) == 1, 5, what="in flight")
    gone = asyncio.create_task(post(timeout=1.0))
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_queued", model=model) == 1, 1.0, what="queued")
    with pytest.raises(asyncio.TimeoutError):
        await gone
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_queued", model=model) == 0, 1.0,
                   what="the queue place freed after the client left")
    status, doc = await holder
    assert (status, doc["reason"]) == (504, "triton_timeout")


async def test_a_client_that_leaves_cancels_its_upstream_call_when_served_like_production(triton, fresh_model):
    model = fresh_model.name
    config = proxy_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                          probes={"interval_s": 3600, "jitter": 0.0}, proxy={"upstream_timeout_s": 30.0})
    async with served_like_production(config) as (app, registry, url):
        await wait_for(lambda: app[STATES].get(model).state is ModelState.HEALTHY, 20, what="HEALTHY")
        fresh_model.inject("hang")
        with capture_logs() as logs:
            async with aiohttp.ClientSession() as s:
                with pytest.raises(asyncio.TimeoutError):
                    async with s.post(url + _infer_path(model), json=credit_json(),
                                      timeout=aiohttp.ClientTimeout(0.3)):
                        pass
            # Freed within the poll period, not after the 30 s upstream bound.
            await wait_for(lambda: registry.get_sample_value("triton_sidecar_proxy_requests_total",
                                                             {"protocol": "http", "model": model,
                                                              "code": "499"}) == 1, 2.0,
                           what="499 counted")
            # The Rust front counts at once and hands the log line to Python's loop just after.
            await wait_for(lambda: any(e["event"] == "client_disconnected" and e["model"] == model for e in logs),
                           2.0, what="client_disconnected logged")
        assert registry.get_sample_value("triton_sidecar_proxy_in_flight", {"model": model}) == 0


async def test_triton_down_answers_503_and_readiness_drops_at_once(own_triton, start):
    sidecar = await started_and_healthy(start, proxy_config(own_triton, models=["credit_risk"],
                                                            probes={"interval_s": 3600, "jitter": 0.0}))
    async with aiohttp.ClientSession() as s:
        async with s.post(sidecar.url + "/v2/models/credit_risk/infer", json=credit_json()) as r:
            assert r.status == 200
        own_triton.kill()
        async with s.post(sidecar.url + "/v2/models/credit_risk/infer", json=credit_json()) as r:
            doc = await r.json()
            assert r.status == 503 and doc["reason"] == "triton_unreachable" and r.headers["Retry-After"] == "5"
        assert sidecar.app[WATCH].ready is False
        async with s.get(sidecar.url + "/v2/health/ready") as r:
            assert r.status == 503
        async with s.get(sidecar.url + "/readyz") as r:
            assert r.status == 503
