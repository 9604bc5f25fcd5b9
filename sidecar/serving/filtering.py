"""Output filtering: outputs that never leave the pod, and answers that must not leave it either.

Pure logic on bytes and documents; the proxy calls it on Triton's answers:
- `OutputFilter` says, per model, which outputs the `filtering.rules` hide (regexes, whole-name match).
- `screen_infer_response` removes hidden outputs from an infer answer, JSON or binary, and reports
  outputs holding NaN/±Inf (NaN, Infinity, or null in float data as MLServer writes NaN). Kept tensors
  are passed on byte for byte: hidden output objects are cut out of Triton's JSON text, and their
  binary sections out of the binary body; nothing is re-encoded. The rule is the compiled data
  plane's (sidecar._dataplane).
- `hide_in_metadata` / `hide_in_config` remove them from model metadata and config documents.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from sidecar._dataplane import AnswerNotV2
from sidecar._dataplane import screen_infer_response as _screen
from sidecar.config import FilterRule

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
    untouched when there is nothing to do (the common case costs a substring search). The rule is
    the data plane's (`dataplane/src/serving/filtering.rs`): hidden output objects are cut out of
    Triton's JSON text and their binary sections out of the body, the rest kept byte for byte."""
    try:
        new_body, new_length, dropped, non_finite = _screen(body, header_length, is_hidden, check_non_finite)
    except AnswerNotV2 as e:
        raise ResponseFormatError(str(e)) from None
    if new_body is None:
        return ScreenedResponse(body, header_length, dropped, non_finite)
    return ScreenedResponse(new_body, new_length, dropped, non_finite)
