"""The serving core's own rules, in milliseconds: no Triton, no sockets. The upstream is a fake
exchange (the sidecar's logic is under test here, not Triton's); the gRPC codec functions run on
real protobuf messages from tritonclient's service_pb2."""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from sidecar.config import FilterRule, SidecarConfig
from sidecar.fronts.grpc_server import GrpcAnswer, decode_infer_request, screen_infer_response
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import OutputPolicy, Screened, ServingCore
from sidecar.serving.passive_signals import HealthEvents
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.telemetry import HTTP, RequestContext
from sidecar.serving.validation import ModelSpec, validate_decoded_request
from sidecar.states import ModelHealth, ModelStates

METADATA = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 1]},
                        {"name": "secret", "datatype": "FP32", "shape": [-1, 1]}]}
CONFIG = {"name": "m", "max_batch_size": 8, "input": [{"name": "x"}]}


@dataclass
class Recorder:
    """What the core asked of the rest of the sidecar."""

    fetched: list[tuple[str, str, str]] = field(default_factory=list)
    probes_asked: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    stubs_dead: list[str] = field(default_factory=list)


@dataclass
class FakeExchange:
    """A request in the v2 document shape; the answer is a dict of output name -> values."""

    doc: dict[str, Any]
    answer: dict[str, list[float]] | UpstreamFailure = field(default_factory=lambda: {"scores": [0.5], "secret": [1.0]})
    delay_s: float = 0.0
    sent: int = 0

    def validate(self, spec: ModelSpec) -> None:
        validate_decoded_request(spec, self.doc, b"")

    async def send(self, version: str = "") -> dict[str, list[float]]:
        self.sent += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if isinstance(self.answer, UpstreamFailure):
            raise self.answer
        return dict(self.answer)

    def screen(self, answer: dict[str, list[float]], policy: OutputPolicy) -> Screened[dict[str, list[float]]]:
        dropped = [name for name in answer if policy.is_hidden is not None and policy.is_hidden(name)]
        kept = {k: v for k, v in answer.items() if k not in dropped}
        non_finite = [k for k, v in kept.items() if policy.check_non_finite and not np.isfinite(v).all()]
        return Screened(kept, dropped=dropped, non_finite=non_finite)


def request(rows: int = 1, value: float = 0.25) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": [value] * (rows * 4)}]}


def build_core(**proxy: Any) -> tuple[ServingCore, ModelStates, Recorder, CollectorRegistry]:
    base = SidecarConfig()
    config = replace(base, models=("m",), proxy=replace(base.proxy, **{"passive_failure_threshold": 2, **proxy}),
                     filtering=replace(base.filtering, rules=(FilterRule(model="m", drop_outputs=("secret",)),)))
    states = ModelStates(failure_threshold=1, success_threshold=1, clock=lambda: 0.0)
    recorder = Recorder()
    registry = CollectorRegistry()

    async def fetch(model: str, version: str, what: str) -> tuple[int, bytes]:
        recorder.fetched.append((model, version, what))
        return 200, json.dumps(METADATA if what == "metadata" else CONFIG).encode()

    core = ServingCore(config, states=states, metrics=SidecarMetrics(registry), fetch_document=fetch,
                       cases_for=lambda model: (),
                       events=HealthEvents(probe_soon=lambda model, cause: recorder.probes_asked.append(model),
                                           stub_dead=recorder.stubs_dead.append,
                                           triton_unreachable=recorder.unreachable.append))
    states.track("m")
    return core, states, recorder, registry


def make_healthy(states: ModelStates) -> None:
    states.apply("m", ModelHealth.probe_passed)


async def serve(core: ServingCore, exchange: FakeExchange, model: str = "m") -> dict[str, list[float]]:
    core.resolve(RequestContext(HTTP, "r1", ""), model)
    return await core.infer(model, "", exchange)


async def test_a_healthy_model_answers_with_hidden_outputs_removed_and_counted() -> None:
    core, states, recorder, registry = build_core()
    make_healthy(states)
    answer = await serve(core, FakeExchange(request()))
    assert answer == {"scores": [0.5]}
    assert registry.get_sample_value("triton_sidecar_outputs_filtered_total", {"model": "m", "output": "secret"}) == 1
    # The spec is fetched once, not per request.
    await serve(core, FakeExchange(request()))
    assert recorder.fetched == [("m", "", "metadata"), ("m", "", "config")]


@pytest.mark.parametrize("state_change", ["never probed", "quarantined"])
async def test_an_untrusted_model_is_refused_before_anything_is_sent(state_change: str) -> None:
    core, states, _, _ = build_core()
    if state_change == "quarantined":
        make_healthy(states)
        states.apply("m", lambda h, now: h.probe_failed("golden case broke", now))
    exchange = FakeExchange(request())
    with pytest.raises(Refusal) as refused:
        await serve(core, exchange)
    expected = Reason.QUARANTINED if state_change == "quarantined" else Reason.NOT_VERIFIED
    assert refused.value.reason is expected and refused.value.retry_after == core.settings.retry_after_s
    assert (refused.value.status, expected.grpc_code) == (503, "UNAVAILABLE")
    assert exchange.sent == 0


async def test_unguarded_models_and_bad_versions_are_refused_by_name() -> None:
    core, _, _, _ = build_core()
    with pytest.raises(Refusal) as unknown:
        core.resolve(RequestContext(HTTP, "r1", ""), "other")
    assert unknown.value.reason is Reason.UNKNOWN_MODEL and "'other'" in unknown.value.message
    with pytest.raises(Refusal) as version:
        core.resolve(RequestContext(HTTP, "r1", ""), "m", "latest")
    assert version.value.reason is Reason.UNKNOWN_MODEL and "latest" in version.value.message


@pytest.mark.parametrize(("doc", "reason", "words"), [
    ({"inputs": [{"name": "y", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}]}, Reason.UNKNOWN_INPUT, "'y'"),
    ({"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 4], "data": [0] * 4}]}, Reason.DATATYPE, "FP32"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [0.0] * 3}]}, Reason.SHAPE, "x"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [9, 4], "data": [0.0] * 36}]}, Reason.SHAPE, "batch"),
    (request(value=float("inf")), Reason.NON_FINITE, "x"),
    ({**request(), "outputs": [{"name": "secret"}]}, Reason.FILTERED_OUTPUT, "secret"),
])
async def test_bad_requests_are_refused_with_a_reason_and_never_sent(doc: dict[str, Any], reason: Reason,
                                                                     words: str) -> None:
    core, states, _, _ = build_core()
    make_healthy(states)
    exchange = FakeExchange(doc)
    with pytest.raises(Refusal) as refused:
        await serve(core, exchange)
    assert refused.value.reason is reason and words in refused.value.message, refused.value.message
    assert refused.value.before_triton and exchange.sent == 0


async def test_a_non_finite_answer_is_withheld_and_the_model_re_checked() -> None:
    core, states, recorder, _ = build_core()
    make_healthy(states)
    with pytest.raises(Refusal) as withheld:
        await serve(core, FakeExchange(request(), answer={"scores": [float("nan")], "secret": [1.0]}))
    assert withheld.value.reason is Reason.NON_FINITE_OUTPUT and not withheld.value.before_triton
    assert recorder.probes_asked == ["m"]
    # A hidden output is dropped before it is judged: NaN there is nobody's answer.
    assert await serve(core, FakeExchange(request(), answer={"scores": [1.0], "secret": [float("nan")]})) == {
        "scores": [1.0]}


async def test_upstream_failures_map_to_one_refusal_each_and_repeated_ones_ask_for_a_probe() -> None:
    core, states, recorder, _ = build_core()
    make_healthy(states)
    expected = {FailureKind.UNREACHABLE: (Reason.TRITON_UNREACHABLE, 503, "UNAVAILABLE"),
                FailureKind.TIMEOUT: (Reason.TRITON_TIMEOUT, 504, "DEADLINE_EXCEEDED"),
                FailureKind.SERVER_ERROR: (Reason.TRITON_ERROR, 502, "INTERNAL"),
                FailureKind.DROPPED: (Reason.TRITON_BAD_ANSWER, 502, "INTERNAL")}
    for kind, (reason, status, code) in expected.items():
        with pytest.raises(Refusal) as refused:
            await serve(core, FakeExchange(request(), answer=UpstreamFailure(kind, "boom", status=500)))
        assert (refused.value.reason, refused.value.status, refused.value.reason.grpc_code) == (reason, status, code)
    assert recorder.unreachable and "boom" in recorder.unreachable[0]
    # Threshold 2: three failures that count (timeout, server error, dropped) ask for one probe.
    assert recorder.probes_asked == ["m"]
    assert recorder.stubs_dead == []
    # Triton's typed verdict that the stub died reaches the healer (it need not wait for the unload).
    with pytest.raises(Refusal):
        await serve(core, FakeExchange(request(), answer=UpstreamFailure(FailureKind.SERVER_ERROR, "Stub process "
                                                                         "'m_0_0' is not healthy.", status=500,
                                                                         stub_dead=True)))
    assert recorder.stubs_dead == ["m"]


async def test_a_full_breaker_refuses_with_overloaded() -> None:
    core, states, _, _ = build_core(max_in_flight_per_model=1, queue_size_per_model=0)
    make_healthy(states)
    slow = asyncio.create_task(serve(core, FakeExchange(request(), delay_s=0.2)))
    await asyncio.sleep(0.01)  # let the slow one take the only slot
    with pytest.raises(Refusal) as refused:
        await serve(core, FakeExchange(request()))
    assert refused.value.reason is Reason.OVERLOADED and refused.value.reason.grpc_code == "RESOURCE_EXHAUSTED"
    assert await slow == {"scores": [0.5]}


def test_every_reason_names_a_real_http_status_and_grpc_code() -> None:
    labels = [r.value for r in Reason]
    assert len(labels) == len(set(labels))
    for reason in Reason:
        assert 400 <= reason.http_status <= 599, reason
        assert isinstance(getattr(grpc.StatusCode, reason.grpc_code), grpc.StatusCode), reason


def test_grpc_requests_decode_to_the_documents_http_checks() -> None:
    typed = pb.ModelInferRequest(model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[1, 4], contents=pb.InferTensorContents(fp32_contents=[1, 2, 3, 4]))])
    doc, binary = decode_infer_request(typed)
    assert doc["inputs"] == [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]
    assert binary == b""
    text = pb.ModelInferRequest(model_name="t", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="s", datatype="BYTES", shape=[2], contents=pb.InferTensorContents(bytes_contents=[b"ab", b""]))])
    doc, binary = decode_infer_request(text)
    assert binary == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)
    assert doc["inputs"][0]["parameters"] == {"binary_data_size": len(binary)}
    mixed = pb.ModelInferRequest(model_name="m", inputs=[typed.inputs[0], typed.inputs[0]],
                                 raw_input_contents=[b"\0" * 16])
    with pytest.raises(Refusal) as refused:
        decode_infer_request(mixed)
    assert refused.value.reason is Reason.SCHEMA and "raw_input_contents" in refused.value.message


def test_grpc_answers_lose_hidden_outputs_with_their_raw_contents() -> None:
    response = pb.ModelInferResponse(model_name="m", outputs=[
        pb.ModelInferResponse.InferOutputTensor(name="secret", datatype="FP32", shape=[1]),
        pb.ModelInferResponse.InferOutputTensor(name="scores", datatype="FP32", shape=[1])],
        raw_output_contents=[np.float32([7]).tobytes(), np.float32([np.nan]).tobytes()])
    screened = screen_infer_response(GrpcAnswer(response.SerializeToString()),
                                     OutputPolicy(lambda name: name == "secret", True))
    kept = pb.ModelInferResponse.FromString(screened.answer.payload)
    assert [o.name for o in kept.outputs] == ["scores"] and len(kept.raw_output_contents) == 1
    assert screened.dropped == ["secret"] and screened.non_finite == ["scores"]
    untouched = screen_infer_response(GrpcAnswer(b"as sent"), OutputPolicy(None, False))
    assert untouched.answer.payload == b"as sent"


class FakeStream:
    """Triton's side of a stream: as many one-event reads as the test lets out, forever."""

    def __init__(self) -> None:
        self.reads = 0
        self.closed = False

    async def open(self) -> bool:
        return True

    async def receive(self) -> list[bytes]:
        self.reads += 1
        await asyncio.sleep(0)
        return [b"event %d" % self.reads]

    def screen(self, event: bytes, policy_for: Any) -> None:
        return None

    def in_stream(self, refusal: Refusal, verdict: Any) -> None:
        return None

    def silence_bound(self, events: int) -> float:
        return 30.0

    def close(self) -> None:
        self.closed = True


async def test_a_slow_client_stops_the_stream_s_reads_and_a_quarantine_ends_it_at_once() -> None:
    from sidecar.serving.streaming import QUEUE_BATCHES

    core, states, _, registry = build_core()
    make_healthy(states)
    upstream = FakeStream()
    async with core.stream(upstream, started=0.0) as stream:
        await stream.join("m", "", lambda spec: None)
        assert await stream.open()
        assert registry.get_sample_value("triton_sidecar_streams_in_flight", {"model": "m"}) == 1
        # The client reads nothing: the pump stops once the queue is full, instead of buffering for ever.
        for _ in range(QUEUE_BATCHES * 3):
            await asyncio.sleep(0)
        assert upstream.reads == QUEUE_BATCHES
        assert await stream.__anext__() == [b"event 1"]
        for _ in range(10):
            await asyncio.sleep(0)
        assert upstream.reads == QUEUE_BATCHES + 1  # one taken, one more read: back-pressure, not a stop
        states.apply("m", lambda h, now: h.probe_failed("golden case broke", now))
        for _ in range(5):  # the alarm's waiter runs within a few loop turns: no event is read meanwhile
            await asyncio.sleep(0)
        assert upstream.reads == QUEUE_BATCHES + 1
        # Queued events from the now untrusted model are dropped: the stream ends at once.
        assert [batch async for batch in stream] == []
        assert stream.ending is not None and stream.ending.reason is Reason.QUARANTINED
    assert upstream.closed
    assert registry.get_sample_value("triton_sidecar_streams_in_flight", {"model": "m"}) == 0
    assert registry.get_sample_value("triton_sidecar_stream_endings_total",
                                     {"model": "m", "outcome": "quarantined"}) == 1
    assert core.breaker("m")._slots._value == core.settings.max_in_flight_per_model  # the slot came back
