"""The gRPC front in front of the real shared Triton, driven with tritonclient.grpc and grpc.aio:
answers equal Triton's own, filtered outputs never leave, the control API is closed, bad tensors
never reach Triton, streams pass each response as it comes, the health service answers (on the Rust
front without Python, Watch following a real quarantine) and, on the Rust front, server reflection
describes every service."""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np
import pytest
import structlog
import structlog.testing
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from sidecar.app.factory import apply_config
from sidecar.config import FilterRule
from sidecar.devtools import grpc_descriptors
from sidecar.devtools.tritonserver import free_port
from sidecar.fronts.appkeys import LIFECYCLE, LIVE, STATES
from sidecar.fronts.grpc_server import CONTROL, SERVICE
from sidecar.states import ModelState
from tests.harness import REPO, TEST_GRPC_FRONT, triton_post, wait_for
from tests.proxy_support import CREDIT_RULE, features, proxy_config, started_and_healthy, triton_successes

DECOUPLED = "decoupled_counter"

#: Which front serves listen.grpc_port in this run: the data plane's by default; make test runs
#: these modules again with SIDECAR_TEST_GRPC_FRONT=python (grpcio alone, while it exists).
GRPC_FRONT = TEST_GRPC_FRONT
rust_front_only = pytest.mark.skipif(GRPC_FRONT != "rust", reason="the data plane's gRPC front only "
                                     "(this run: SIDECAR_TEST_GRPC_FRONT=python or the Python listener)")
DECOUPLED_RULE = FilterRule(model=DECOUPLED, drop_outputs=("SECRET",))


def grpc_config(triton, **kwargs):  # type: ignore[no-untyped-def]
    config = proxy_config(triton, **kwargs)
    return replace(config, listen=replace(config.listen, grpc_port=free_port()))


@pytest.fixture
async def grpc_sidecar(triton, start):  # type: ignore[no-untyped-def]
    config = grpc_config(triton)
    # Statistics are served by default; these tests deny them as the control API is denied.
    config = replace(config, proxy=replace(config.proxy, allow_statistics=False))
    sidecar = await started_and_healthy(start, config)
    sidecar.grpc = f"127.0.0.1:{config.listen.grpc_port}"
    return sidecar


def _infer_inputs(x: np.ndarray) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor]


async def _raw_call(target: str, method: str, payload: bytes, metadata=()):  # type: ignore[no-untyped-def]
    """One unary RPC with raw bytes: (status code, details, trailing metadata, answer). Async: the
    sidecar under test runs on this very event loop."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=10, metadata=metadata)
        try:
            answer = await call
            return grpc.StatusCode.OK, "", dict(await call.trailing_metadata() or ()), answer
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), dict(e.trailing_metadata() or ()), b""


def _infer_request(model: str, inputs: list[pb.ModelInferRequest.InferInputTensor], raw: list[bytes] = (),
                   outputs: list[str] = ()) -> bytes:  # type: ignore[assignment]
    request = pb.ModelInferRequest(model_name=model, inputs=inputs, raw_input_contents=list(raw),
                                   outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=o) for o in outputs])
    return request.SerializeToString()


def _tensor(name: str, datatype: str, shape: list[int], **contents) -> pb.ModelInferRequest.InferInputTensor:  # type: ignore[no-untyped-def]
    return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape,
                                                 contents=pb.InferTensorContents(**contents))


async def test_proxied_answers_equal_direct_and_filtered_outputs_never_leave(triton, grpc_sidecar):
    direct = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.ports.grpc}")
    proxied = grpcclient_aio.InferenceServerClient(grpc_sidecar.grpc)
    x = features(rows=3, seed=11)
    want = direct.infer("credit_risk", _infer_inputs(x))
    got = await proxied.infer("credit_risk", _infer_inputs(x))
    assert np.array_equal(got.as_numpy("scores"), want.as_numpy("scores"))
    assert want.as_numpy("income_prob") is not None and got.as_numpy("income_prob") is None
    assert [o.name for o in got.get_response().outputs] == ["scores"]
    # A model without rules: Triton's answer, value for value.
    image = np.random.default_rng(3).uniform(0, 1, (2, 3, 32, 32)).astype(np.float32)
    tensor = grpcclient.InferInput("image", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    assert np.array_equal((await proxied.infer("image_classifier", [tensor])).as_numpy("class_scores"),
                          direct.infer("image_classifier", [tensor]).as_numpy("class_scores"))
    # Asking for a filtered output by name is refused; metadata and config never show it.
    with pytest.raises(InferenceServerException) as refused:
        await proxied.infer("credit_risk", _infer_inputs(x), outputs=[grpcclient.InferRequestedOutput("income_prob")])
    assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
    metadata = await proxied.get_model_metadata("credit_risk", as_json=True)
    assert [o["name"] for o in metadata["outputs"]] == ["scores"]
    config = await proxied.get_model_config("credit_risk", as_json=True)
    assert [o["name"] for o in config["config"]["output"]] == ["scores"]
    assert "income_prob" in [o["name"] for o in direct.get_model_metadata("credit_risk", as_json=True)["outputs"]]
    assert await proxied.is_server_live() and await proxied.is_server_ready()
    assert await proxied.is_model_ready("credit_risk")
    extensions = (await proxied.get_server_metadata(as_json=True))["extensions"]
    assert "model_repository" not in extensions and "system_shared_memory" not in extensions
    with pytest.raises(InferenceServerException) as unknown:
        await proxied.infer("no_such_model", _infer_inputs(x))
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    await proxied.close()
    assert grpc_sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="credit_risk",
                               code="OK") >= 1
    assert grpc_sidecar.metric("triton_sidecar_outputs_filtered_total", model="credit_risk", output="income_prob") >= 1


async def test_every_control_rpc_is_denied_and_the_model_stays_loaded(triton, grpc_sidecar):
    for method in CONTROL:
        code, details, trailing, _ = await _raw_call(grpc_sidecar.grpc, method, b"")
        assert code is grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
        assert trailing["x-sidecar-reason"] == "forbidden_endpoint"
    async with grpcclient_aio.InferenceServerClient(grpc_sidecar.grpc) as proxied:
        with pytest.raises(InferenceServerException) as refused:
            await proxied.unload_model("credit_risk")
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException):
            await proxied.get_model_repository_index()
        with pytest.raises(InferenceServerException):
            await proxied.get_inference_statistics("credit_risk")  # proxy.allow_statistics is off
    assert grpcclient.InferenceServerClient(f"127.0.0.1:{triton.ports.grpc}").is_model_ready("credit_risk")


BAD_REQUESTS = [
    ("unknown input", [_tensor("nope", "FP32", [1, 128], fp32_contents=[0.5] * 128)], [], "INVALID_ARGUMENT",
     "unknown_input"),
    ("wrong datatype", [_tensor("features", "FP64", [1, 128], fp64_contents=[0.5] * 128)], [], "INVALID_ARGUMENT",
     "datatype"),
    ("wrong shape", [_tensor("features", "FP32", [1, 64], fp32_contents=[0.5] * 64)], [], "INVALID_ARGUMENT", "shape"),
    ("typed count short", [_tensor("features", "FP32", [1, 128], fp32_contents=[0.5] * 100)], [], "INVALID_ARGUMENT",
     "shape"),
    ("typed NaN", [_tensor("features", "FP32", [1, 128], fp32_contents=[float("nan")] * 128)], [],
     "INVALID_ARGUMENT", "non_finite"),
    ("raw size", [pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[1, 128])],
     [b"\0" * 100], "INVALID_ARGUMENT", "shape"),
    ("raw NaN", [pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[1, 128])],
     [np.full(128, np.inf, dtype="<f4").tobytes()], "INVALID_ARGUMENT", "non_finite"),
    ("batch too large", [pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[65, 128])],
     [np.zeros((65, 128), dtype="<f4").tobytes()], "INVALID_ARGUMENT", "shape"),
]


@pytest.mark.parametrize(("case", "inputs", "raw", "code", "reason"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_tensors_are_refused_with_the_http_reason_and_never_reach_triton(
        triton, grpc_sidecar, case, inputs, raw, code, reason):
    before = triton_successes(triton, "credit_risk")
    request = _infer_request("credit_risk", inputs, raw)
    got, details, trailing, _ = await _raw_call(grpc_sidecar.grpc, "ModelInfer", request)
    assert (got.name, trailing.get("x-sidecar-reason")) == (code, reason), details
    assert "input" in details or "features" in details or "nope" in details
    assert triton_successes(triton, "credit_risk") == before, "a refused request reached Triton"


async def test_shared_memory_and_garbage_are_refused(triton, grpc_sidecar):
    shm = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[1, 128])
    shm.parameters["shared_memory_region"].string_param = "region0"
    code, _, trailing, _ = await _raw_call(grpc_sidecar.grpc, "ModelInfer", _infer_request("credit_risk", [shm]))
    assert (code, trailing["x-sidecar-reason"]) == (grpc.StatusCode.PERMISSION_DENIED, "shared_memory")
    code, _, trailing, _ = await _raw_call(grpc_sidecar.grpc, "ModelInfer", b"\xff\xff not protobuf")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and trailing["x-sidecar-reason"] == "malformed"


#: Check's words for a name that is neither "" nor a guarded model, whichever front answers.
UNKNOWN_SERVICE = "unknown service 'no_such_model': '' (the pod) or a guarded model's name"


async def test_the_health_service_answers_for_the_pod_and_each_model(grpc_sidecar):
    async with grpc.aio.insecure_channel(grpc_sidecar.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "credit_risk", "image_classifier"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="no_such_model"), timeout=5)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
        assert unknown.value.details() == UNKNOWN_SERVICE
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        first = await asyncio.wait_for(watch.read(), 5)
        watch.cancel()
        assert first.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def decoupled(triton):  # type: ignore[no-untyped-def]
    """The decoupled test model loaded into the shared Triton for this module, with a golden case
    (HTTP /infer refuses decoupled models: the probe expects exactly that refusal)."""
    shutil.copytree(REPO / "tests" / "models" / DECOUPLED, triton.model_repository / DECOUPLED, dirs_exist_ok=True)
    status, body = triton_post(triton, f"/v2/repository/models/{DECOUPLED}/load")
    assert status == 200, body
    yield DECOUPLED
    triton_post(triton, f"/v2/repository/models/{DECOUPLED}/unload")


@pytest.fixture
def decoupled_golden(tmp_path: Path) -> Path:
    root = tmp_path / "golden"
    (root / DECOUPLED).mkdir(parents=True)
    (root / DECOUPLED / "refused_over_http.json").write_text(
        '{"request": {"inputs": [{"name": "COUNT", "shape": [1], "datatype": "INT32", "data": [1]}]},'
        ' "expect": {"status": 501, "error_contains": "decoupled"}}')
    return root


async def _stream(target: str, count: int) -> list[tuple[float, object, object]]:
    """Send one request to the decoupled model on a stream; (arrival time, result, error) per response.

    Read to Triton's empty final response before closing: Triton 2.51 never releases a decoupled
    request whose stream the client closed between its last data response and that final flag,
    and the model then never finishes unloading (seen with and without the sidecar)."""
    client = grpcclient_aio.InferenceServerClient(target)
    tensor = grpcclient_aio.InferInput("COUNT", [1], "INT32")
    tensor.set_data_from_numpy(np.array([count], dtype=np.int32))

    async def requests():  # type: ignore[no-untyped-def]
        yield {"model_name": DECOUPLED, "inputs": [tensor], "enable_empty_final_response": True}

    got = []
    try:
        async for result, error in client.stream_infer(requests()):
            final = result is not None and result.get_response().parameters["triton_final_response"].bool_param
            if final:
                break
            got.append((time.monotonic(), result, error))
    finally:
        await client.close()
    return got


async def test_a_stream_passes_each_response_as_it_comes_and_screens_it(triton, decoupled, decoupled_golden, start):
    config = grpc_config(triton, models=[DECOUPLED], golden_dir=decoupled_golden, rules=(CREDIT_RULE, DECOUPLED_RULE))
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    direct = await _stream(f"127.0.0.1:{triton.ports.grpc}", 6)
    proxied = await _stream(target, 6)
    assert [r.as_numpy("VALUE").tolist() for _, r, _ in proxied] == [r.as_numpy("VALUE").tolist() for _, r, _ in direct]
    assert [r.as_numpy("VALUE")[0] for _, r, _ in proxied] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert all(r.as_numpy("SECRET") is None for _, r, _ in proxied)
    assert all(r.as_numpy("SECRET") is not None for _, r, _ in direct)
    # 50 ms between responses inside the model: the first reached the client long before the last.
    assert proxied[-1][0] - proxied[0][0] >= 0.2
    # NaN answers are withheld one by one, as in-stream errors the client can read.
    withheld = await _stream(target, 103)
    assert len(withheld) == 3 and all(r is None and "non_finite_output" in str(e) for _, r, e in withheld), withheld
    # SECRET dropped from all nine responses, the withheld ones included (hidden before judged).
    assert sidecar.metric("triton_sidecar_outputs_filtered_total", model=DECOUPLED, output="SECRET") == 9


async def test_concurrent_grpc_clients_during_a_real_nan_heal_never_receive_nan(triton, fresh_model, start):
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                         rules=(FilterRule(model=model, drop_outputs=("income_prob",)),))
    sidecar = await started_and_healthy(start, config)
    x = features(rows=4, seed=5)
    expected = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.ports.grpc}").infer(
        model, _infer_inputs(x)).as_numpy("scores")
    answers: list[tuple[float, str, object]] = []
    stop = asyncio.Event()

    async def client() -> None:
        async with grpcclient_aio.InferenceServerClient(f"127.0.0.1:{config.listen.grpc_port}") as c:
            while not stop.is_set():
                try:
                    result = await c.infer(model, _infer_inputs(x))
                    answers.append((time.monotonic(), "OK", result.as_numpy("scores")))
                except InferenceServerException as e:
                    answers.append((time.monotonic(), str(e.status()), e.message()))
                    await asyncio.sleep(0.01)

    clients = [asyncio.create_task(client()) for _ in range(4)]
    try:
        await wait_for(lambda: len(answers) >= 20, 10, what="traffic flowing")
        fresh_model.inject("nan")
        broken = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 20, what="UNHEALTHY")
        healed = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=broken.at),
                                40, what="healed")
        await wait_for(lambda: sum(1 for t, code, _ in answers if t > healed.at and code == "OK") >= 10, 10,
                       what="correct answers after the heal")
    finally:
        stop.set()
        await asyncio.gather(*clients)
    codes = {code for _, code, _ in answers}
    assert codes <= {"OK", "StatusCode.INTERNAL", "StatusCode.UNAVAILABLE"}, codes
    assert "StatusCode.UNAVAILABLE" in codes, "no request met the quarantine"
    for _, code, value in answers:
        if code == "OK":
            assert np.all(np.isfinite(value)) and np.allclose(value, expected, atol=1e-6)
        elif code == "StatusCode.INTERNAL":
            assert "NaN" in value or "Stub" in value or "Triton" in value, value


def _stream_call(channel: grpc.aio.Channel, metadata=()):  # type: ignore[no-untyped-def]
    return channel.stream_stream(f"/{SERVICE}/ModelStreamInfer",
                                 request_serializer=pb.ModelInferRequest.SerializeToString,
                                 response_deserializer=pb.ModelStreamInferResponse.FromString)(metadata=metadata)


class SyncStream:
    """A ModelStreamInfer call on grpcio's synchronous client, for tests whose stream the sidecar ends
    while the client may be writing: grpc.aio's client then replaces the server's status with
    INTERNAL "Internal error from Core" (grpc/grpc#36066), the synchronous one reports it. Call
    `exchange` through asyncio.to_thread: the sidecar under test runs on this test's event loop."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self._requests: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
        call = self.channel.stream_stream(f"/{SERVICE}/ModelStreamInfer",
                                          request_serializer=pb.ModelInferRequest.SerializeToString,
                                          response_deserializer=pb.ModelStreamInferResponse.FromString)
        # The call's deadline bounds a test that goes wrong: a read never waits longer.
        self._responses = call(iter(self._requests.get, None), timeout=60)

    def exchange(self, request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
        """Write one request and read the next response; grpc.RpcError (with the server's status
        and trailing metadata) once the stream has ended."""
        self._requests.put(request)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()


def _credit_request(model: str, x: np.ndarray, request_id: str = "") -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
    return pb.ModelInferRequest(model_name=model, id=request_id, inputs=[tensor],
                                raw_input_contents=[x.astype("<f4").tobytes()])


async def test_a_quarantine_that_begins_mid_stream_ends_the_stream_unavailable(triton, fresh_model, start):
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir)
    sidecar = await started_and_healthy(start, config)
    x = features(rows=2, seed=9)
    values: list[np.ndarray] = []
    in_stream_errors: list[str] = []
    stream = SyncStream(f"127.0.0.1:{config.listen.grpc_port}")
    ended: grpc.RpcError | None = None
    try:
        for i in range(3):
            answer = await asyncio.to_thread(stream.exchange, _credit_request(model, x, f"before-{i}"))
            values.append(np.frombuffer(answer.infer_response.raw_output_contents[0], dtype="<f4"))
        fresh_model.inject("nan")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            answer = await asyncio.to_thread(stream.exchange, _credit_request(model, x))
            if answer.error_message:
                in_stream_errors.append(answer.error_message)
            else:
                values.append(np.frombuffer(answer.infer_response.raw_output_contents[0], dtype="<f4"))
            await asyncio.sleep(0.02)
    except grpc.RpcError as e:
        ended = e  # the stream ended: its status says why
    finally:
        stream.close()
    assert ended is not None, "the stream outlived the quarantine"
    code, trailing = ended.code(), dict(ended.trailing_metadata() or ())
    assert code is grpc.StatusCode.UNAVAILABLE, (code, ended.details())
    assert trailing["x-sidecar-reason"] == "quarantined" and "grpc-retry-pushback-ms" in trailing, trailing
    assert all(np.isfinite(v).all() for v in values), "a NaN answer passed on the stream"
    assert all("[non_finite_output]" in e for e in in_stream_errors), in_stream_errors
    assert sidecar.state(model) in (ModelState.UNHEALTHY, ModelState.HEALING, ModelState.HEALTHY)


async def test_a_stream_open_to_a_model_the_sidecar_stops_guarding_ends_not_found(triton, fresh_model, start):
    """Released mid-stream (taken out of `models`): the stream ends NOT_FOUND unknown_model, as a new
    call to the model is refused, instead of serving on unguarded."""
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir)
    sidecar = await started_and_healthy(start, config)
    x = features(rows=1, seed=4)
    stream = SyncStream(f"127.0.0.1:{config.listen.grpc_port}")
    ended: grpc.RpcError | None = None
    try:
        answer = await asyncio.to_thread(stream.exchange, _credit_request(model, x, "before"))
        assert not answer.error_message, answer.error_message
        # What a reload of the config does: the live config swapped, then handed to every part.
        without = replace(config, models=("credit_risk",))
        sidecar.app[LIVE].config = without
        apply_config(sidecar.app, without)
        await wait_for(lambda: model not in sidecar.app[STATES], 10, what=f"{model} released")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            await asyncio.to_thread(stream.exchange, _credit_request(model, x))
    except grpc.RpcError as e:
        ended = e
    finally:
        stream.close()
    assert ended is not None, "the stream outlived the model's release"
    code, trailing = ended.code(), dict(ended.trailing_metadata() or ())
    assert code is grpc.StatusCode.NOT_FOUND, (code, ended.details())
    assert trailing["x-sidecar-reason"] == "unknown_model", trailing
    assert f"model {model} is no longer guarded by the sidecar (released)" in ended.details(), ended.details()


async def test_a_client_that_cancels_a_stream_cancels_triton_s_side(triton, decoupled, decoupled_golden, start):
    config = grpc_config(triton, models=[DECOUPLED], golden_dir=decoupled_golden)
    sidecar = await started_and_healthy(start, config)
    tensor = pb.ModelInferRequest.InferInputTensor(name="COUNT", datatype="INT32", shape=[1],
                                                   contents=pb.InferTensorContents(int_contents=[60]))
    marks_before = triton.log_path.read_text().count("decoupled_counter: cancelled after")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        call = _stream_call(channel)
        await call.write(pb.ModelInferRequest(model_name=DECOUPLED, inputs=[tensor]))
        for _ in range(3):
            await asyncio.wait_for(call.read(), 10)
        call.cancel()
    # 60 responses 50 ms apart would take 3 s; the model sees the cancel at its next response.
    await wait_for(lambda: triton.log_path.read_text().count("decoupled_counter: cancelled after") > marks_before,
                   2.5, what="the model to see the cancel")
    await wait_for(lambda: sidecar.app[LIFECYCLE].in_flight == 0, 2, what="the stream to be finished")


async def test_a_stream_whose_client_leaves_is_counted_cancelled_and_frees_its_slot(
    triton, decoupled, decoupled_golden, start
):
    config = grpc_config(triton, models=[DECOUPLED], golden_dir=decoupled_golden)
    sidecar = await started_and_healthy(start, config)
    front = sidecar.server
    handovers, served = (front.grpc_handovers, front.grpc_served) if GRPC_FRONT == "rust" else (0, 0)
    tensor = pb.ModelInferRequest.InferInputTensor(name="COUNT", datatype="INT32", shape=[1],
                                                   contents=pb.InferTensorContents(int_contents=[60]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        call = _stream_call(channel)
        await call.write(pb.ModelInferRequest(model_name=DECOUPLED, inputs=[tensor]))
        for _ in range(3):
            assert not (await asyncio.wait_for(call.read(), 10)).error_message
        call.cancel()
    await wait_for(lambda: sidecar.metric("triton_sidecar_stream_endings_total", model=DECOUPLED,
                                          outcome="client_disconnected") == 1, 5, what="the stream's end counted")
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model=DECOUPLED,
                                          code="CANCELLED") == 1, 5, what="the call counted CANCELLED")
    assert sidecar.metric("triton_sidecar_streams_in_flight", model=DECOUPLED) == 0
    await wait_for(lambda: sidecar.app[LIFECYCLE].in_flight == 0, 5, what="the stream finished")
    if GRPC_FRONT == "rust":
        assert (front.grpc_handovers, front.grpc_served) == (handovers, served + 1), "not served by the front"


async def test_the_client_deadline_reaches_triton_and_upstream_timeout_bounds_it(triton, fresh_model, start):
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                         proxy={"upstream_timeout_s": 1.5})
    await started_and_healthy(start, config)
    fresh_model.inject("hang")
    request = _credit_request(model, features(rows=1, seed=2)).SerializeToString()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as short:
            await infer(request, timeout=0.4)
        short_s = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as bounded:
            await infer(request, timeout=30)
        bounded_s = time.monotonic() - started
    assert short.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and short_s < 1.0, short_s
    # No client waits on a hung model longer than upstream_timeout_s, whatever deadline it set.
    assert bounded.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), bounded.value
    assert 1.4 <= bounded_s < 3.0, bounded_s
    if bounded.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        assert dict(bounded.value.trailing_metadata())["x-sidecar-reason"] == "triton_timeout"


async def test_request_ids_are_forwarded_and_logged_and_oversized_messages_refused(triton, start):
    config = grpc_config(triton, validation={"max_body_bytes": 64 * 1024}, logging={"access_log_sample_rate": 1.0})
    await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    request = _credit_request("credit_risk", features(rows=1, seed=4)).SerializeToString()
    with structlog.testing.capture_logs() as logs:
        code, _, trailing, answer = await _raw_call(target, "ModelInfer", request, metadata=(
            ("x-request-id", "grpc-req-42"), ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            ("authorization", "Bearer never-forwarded")))
    assert code is grpc.StatusCode.OK and trailing["x-request-id"] == "grpc-req-42"
    assert pb.ModelInferResponse.FromString(answer).model_name == "credit_risk"
    access = [e for e in logs if e.get("request_id") == "grpc-req-42"]
    assert access and access[-1].get("trace_id") == "4bf92f3577b34da6a3ce929d0e0e4736", logs
    assert not any("never-forwarded" in str(e) for e in logs)
    big = _credit_request("credit_risk", features(rows=1, seed=4))
    big.parameters["padding"].string_param = "x" * (80 * 1024)
    code, details, _, _ = await _raw_call(target, "ModelInfer", big.SerializeToString())
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details


async def test_triton_killed_answers_unavailable_and_ends_open_streams(own_triton, start):
    config = grpc_config(own_triton)
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    request = _credit_request("credit_risk", features(rows=1, seed=6))
    stream = SyncStream(target)
    try:
        assert not (await asyncio.to_thread(stream.exchange, request)).error_message
        own_triton.kill()
        code, details, trailing, _ = await _raw_call(target, "ModelInfer", request.SerializeToString())
        assert code is grpc.StatusCode.UNAVAILABLE, details
        assert trailing["x-sidecar-reason"] in ("triton_unreachable", "quarantined", "model_unavailable"), trailing
        with pytest.raises(grpc.RpcError) as ended:
            await asyncio.to_thread(stream.exchange, request)
        assert ended.value.code() is grpc.StatusCode.UNAVAILABLE, ended.value.details()
    finally:
        stream.close()
    await wait_for(lambda: sidecar.app[LIFECYCLE].in_flight == 0, 2, what="nothing left in flight")


async def _gauge_from_metrics(sidecar, name: str, model: str) -> float:  # type: ignore[no-untyped-def]
    """A gauge as a scrape sees it: read from the sidecar's /metrics over HTTP."""
    async with sidecar.session.get(sidecar.url + "/metrics") as response:
        text = await response.text()
    prefix = f'{name}{{model="{model}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


async def test_an_open_stream_holds_a_breaker_slot_and_counts_in_the_in_flight_gauge(
    triton, decoupled, decoupled_golden, start
):
    # One slot and no queue per model: while the first stream is open, a second one is refused.
    config = grpc_config(triton, models=[DECOUPLED], golden_dir=decoupled_golden,
                         proxy={"max_in_flight_per_model": 1, "queue_size_per_model": 0})
    sidecar = await started_and_healthy(start, config)
    gauge = "triton_sidecar_streams_in_flight"
    tensor = pb.ModelInferRequest.InferInputTensor(name="COUNT", datatype="INT32", shape=[1],
                                                   contents=pb.InferTensorContents(int_contents=[60]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        first = _stream_call(channel)
        await first.write(pb.ModelInferRequest(model_name=DECOUPLED, inputs=[tensor]))
        for _ in range(2):
            assert not (await asyncio.wait_for(first.read(), 10)).error_message
        assert await _gauge_from_metrics(sidecar, gauge, DECOUPLED) == 1
        second = _stream_call(channel)
        await second.write(pb.ModelInferRequest(model_name=DECOUPLED, inputs=[tensor]))
        refused = await asyncio.wait_for(second.read(), 10)
        assert refused.error_message.startswith("[overloaded]"), refused
        second.cancel()
        first.cancel()

    async def freed() -> bool:
        return await _gauge_from_metrics(sidecar, gauge, DECOUPLED) == 0

    await wait_for(freed, 5, what="the stream's slot and gauge freed")
    # The slot came back: a new stream is served to its end.
    answers = await _stream(f"127.0.0.1:{config.listen.grpc_port}", 2)
    assert [r.as_numpy("VALUE")[0] for _, r, _ in answers] == [0.0, 0.5]


async def test_http2_bounds_streams_per_connection_and_idle_connections(triton, start):
    config = grpc_config(triton, listen={"grpc_max_concurrent_streams": 1, "grpc_max_connection_idle_s": 0.5,
                                         "grpc_min_ping_interval_s": 10})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    live = pb.ServerLiveRequest().SerializeToString()
    async with grpc.aio.insecure_channel(target) as channel:
        server_live = channel.unary_unary(f"/{SERVICE}/ServerLive")
        await server_live(live, timeout=5)  # connected: the client knows the server's SETTINGS now
        stream = _stream_call(channel)  # one open call: the connection's only stream
        with pytest.raises(grpc.aio.AioRpcError) as waited:
            await server_live(live, timeout=1)
        assert waited.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # it waited for a stream, in the client
        stream.cancel()
        await server_live(live, timeout=5)  # the stream is free again
        # No call for grpc_max_connection_idle_s: the server sends GOAWAY and the channel goes idle.
        await wait_for(lambda: channel.get_state() is grpc.ChannelConnectivity.IDLE, 10,
                       what="the idle connection closed by the server")
        await server_live(live, timeout=5)  # and a next call simply reconnects
    assert sidecar.state("credit_risk") is ModelState.HEALTHY


async def test_a_connection_past_its_age_closes_after_the_grace_under_an_open_watch(triton, start):
    # grpcio's grpc.max_connection_age_grace_ms is proxy.upstream_timeout_s: a call still open then
    # (a Watch never ends by itself) does not keep the connection, whichever front serves the port.
    config = grpc_config(triton, listen={"grpc_max_connection_age_s": 1}, proxy={"upstream_timeout_s": 1.5})
    await started_and_healthy(start, config)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(watch.read(), 15)
        closed_after = time.monotonic() - started
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE, ended.value
    assert closed_after < 6, closed_after  # age (1 s) and grace (1.5 s), not the Watch's whole life


async def test_a_client_that_pings_too_often_is_sent_goaway(triton, start):
    config = grpc_config(triton, listen={"grpc_min_ping_interval_s": 10})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    # A client that pings every 100 ms (the floor here is 10 s) is sent GOAWAY (too_many_pings).
    async with grpc.aio.insecure_channel(target, options=[
            ("grpc.keepalive_time_ms", 100), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]) as channel:
        stream = _stream_call(channel)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(stream.read(), 20)
        assert ended.value.code() is grpc.StatusCode.UNAVAILABLE, ended.value
        assert "Too many pings" in (ended.value.details() or ""), ended.value
    assert sidecar.state("credit_risk") is ModelState.HEALTHY


async def test_a_model_that_goes_silent_mid_stream_ends_the_grpc_stream_at_the_idle_bound(
    triton, decoupled, decoupled_golden, start
):
    # The model sends a response every 50 ms; a 20 ms bound on the silence after the first one is
    # passed by every gap, so the stream ends after one response instead of waiting for the rest.
    config = grpc_config(triton, models=[DECOUPLED], golden_dir=decoupled_golden,
                         generation={"idle_timeout_s": 0.02})
    sidecar = await started_and_healthy(start, config)
    tensor = pb.ModelInferRequest.InferInputTensor(name="COUNT", datatype="INT32", shape=[1],
                                                   contents=pb.InferTensorContents(int_contents=[40]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        stream = _stream_call(channel)
        await stream.write(pb.ModelInferRequest(model_name=DECOUPLED, inputs=[tensor]))
        responses = []
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                response = await asyncio.wait_for(stream.read(), 10)
                assert response is not grpc.aio.EOF, "the stream ran to its end"
                responses.append(response)
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
    assert "generation.idle_timeout_s" in (ended.value.details() or "")
    assert 1 <= len(responses) < 40
    await wait_for(lambda: sidecar.metric("triton_sidecar_stream_endings_total", model=DECOUPLED,
                                          outcome="stream_idle") == 1, 5, what="the ending counted")
    assert sidecar.metric("triton_sidecar_streams_in_flight", model=DECOUPLED) == 0


async def test_grpc_connections_beyond_max_connections_are_refused(triton, start):
    config = grpc_config(triton, listen={"max_connections": 2})
    await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    live = pb.ServerLiveRequest().SerializeToString()
    # Each channel gets a connection of its own (a local subchannel pool, not the process-wide one).
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(3)]
    try:
        for channel in channels[:2]:
            await channel.unary_unary(f"/{SERVICE}/ServerLive")(live, timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channels[2].unary_unary(f"/{SERVICE}/ServerLive")(live, timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value
        await channels[0].close()
        await wait_for(lambda: _served(channels[2], live), 10, what="a connection free again")
    finally:
        for channel in channels:
            await channel.close()


async def _served(channel: grpc.aio.Channel, live: bytes) -> bool:
    try:
        await channel.unary_unary(f"/{SERVICE}/ServerLive")(live, timeout=2)
    except grpc.aio.AioRpcError:
        return False
    return True


async def _served_by_the_lane(sidecar, target: str, request: bytes) -> bool:  # type: ignore[no-untyped-def]
    """One ModelInfer answered OK by the data plane's gRPC front itself (the model is a lane)."""
    before = sidecar.server.grpc_served
    code, _, _, _ = await _raw_call(target, "ModelInfer", request)
    return code is grpc.StatusCode.OK and sidecar.server.grpc_served > before


@rust_front_only
async def test_model_infer_to_a_trusted_model_never_enters_python(triton, grpc_sidecar):
    x = features(rows=2, seed=21)
    request = _credit_request("credit_risk", x).SerializeToString()
    await wait_for(lambda: _served_by_the_lane(grpc_sidecar, grpc_sidecar.grpc, request), 10,
                   what="credit_risk published as a lane")
    front = grpc_sidecar.server
    handovers, served = front.grpc_handovers, front.grpc_served
    counted = grpc_sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="credit_risk",
                                  code="OK")
    client = grpcclient_aio.InferenceServerClient(grpc_sidecar.grpc)
    try:
        for _ in range(20):
            result = await client.infer("credit_risk", _infer_inputs(x))
            assert result.as_numpy("scores") is not None and result.as_numpy("income_prob") is None
    finally:
        await client.close()
    assert front.grpc_handovers == handovers, "a ModelInfer to a lane was handed to the Python gRPC server"
    assert front.grpc_served == served + 20
    assert grpc_sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="credit_risk",
                               code="OK") == counted + 20


@rust_front_only
async def test_the_lane_refuses_a_malformed_request_and_withholds_a_nan_answer(triton, fresh_model, start):
    model = fresh_model.name
    # Rounds far apart: the NaN answer must meet the lane, not a probe round that quarantines first.
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir, probes={"interval_s": 30})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    good = _credit_request(model, features(rows=1, seed=3)).SerializeToString()
    await wait_for(lambda: _served_by_the_lane(sidecar, target, good), 10, what=f"{model} published as a lane")
    front = sidecar.server
    handovers = front.grpc_handovers
    bad = _credit_request(model, features(rows=1, seed=3))
    bad.raw_input_contents[0] = bad.raw_input_contents[0][:100]
    code, details, trailing, _ = await _raw_call(target, "ModelInfer", bad.SerializeToString())
    assert (code, trailing.get("x-sidecar-reason")) == (grpc.StatusCode.INVALID_ARGUMENT, "shape"), details
    assert trailing.get("x-request-id")
    fresh_model.inject("nan")
    refused: list[tuple[grpc.StatusCode, str, dict]] = []

    async def nan_met() -> bool:
        code, details, trailing, _ = await _raw_call(target, "ModelInfer", good)
        if code is not grpc.StatusCode.OK:
            refused.append((code, details, trailing))
        return bool(refused)

    await wait_for(nan_met, 10, what="the NaN answer")
    code, details, trailing = refused[0]
    assert (code, trailing.get("x-sidecar-reason")) == (grpc.StatusCode.INTERNAL, "non_finite_output"), details
    assert "NaN/Inf" in details
    assert front.grpc_handovers == handovers, "the lane handed a call to the Python gRPC server"
    assert sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="grpc", model=model, reason="shape") == 1


async def test_a_rule_file_refuses_grpc_requests_with_the_words_http_clients_read(triton, start, tmp_path):
    path = tmp_path / "credit_risk.schema.json"
    path.write_text(json.dumps({"required": ["id"], "properties": {"id": {"type": "string", "pattern": "^app-"}},
                                "x-tensors": {"features": {"minimum": -10, "maximum": 10}}}))
    # No probe round meanwhile: Triton's count of credit_risk's successes must move only with these calls.
    config = grpc_config(triton, validation={"schemas": {"credit_risk": str(path)}},
                         probes={"interval_s": 3600, "jitter": 0.0})
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    good = _credit_request("credit_risk", features(rows=1, seed=3), "app-1").SerializeToString()
    if GRPC_FRONT == "rust":  # a model with a rule file is a lane: the data plane checks it itself
        await wait_for(lambda: _served_by_the_lane(sidecar, target, good), 10, what="credit_risk published as a lane")
    else:
        assert (await _raw_call(target, "ModelInfer", good))[0] is grpc.StatusCode.OK
    handovers = sidecar.server.grpc_handovers
    before = triton_successes(triton, "credit_risk")
    too_big = features(rows=1, seed=3)
    too_big[0, 5] = 11.0
    for request, words in (
            (_credit_request("credit_risk", features(rows=1, seed=3)),
             "request breaks credit_risk.schema.json at $: 'id' is a required property"),
            (_credit_request("credit_risk", features(rows=1, seed=3), "web-1"),
             "request breaks credit_risk.schema.json at $.id: 'web-1' does not match '^app-'"),
            (_credit_request("credit_risk", too_big, "app-2"),
             "input 'features' breaks credit_risk.schema.json: element 5 = 11.0 is above the maximum 10")):
        code, details, trailing, _ = await _raw_call(target, "ModelInfer", request.SerializeToString())
        assert (code, trailing.get("x-sidecar-reason"), details) == (
            grpc.StatusCode.INVALID_ARGUMENT, "business_rule", words)
    assert triton_successes(triton, "credit_risk") == before, "a refused request reached Triton"
    if GRPC_FRONT == "rust":
        assert sidecar.server.grpc_handovers == handovers, "the lane handed a ruled call to the Python gRPC server"
    assert sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="grpc", model="credit_risk",
                          reason="business_rule") == 3


@rust_front_only
async def test_the_front_answers_health_itself_and_watch_streams_a_real_quarantine_and_heal(
        triton, fresh_model, start):
    model = fresh_model.name
    config = grpc_config(triton, models=[model], golden_dir=fresh_model.golden_dir)
    sidecar = await started_and_healthy(start, config)
    front = sidecar.server
    handovers, served = front.grpc_handovers, front.grpc_served
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", model):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == serving, service
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="no_such_model"), timeout=5)
        assert (unknown.value.code(), unknown.value.details()) == (grpc.StatusCode.NOT_FOUND, UNKNOWN_SERVICE)
        nobody = health.Watch(health_pb2.HealthCheckRequest(service="no_such_model"))
        assert (await asyncio.wait_for(nobody.read(), 5)).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        nobody.cancel()
        watch = health.Watch(health_pb2.HealthCheckRequest(service=model))
        pod = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(watch.read(), 5)).status == serving
        assert (await asyncio.wait_for(pod.read(), 5)).status == serving
        fresh_model.inject("nan")  # the model's answers turn NaN: its golden requests fail, it is quarantined
        # A Watch sends only a change: the next status on each stream is the quarantine's.
        assert (await asyncio.wait_for(watch.read(), 30)).status == not_serving
        assert sidecar.first_transition_to(model, ModelState.UNHEALTHY) is not None
        assert (await asyncio.wait_for(pod.read(), 5)).status == not_serving
        # The heal reloads the model (its memory, and the fault, gone): the same streams say so.
        assert (await asyncio.wait_for(watch.read(), 60)).status == serving
        assert sidecar.state(model) is ModelState.HEALTHY
        assert (await asyncio.wait_for(pod.read(), 30)).status == serving
        watch.cancel()
        pod.cancel()
    assert front.grpc_handovers == handovers, "a health call was handed to the Python gRPC server"
    assert front.grpc_served == served + 6  # three Checks, three Watches


@rust_front_only
async def test_an_open_watch_ends_unavailable_when_the_front_stops(grpc_sidecar):
    async with grpc.aio.insecure_channel(grpc_sidecar.grpc) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        await grpc_sidecar.server.close()
        assert time.monotonic() - started < 5, "the front's stop waited on an open Watch"
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(watch.read(), 5)
        assert ended.value.code() is grpc.StatusCode.UNAVAILABLE, ended.value


REFLECTION_V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
SERVICES = ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
            SERVICE]


def _resolved_over_reflection(target: str) -> dict[str, object]:
    """What grpcio-reflection's client learns from the sidecar (v1alpha, a stream per question).
    Synchronous: run it in a thread, the sidecar under test runs on the test's loop."""
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(database.get_services())
        pool = DescriptorPool(database)
        infer = pool.FindServiceByName(SERVICE).FindMethodByName("ModelInfer")
        try:
            database.FindFileContainingSymbol("inference.NoSuchMessage")
            missing = None
        except KeyError as e:  # NOT_FOUND in an error_response
            missing = e
        # The next question is answered, and an import is resolved with the file that needs it.
        check = pool.FindServiceByName("grpc.health.v1.Health").FindMethodByName("Check")
        config = pool.FindMessageTypeByName("inference.ModelConfig")
        return {"services": services, "infer": (infer.input_type.full_name, infer.output_type.full_name),
                "missing": missing, "check": check.input_type.full_name, "config": config.file.name}


@rust_front_only
async def test_server_reflection_lists_and_resolves_the_services_without_python(grpc_sidecar):
    front = grpc_sidecar.server
    handovers, served = front.grpc_handovers, front.grpc_served
    got = await asyncio.to_thread(_resolved_over_reflection, grpc_sidecar.grpc)
    assert got["services"] == SERVICES
    assert got["infer"] == ("inference.ModelInferRequest", "inference.ModelInferResponse")
    assert isinstance(got["missing"], KeyError)
    assert got["check"] == "grpc.health.v1.HealthCheckRequest"
    assert got["config"] == "model_config.proto"
    assert front.grpc_served >= served + 4, "the client's streams were not answered by the front"
    served = front.grpc_served
    # grpc.reflection.v1, the same messages: each question answered on one stream, in order.
    request, response = reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse
    async with grpc.aio.insecure_channel(grpc_sidecar.grpc) as channel:
        call = channel.stream_stream(REFLECTION_V1, request_serializer=request.SerializeToString,
                                     response_deserializer=response.FromString)()
        answers = []
        for question in (request(host="h", list_services=""),
                         request(file_containing_symbol="inference.GRPCInferenceService.ModelInfer"),
                         request(file_by_filename="no_such.proto"),
                         request(all_extension_numbers_of_type="inference.ModelInferRequest"),
                         request(file_containing_extension=reflection_pb2.ExtensionRequest(
                             containing_type="inference.ModelInferRequest", extension_number=1000))):
            await call.write(question)
            answers.append(await asyncio.wait_for(call.read(), 5))
        await call.done_writing()
        assert await call.code() is grpc.StatusCode.OK
    listed, files, no_file, numbers, no_extension = answers
    assert (listed.valid_host, listed.original_request.list_services) == ("h", "")
    assert sorted(s.name for s in listed.list_services_response.service) == SERVICES
    # The symbol's file first, then what it imports (not sent on this stream before).
    names = [FileDescriptorProto.FromString(b).name for b in files.file_descriptor_response.file_descriptor_proto]
    assert names == ["grpc_service.proto", "model_config.proto"]
    not_found = grpc.StatusCode.NOT_FOUND.value[0]
    assert no_file.error_response.error_code == not_found and "no_such.proto" in no_file.error_response.error_message
    assert numbers.all_extension_numbers_response.base_type_name == "inference.ModelInferRequest"
    assert list(numbers.all_extension_numbers_response.extension_number) == []
    assert no_extension.error_response.error_code == not_found
    assert front.grpc_handovers == handovers, "a reflection call was handed to the Python gRPC server"
    assert front.grpc_served == served + 1  # the v1 stream


async def _document_views(target: str, direct: str) -> dict[str, Any]:
    """Every document and readiness RPC through the sidecar, and the documents Triton itself gives."""
    views: dict[str, Any] = {}
    for method, request, response in (
            ("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse),
            ("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse),
            ("ModelReady", pb.ModelReadyRequest(name="credit_risk"), pb.ModelReadyResponse),
            ("ServerMetadata", pb.ServerMetadataRequest(), pb.ServerMetadataResponse),
            ("ModelMetadata", pb.ModelMetadataRequest(name="credit_risk"), pb.ModelMetadataResponse),
            ("ModelConfig", pb.ModelConfigRequest(name="credit_risk"), pb.ModelConfigResponse),
            ("ModelMetadata:image", pb.ModelMetadataRequest(name="image_classifier"), pb.ModelMetadataResponse)):
        name = method.split(":")[0]
        code, details, trailing, answer = await _raw_call(target, name, request.SerializeToString(),
                                                          metadata=(("x-request-id", f"doc-{method}"),))
        assert code is grpc.StatusCode.OK and trailing["x-request-id"] == f"doc-{method}", (method, code, details)
        views[method] = response.FromString(answer)
    _, _, _, answer = await _raw_call(direct, "ModelMetadata",
                                      pb.ModelMetadataRequest(name="image_classifier").SerializeToString())
    views["direct:image"] = pb.ModelMetadataResponse.FromString(answer)
    return views


async def test_documents_readiness_and_the_control_api_answer_alike_on_both_fronts(triton, grpc_sidecar):
    """The same answers, words, trailers, counters and access log whichever front serves the port;
    on the data plane's, without handing one call to the Python gRPC server."""
    rust = GRPC_FRONT == "rust"
    front, target, direct = grpc_sidecar.server, grpc_sidecar.grpc, f"127.0.0.1:{triton.ports.grpc}"
    if rust:  # credit_risk's spec fetched (a lane): its filtered documents are judged by the front
        request = _credit_request("credit_risk", features(rows=1, seed=5)).SerializeToString()
        await wait_for(lambda: _served_by_the_lane(grpc_sidecar, target, request), 10,
                       what="credit_risk published as a lane")
    handovers, served = (front.grpc_handovers, front.grpc_served) if rust else (0, 0)
    denied = grpc_sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="_server_",
                                 code="PERMISSION_DENIED") or 0
    views = await _document_views(target, direct)
    assert views["ServerLive"].live and views["ServerReady"].ready and views["ModelReady"].ready
    extensions = list(views["ServerMetadata"].extensions)
    assert extensions and not {"model_repository", "system_shared_memory", "statistics"} & set(extensions)
    assert [o.name for o in views["ModelMetadata"].outputs] == ["scores"]
    assert views["ModelMetadata:image"] == views["direct:image"], "a model without rules: Triton's document"
    # The config is Triton's but for the hidden output.
    _, _, _, answer = await _raw_call(direct, "ModelConfig",
                                      pb.ModelConfigRequest(name="credit_risk").SerializeToString())
    want = pb.ModelConfigResponse.FromString(answer)
    kept = [o for o in want.config.output if o.name != "income_prob"]
    assert len(kept) == len(want.config.output) - 1
    del want.config.output[:]
    want.config.output.extend(kept)
    assert views["ModelConfig"] == want
    with structlog.testing.capture_logs() as logs:
        for method in CONTROL:
            code, details, trailing, _ = await _raw_call(target, method, b"\xff not even protobuf",
                                                         metadata=(("x-request-id", f"ctl-{method}"),))
            assert (code, trailing["x-sidecar-reason"], trailing["x-request-id"]) == (
                grpc.StatusCode.PERMISSION_DENIED, "forbidden_endpoint", f"ctl-{method}"), (method, details)
            assert details == (f"{method} is part of Triton's control API, which stays inside the pod; only "
                               "inference, metadata, config, readiness and health are served here"), details
        logged = await wait_for(lambda: [e for e in logs if e.get("request_id") == "ctl-RepositoryIndex"], 5,
                                what="the refusal's access-log line")
    assert {k: logged[0].get(k) for k in ("model", "protocol", "path", "status", "reason")} == {
        "model": "_server_", "protocol": "grpc", "path": f"/{SERVICE}/RepositoryIndex",
        "status": "PERMISSION_DENIED", "reason": "forbidden_endpoint"}, logged
    code, details, trailing, _ = await _raw_call(target, "ModelStatistics", b"")
    assert (code, trailing["x-sidecar-reason"]) == (grpc.StatusCode.PERMISSION_DENIED, "forbidden_endpoint")
    assert details == "statistics are not exposed through the sidecar (proxy.allow_statistics is off)"
    code, details, trailing, _ = await _raw_call(target, "ModelConfig",
                                                 pb.ModelConfigRequest(name="no_such_model").SerializeToString())
    assert (code, trailing["x-sidecar-reason"]) == (grpc.StatusCode.NOT_FOUND, "unknown_model"), details
    assert details == "unknown model 'no_such_model'; served: credit_risk, image_classifier", details
    code, details, _, _ = await _raw_call(target, "ModelReady",
                                          pb.ModelReadyRequest(name="credit_risk", version="x").SerializeToString())
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "model credit_risk has no version 'x' (versions are numbers)")
    # Triton's own error for the client (a version it does not have) is passed on as Triton words it.
    missing = pb.ModelMetadataRequest(name="credit_risk", version="99").SerializeToString()
    via, straight = await _raw_call(target, "ModelMetadata", missing), await _raw_call(direct, "ModelMetadata", missing)
    assert via[:2] == straight[:2] and via[0] is not grpc.StatusCode.OK, (via, straight)
    assert "x-sidecar-reason" not in via[2]
    assert grpc_sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="_server_",
                               code="PERMISSION_DENIED") == denied + len(CONTROL) + 1
    assert grpc_sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="grpc", model="_unknown_",
                               reason="unknown_model") >= 1
    if rust:
        assert front.grpc_handovers == handovers, "a document, readiness or control RPC was handed to Python"
        assert front.grpc_served == served + 7 + len(CONTROL) + 4


async def test_statistics_are_served_by_default_for_the_server_and_a_model(triton, start):
    config = grpc_config(triton)
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    handovers = sidecar.server.grpc_handovers if GRPC_FRONT == "rust" else 0
    for name in ("credit_risk", ""):
        code, details, _, answer = await _raw_call(target, "ModelStatistics",
                                                   pb.ModelStatisticsRequest(name=name).SerializeToString())
        assert code is grpc.StatusCode.OK, details
        stats = pb.ModelStatisticsResponse.FromString(answer).model_stats
        assert "credit_risk" in {s.name for s in stats}, stats
    code, _, trailing, _ = await _raw_call(target, "ModelStatistics",
                                           pb.ModelStatisticsRequest(name="no_such_model").SerializeToString())
    assert (code, trailing["x-sidecar-reason"]) == (grpc.StatusCode.NOT_FOUND, "unknown_model")
    if GRPC_FRONT == "rust":
        assert sidecar.server.grpc_handovers == handovers, "a ModelStatistics was handed to the Python gRPC server"


async def test_model_infer_to_a_model_the_sidecar_does_not_guard_is_refused_alike_on_both_fronts(triton, start):
    config = grpc_config(triton)
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    front = sidecar.server if GRPC_FRONT == "rust" else None
    handovers = front.grpc_handovers if front is not None else 0

    def rejected(model: str) -> float:
        return sidecar.metric("triton_sidecar_proxy_rejections_total", protocol="grpc", model=model,
                              reason="unknown_model") or 0

    before = {model: rejected(model) for model in ("_unknown_", "credit_risk")}
    refusals = [
        (pb.ModelInferRequest(model_name="no_such_model"),
         "unknown model 'no_such_model'; served: credit_risk, image_classifier"),
        (pb.ModelInferRequest(model_name="credit_risk", model_version="x"),
         "model credit_risk has no version 'x' (versions are numbers)"),
    ]
    for n, (request, details) in enumerate(refusals):
        code, got, trailing, _ = await _raw_call(target, "ModelInfer", request.SerializeToString(),
                                                 metadata=(("x-request-id", f"unguarded-{n}"),))
        assert (code, got) == (grpc.StatusCode.NOT_FOUND, details)
        assert (trailing.get("x-sidecar-reason"), trailing.get("x-request-id")) == ("unknown_model", f"unguarded-{n}")
    assert {model: rejected(model) - before[model] for model in before} == {"_unknown_": 1, "credit_risk": 1}
    if front is not None:
        assert front.grpc_handovers == handovers, "a refusal was handed to the Python gRPC server"


def test_the_vendored_reflection_descriptors_match_the_installed_protocol() -> None:
    assert grpc_descriptors.VENDORED.read_bytes() == grpc_descriptors.descriptor_set(), (
        "dataplane/src/front/grpc/descriptors.binpb is not what the installed tritonclient, grpc.health.v1 and "
        "grpcio-reflection describe: run python -m sidecar.devtools.grpc_descriptors")
