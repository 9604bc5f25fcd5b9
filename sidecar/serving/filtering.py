"""Output filtering: outputs that never leave the pod, and answers that must not leave it either.

Pure logic on bytes and documents; the proxy calls it on Triton's answers:
- `OutputFilter` says, per model, which outputs the `filtering.rules` hide (regexes, whole-name match).
- `screen_infer_response` removes hidden outputs from an infer answer, JSON or binary, and reports
  outputs holding NaN/±Inf. Kept tensors are passed on byte for byte: hidden output objects are cut
  out of Triton's JSON text, and their binary sections out of the binary body; nothing is re-encoded.
- `hide_in_metadata` / `hide_in_config` remove them from model metadata and config documents.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import rapidjson

from sidecar.config import FilterRule
from sidecar.protocol.datatypes import FLOAT_DATATYPES

_NUMBER_MODE = rapidjson.NM_NATIVE | rapidjson.NM_NAN


#: Where each output object starts in Triton's compact JSON. Inside a JSON string every quote is
#: escaped, so these bytes can only be an object whose first key is "name"; the splice is verified
#: against the parsed document before it is used.
_OUTPUT_START = b'{"name":"'


_BINARY_DTYPE = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


#: Words servers write for non-finite floats in JSON (Triton: NaN, Infinity; MLServer: null); absent
#: from the text = no NaN/Inf in it. A null in float data is read as NaN.
_NON_FINITE_WORDS = (b"NaN", b"Infinity", b"null")


IsHidden = Callable[[str], bool]


class ResponseFormatError(ValueError):
    """Triton's answer is not what the v2 protocol says (unparsable JSON, sizes that do not add up)."""


class OutputFilter:
    """The filtering rules, compiled once; `for_model` is cached per model name."""

    def __init__(self, rules: Sequence[FilterRule]) -> None:
        self._rules = [(re.compile(r.model), tuple(re.compile(p) for p in r.drop_outputs)) for r in rules]
        self.for_model = lru_cache(maxsize=1024)(self._for_model)

    def _for_model(self, model: str) -> IsHidden | None:
        """A predicate on output names for `model`, or None when no rule names the model."""
        patterns = tuple(p for model_re, outputs in self._rules if model_re.fullmatch(model) for p in outputs)
        if not patterns:
            return None

        @lru_cache(maxsize=256)
        def is_hidden(output: str) -> bool:
            return any(p.fullmatch(output) for p in patterns)

        return is_hidden


def hide_in_metadata(doc: Mapping[str, Any], is_hidden: IsHidden) -> tuple[dict[str, Any], list[str]]:
    """Model metadata without hidden outputs; also the names removed."""
    out = dict(doc)
    outputs = doc.get("outputs", [])
    dropped = [o["name"] for o in outputs if isinstance(o, dict) and is_hidden(str(o.get("name")))]
    out["outputs"] = [o for o in outputs if not (isinstance(o, dict) and o.get("name") in dropped)]
    return out, dropped


def hide_in_config(doc: Mapping[str, Any], is_hidden: IsHidden) -> tuple[dict[str, Any], list[str]]:
    """Model config without hidden outputs (the `output` list, and ensemble steps' output maps)."""
    out = dict(doc)
    outputs = doc.get("output", [])
    dropped = [o["name"] for o in outputs if isinstance(o, dict) and is_hidden(str(o.get("name")))]
    out["output"] = [o for o in outputs if not (isinstance(o, dict) and o.get("name") in dropped)]
    scheduling = doc.get("ensemble_scheduling")
    if isinstance(scheduling, dict) and isinstance(scheduling.get("step"), list):
        steps = []
        for step in scheduling["step"]:
            if isinstance(step, dict) and isinstance(step.get("output_map"), dict):
                step = {**step, "output_map": {k: v for k, v in step["output_map"].items() if not is_hidden(str(v))}}
            steps.append(step)
        out["ensemble_scheduling"] = {**scheduling, "step": steps}
    return out, dropped


@dataclass(frozen=True)
class ScreenedResponse:
    body: bytes
    #: The new Inference-Header-Content-Length for a binary answer; None for a JSON answer.
    header_length: int | None
    dropped: list[str] = field(default_factory=list)
    #: Kept float outputs holding NaN or ±Inf (only looked for when asked).
    non_finite: list[str] = field(default_factory=list)


def screen_infer_response(body: bytes, header_length: int | None, *, is_hidden: IsHidden | None,
                          check_non_finite: bool) -> ScreenedResponse:
    """Remove hidden outputs from an infer answer and find non-finite ones; the body is returned
    untouched when there is nothing to do (the common case costs a substring search)."""
    if is_hidden is None and not check_non_finite:
        return ScreenedResponse(body, header_length)
    if header_length is None:
        if is_hidden is None and not any(w in body for w in _NON_FINITE_WORDS):
            return ScreenedResponse(body, None)
        return _screen_json(body, is_hidden, check_non_finite)
    return _screen_binary(body, header_length, is_hidden, check_non_finite)


def _parse(text: bytes) -> dict[str, Any]:
    try:
        doc = rapidjson.loads(text, number_mode=_NUMBER_MODE)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ResponseFormatError(f"Triton's answer is not valid JSON: {str(e)[:120]}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("outputs", []), list):
        raise ResponseFormatError("Triton's answer has no 'outputs' list")
    return doc


def _screen_json(body: bytes, is_hidden: IsHidden | None, check_non_finite: bool) -> ScreenedResponse:
    doc = _parse(body)
    outputs = doc.get("outputs", [])
    non_finite = []
    if check_non_finite and any(w in body for w in _NON_FINITE_WORDS):
        for o in outputs:
            if o.get("datatype") in FLOAT_DATATYPES and not _all_finite(o.get("data", [])):
                if not (is_hidden and is_hidden(o.get("name", ""))):
                    non_finite.append(o["name"])
    dropped = [o.get("name", "") for o in outputs if is_hidden is not None and is_hidden(o.get("name", ""))]
    if not dropped:
        return ScreenedResponse(body, None, [], non_finite)
    return ScreenedResponse(_drop_from_json(body, doc, set(dropped)), None, dropped, non_finite)


def _all_finite(data: Any) -> bool:
    try:
        return bool(np.isfinite(np.asarray(data, dtype=np.float64)).all())
    except (ValueError, TypeError):
        return True  # not numbers at all: not ours to judge


def _drop_from_json(text: bytes, doc: Mapping[str, Any], dropped: set[str]) -> bytes:
    """Cut the dropped output objects out of Triton's JSON text, keeping the others' bytes as they are.
    Falls back to re-encoding the document if the text is not laid out as Triton writes it."""
    outputs = doc["outputs"]
    starts = []
    pos = text.find(_OUTPUT_START)
    while pos != -1:
        starts.append(pos)
        pos = text.find(_OUTPUT_START, pos + 1)
    layout_ok = (
        len(starts) == len(outputs)
        and list(doc)[-1] == "outputs"
        and text.endswith(b"]}")
        and all(text[s - 1: s] == b"," for s in starts[1:])
        and text[starts[0] - 1: starts[0]] == b"[" if starts else False
    )
    if layout_ok:
        ends = [s - 1 for s in starts[1:]] + [len(text) - 2]
        pieces = [text[s:e] for s, e in zip(starts, ends, strict=True)]
        if all(_name_of(piece) == o.get("name") for piece, o in zip(pieces, outputs, strict=True)):
            kept = [piece for piece, o in zip(pieces, outputs, strict=True) if o.get("name") not in dropped]
            return text[: starts[0]] + b",".join(kept) + b"]}"
    rebuilt = dict(doc)
    rebuilt["outputs"] = [o for o in outputs if o.get("name") not in dropped]
    return json.dumps(rebuilt, separators=(",", ":")).encode()


def _name_of(piece: bytes) -> str | None:
    end = piece.find(b'"', len(_OUTPUT_START))
    try:
        return json.loads(piece[len(_OUTPUT_START) - 1: end + 1])  # type: ignore[no-any-return]
    except (ValueError, UnicodeDecodeError):
        return None


def _screen_binary(body: bytes, header_length: int, is_hidden: IsHidden | None,
                   check_non_finite: bool) -> ScreenedResponse:
    if not 0 < header_length <= len(body):
        raise ResponseFormatError(f"Inference-Header-Content-Length {header_length} is outside the answer")
    header_text = body[:header_length]
    doc = _parse(header_text)
    outputs = doc.get("outputs", [])
    sections: list[tuple[int, int]] = []  # (start, end) in body, per output; (0, 0) for JSON outputs
    offset = header_length
    for o in outputs:
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is None:
            sections.append((0, 0))
            continue
        if not isinstance(size, int) or size < 0 or offset + size > len(body):
            raise ResponseFormatError(f"binary_data_size of output {o.get('name')!r} runs past the answer")
        sections.append((offset, offset + size))
        offset += size
    if offset != len(body):
        raise ResponseFormatError("binary sizes do not add up to the answer's length")
    dropped = [o.get("name", "") for o in outputs if is_hidden is not None and is_hidden(o.get("name", ""))]
    non_finite = []
    if check_non_finite:
        view = memoryview(body)
        for o, (start, end) in zip(outputs, sections, strict=True):
            if o.get("name") in dropped or o.get("datatype") not in FLOAT_DATATYPES:
                continue
            if end > start:
                values = np.frombuffer(view[start:end], dtype=_BINARY_DTYPE[o["datatype"]])
                finite = bool(np.isfinite(values).all())
            elif any(w in header_text for w in _NON_FINITE_WORDS):
                finite = _all_finite(o.get("data", []))
            else:
                finite = True
            if not finite:
                non_finite.append(o["name"])
    if not dropped:
        return ScreenedResponse(body, header_length, [], non_finite)
    new_header = _drop_from_json(header_text, doc, set(dropped))
    kept_binary = [body[s:e] for o, (s, e) in zip(outputs, sections, strict=True)
                   if e > s and o.get("name") not in dropped]
    return ScreenedResponse(new_header + b"".join(kept_binary), len(new_header), dropped, non_finite)

