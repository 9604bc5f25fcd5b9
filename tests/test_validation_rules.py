"""The request checks of the compiled data plane (sidecar._dataplane), seen from Python: one
implementation for both wires, and the values the drift monitor reads decoded as numpy would.
Pure logic: the proxy tests send the same requests through a real Triton."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from sidecar.serving.refusals import Reason
from sidecar.serving.request_rules import load_request_rules
from sidecar.serving.validation import (
    InvalidRequest,
    Limits,
    build_model_spec,
    validate_decoded_request,
    validate_infer_request,
)

METADATA = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]},
                       {"name": "ids", "datatype": "INT64", "shape": [-1, 2]}],
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 1]},
                        {"name": "secret", "datatype": "FP32", "shape": [-1, 1]}]}
CONFIG = {"max_batch_size": 8, "input": [{"name": "ids", "optional": True}]}
SPEC = build_model_spec("m", "", METADATA, CONFIG, limits=Limits(1000, 64, reject_non_finite=True),
                        is_hidden=lambda name: name == "secret")


def _doc(**tensor: object) -> dict:
    return {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4], **tensor}]}


BAD = {
    "NaN": (_doc(data=[1, float("nan"), 3, 4]), Reason.NON_FINITE, "NaN/Infinity at element 1"),
    "overflow": (_doc(data=[1, 2, 3, 1e39]), Reason.NON_FINITE, "value 1e+39 overflows FP32 to infinity"),
    "bool among numbers": (_doc(data=[1, True, 3, 4]), Reason.DATATYPE, "FP32 data must be numbers, got true"),
    "short data": (_doc(data=[1, 2, 3]), Reason.SHAPE, "shape [1, 4] holds 4 values, 'data' has 3"),
    "hidden output": ({**_doc(), "outputs": [{"name": "secret"}]}, Reason.FILTERED_OUTPUT,
                      "output 'secret' of model m is not available outside the pod"),
    "unknown output": ({**_doc(), "outputs": [{"name": "nope"}]}, Reason.UNKNOWN_OUTPUT, "(outputs: scores)"),
    "wrong datatype": (_doc(datatype="FP64"), Reason.DATATYPE, "input 'features' must be FP32, got FP64"),
    "batch too large": (_doc(shape=[9, 4], data=[0] * 36), Reason.SHAPE, "batch size 9"),
    "shared memory": (_doc(parameters={"shared_memory_region": "r"}), Reason.SHARED_MEMORY, "shared-memory"),
    "bad priority": ({**_doc(), "parameters": {"priority": -1}}, Reason.PARAMETER,
                     "request parameter 'priority' must be an unsigned integer, got -1"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_http_and_grpc_refuse_alike_with_the_same_words(case: str) -> None:
    doc, reason, words = BAD[case]
    refusals = []
    for check in (lambda: validate_infer_request(SPEC, json.dumps(doc).encode()),
                  lambda: validate_decoded_request(SPEC, doc, b"")):
        with pytest.raises(InvalidRequest) as caught:
            check()
        refusals.append((caught.value.reason, caught.value.message, caught.value.model))
    assert refusals[0] == refusals[1]
    assert refusals[0][0] is reason and words in refusals[0][1] and refusals[0][2] == "m", refusals[0]


def test_a_duplicate_key_is_malformed() -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_infer_request(SPEC, b'{"inputs": [], "inputs": []}')
    assert caught.value.reason is Reason.MALFORMED and "duplicate key inputs" in caught.value.message


def test_the_values_drift_reads_are_decoded_as_numpy_would() -> None:
    doc = {"inputs": [{"name": "features", "shape": [2, 4], "datatype": "FP32", "data": [[1, 2, 3, 4.5], [5, 6, 7, 8]]},
                      {"name": "ids", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]}]}
    checked = validate_infer_request(SPEC, json.dumps(doc).encode())
    assert checked.elements == 12 and not checked.binary and checked.requested_outputs == ()
    (name, datatype, shape, features), (_, _, _, ids) = checked.inputs
    assert (name, datatype, shape) == ("features", "FP32", (2, 4))
    np.testing.assert_array_equal(features, np.array(doc["inputs"][0]["data"]))
    assert ids.dtype == np.int64 and ids.tolist() == [[1, 2], [3, 4]]


def test_binary_inputs_are_views_into_the_body() -> None:
    header = json.dumps({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 16}}]}).encode()
    body = header + struct.pack("<4f", 1, 2, 3, 4)
    checked = validate_infer_request(SPEC, body, len(header))
    assert checked.binary
    (_, _, shape, chunk), = checked.inputs
    assert shape == (1, 4) and np.frombuffer(chunk, "<f4").tolist() == [1, 2, 3, 4]
    with pytest.raises(InvalidRequest) as caught:
        validate_infer_request(SPEC, header + struct.pack("<4f", 1, float("inf"), 3, 4), len(header))
    assert caught.value.reason is Reason.NON_FINITE and caught.value.input == "features"


RULES = {"type": "object", "properties": {"parameters": {"required": ["tenant"]}},
         "x-tensors": {"features": {"exclusiveMinimum": 0}, "ids": {"enum": [1, 2]}}}


@pytest.mark.parametrize("doc, words, input", [
    ({**_doc(), "parameters": {}}, "request breaks r.json at $.parameters: 'tenant' is a required property", ""),
    ({**_doc(data=[1, 2, 0, 4]), "parameters": {"tenant": "a"}},
     "input 'features' breaks r.json: element 2 = 0 is not above the exclusive minimum 0", "features"),
    ({"inputs": [*_doc()["inputs"], {"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [2, 3]}],
      "parameters": {"tenant": "a"}}, "input 'ids' breaks r.json: element 1 = 3 is not one of [1, 2]", "ids"),
])
def test_a_rule_file_is_checked_by_the_data_plane_for_both_wires(tmp_path, doc, words, input) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(RULES))
    spec = build_model_spec("m", "", METADATA, CONFIG, limits=Limits(1000, 64, reject_non_finite=True),
                            rules=load_request_rules(path, model="m"))
    assert validate_infer_request(spec, json.dumps({**_doc(), "parameters": {"tenant": "a"}}).encode()).elements == 4
    for check in (lambda: validate_infer_request(spec, json.dumps(doc).encode()),
                  lambda: validate_decoded_request(spec, doc, b"")):  # the gRPC front's Python chain
        with pytest.raises(InvalidRequest) as caught:
            check()
        assert (caught.value.reason, caught.value.message, caught.value.input) == (Reason.BUSINESS_RULE, words, input)
