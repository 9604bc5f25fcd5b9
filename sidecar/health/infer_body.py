"""A golden case's infer request encoded, and Triton's answer decoded, byte for byte as tritonclient's
HTTP client does it (`InferInput.set_data_from_numpy(binary_data=False)` + `generate_request_body`;
`parse_response_body` + `InferResult.as_numpy`), without importing `tritonclient.http`.

Why not tritonclient's own: importing `tritonclient.http` imports its HTTP client too, and with it
gevent, geventhttpclient, greenlet and zope: about 10 MB of resident memory for a client the sidecar
never uses (its HTTP is aiohttp's and its own pool), a seventh of issue 18's 80 MB idle budget. The
dtype table is still tritonclient's (`tritonclient.utils`, no gevent) and the answer is decoded by
the data plane's rule (sidecar.protocol.answers), tested against tritonclient's parser, so a probe
sees the same arrays as before: JSON nulls read as NaN, binary outputs (Triton answers all outputs in
binary when the case names none) decoded by datatype, BYTES as an object array.

The health loop itself uses neither numpy nor arrays (issue 30: numpy is several MB of every idle
sidecar's RSS): `encode_request` casts each value to its datatype as numpy would (struct's float32
and float16 packing round as numpy's casts do; integers out of range wrap as numpy's do),
and `read_answer` hands the data plane's float64 reading of an answer to its comparison. The arrays
(`decode_answer`, `sidecar.golden.cases.request_as_arrays`) are for the record command and tests.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

import rapidjson

from sidecar import _dataplane
from sidecar.golden.cases import GoldenCase, ReceivedOutput, flatten

#: Request parameters Triton keeps for itself (tritonclient.utils' list, server/src/common.h).
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers",
                                 "binary_data_output"})
RESERVED_PARAMETER_PREFIX = "triton_"


class EncodeRefused(ValueError):
    """A golden case tritonclient would refuse to encode, with tritonclient's words (its
    InferenceServerException; tritonclient.utils is not imported by a running sidecar)."""


def raise_error(message: str) -> None:
    raise EncodeRefused(message)


def encode_request(case: GoldenCase) -> bytes:
    """The case's request as one JSON body (every tensor in JSON, none binary); raises
    EncodeRefused where tritonclient would raise its InferenceServerException (a datatype the array does not
    have, BF16 or non-UTF-8 BYTES in JSON, a reserved request parameter)."""
    request: dict[str, Any] = {"inputs": [_input(tensor) for tensor in case.request["inputs"]]}
    parameters: dict[str, Any] = {}
    outputs = case.request.get("outputs", [])
    if outputs:
        request["outputs"] = [{"name": o["name"], "parameters": {"binary_data": False}} for o in outputs]
    else:
        parameters["binary_data_output"] = True  # as tritonclient asks when no output is named
    for key, value in (case.request.get("parameters") or {}).items():
        if key in RESERVED_PARAMETERS or key.startswith(RESERVED_PARAMETER_PREFIX):
            raise_error(f'Parameter "{key}" is a reserved parameter and cannot be specified.')
        parameters[key] = value
    if parameters:
        request["parameters"] = parameters
    return rapidjson.dumps(request).encode()  # tritonclient's encoder too: same bytes


def _input(tensor: Mapping[str, Any]) -> dict[str, Any]:
    datatype = tensor["datatype"]
    if datatype == "BF16":
        raise_error("BF16 inputs must be sent as binary data over HTTP. Please set binary_data=True")
    flat = flatten(tensor["data"])
    if datatype != "BYTES":
        cast = _CASTS.get(datatype)
        if cast is None:
            raise_error(f"got unexpected datatype None from numpy array, expected {datatype}.")
        data: list[Any] = [cast(value) for value in flat]
    else:
        data = []
        for value in flat:
            if isinstance(value, str):
                value.encode()  # a lone surrogate fails here, as numpy's array of encoded texts did
                data.append(value)
            else:
                data.append(str(value))
    return {"name": tensor["name"], "shape": [int(d) for d in tensor["shape"]], "datatype": datatype, "data": data}


def _float64(value: Any) -> float:
    """numpy's float64 of a JSON value (null is NaN, a text is parsed)."""
    return math.nan if value is None else float(value)


def _rounded(fmt: str) -> Callable[[Any], float]:
    """A value rounded to float32 ("<f") or float16 ("<e") and read back, as numpy's cast and
    `.item()` give it: to nearest, ties to even; beyond the type's range, infinity."""

    def cast(value: Any) -> float:
        wide = _float64(value)
        try:
            return struct.unpack(fmt, struct.pack(fmt, wide))[0]
        except OverflowError:
            return math.copysign(math.inf, wide)

    return cast


def _integer(bits: int, signed: bool) -> Callable[[Any], int]:
    """A value as numpy's integer type of `bits` bits gives it back: a float truncated toward zero, a
    value out of range wrapped (two's complement, as numpy 1.x casts it)."""
    span, half = 1 << bits, 1 << (bits - 1)

    def cast(value: Any) -> int:
        number = int(value) % span
        return number - span if signed and number >= half else number

    return cast


#: Each numeric datatype's cast of a golden request's values (what tritonclient's body holds after
#: numpy's `np.array(data, dtype)` and `.item()`).
_CASTS: dict[str, Callable[[Any], Any]] = {
    "BOOL": bool, "FP64": _float64, "FP32": _rounded("<f"), "FP16": _rounded("<e"),
    **{f"INT{b}": _integer(b, True) for b in (8, 16, 32, 64)},
    **{f"UINT{b}": _integer(b, False) for b in (8, 16, 32, 64)},
}


def decode_answer(body: bytes, header_length: int | None) -> dict[str, ReceivedOutput]:
    """Every output of a 200 answer (JSON, or a JSON header of `header_length` bytes + binary
    sections), as tritonclient's `as_numpy` reads it. Raises ValueError for an answer that is not v2
    (the caller's 502), as tritonclient's parser did; the decoding is the data plane's
    (sidecar.protocol.answers)."""
    from sidecar.protocol.answers import decode_outputs
    from sidecar.protocol.datatypes import numpy_dtype

    _, outputs = decode_outputs(body, header_length, numpy_dtype)
    return {name: ReceivedOutput(datatype=datatype, shape=shape, data=values.reshape(shape))
            for name, datatype, shape, values in outputs}


def read_answer(body: bytes, header_length: int | None) -> dict[str, ReceivedOutput]:
    """Every output of a 200 answer as the health loop compares it, without numpy: the data plane's
    reading (sidecar._dataplane.read_answer: float64 bytes, or a list for BYTES), for
    sidecar.golden.compare. Raises ValueError for an answer that is not v2, as decode_answer does."""
    _, outputs = _dataplane.read_answer(body, header_length)
    return {name: ReceivedOutput(datatype=datatype, shape=tuple(shape), data=values)
            for name, datatype, shape, values in outputs}
