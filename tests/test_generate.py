"""Generative models through the sidecar, against a real Triton: generate_stream relayed event by
event, bodies checked before Triton, faults in the middle of a stream, golden text cases that
quarantine and heal a model that answers wrong text or stalls."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.app.factory import apply_config
from sidecar.devtools.tritonserver import LocalTriton
from sidecar.fronts.appkeys import LIVE, SERVING, STATES
from sidecar.fronts.http_front import HttpFront
from sidecar.states import ModelState
from tests.harness import FAULTY_TEXT_TEMPLATE, SLACK_S, FreshModel, sidecar_config, wait_for
from tests.proxy_support import PythonEntries, served_by_front

#: 20 words at the model's 10 ms per word: about 200 ms from the first event to the last.
WORDS = " ".join(f"w{i}" for i in range(20))
IDLE_S = 0.5


@pytest.fixture
def text_model(triton: LocalTriton, tmp_path: Path) -> Iterator[FreshModel]:
    model = FreshModel.create(triton, tmp_path, prefix="text", template=FAULTY_TEXT_TEMPLATE, golden_from="text_echo")
    yield model
    model.remove()


def _config(triton: LocalTriton, model: FreshModel, **sections: dict) -> Any:
    generation = {"idle_timeout_s": IDLE_S, "max_tokens": 64, **sections.pop("generation", {})}
    return sidecar_config(triton, models=[model.name], golden_dir=model.golden_dir, generation=generation,
                          **sections)


async def _healthy(sidecar: Any, model: str) -> None:
    """HEALTHY, and on the Rust front published as a lane: until its spec is fetched the model's
    requests go to the Python chain, whose breaker is not the front's (a test of the breaker or of
    what the front serves would race that hand-over)."""
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 30, what=f"{model} HEALTHY")
    await served_by_front(sidecar.server, model)


async def read_stream(url: str, body: dict[str, Any], *, limit_s: float = 15.0
                      ) -> tuple[int, list[tuple[float, dict[str, Any]]], dict[str, str]]:
    """(status, [(seconds since the request, event)], headers) of one generate_stream call, read
    event by event as a client would; a stream that does not end within limit_s fails the test."""
    events: list[tuple[float, dict[str, Any]]] = []
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        async with asyncio.timeout(limit_s):
            async with session.post(url, json=body) as response:
                if response.status != 200 or not response.content_type.startswith("text/event-stream"):
                    return response.status, [(0.0, await response.json(content_type=None))], dict(response.headers)
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        assert event.startswith(b"data: "), event
                        events.append((time.perf_counter() - started, json.loads(event[6:])))
                return response.status, events, dict(response.headers)


def _text(events: list[tuple[float, dict[str, Any]]]) -> str:
    return "".join(e.get("text_output", "") for _, e in events)


def triton_success_count(triton: LocalTriton, model: str) -> tuple[int, int]:
    """Triton's own counters for the model: (successful, failed) requests."""
    with urllib.request.urlopen(f"{triton.url}/v2/models/{model}/stats", timeout=10) as response:
        stats = json.loads(response.read())["model_stats"][0]["inference_stats"]
    return stats["success"]["count"], stats["fail"]["count"]


async def test_events_reach_the_client_as_triton_sends_them_and_the_text_equals_triton_s(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    sidecar = await start(_config(triton, text_model))
    await _healthy(sidecar, text_model.name)
    path = f"/v2/models/{text_model.name}/generate_stream"
    body = {"text_input": WORDS, "max_tokens": 20}

    status, events, headers = await read_stream(sidecar.url + path, body)
    _, direct, _ = await read_stream(triton.url + path, body)

    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert len(events) == 20 and _text(events) == _text(direct) == WORDS
    first, last = events[0][0], events[-1][0]
    # 19 gaps of 10 ms at the model: buffered answers would arrive all at once, at the end.
    assert last - first > 0.12, f"events arrived together ({first:.3f} s, {last:.3f} s): buffered"
    assert first < (last - first), "the first event came late: it waited for others"
    assert [e for _, e in events] == [e for _, e in direct], "events must be passed on unchanged"
    assert sidecar.metric("triton_sidecar_stream_first_event_seconds_count", model=text_model.name) == 1
    assert sidecar.metric("triton_sidecar_stream_events_sum", model=text_model.name) == 20
    assert sidecar.metric("triton_sidecar_stream_inter_event_seconds_count", model=text_model.name) == 19
    assert sidecar.metric("triton_sidecar_streams_in_flight", model=text_model.name) == 0
    assert sidecar.metric("triton_sidecar_stream_endings_total", model=text_model.name, outcome="complete") == 1


#: (body, reason, field): each refused with 400 naming the field.
BAD_BODIES = [
    ({"text_input": "a", "temprature": 0}, "unknown_field", "temprature"),
    ({"text_input": 5}, "datatype", "text_input"),
    ({"text_input": "a", "max_tokens": 65}, "too_many_tokens", "max_tokens"),
    ({"text_input": "a", "parameters": {"max_tokens": 1000}}, "too_many_tokens", "parameters.max_tokens"),
    ({"text_input": "a", "max_tokens": "8"}, "datatype", "max_tokens"),
    ({"text_input": "x" * 2000}, "bytes_element_too_long", "text_input"),
    ({"max_tokens": 3}, "missing_input", "text_input"),
    ({"text_input": ["a", "b"]}, "shape", "text_input"),
    ({"text_input": "a", "temperature": {"x": 1}}, "parameter", "temperature"),
]


async def test_bad_bodies_are_refused_naming_the_field_and_never_reach_triton(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    # One probe round only (interval 30 s): from then on Triton's counters move only for traffic.
    sidecar = await start(_config(triton, text_model, validation={"max_bytes_element": 1024},
                                  probes={"interval_s": 30}))
    await _healthy(sidecar, text_model.name)
    before = triton_success_count(triton, text_model.name)
    for body, reason, field in BAD_BODIES:
        for endpoint in ("generate_stream", "generate"):
            url = f"{sidecar.url}/v2/models/{text_model.name}/{endpoint}"
            async with sidecar.session.post(url, json=body) as r:
                answer = await r.json()
            assert r.status == 400, (body, answer)
            assert (answer["reason"], answer["field"], answer["model"]) == (reason, field, text_model.name), answer
    assert triton_success_count(triton, text_model.name) == before, "a refused body reached Triton"


async def test_generate_on_a_streaming_model_is_an_error_status_not_a_200(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    sidecar = await start(_config(triton, text_model))
    await _healthy(sidecar, text_model.name)
    url = f"{sidecar.url}/v2/models/{text_model.name}/generate"
    async with sidecar.session.post(url, json={"text_input": "alpha beta"}) as response:
        answer = await response.json()
    assert response.status == 400 and answer["reason"] == "streaming_model", answer
    assert "generate_stream" in answer["error"]
    async with sidecar.session.post(url, json={"text_input": "alpha"}) as response:
        one = await response.json()
    assert response.status == 200 and one["text_output"] == "alpha"


async def test_hidden_outputs_are_removed_from_every_event(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    rules = ({"model": "text_.*", "drop_outputs": ("logprob",)},)
    from sidecar.config import FilterRule
    sidecar = await start(_config(triton, text_model, filtering={"rules": tuple(FilterRule(**r) for r in rules)}))
    await _healthy(sidecar, text_model.name)
    status, events, _ = await read_stream(f"{sidecar.url}/v2/models/{text_model.name}/generate_stream",
                                          {"text_input": "a b c"})
    assert status == 200 and _text(events) == "a b c"
    assert all("logprob" not in e for _, e in events), events
    assert sidecar.metric("triton_sidecar_outputs_filtered_total", model=text_model.name, output="logprob") == 3


async def test_a_nan_event_is_withheld_and_ends_the_stream_with_an_error_event(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    sidecar = await start(_config(triton, text_model, probes={"interval_s": 30}))
    await _healthy(sidecar, text_model.name)
    text_model.inject("nan")
    url = f"{sidecar.url}/v2/models/{text_model.name}/generate_stream"

    async def ends_with_nan_error() -> bool:
        status, events, _ = await read_stream(url, {"text_input": "a b c"})
        return status == 200 and events[-1][1].get("reason") == "non_finite_output"

    await wait_for(ends_with_nan_error, 10, what="a stream ending with non_finite_output")
    _, events, _ = await read_stream(url, {"text_input": "a b c"})
    assert all("logprob" not in e or e.get("reason") for _, e in events)
    assert events[-1][1]["outputs"] == ["logprob"] and "error" in events[-1][1]


async def test_a_stub_killed_mid_stream_ends_the_client_s_stream_with_an_error_event(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    sidecar = await start(_config(triton, text_model, probes={"interval_s": 30}))
    await _healthy(sidecar, text_model.name)
    url = f"{sidecar.url}/v2/models/{text_model.name}/generate_stream"
    events: list[dict[str, Any]] = []
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, asyncio.timeout(IDLE_S + 10):
        async with session.post(url, json={"text_input": " ".join(f"w{i}" for i in range(60)),
                                           "max_tokens": 60}) as response:
            assert response.status == 200
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    events.append(json.loads(event[6:]))
                    if len(events) == 2:
                        text_model.kill_stub()
    # Triton itself leaves such a stream open forever; the sidecar's idle timeout ends it.
    assert events[-1].get("reason") == "stream_idle", events[-1]
    assert 2 <= len(events) - 1 < 60
    assert time.monotonic() - started < IDLE_S + SLACK_S + 2
    assert sidecar.metric("triton_sidecar_streams_in_flight", model=text_model.name) == 0


async def test_a_dead_stub_before_a_stream_is_a_502_and_a_passive_signal(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    sidecar = await start(_config(triton, text_model, probes={"interval_s": 30},
                                  proxy={"passive_failure_threshold": 1}))
    await _healthy(sidecar, text_model.name)
    text_model.kill_stub()
    url = f"{sidecar.url}/v2/models/{text_model.name}/generate_stream"

    async def refused_as_server_fault() -> Any:
        status, events, _ = await read_stream(url, {"text_input": "alpha"})
        return events[0][1] if status == 502 else None

    # Triton itself answers this with a 400 ("Stub process ... is not healthy"): a server fault,
    # not the client's; it brings the next probe round forward (probes are 30 s apart here).
    answer = await wait_for(refused_as_server_fault, 10, what="a 502 for the dead stub")
    assert answer["reason"] == "triton_error" and "not healthy" in answer["error"], answer
    # The round judges the model at once: DEGRADED, or UNHEALTHY when Triton's own verdict on the
    # stub makes the failure final (issue 34's fault scope: the model's own fault, healed by reload).
    judged = await wait_for(lambda: sidecar.first_transition_to(text_model.name, ModelState.DEGRADED,
                                                                ModelState.UNHEALTHY), 10,
                            what="the probe round the passive signal brought forward")
    assert "not healthy" in judged.cause


async def test_a_client_that_leaves_mid_stream_frees_its_stream(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    sidecar = await start(_config(triton, text_model))
    await _healthy(sidecar, text_model.name)
    url = f"{sidecar.url}/v2/models/{text_model.name}/generate_stream"
    async with aiohttp.ClientSession() as session:
        response = await session.post(url, json={"text_input": " ".join(["w"] * 60), "max_tokens": 60})
        await response.content.readuntil(b"\n\n")
        assert sidecar.metric("triton_sidecar_streams_in_flight", model=text_model.name) == 1
        response.close()
    await wait_for(lambda: sidecar.metric("triton_sidecar_streams_in_flight", model=text_model.name) == 0, 5,
                   what="the stream to be freed")
    await wait_for(lambda: sidecar.metric("triton_sidecar_stream_endings_total", model=text_model.name,
                                          outcome="client_disconnected") == 1, 5, what="the ending counted")


async def test_an_open_generate_stream_holds_its_model_s_breaker_slot(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    # One slot and no queue: while a stream is open, a second one (and a unary generate) is refused.
    sidecar = await start(_config(triton, text_model, proxy={"max_in_flight_per_model": 1,
                                                             "queue_size_per_model": 0}))
    await _healthy(sidecar, text_model.name)
    base = f"{sidecar.url}/v2/models/{text_model.name}"
    async with aiohttp.ClientSession() as session:
        first = await session.post(f"{base}/generate_stream", json={"text_input": " ".join(["w"] * 60),
                                                                    "max_tokens": 60})
        await first.content.readuntil(b"\n\n")  # begun: the slot is held from here to its end
        for endpoint in ("generate_stream", "generate"):
            async with session.post(f"{base}/{endpoint}", json={"text_input": "a b", "max_tokens": 2}) as second:
                assert second.status == 503, endpoint
                assert (await second.json())["reason"] == "overloaded", endpoint
        first.close()
    await wait_for(lambda: sidecar.metric("triton_sidecar_streams_in_flight", model=text_model.name) == 0, 5,
                   what="the stream's slot freed")
    status, events, _ = await read_stream(f"{base}/generate_stream", {"text_input": "a b", "max_tokens": 2})
    assert status == 200 and events, "the slot came back"


@pytest.mark.parametrize("fault", ["wrong", "stall"])
async def test_wrong_text_or_a_stall_is_caught_by_the_golden_case_quarantined_and_healed(
    triton: LocalTriton, text_model: FreshModel, start: Any, fault: str
) -> None:
    sidecar = await start(_config(triton, text_model))
    await _healthy(sidecar, text_model.name)
    url = f"{sidecar.url}/v2/models/{text_model.name}/generate_stream"
    faulted = time.monotonic()
    text_model.inject(fault)

    quarantined = await wait_for(lambda: sidecar.first_transition_to(
        text_model.name, ModelState.UNHEALTHY, ModelState.HEALING, after=faulted), 20, what="quarantine")
    # wrong: "text_output expected 'alpha beta', got 'ahpla ateb'"; stall: the stream never ends
    assert ("expected 'alpha beta'" if fault == "wrong" else "no answer within") in quarantined.cause, (
        quarantined.cause)
    await wait_for(lambda: sidecar.first_transition_to(text_model.name, ModelState.HEALTHY, after=quarantined.at),
                   40, what="healed")
    status, events, _ = await read_stream(url, {"text_input": "alpha beta"})
    assert status == 200 and _text(events) == "alpha beta"


async def test_a_quarantined_model_answers_503_with_retry_after_before_any_stream(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    sidecar = await start(_config(triton, text_model, healing={"enabled": False}))
    await _healthy(sidecar, text_model.name)
    text_model.inject("wrong")
    await wait_for(lambda: sidecar.state(text_model.name) is ModelState.UNHEALTHY, 20, what="UNHEALTHY")
    status, events, headers = await read_stream(f"{sidecar.url}/v2/models/{text_model.name}/generate_stream",
                                                {"text_input": "alpha beta"})
    assert status == 503 and events[0][1]["reason"] == "quarantined"
    assert headers["Retry-After"] == "5"


async def test_a_stream_held_during_a_heal_streams_the_healed_text_without_python(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    """With proxy.hold_during_heal_s, a generate_stream that comes while its model is quarantined for
    wrong text waits for the heal, then streams the right text; on the Rust front it is held and
    relayed by the front itself: no hand-over to the Python app, no entry into its chain."""
    model = text_model.name
    sidecar = await start(_config(triton, text_model, proxy={"hold_during_heal_s": 30}))
    await _healthy(sidecar, model)
    front = sidecar.server
    text_model.inject("wrong")
    quarantined = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 20,
                                 what="quarantined")
    handovers = front.handovers if isinstance(front, HttpFront) else 0
    admission = sidecar.app[SERVING].admission
    url = f"{sidecar.url}/v2/models/{model}/generate_stream"
    with PythonEntries(sidecar.app[SERVING]) as entries:
        stream = asyncio.create_task(read_stream(url, {"text_input": "alpha beta"}, limit_s=40))
        await wait_for(lambda: admission.holding[model] == 1, 10, interval=0.002, what="the stream held")
        status, events, _ = await stream
    healed = sidecar.first_transition_to(model, ModelState.HEALTHY, after=quarantined.at)
    assert healed is not None, "answered before the heal"
    assert status == 200 and _text(events) == "alpha beta", events
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="held_released") == 1
    assert not admission.holding, admission.holding
    if isinstance(front, HttpFront):
        assert front.handovers == handovers, f"{front.handovers - handovers} requests handed to the Python app"
        assert entries.count == 0, f"{entries.count} entries into the Python request chain"


async def test_a_stream_open_when_its_model_is_quarantined_ends_at_once_with_an_error_event(
    triton: LocalTriton, text_model: FreshModel, start: Any
) -> None:
    # A stalled stream (its model hangs after the first event) would wait out the idle timeout
    # (30 s here); the quarantine its golden case brings ends it as soon as it begins.
    sidecar = await start(_config(triton, text_model, healing={"enabled": False},
                                  generation={"idle_timeout_s": 30.0}))
    await _healthy(sidecar, text_model.name)
    text_model.inject("stall")
    url = f"{sidecar.url}/v2/models/{text_model.name}/generate_stream"
    stream = asyncio.create_task(read_stream(url, {"text_input": WORDS}, limit_s=25))
    quarantined = await wait_for(lambda: sidecar.first_transition_to(text_model.name, ModelState.UNHEALTHY), 20,
                                 what="UNHEALTHY")
    status, events, _ = await stream
    ended_at = time.monotonic()
    assert status == 200 and events[0][1]["text_output"] == "w0", events
    assert events[-1][1]["reason"] == "quarantined", events[-1]
    assert ended_at - quarantined.at < 2.0, ended_at - quarantined.at


async def test_a_stream_open_to_a_model_the_sidecar_stops_guarding_ends_with_its_unknown_model_event(
        triton, text_model, start):
    """Released mid-stream (taken out of `models`): the stream's last event says so, with the words a
    new request to the model is refused with, and it ends there instead of running on unguarded."""
    config = _config(triton, text_model)
    sidecar = await start(config)
    model = text_model.name
    await _healthy(sidecar, model)
    long_text = " ".join(f"w{i}" for i in range(400))  # 400 words at 10 ms: 4 s unless ended
    stream = asyncio.ensure_future(read_stream(f"{sidecar.url}/v2/models/{model}/generate_stream",
                                               {"text_input": long_text}))
    await wait_for(lambda: sidecar.metric("triton_sidecar_streams_in_flight", model=model) == 1, 5,
                   what="the stream open")
    # What a reload of the config does: the live config swapped, then handed to every part.
    without = replace(config, models=("credit_risk",))
    sidecar.app[LIVE].config = without
    apply_config(sidecar.app, without)
    await wait_for(lambda: model not in sidecar.app[STATES], 10, what=f"{model} released")
    status, events, _ = await stream
    assert status == 200
    last = json.dumps(events[-1][1])
    assert f"model {model} is no longer guarded by the sidecar (released)" in last, events[-1]
    assert "unknown_model" in last, events[-1]
    assert len(_text(events[:-1]).split()) < 400, "the stream ran to its end unguarded"
