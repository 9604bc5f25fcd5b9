"""One stream at a time, timed from the client: generate_stream over HTTP (SSE) and ModelStreamInfer
over gRPC, both on the decoupled `text_echo` model (one event per word).

Each call returns (seconds to the first event, seconds to the end, events). The clients run in the
benchmark's own process: their CPU is not counted, only the proxy's, from /proc.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import aiohttp
import grpc
import grpc.aio
import numpy as np
from tritonclient.grpc import service_pb2 as pb

MODEL = "text_echo"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def sse_body(words: int) -> dict[str, Any]:
    return {"text_input": " ".join(f"w{i}" for i in range(words)), "max_tokens": words}


async def sse_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """(seconds to the first event, seconds to the end, events) of one generate_stream call."""
    started = time.perf_counter()
    first, events, buffer = 0.0, 0, b""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: generate_stream answered {response.status}: {await response.text()}")
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                _, buffer = buffer.split(b"\n\n", 1)
                if not events:
                    first = time.perf_counter() - started
                events += 1
    return first, time.perf_counter() - started, events


async def one_sse_stream(session: aiohttp.ClientSession, base_url: str, words: int) -> tuple[float, float, int]:
    return await sse_stream(session, f"{base_url}/v2/models/{MODEL}/generate_stream", sse_body(words))


def stream_request(words: int) -> pb.ModelInferRequest:
    """text_echo's request on ModelStreamInfer, asking for Triton's empty final response: Triton 2.51
    never releases a decoupled request whose stream is closed before that flag (tests/test_grpc.py)."""
    text = " ".join(f"w{i}" for i in range(words)).encode()
    request = pb.ModelInferRequest(model_name=MODEL, inputs=[
        pb.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1]),
        pb.ModelInferRequest.InferInputTensor(name="max_tokens", datatype="INT32", shape=[1])],
        raw_input_contents=[struct.pack("<I", len(text)) + text, np.array([words], dtype="<i4").tobytes()])
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


async def one_grpc_stream(channel: grpc.aio.Channel, payload: bytes) -> tuple[float, float, int]:
    """Write one serialized request, read to the final flag; events = responses with outputs."""
    call = channel.stream_stream(STREAM_METHOD)()
    started = time.perf_counter()
    first, events = 0.0, 0
    await call.write(payload)
    while True:
        raw = await call.read()
        if raw is grpc.aio.EOF:
            raise RuntimeError(f"the stream ended before the final response: {await call.code()}")
        response = pb.ModelStreamInferResponse.FromString(raw)
        if response.error_message:
            raise RuntimeError(f"in-stream error: {response.error_message}")
        if response.infer_response.outputs:
            if not events:
                first = time.perf_counter() - started
            events += 1
        flag = response.infer_response.parameters.get("triton_final_response")
        if flag is not None and flag.bool_param:
            break
    await call.done_writing()
    ended = time.perf_counter() - started
    await call.code()
    return first, ended, events
