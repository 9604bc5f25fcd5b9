"""sidecar.health.infer_body against tritonclient's HTTP client, the implementation it replaces (pure
logic, no server): the same request bytes for every shipped golden case, the same arrays (dtype,
shape, values, NaN) from binary and JSON answers, and the same refusals."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from sidecar.golden.cases import INFER, load_golden_dir, request_as_arrays
from sidecar.health.infer_body import EncodeRefused, decode_answer, encode_request
from sidecar.protocol.answers import answer_tensors
from tests.harness import GOLDEN


def _tritonclient_body(case) -> bytes:  # type: ignore[no-untyped-def]
    inputs = []
    for name, datatype, array in request_as_arrays(case):
        tensor = triton_http.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=False)
        inputs.append(tensor)
    outputs = [triton_http.InferRequestedOutput(o["name"], binary_data=False)
               for o in case.request.get("outputs", [])] or None
    body, json_size = triton_http.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, parameters=case.request.get("parameters"))
    assert json_size is None, "every tensor of a golden request goes in JSON"
    return body if isinstance(body, bytes) else body.encode()


def _tritonclient_outputs(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    result = triton_http.InferenceServerClient.parse_response_body(body, header_length=header_length)
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def test_every_shipped_golden_request_encodes_to_tritonclient_s_bytes():
    cases = [c for cases in load_golden_dir(GOLDEN).values() for c in cases if c.endpoint == INFER]
    assert len(cases) >= 5
    for case in cases:
        assert encode_request(case) == _tritonclient_body(case), (case.model, case.name)


def test_a_named_output_is_asked_in_json_and_a_reserved_parameter_is_refused():
    case = next(c for c in load_golden_dir(GOLDEN)["credit_risk"] if c.expect_status == 200)
    named = dataclasses.replace(case, request={**case.request, "outputs": [{"name": "scores"}],
                                               "parameters": {"note": "x"}})
    body = json.loads(encode_request(named))
    assert body["outputs"] == [{"name": "scores", "parameters": {"binary_data": False}}]
    assert body["parameters"] == {"note": "x"} and encode_request(named) == _tritonclient_body(named)
    reserved = dataclasses.replace(case, request={**case.request, "parameters": {"priority": 1}})
    with pytest.raises(EncodeRefused, match="reserved") as ours:
        encode_request(reserved)
    with pytest.raises(InferenceServerException) as theirs:  # tritonclient refuses it in the same words
        _tritonclient_body(reserved)
    assert str(ours.value) == theirs.value.message()


def test_binary_and_json_answers_decode_to_tritonclient_s_arrays():
    floats = np.array([[1.5, np.nan]], dtype=np.float32).tobytes()
    strings = serialize_byte_tensor(np.array([b"ab", b"\xff"], dtype=object)).item()
    bools = np.array([True, False]).tobytes()
    ints = np.array([3, -4], dtype=np.int64).tobytes()
    outputs = [
        {"name": "f", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": len(floats)}},
        {"name": "s", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(strings)}},
        {"name": "b", "datatype": "BOOL", "shape": [2], "parameters": {"binary_data_size": len(bools)}},
        {"name": "empty", "datatype": "FP32", "shape": [0], "parameters": {"binary_data_size": 0}},
        {"name": "j", "datatype": "FP64", "shape": [3], "data": [1.0, None, 2.5]},
        {"name": "i", "datatype": "INT64", "shape": [2], "parameters": {"binary_data_size": len(ints)}},
    ]
    header = json.dumps({"model_name": "m", "outputs": outputs}).encode()
    json_only = json.dumps({"model_name": "m", "outputs": [
        outputs[4], {"name": "t", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}).encode()
    for body, length in ((header + floats + strings + bools + ints, len(header)), (json_only, None)):
        expected, got = _tritonclient_outputs(body, length), decode_answer(body, length)
        assert set(got) == set(expected)
        for name, array in expected.items():
            mine = got[name].data
            assert (mine.dtype, mine.shape) == (array.dtype, array.shape), name
            assert np.array_equal(mine, array, equal_nan=array.dtype.kind == "f"), name
    assert np.isnan(decode_answer(json_only, None)["j"].data[1]), "a JSON null reads as NaN"


@pytest.mark.parametrize("body", [b"[]", b"not json", b'{"outputs": [{"name": "x"}]}'])
def test_an_answer_that_is_not_v2_raises_what_the_client_maps_to_502(body):
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode_answer(body, None)


def test_measuring_reads_the_numeric_outputs_of_the_same_decoding_and_nothing_of_an_answer_not_v2():
    floats = np.array([0.25, -1.5], dtype=np.float32).tobytes()
    strings = serialize_byte_tensor(np.array([b"ab"], dtype=object)).item()
    header = json.dumps({"model_name": "m", "model_version": "2", "outputs": [
        {"name": "s", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(strings)}},
        {"name": "f", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": len(floats)}},
        {"name": "j", "datatype": "INT32", "shape": [2], "data": [7, -8]},
        {"name": "b", "datatype": "BOOL", "shape": [1], "data": [True]}]}).encode()
    version, tensors = answer_tensors(header + strings + floats, len(header))
    assert version == "2" and [t[:3] for t in tensors] == [("f", "FP32", (1, 2)), ("j", "INT32", (2,))]
    assert tensors[0][3].dtype == np.float32 and tensors[0][3].tolist() == [0.25, -1.5]
    assert tensors[1][3].dtype == np.int32 and tensors[1][3].tolist() == [7, -8]
    for body, length in ((b"[]", None), (b"not json", None), (header, len(header))):
        assert answer_tensors(body, length) == ("", [])  # the last: binary sections missing


def test_datatypes_map_to_numpy_as_tritonclient_maps_them():
    # The running sidecar no longer imports tritonclient.utils (3.4 MB of ml_dtypes in every pod):
    # its two maps are the sidecar's own, and must stay tritonclient's.
    import ml_dtypes
    from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

    from sidecar.protocol.datatypes import numpy_dtype, v2_datatype

    for datatype in ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
                     "FP32", "FP64", "BF16", "BYTES", "NOPE"):
        assert numpy_dtype(datatype) == triton_to_np_dtype(datatype), datatype
    for kind in (np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64,
                 np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.object_, np.bytes_, np.str_, np.complex64):
        assert v2_datatype(np.dtype(kind)) == np_to_triton_dtype(np.dtype(kind)), kind
