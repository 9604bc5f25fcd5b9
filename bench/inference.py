"""Inference requests as bytes (JSON or the binary tensor extension) and checking their answers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np
import tritonclient.http as triton_http

from bench.wrk import RequestBody


def features(rows: int, seed: int = 7) -> np.ndarray:
    """Standardised features, rounded to 4 decimals so the JSON text is the size a client sends."""
    rng = np.random.default_rng(seed)
    return np.round(rng.standard_normal((rows, 128)), 4).astype(np.float32)


def json_request(x: np.ndarray, name: str | None = None) -> RequestBody:
    """The v2 JSON request for `features`, without an outputs list (so every output comes back and
    the sidecar's filter has something to drop)."""
    # The decimals a client writes (0.2987), not float32's widened repr (0.29870000481605530).
    data = [round(float(v), 4) for v in x.ravel()]
    body = {"inputs": [{"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": data}]}
    rows, cols = x.shape
    return RequestBody(name or f"{rows}x{cols}-json", json.dumps(body, separators=(",", ":")).encode())


def binary_request(x: np.ndarray, name: str | None = None) -> RequestBody:
    """The same request in tritonclient's binary encoding (JSON header + raw little-endian tensor);
    without outputs tritonclient asks for every output in binary too."""
    tensor = triton_http.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    body, header_length = triton_http.InferenceServerClient.generate_request_body([tensor])
    rows, cols = x.shape
    return RequestBody(name or f"{rows}x{cols}-binary", body, "application/octet-stream", header_length)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    outputs: dict[str, np.ndarray]
    error: str = ""


def post(url: str, request: RequestBody, timeout: float = 30.0) -> Answer:
    """One request with urllib (checks only, never timed): status, headers and decoded outputs."""
    headers = {"Content-Type": request.content_type}
    if request.json_header_length is not None:
        headers["Inference-Header-Content-Length"] = str(request.json_header_length)
    http_request = urllib.request.Request(url, data=request.body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(http_request, timeout=timeout) as response:
            body, status, got = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as e:
        return Answer(e.code, dict(e.headers), {}, e.read().decode(errors="replace")[:300])
    return Answer(status, got, decode_outputs(body, got), "")


def decode_outputs(body: bytes, headers: dict[str, str]) -> dict[str, np.ndarray]:
    lowered = {k.lower(): v for k, v in headers.items()}
    length = lowered.get("inference-header-content-length")
    result = triton_http.InferResult.from_response_body(body, False, int(length) if length else None)
    return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response()["outputs"]}
