"""The generate extension's pure logic: the body check, the event splitter, event screening, and
golden files for generative models. No server: these are decisions on bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.config import GenerationSection
from sidecar.golden.cases import GoldenFileError, load_golden_file
from sidecar.protocol.sse import EventSplitter
from sidecar.serving.generation import GenerateLimits, check_generate_request, screen_event
from sidecar.serving.refusals import Refusal
from sidecar.serving.validation import InputSpec, Limits, ModelSpec

SPEC = ModelSpec(model="llm", version="", inputs={
    "text_input": InputSpec("text_input", "BYTES", (1,)),
    "max_tokens": InputSpec("max_tokens", "INT32", (1,), optional=True),
    "temperature_in": InputSpec("temperature_in", "FP32", (-1,), optional=True),
}, outputs={"text_output": "BYTES"}, hidden_outputs=frozenset(), max_batch_size=0,
    limits=Limits(1000, 1000, True), decoupled=True)
LIMITS = GenerateLimits.for_model(GenerationSection(max_tokens=100, max_tokens_per_model={"llm": 50}), "llm", 32)


def _refusal(body: dict) -> Refusal:
    with pytest.raises(Refusal) as caught:
        check_generate_request(SPEC, json.dumps(body).encode(), LIMITS)
    return caught.value


def test_a_body_of_inputs_and_known_parameters_passes() -> None:
    body = {"text_input": "hi", "max_tokens": 50, "temperature": 0, "seed": 7, "id": "r1",
            "parameters": {"top_k": 1, "stop": ["\n", "."]}, "temperature_in": [0.5, 1]}
    assert check_generate_request(SPEC, json.dumps(body).encode(), LIMITS)["seed"] == 7


@pytest.mark.parametrize(("body", "reason", "field"), [
    ({"text_input": "hi", "max_tokens": 51}, "too_many_tokens", "max_tokens"),  # the per-model ceiling
    ({"text_input": "hi", "max_new_tokens": 51}, "too_many_tokens", "max_new_tokens"),
    ({"text_input": "hi", "max_tokens": True}, "datatype", "max_tokens"),
    ({"text_input": "hi", "max_tokens": 2**40}, "out_of_range", "max_tokens"),
    ({"text_input": "hi", "top_p": float("nan")}, "non_finite", "top_p"),
    ({"text_input": "hi", "parameters": {"tmp": 1}}, "unknown_field", "parameters.tmp"),
    ({"text_input": "hi", "parameters": [1]}, "parameter", "parameters"),
    ({"text_input": "é" * 17}, "bytes_element_too_long", "text_input"),  # 34 bytes > 32
    ({"text_input": "hi", "temperature_in": "warm"}, "datatype", "temperature_in"),
    ({"text_input": [["nested"]]}, "shape", "text_input"),
    ({"text_input": "hi", "id": 3}, "schema", "id"),
])
def test_bad_bodies_are_refused_naming_the_field(body: dict, reason: str, field: str) -> None:
    refusal = _refusal(body)
    assert (refusal.reason.value, refusal.body()["field"], refusal.status) == (reason, field, 400), refusal.body()


def test_malformed_json_and_duplicate_keys_are_malformed() -> None:
    for raw in (b"{", b'{"text_input": "a", "text_input": "b"}'):
        with pytest.raises(Refusal) as caught:
            check_generate_request(SPEC, raw, LIMITS)
        assert caught.value.reason.value == "malformed"


def test_events_are_cut_as_soon_as_their_blank_line_arrives() -> None:
    splitter = EventSplitter()
    assert list(splitter.feed(b'data: {"a": 1}\n\ndata: {"b"')) == [b'{"a": 1}']
    assert splitter.pending
    assert list(splitter.feed(b': 2}\r\n\r\n: a comment\n\n')) == [b'{"b": 2}']
    assert not splitter.pending
    assert list(splitter.feed(b"data: line one\ndata: line two\n\n")) == [b"line one\nline two"]


def test_screening_drops_hidden_outputs_and_finds_non_finite_fields() -> None:
    raw = b'{"model_name":"llm","text_output":"hi","logprob":NaN,"secret":"x"}'
    screened = screen_event(raw, is_hidden=lambda name: name == "secret", check_non_finite=True)
    assert screened.dropped == ["secret"] and screened.non_finite == ["logprob"]
    assert b"secret" not in screened.data and b"text_output" in screened.data
    untouched = b'{"model_name":"llm","text_output":"hi"}'
    assert screen_event(untouched, is_hidden=lambda n: False, check_non_finite=True).data is untouched
    assert screen_event(b'{"error":"Stub process is not healthy."}', is_hidden=None,
                        check_non_finite=True).error == "Stub process is not healthy."


def _golden(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "case.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_generate_golden_case_loads_with_its_text_and_bounds(tmp_path: Path) -> None:
    case = load_golden_file(_golden(tmp_path, {
        "endpoint": "generate_stream", "request": {"text_input": "a b", "max_tokens": 2},
        "expect": {"status": 200, "text": {"field": "text_output", "regex": "^a b$"},
                   "max_first_event_s": 0.5, "max_total_s": 2}}), model="llm")
    assert case.is_generate and case.max_first_event_s == 0.5 and case.max_total_s == 2
    assert case.text is not None and case.text.mismatch("a b") is None
    assert case.text.mismatch("b a") == "text_output expected matching '^a b$', got 'b a'"


@pytest.mark.parametrize(("doc", "where"), [
    ({"endpoint": "generate_stream", "request": {"text_input": "a"}, "expect": {"status": 200}}, "$.expect"),
    ({"endpoint": "generate", "request": {"text_input": "a"},
      "expect": {"text": {"field": "t", "equals": "a", "contains": "a"}}}, "$.expect.text"),
    ({"endpoint": "generate", "request": {"text_input": "a"},
      "expect": {"text": {"field": "t", "equals": "a"}, "max_first_event_s": 1}}, "$.expect.max_first_event_s"),
    ({"endpoint": "generate", "request": {"text_input": "a"},
      "expect": {"text": {"field": "t", "regex": "("}}}, "$.expect.text.regex"),
    ({"request": {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]},
      "expect": {"text": {"field": "t", "equals": "a"}}}, "$.expect.text"),
    ({"endpoint": "chat", "request": {}, "expect": {}}, "$.endpoint"),
])
def test_broken_generate_golden_files_name_the_place(tmp_path: Path, doc: dict, where: str) -> None:
    with pytest.raises(GoldenFileError, match=rf"at {where.replace('$', '[$]')}"):
        load_golden_file(_golden(tmp_path, doc), model="llm")
