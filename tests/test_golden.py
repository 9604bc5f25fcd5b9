"""Golden files and the comparison of answers, as pure logic (no Triton needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sidecar.golden.cases import GoldenFileError, ReceivedOutput, dump_golden_case, load_golden_dir, load_golden_file
from sidecar.golden.compare import compare_outputs

REPO = Path(__file__).resolve().parent.parent


def _case_file(tmp_path: Path, body: dict, name: str = "c.json") -> Path:
    path = tmp_path / "m" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    return path


def _scores_case(tmp_path: Path, expected: list, **tolerance) -> object:
    body = {
        "request": {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]},
        "expect": {"status": 200, "outputs": {"scores": {"datatype": "FP32", "shape": [1, len(expected)],
                                                         "data": expected, **tolerance}}},
    }
    return load_golden_file(_case_file(tmp_path, body), model="m")


def _answer(values: list[float], datatype: str = "FP32", shape: tuple[int, ...] | None = None) -> dict:
    data = np.array(values, dtype=np.float32)
    return {"scores": ReceivedOutput(datatype, shape or (1, len(values)), data)}


def test_every_shipped_model_has_a_normal_a_boundary_and_an_abnormal_case():
    cases = load_golden_dir(REPO / "golden_requests")
    assert set(cases) >= {"credit_risk", "image_classifier"}
    for model, model_cases in cases.items():
        names = {c.name for c in model_cases}
        assert "normal" in names and "boundary" in names, model
        assert any(c.expects_error and 400 <= c.expect_status < 500 for c in model_cases), model


def test_values_within_atol_plus_rtol_times_expected_pass(tmp_path):
    case = _scores_case(tmp_path, [0.7310], atol=1e-4, rtol=0.0)
    assert compare_outputs(case, _answer([0.73109])) == []
    mismatches = compare_outputs(case, _answer([0.7312]))
    assert [str(m) for m in mismatches] == ["scores[0] expected 0.7310±0.0001, got 0.7312"]


def test_relative_tolerance_scales_with_the_expected_value(tmp_path):
    case = _scores_case(tmp_path, [1000.0], atol=0.0, rtol=1e-3)
    assert compare_outputs(case, _answer([1000.9])) == []
    assert compare_outputs(case, _answer([1001.5]))


def test_nan_in_an_answer_fails_unless_the_golden_file_expects_it(tmp_path):
    case = _scores_case(tmp_path, [0.7310, 0.5])
    mismatches = compare_outputs(case, _answer([float("nan"), 0.5]))
    assert [str(m) for m in mismatches] == ["scores[0] expected 0.7310±8.3e-05, got nan"]
    assert compare_outputs(case, _answer([float("inf"), 0.5]))
    expects_nan = _scores_case(tmp_path, ["NaN", "Infinity"])
    assert expects_nan.allows_non_finite
    assert compare_outputs(expects_nan, _answer([float("nan"), float("inf")])) == []
    assert compare_outputs(expects_nan, _answer([0.1, float("-inf")]))


def test_datatype_and_shape_must_match_exactly(tmp_path):
    case = _scores_case(tmp_path, [0.5, 0.5])
    assert str(compare_outputs(case, _answer([0.5, 0.5], datatype="FP64"))[0]) == \
        "scores datatype expected FP32, got FP64"
    assert str(compare_outputs(case, _answer([0.5, 0.5], shape=(2, 1)))[0]) == \
        "scores shape expected [1, 2], got [2, 1]"
    assert str(compare_outputs(case, {})[0]) == "output scores missing from the answer"


def test_many_differences_are_summarised(tmp_path):
    case = _scores_case(tmp_path, [0.0] * 10)
    messages = [str(m) for m in compare_outputs(case, _answer([1.0] * 10))]
    assert len(messages) == 4 and messages[-1] == "scores: 7 more elements differ"


def test_bytes_outputs_compare_as_bytes_and_are_quoted_as_the_file_and_the_answer_have_them(tmp_path):
    body = {
        "request": {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]},
        "expect": {"status": 200, "outputs": {"label": {"datatype": "BYTES", "shape": [5],
                                                        "data": ["cat", "dog", "it's", "a", "b"]}}},
    }
    case = load_golden_file(_case_file(tmp_path, body), model="m")
    same = np.array([b"cat", "dog", b"it's", b"a", b"b"], dtype=np.object_)
    assert compare_outputs(case, {"label": ReceivedOutput("BYTES", (5,), same)}) == []
    other = np.array([b"cow\xff", "dog", b"its", b"x", b"y"], dtype=np.object_)
    assert [str(m) for m in compare_outputs(case, {"label": ReceivedOutput("BYTES", (5,), other)})] == [
        "label[0] expected 'cat', got b'cow\\xff'", "label[2] expected \"it's\", got b'its'",
        "label[3] expected 'a', got b'x'", "label: 1 more elements differ"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("{not json", "not valid JSON (line 1, column 2)"),
        (json.dumps({"expect": {"status": 400}}), "at $: 'request' is a required property"),
        (json.dumps({"request": {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0]}]},
                     "expect": {"status": 400}}), "at $.request.inputs[0].data: 1 values, but shape [2] holds 2"),
        (json.dumps({"request": {"inputs": [{"name": "x", "shape": [1], "datatype": "FP99", "data": [1]}]},
                     "expect": {"status": 400}}), "at $.request.inputs[0].datatype:"),
        (json.dumps({"request": {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]},
                     "expect": {"status": 200}}), "a status-200 case needs 'outputs'"),
        (json.dumps({"request": {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]},
                     "expect": {"status": 200, "outputs": {"y": {"datatype": "FP32", "shape": [1],
                                                                 "data": ["high"]}}}}),
         "at $.expect.outputs.y.data[0]: expected a number, got 'high'"),
        (json.dumps({"request": {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]},
                     "expect": {"status": 400}, "surprise": 1}), "Additional properties are not allowed"),
    ],
)
def test_a_malformed_golden_file_is_named_with_its_json_path(tmp_path, body, expected):
    path = tmp_path / "m" / "bad.json"
    path.parent.mkdir(parents=True)
    path.write_text(body)
    with pytest.raises(GoldenFileError) as e:
        load_golden_dir(tmp_path)
    assert str(e.value).startswith(f"{path}: ")
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_golden_files_are_accepted(tmp_path):
    path = tmp_path / "m" / "case.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("request:\n  inputs:\n  - {name: x, shape: [1], datatype: INT32, data: [3]}\n"
                    "expect:\n  status: 400\n  error_contains: negative\n")
    (case,) = load_golden_dir(tmp_path)["m"]
    assert case.name == "case" and case.expect_status == 400 and case.error_contains == "negative"


def test_yaml_exponent_numbers_without_a_dot_are_numbers(tmp_path):
    path = tmp_path / "m" / "case.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("request:\n  inputs:\n  - {name: x, shape: [1], datatype: FP32, data: [1e-3]}\n"
                    "expect:\n  outputs:\n    y: {datatype: FP32, shape: [1], data: [2E+2], atol: 1e-05}\n")
    (case,) = load_golden_dir(tmp_path)["m"]
    assert case.outputs["y"].atol == 1e-05 and case.outputs["y"].data[0] == 200.0


def test_written_golden_files_read_back_the_same(tmp_path):
    original = json.loads((REPO / "golden_requests" / "credit_risk" / "normal.json").read_text())
    text = dump_golden_case(original)
    assert json.loads(text) == original
    assert '"data": [' in text  # data stays on one line for people reading diffs
