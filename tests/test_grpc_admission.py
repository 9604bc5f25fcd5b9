"""Admission on the gRPC port, against the real Triton and real faults: ModelInfer calls that come
while a model's weights turn NaN and it is healed are held through the heal (proxy.hold_during_heal_s)
and answered right after it, or refused UNAVAILABLE with the quarantine's reason and
`grpc-retry-pushback-ms`; calls that come while a failed round is being confirmed wait for its
verdict (proxy.hold_while_suspect_ms); a held call its client cancels frees its hold and is counted
CANCELLED; unpinned calls to a model whose newest version is broken are answered by the trusted one
(the fallback). On the Rust gRPC front (the default) not one
of them is handed to the Python gRPC server or enters the Python request chain."""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from bench.repository import credit_risk_scores
from sidecar.fronts.appkeys import SERVING, STATES
from sidecar.fronts.grpc_server import SERVICE
from sidecar.fronts.http_front import HttpFront
from sidecar.states import ModelState
from tests.harness import wait_for
from tests.proxy_support import PythonEntries, features, started_and_healthy, triton_counted, triton_successes
from tests.test_grpc import GRPC_FRONT, SyncStream, grpc_config
from tests.test_versions import _pinnable, _pins_served, two_versions  # noqa: F401 (a fixture)

pytestmark = pytest.mark.fault

ROWS = 4


def _request(model: str, seed: int) -> bytes:
    x = features(rows=ROWS, seed=seed)
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
    return pb.ModelInferRequest(model_name=model, inputs=[tensor],
                                raw_input_contents=[x.astype("<f4").tobytes()]).SerializeToString()


def _infer(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(f"/{SERVICE}/ModelInfer", response_deserializer=pb.ModelInferResponse.FromString)


def _scores(answer: pb.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(answer.raw_output_contents[[o.name for o in answer.outputs].index("scores")], "<f4")


class GrpcTraffic:
    """Clients sending the same ModelInfer in a loop over one channel each; every answer is kept as
    (when it ended, status code, trailing metadata, scores or None)."""

    def __init__(self, target: str, model: str, seed: int, clients: int = 3) -> None:
        self.target, self.payload = target, _request(model, seed)
        self.answers: list[tuple[float, grpc.StatusCode, dict[str, str], np.ndarray | None]] = []
        self._tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as channel:
            infer = _infer(channel)
            while True:
                call = infer(self.payload, timeout=60)
                try:
                    answer = await call
                except grpc.aio.AioRpcError as e:
                    self.answers.append((time.monotonic(), e.code(), dict(e.trailing_metadata() or ()), None))
                else:
                    self.answers.append((time.monotonic(), grpc.StatusCode.OK, {}, _scores(answer)))
                await asyncio.sleep(0.01)

    def ok_after(self, at: float) -> int:
        return sum(1 for ended, code, _, _ in self.answers if ended > at and code is grpc.StatusCode.OK)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _through_a_nan_heal(sidecar, fresh_model, target: str, seed: int) -> GrpcTraffic:  # type: ignore[no-untyped-def]
    """gRPC clients on the model while its weights turn NaN and it is healed, until ten correct
    answers came after the heal."""
    model = fresh_model.name
    traffic = GrpcTraffic(target, model, seed)
    await wait_for(lambda: len(traffic.answers) >= 10, 10, what="traffic flowing")
    fresh_model.inject("nan")
    broken = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 20, what="UNHEALTHY")
    healed = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=broken.at),
                            40, what="healed")
    await wait_for(lambda: traffic.ok_after(healed.at) >= 10, 10, what="correct answers after the heal")
    await traffic.stop()
    return traffic


def _count(traffic: GrpcTraffic, seed: int, *, allow_unavailable: bool) -> dict[str, int]:
    """Every answer is the right scores, a withheld NaN, or (allowed) the quarantine's refusal."""
    expected = credit_risk_scores(features(ROWS, seed=seed)).ravel()
    counts: dict[str, int] = {}
    for _, code, trailing, scores in traffic.answers:
        counts[code.name] = counts.get(code.name, 0) + 1
        if code is grpc.StatusCode.OK:
            assert scores is not None and np.all(np.isfinite(scores)), "a NaN answer reached a client"
            np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=1e-4, err_msg="a wrong answer")
        elif code is grpc.StatusCode.INTERNAL:
            assert trailing.get("x-sidecar-reason") == "non_finite_output", trailing
        elif code is grpc.StatusCode.UNAVAILABLE and allow_unavailable:
            assert trailing.get("x-sidecar-reason") == "quarantined", trailing
            assert trailing.get("grpc-retry-pushback-ms") == "5000", trailing  # Retry-After's 5 s
            assert trailing.get("x-request-id"), trailing
        else:
            raise AssertionError(f"unexpected answer {code.name}: {trailing}")
    return counts


async def _a_lane(sidecar, target: str, model: str) -> None:  # type: ignore[no-untyped-def]
    """On the Rust front: wait until ModelInfer to the model is served by the front itself."""
    front = sidecar.server
    if GRPC_FRONT != "rust":
        return
    assert isinstance(front, HttpFront)

    async def served() -> bool:
        before = front.grpc_served
        async with grpc.aio.insecure_channel(target) as channel:
            try:
                await channel.unary_unary(f"/{SERVICE}/ModelInfer")(_request(model, 0), timeout=10)
            except grpc.aio.AioRpcError:
                return False
        return front.grpc_served > before

    await wait_for(served, 10, what=f"{model} published as a lane")


async def test_grpc_calls_through_a_nan_heal_are_held_and_answered_right_after_it(triton, fresh_model, start):
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir, proxy={"hold_during_heal_s": 30})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    await _a_lane(sidecar, target, model)
    admission = sidecar.app[SERVING].admission
    holding: list[int] = []

    async def watch_holding() -> None:
        while True:
            holding.append(admission.holding[model])
            await asyncio.sleep(0.005)

    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    with PythonEntries(sidecar.app[SERVING]) as entries:
        watcher = asyncio.create_task(watch_holding())
        traffic = await _through_a_nan_heal(sidecar, fresh_model, target, seed=11)
        watcher.cancel()
    # Held, not refused: the only UNAVAILABLE allowed is a call that was already waiting at Triton
    # when the quarantine began (Admission._end_waiting ends those on both fronts, hold or not; how
    # many there are is a race with the passive signal, 0 on most runs).
    counts = _count(traffic, 11, allow_unavailable=True)
    ended = sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="ended_at_triton") or 0
    assert counts.get("UNAVAILABLE", 0) <= ended, (counts, ended)
    assert not sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="rejected"), counts
    assert counts.get("OK", 0) >= 20, counts
    assert max(holding) >= 1, "no call was held"
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="held_released") >= 1
    assert not admission.holding, admission.holding
    if GRPC_FRONT == "rust":
        assert sidecar.server.grpc_handovers == handovers, "a call was handed to the Python gRPC server"
        assert entries.count == 0, f"{entries.count} entries into the Python request chain"


async def test_a_grpc_client_that_leaves_while_held_frees_its_hold_and_is_counted_cancelled(
        triton, fresh_model, start):
    """A call held for a heal that does not come (healing off): its client cancels it, and the hold
    ends with it (Admission.holding back to zero, CANCELLED counted), long before the bound."""
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir, healing={"enabled": False},
                         proxy={"hold_during_heal_s": 60})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    await _a_lane(sidecar, target, model)
    fresh_model.inject("nan")
    await wait_for(lambda: sidecar.state(model) is ModelState.UNHEALTHY, 20, what="UNHEALTHY")
    admission = sidecar.app[SERVING].admission
    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    async with grpc.aio.insecure_channel(target) as channel:
        call = _infer(channel)(_request(model, 1), timeout=60)
        await wait_for(lambda: admission.holding[model] == 1, 10, what="the call held")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    await wait_for(lambda: not admission.holding, 5, what="the hold ended with its client")
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model=model,
                                          code="CANCELLED") == 1, 5, what="CANCELLED counted")
    assert not sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="held_timeout")
    if GRPC_FRONT == "rust":
        assert sidecar.server.grpc_handovers == handovers, "the call was handed to the Python gRPC server"


async def test_grpc_calls_to_a_quarantined_model_are_refused_unavailable_with_its_reason_and_pushback(
        triton, fresh_model, start):
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir)
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    await _a_lane(sidecar, target, model)
    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    with PythonEntries(sidecar.app[SERVING]) as entries:
        traffic = await _through_a_nan_heal(sidecar, fresh_model, target, seed=12)
    counts = _count(traffic, 12, allow_unavailable=True)
    assert counts.get("UNAVAILABLE", 0) >= 1 and counts.get("OK", 0) >= 20, counts
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="rejected") >= 1
    assert sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="grpc", model=model,
                          reason="quarantined") >= 1
    if GRPC_FRONT == "rust":
        assert sidecar.server.grpc_handovers == handovers, "a call was handed to the Python gRPC server"
        assert entries.count == 0, f"{entries.count} entries into the Python request chain"


async def test_grpc_calls_while_a_failed_round_is_confirmed_wait_for_its_verdict_and_are_served(
        triton, fresh_model, start):
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                         probes={"interval_s": 0.5, "timeout_s": 2.0, "failure_threshold": 2},
                         proxy={"hold_while_suspect_ms": 3000.0, "retry_after_s": 1})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    await _a_lane(sidecar, target, model)
    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    health = sidecar.app[STATES].get(model)
    with PythonEntries(sidecar.app[SERVING]) as entries:
        fresh_model.inject("blip")  # one wrong answer (the probe's), then a slow confirmation that passes
        await wait_for(lambda: health.suspect, 20, interval=0.002, what=f"{model} suspect")
        async with grpc.aio.insecure_channel(target) as channel:
            infer = _infer(channel)
            answers = await asyncio.gather(*(infer(_request(model, seed), timeout=20) for seed in range(4)))
    for seed, answer in enumerate(answers):
        expected = credit_risk_scores(features(ROWS, seed=seed)).ravel()
        np.testing.assert_allclose(_scores(answer), expected, atol=1e-5, rtol=1e-4)
    assert sidecar.metric("triton_sidecar_proxy_quarantined_total", model=model, outcome="suspect_released") >= 1
    assert sidecar.first_transition_to(model, ModelState.UNHEALTHY) is None
    if GRPC_FRONT == "rust":
        assert sidecar.server.grpc_handovers == handovers, "a call was handed to the Python gRPC server"
        assert entries.count == 0, f"{entries.count} entries into the Python request chain"


async def test_unpinned_grpc_calls_go_to_the_trusted_version_while_the_newest_is_broken(two_versions, start):  # noqa: F811
    model = two_versions.name
    config = grpc_config(two_versions.triton, models=[model], golden_dir=two_versions.golden_dir,
                         healing={"enabled": False})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    await _pins_served(sidecar, model)  # both versions' specs fetched (and on the front)
    two_versions.inject("2", "nan")
    await wait_for(lambda: sidecar.state(model) is ModelState.UNHEALTHY, 20, what="UNHEALTHY")
    front = sidecar.server
    assert isinstance(front, HttpFront)
    await wait_for(lambda: (model, False, True, "1") in front.lanes()[2] and _pinnable(sidecar, model) >= {"1"},
                   5, what="the fallback to version 1 on the front")
    expected = credit_risk_scores(features(ROWS, seed=5)).ravel()
    fallback_before = sidecar.metric("triton_sidecar_routed_total", model=model, version="1", reason="fallback") or 0
    on_1, on_2 = triton_successes(two_versions.triton, model, "1"), triton_successes(two_versions.triton, model, "2")
    handovers = front.grpc_handovers

    def request(version: str) -> bytes:
        message = pb.ModelInferRequest.FromString(_request(model, 5))
        message.model_version = version
        return message.SerializeToString()

    with PythonEntries(sidecar.app[SERVING]) as entries:
        async with grpc.aio.insecure_channel(target) as channel:
            infer = _infer(channel)
            for version in ("", "", "", "", "", "1"):
                answer = await infer(request(version), timeout=10)
                np.testing.assert_allclose(_scores(answer), expected, atol=1e-5, rtol=1e-4)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(request("2"), timeout=10)
    trailing = dict(refused.value.trailing_metadata() or ())
    assert (refused.value.code(), trailing.get("x-sidecar-reason")) == (grpc.StatusCode.UNAVAILABLE, "quarantined")
    assert "version 2" in (refused.value.details() or ""), refused.value.details()
    assert trailing.get("grpc-retry-pushback-ms") == "5000", trailing
    assert sidecar.metric("triton_sidecar_routed_total", model=model, version="1", reason="fallback") == (
        fallback_before + 5)
    assert await triton_counted(two_versions.triton, model, on_1 + 6, "1") - on_1 == 6
    assert triton_successes(two_versions.triton, model, "2") == on_2
    if GRPC_FRONT == "rust":
        assert front.grpc_handovers == handovers, "a call was handed to the Python gRPC server"
        assert entries.count == 0, f"{entries.count} entries into the Python request chain"


async def test_a_grpc_call_pinned_by_x_model_version_metadata_reaches_that_version(two_versions, start):  # noqa: F811
    """A pin by metadata is a pin as the message's model_version is (ServingCore.pinned): the call
    reaches that version (Triton's own count per version says so), is counted pinned, and on the
    Rust front is served there; message and metadata naming different versions is refused
    INVALID_ARGUMENT naming the metadata key, and Triton sees nothing of it."""
    model = two_versions.name
    config = grpc_config(two_versions.triton, models=[model], golden_dir=two_versions.golden_dir,
                         probes={"interval_s": 3600.0, "jitter": 0.0})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    await _pins_served(sidecar, model)
    front = sidecar.server
    expected = credit_risk_scores(features(ROWS, seed=3)).ravel()
    on = {v: triton_successes(two_versions.triton, model, v) for v in ("1", "2")}
    pinned = {v: sidecar.metric("triton_sidecar_routed_total", model=model, version=v, reason="pinned") or 0
              for v in ("1", "2")}
    handovers = front.grpc_handovers if isinstance(front, HttpFront) else 0
    with PythonEntries(sidecar.app[SERVING]) as entries:
        async with grpc.aio.insecure_channel(target) as channel:
            infer = _infer(channel)
            for version, times in (("1", 3), ("2", 2)):
                for _ in range(times):
                    answer = await infer(_request(model, 3), metadata=(("x-model-version", version),),
                                         timeout=10)
                    assert answer.model_version == version
                    np.testing.assert_allclose(_scores(answer), expected, atol=1e-5, rtol=1e-4)
            if isinstance(front, HttpFront) and GRPC_FRONT == "rust":
                assert front.grpc_handovers == handovers, "a pinned call was handed to the Python gRPC server"
                assert entries.count == 0, f"{entries.count} entries into the Python request chain"
            message = pb.ModelInferRequest.FromString(_request(model, 3))
            message.model_version = "1"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(message.SerializeToString(), metadata=(("x-model-version", "2"),), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert "x-model-version" in (refused.value.details() or ""), refused.value.details()
    # Triton counts an answer in its statistics a moment after sending it: polled, then exact.
    def served_since() -> dict[str, float]:
        return {v: triton_successes(two_versions.triton, model, v) - on[v] for v in on}

    await wait_for(lambda: served_since() == {"1": 3, "2": 2}, 5, what="3 answers from version 1, 2 from version 2")
    for version, times in (("1", 3), ("2", 2)):
        assert sidecar.metric("triton_sidecar_routed_total", model=model, version=version,
                              reason="pinned") == pinned[version] + times


async def test_a_grpc_stream_is_served_by_the_front_until_a_real_quarantine_ends_it_unavailable(
        triton, fresh_model, start):
    """ModelStreamInfer on the stream's model: answered request by request, a later request to an
    unknown model refused in-stream as the Python server refuses it, then the model's weights turn NaN:
    the NaN answers are withheld in-stream and the quarantine ends the stream UNAVAILABLE with its
    reason and pushback. On the Rust front the stream is never handed to the Python gRPC server and
    never enters the Python request chain."""
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir)
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    await _a_lane(sidecar, target, model)
    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    served = sidecar.server.grpc_served if GRPC_FRONT == "rust" else 0
    expected = credit_risk_scores(features(ROWS, seed=21)).ravel()
    request = pb.ModelInferRequest.FromString(_request(model, 21))
    stream = SyncStream(target)
    in_stream_errors: list[str] = []
    ended: grpc.RpcError | None = None
    with PythonEntries(sidecar.app[SERVING]) as entries:
        try:
            for i in range(3):
                request.id = f"before-{i}"
                answer = await asyncio.to_thread(stream.exchange, request)
                assert answer.infer_response.id == f"before-{i}" and not answer.error_message, answer
                np.testing.assert_allclose(_scores(answer.infer_response), expected, atol=1e-5, rtol=1e-4)
            unknown = pb.ModelInferRequest.FromString(_request("no_such_model", 21))
            refused = await asyncio.to_thread(stream.exchange, unknown)
            assert refused.error_message.startswith("[unknown_model] unknown model 'no_such_model'; served: "), refused
            fresh_model.inject("nan")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                answer = await asyncio.to_thread(stream.exchange, request)
                if answer.error_message:
                    in_stream_errors.append(answer.error_message)
                else:
                    np.testing.assert_allclose(_scores(answer.infer_response), expected, atol=1e-5, rtol=1e-4)
                await asyncio.sleep(0.02)
        except grpc.RpcError as e:
            ended = e
        finally:
            stream.close()
    assert ended is not None, "the stream outlived the quarantine"
    trailing = dict(ended.trailing_metadata() or ())
    assert ended.code() is grpc.StatusCode.UNAVAILABLE, (ended.code(), ended.details())
    assert trailing.get("x-sidecar-reason") == "quarantined" and trailing.get("grpc-retry-pushback-ms") == "5000"
    assert all(e.startswith("[non_finite_output]") for e in in_stream_errors), in_stream_errors
    await wait_for(lambda: sidecar.metric("triton_sidecar_stream_endings_total", model=model,
                                          outcome="quarantined") == 1, 5, what="the stream's ending counted")
    assert sidecar.metric("triton_sidecar_streams_in_flight", model=model) == 0
    assert sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model=model,
                          code="UNAVAILABLE") >= 1
    if GRPC_FRONT == "rust":
        assert sidecar.server.grpc_served == served + 1, "the stream was not served by the front"
        assert sidecar.server.grpc_handovers == handovers, "the stream was handed to the Python gRPC server"
        assert entries.count == 0, f"{entries.count} entries into the Python request chain"
