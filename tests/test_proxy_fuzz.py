"""Property-based fuzzing of request bodies and headers against the real sidecar and Triton: the
sidecar never answers 5xx to a bad request, and Triton's own success counter proves that every request
the sidecar refused never ran."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proxy_support import CREDIT_RULE, SidecarThread, proxy_config, triton_successes

PATH = "/v2/models/credit_risk/infer"
BASE: dict[str, Any] = {"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                    "data": [0.25] * 128}]}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
keys = st.sampled_from(["id", "parameters", "inputs", "outputs", "name", "shape", "datatype", "data",
                        "binary_data_output", "binary_data_size", "binary_data", "priority", "timeout",
                        "sequence_id", "shared_memory_region", "classification", "income_prob", "scores"])


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    """A valid request with a few random edits: the bad requests that get furthest."""
    doc = copy.deepcopy(BASE)
    tensor = doc["inputs"][0]
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["top", "tensor", "tensor-params", "top-params", "outputs", "shape",
                                       "data", "drop"]))
        if target == "top":
            doc[draw(keys)] = draw(json_values)
        elif target == "tensor":
            tensor[draw(keys)] = draw(json_values)
        elif target == "tensor-params":
            tensor.setdefault("parameters", {})[draw(keys)] = draw(json_values)
        elif target == "top-params":
            doc.setdefault("parameters", {})[draw(keys)] = draw(json_values)
        elif target == "outputs":
            doc["outputs"] = draw(st.lists(st.one_of(
                st.fixed_dictionaries({"name": st.sampled_from(["scores", "income_prob", "nope"])},
                                      optional={"parameters": st.dictionaries(keys, scalars, max_size=2)}),
                json_values), max_size=3))
        elif target == "shape":
            tensor["shape"] = draw(st.lists(st.integers(-2, 200), max_size=3))
        elif target == "data":
            data = list(tensor["data"]) if isinstance(tensor.get("data"), list) else [0.25] * 128
            data[draw(st.integers(0, len(data) - 1))] = draw(scalars)
            tensor["data"] = data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data
        else:
            container = draw(st.sampled_from([doc, tensor]))
            if container:
                container.pop(draw(st.sampled_from(sorted(container))), None)
    return json.dumps(doc, allow_nan=True).encode()


@st.composite
def truncated_or_garbled(draw: st.DrawFn) -> bytes:
    text = json.dumps(BASE).encode()
    if draw(st.booleans()):
        return text[: draw(st.integers(0, len(text) - 1))]
    position = draw(st.integers(0, len(text) - 1))
    return text[:position] + draw(st.binary(min_size=1, max_size=8)) + text[position + 1:]


bodies = st.one_of(mutated_requests(), truncated_or_garbled(), st.binary(max_size=64),
                   json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()))
headers = st.fixed_dictionaries({}, optional={
    "Content-Type": st.sampled_from(["application/json", "application/octet-stream", "text/plain",
                                     "multipart/form-data; boundary=x", "application/json; charset=utf-8"]),
    "Inference-Header-Content-Length": st.one_of(st.integers(-5, 4000).map(str), st.sampled_from(["", "x", "1e3"])),
    "Content-Encoding": st.sampled_from(["identity", "gzip", "x-lzw"]),
    "X-Request-ID": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
})


def test_fuzzed_requests_never_get_5xx_and_refused_ones_never_reach_triton(triton):
    config = proxy_config(triton, models=["credit_risk"], rules=(CREDIT_RULE,),
                          probes={"interval_s": 3600, "jitter": 0.0})
    outcomes: list[tuple[int, dict[str, Any]]] = []
    with SidecarThread(config) as sidecar:
        before = triton_successes(triton, "credit_risk")  # after the one start-up probe round

        @settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(body=bodies, extra_headers=headers)
        def one_request(body: bytes, extra_headers: dict[str, str]) -> None:
            status, answer_headers, answer = sidecar.post(PATH, body, extra_headers)
            assert status < 500, (status, body[:200], extra_headers, answer[:300])
            if status != 200:
                doc = json.loads(answer)
                assert doc["error"], answer
                if "reason" in doc:
                    assert answer_headers.get("X-Request-ID")
            outcomes.append((status, extra_headers))

        one_request()
        after = triton_successes(triton, "credit_risk")
    answered = sum(1 for status, _ in outcomes if status == 200)
    refused = len(outcomes) - answered
    assert refused > 100, f"the fuzzer produced mostly valid requests ({answered} of {len(outcomes)})"
    assert after - before == answered, (
        f"Triton ran {after - before} inferences, the sidecar passed {answered}: a refused request reached Triton")
