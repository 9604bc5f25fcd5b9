"""Messages sent compressed to the gRPC front, as real clients send them (tritonclient's
compression_algorithm, grpc.aio's compression: grpc-encoding gzip or deflate), against the real Triton:
answered as the same call uncompressed, a decompression bomb refused RESOURCE_EXHAUSTED without
reaching Triton; on the Rust front, inflated there and never handed to the Python gRPC server, and a
grpc-encoding it does not read refused UNIMPLEMENTED (with curl: no gRPC client sends one)."""

from __future__ import annotations

import asyncio
import queue
import shutil

import grpc
import grpc.aio
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import service_pb2 as pb

from sidecar.fronts.grpc_server import SERVICE
from tests.harness import wait_for
from tests.proxy_support import features, started_and_healthy, triton_successes
from tests.test_grpc import (
    GRPC_FRONT,
    _credit_request,
    _infer_inputs,
    _served_by_the_lane,
    grpc_config,
    rust_front_only,
)

MODEL_INFER = f"/{SERVICE}/ModelInfer"
MODEL_STREAM_INFER = f"/{SERVICE}/ModelStreamInfer"
#: validation.max_body_bytes in these tests: the bound on a message, compressed or inflated.
LIMIT = 64 * 1024
COMPRESSIONS = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}


@pytest.fixture
async def sidecar(triton, start):  # type: ignore[no-untyped-def]
    # Probes far apart: Triton's own inference count then moves with these tests' calls alone.
    config = grpc_config(triton, validation={"max_body_bytes": LIMIT}, probes={"interval_s": 300, "jitter": 0})
    sidecar = await started_and_healthy(start, config)
    sidecar.grpc = f"127.0.0.1:{config.listen.grpc_port}"
    if GRPC_FRONT == "rust":
        request = _credit_request("credit_risk", features(rows=1, seed=1)).SerializeToString()
        await wait_for(lambda: _served_by_the_lane(sidecar, sidecar.grpc, request), 10,
                       what="credit_risk published as a lane")
    return sidecar


def _counts(sidecar) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(calls handed to the Python gRPC server, calls the Rust front answered itself); zeros on grpcio."""
    front = sidecar.server
    return (front.grpc_handovers, front.grpc_served) if GRPC_FRONT == "rust" else (0, 0)


async def _unary(target: str, request: pb.ModelInferRequest, compression: grpc.Compression | None):  # type: ignore[no-untyped-def]
    """One ModelInfer on grpc.aio, its message compressed as asked: (code, details, response)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(MODEL_INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        try:
            answer = await call(request, timeout=10, compression=compression)
            return grpc.StatusCode.OK, "", answer
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), None


async def _triton_ran(triton, count: float) -> None:  # type: ignore[no-untyped-def]
    """Triton's own count of credit_risk's successes reaches `count` (it counts a call just after
    answering it) and goes no further: nothing else reached it."""
    await wait_for(lambda: triton_successes(triton, "credit_risk") >= count, 10, what=f"Triton's count at {count}")
    assert triton_successes(triton, "credit_risk") == count, "Triton ran a call the front should have refused"


def _typed_request(x: np.ndarray) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape),
                                                   contents=pb.InferTensorContents(fp32_contents=x.ravel().tolist()))
    return pb.ModelInferRequest(model_name="credit_risk", inputs=[tensor])


def _bomb() -> pb.ModelInferRequest:
    """A valid request padded far past LIMIT with bytes that compress to almost nothing."""
    bomb = _credit_request("credit_risk", features(rows=1, seed=5))
    bomb.parameters["padding"].string_param = "x" * (16 * 1024 * 1024)
    return bomb


async def test_model_infer_sent_gzip_or_deflate_answers_as_uncompressed(triton, sidecar):
    x = features(rows=3, seed=12)
    plain = grpcclient_aio.InferenceServerClient(sidecar.grpc)
    try:
        want = (await plain.infer("credit_risk", _infer_inputs(x))).as_numpy("scores")
        before, (handovers, served) = triton_successes(triton, "credit_risk"), _counts(sidecar)
        for algorithm in COMPRESSIONS:  # raw_input_contents, as tritonclient sends tensors
            got = await plain.infer("credit_risk", _infer_inputs(x), compression_algorithm=algorithm)
            assert np.array_equal(got.as_numpy("scores"), want), algorithm
            assert got.as_numpy("income_prob") is None, "a filtered output left the pod"
    finally:
        await plain.close()
    # Typed contents (fp32_contents), sent with grpc.aio's own compression.
    code, details, uncompressed = await _unary(sidecar.grpc, _typed_request(x), None)
    assert code is grpc.StatusCode.OK, details
    assert np.array_equal(np.frombuffer(uncompressed.raw_output_contents[0], "<f4").reshape(want.shape), want)
    for name, compression in COMPRESSIONS.items():
        code, details, answer = await _unary(sidecar.grpc, _typed_request(x), compression)
        assert code is grpc.StatusCode.OK, (name, details)
        assert answer.raw_output_contents == uncompressed.raw_output_contents, name
        assert [o.name for o in answer.outputs] == ["scores"]
    # A bad tensor sent compressed is read and refused as it would be uncompressed, before Triton.
    bad = _typed_request(x)
    bad.inputs[0].shape[:] = [3, 127]
    code, details, _ = await _unary(sidecar.grpc, bad, grpc.Compression.Gzip)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, details
    await _triton_ran(triton, before + 5)
    if GRPC_FRONT == "rust":
        assert _counts(sidecar) == (handovers, served + 6), "a compressed ModelInfer was handed to grpcio"


def _stream_exchange(target: str, requests: list[pb.ModelInferRequest], compression: grpc.Compression | None,
                     ) -> tuple[list[pb.ModelStreamInferResponse], grpc.RpcError | None]:
    """A ModelStreamInfer on grpcio's synchronous client (it reports the status of a stream the server
    ends while the client writes; grpc.aio does not, grpc/grpc#36066), every message compressed as
    asked: one request written after each response, the responses read until the stream ends."""
    channel = grpc.insecure_channel(target, compression=compression)
    pending: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
    call = channel.stream_stream(MODEL_STREAM_INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                 response_deserializer=pb.ModelStreamInferResponse.FromString)
    responses = call(iter(pending.get, None), timeout=30)
    got: list[pb.ModelStreamInferResponse] = []
    try:
        for request in requests:
            pending.put(request)
            got.append(next(responses))
        pending.put(None)
        got.extend(responses)
        return got, None
    except grpc.RpcError as e:
        return got, e
    finally:
        pending.put(None)
        channel.close()


async def test_a_stream_sent_compressed_answers_as_uncompressed(triton, sidecar):
    requests = [_credit_request("credit_risk", features(rows=2, seed=s), f"r{s}") for s in range(3)]
    want, ended = await asyncio.to_thread(_stream_exchange, sidecar.grpc, requests, None)
    assert ended is None and len(want) == 3, ended
    before, (handovers, served) = triton_successes(triton, "credit_risk"), _counts(sidecar)
    for name, compression in COMPRESSIONS.items():
        got, ended = await asyncio.to_thread(_stream_exchange, sidecar.grpc, requests, compression)
        assert ended is None, (name, ended)
        assert [r.error_message for r in got] == ["", "", ""], name
        assert [r.infer_response.id for r in got] == ["r0", "r1", "r2"]
        assert [r.infer_response.raw_output_contents for r in got] == [r.infer_response.raw_output_contents
                                                                       for r in want], name
    await _triton_ran(triton, before + 6)
    if GRPC_FRONT == "rust":
        assert _counts(sidecar) == (handovers, served + 2), "a compressed stream was handed to grpcio"


async def test_a_decompression_bomb_is_refused_and_never_reaches_triton(triton, sidecar):
    bomb = _bomb()
    assert bomb.ByteSize() > 200 * LIMIT
    before, (handovers, served) = triton_successes(triton, "credit_risk"), _counts(sidecar)
    code, details, _ = await _unary(sidecar.grpc, bomb, grpc.Compression.Gzip)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
    # The first message of a stream, then one after a request served on it.
    got, ended = await asyncio.to_thread(_stream_exchange, sidecar.grpc, [bomb], grpc.Compression.Deflate)
    assert got == [] and ended is not None and ended.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, ended
    first = _credit_request("credit_risk", features(rows=1, seed=6), "first")
    got, ended = await asyncio.to_thread(_stream_exchange, sidecar.grpc, [first, bomb], grpc.Compression.Gzip)
    assert [r.infer_response.id for r in got] == ["first"]
    assert ended is not None and ended.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, ended
    await _triton_ran(triton, before + 1)  # the one good request; no bomb
    if GRPC_FRONT == "rust":
        assert "once inflated from gzip" in details, details
        assert f"vs. {LIMIT})" in ended.details(), ended.details()
        assert _counts(sidecar) == (handovers, served + 1), "a bomb was handed to grpcio"


async def _curl(target: str, path: str, message: bytes, headers: list[str]) -> dict[str, str]:
    """One call sent by curl over h2c (the one client here that sends any grpc-encoding):
    its answer's headers and trailers, lower-cased names."""
    args = ["curl", "-sS", "--http2-prior-knowledge", "--max-time", "10", "-o", "/dev/null", "-D", "-",
            "--data-binary", "@-", "-H", "content-type: application/grpc", "-H", "te: trailers"]
    for header in headers:
        args += ["-H", header]
    process = await asyncio.create_subprocess_exec(*args, f"http://{target}{path}", stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate(message)
    assert process.returncode == 0, err
    fields = {}
    for line in out.decode().splitlines():
        name, colon, value = line.partition(":")
        if colon and not name.startswith("HTTP/"):
            fields[name.strip().lower()] = value.strip()
    return fields


@rust_front_only
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl sends the grpc-encoding no gRPC client sends")
async def test_an_encoding_the_front_does_not_read_is_refused_unimplemented(triton, sidecar):
    request = _credit_request("credit_risk", features(rows=1, seed=7)).SerializeToString()
    flagged = b"\x01" + len(request).to_bytes(4, "big") + request
    before, (handovers, _) = triton_successes(triton, "credit_risk"), _counts(sidecar)
    for path in (MODEL_INFER, MODEL_STREAM_INFER):
        snappy = await _curl(sidecar.grpc, path, flagged, ["grpc-encoding: snappy"])
        assert snappy.get("grpc-status") == "12", (path, snappy)
        assert "'snappy'" in snappy["grpc-message"] and "identity, deflate, gzip" in snappy["grpc-message"]
        assert snappy.get("grpc-accept-encoding") == "identity, deflate, gzip"
        # The flag set with no encoding named: nothing says how to read it.
        unnamed = await _curl(sidecar.grpc, path, flagged, [])
        assert unnamed.get("grpc-status") == "12", (path, unnamed)
    # An uncompressed message on a call that names an encoding is served (compression is per message).
    plain = b"\x00" + len(request).to_bytes(4, "big") + request
    served = await _curl(sidecar.grpc, MODEL_INFER, plain, ["grpc-encoding: snappy"])
    assert served.get("grpc-status") == "0", served
    await _triton_ran(triton, before + 1)
    # A stream the front serves, whose second message is snappy: the stream ends UNIMPLEMENTED, with
    # its reason (the first request may or may not have been answered by then).
    ended = await _curl(sidecar.grpc, MODEL_STREAM_INFER, plain + flagged, ["grpc-encoding: snappy"])
    assert (ended.get("grpc-status"), ended.get("x-sidecar-reason")) == ("12", "unsupported_media_type"), ended
    assert "'snappy'" in ended["grpc-message"]
    assert _counts(sidecar)[0] == handovers, "a call was handed to grpcio"
