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
"""

from __future__ import annotations

from typing import Any

import numpy as np
import rapidjson

from sidecar.golden.cases import GoldenCase, ReceivedOutput, request_as_arrays
from sidecar.protocol.answers import decode_outputs
from sidecar.protocol.datatypes import numpy_dtype, v2_datatype

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
    request: dict[str, Any] = {"inputs": [_input(name, datatype, array)
                                          for name, datatype, array in request_as_arrays(case)]}
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


def _input(name: str, datatype: str, array: np.ndarray) -> dict[str, Any]:
    got = v2_datatype(array.dtype)
    if got != datatype:
        raise_error(f"got unexpected datatype {got} from numpy array, expected {datatype}.")
    if datatype == "BF16":
        raise_error("BF16 inputs must be sent as binary data over HTTP. Please set binary_data=True")
    if datatype != "BYTES":
        data: list[Any] = [value.item() for value in array.flatten()]
    else:
        data = []
        for value in array.flatten():  # C order, as tritonclient's np.nditer
            if isinstance(value, bytes):
                try:
                    data.append(str(value, encoding="utf-8"))
                except UnicodeDecodeError:
                    raise_error(f'Failed to encode "{value!r}" using UTF-8. Please use binary_data=True, if'
                                " you want to pass a byte array.")
            else:
                data.append(str(value))
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": data}


def decode_answer(body: bytes, header_length: int | None) -> dict[str, ReceivedOutput]:
    """Every output of a 200 answer (JSON, or a JSON header of `header_length` bytes + binary
    sections), as tritonclient's `as_numpy` reads it. Raises ValueError for an answer that is not v2
    (the caller's 502), as tritonclient's parser did; the decoding is the data plane's
    (sidecar.protocol.answers)."""
    _, outputs = decode_outputs(body, header_length, numpy_dtype)
    return {name: ReceivedOutput(datatype=datatype, shape=shape, data=values.reshape(shape))
            for name, datatype, shape, values in outputs}
