"""Triton's generate extension, wire-free: the request check, the server-sent-event stream, screening.

`POST .../generate` and `.../generate_stream` take one flat JSON object: each top-level key is one of
the model's inputs (a scalar or a flat list) or a request parameter, and `parameters` may hold more
parameters. Triton turns what it does not recognise into parameters without a word, and answers 500
to a value of the wrong type, so the sidecar checks the body first (`check_generate_request`):
unknown keys, wrong types, oversized text, a max_tokens-like value above the model's ceiling.

Triton streams `data: {json}\n\n` events (server-sent events). `EventSplitter` cuts the byte stream
into events as it arrives, without waiting for more than one event; `screen_event` removes hidden
outputs and finds NaN/Inf in numeric fields and Triton's own error events. An event that needs no
change is passed on byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import rapidjson

from sidecar.config import GenerationSection
from sidecar.messages import cut
from sidecar.protocol.sse import sse_event
from sidecar.serving.filtering import IsHidden, ResponseFormatError
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.validation import ModelSpec, parse_json

#: Keys of every generate answer that are not outputs.
_ENVELOPE_KEYS = frozenset({"model_name", "model_version", "id"})


#: Request keys that are neither inputs nor parameters in the generate extension.
_REQUEST_KEYS = frozenset({"id", "parameters"})


_INT_RANGE = {"INT8": (-(2**7), 2**7 - 1), "INT16": (-(2**15), 2**15 - 1), "INT32": (-(2**31), 2**31 - 1),
              "INT64": (-(2**63), 2**63 - 1), "UINT8": (0, 2**8 - 1), "UINT16": (0, 2**16 - 1),
              "UINT32": (0, 2**32 - 1), "UINT64": (0, 2**64 - 1)}


_FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64", "BF16"})


_NUMBER_MODE = rapidjson.NM_NATIVE | rapidjson.NM_NAN


#: What Triton says when `generate` (one answer) meets a model that sent several responses.
_SEVERAL_RESPONSES = "exactly 1 response"


@dataclass(frozen=True)
class GenerateLimits:
    max_text_bytes: int
    max_tokens: int
    token_limit_keys: frozenset[str]
    parameters: frozenset[str]

    @classmethod
    def for_model(cls, settings: GenerationSection, model: str, max_text_bytes: int) -> GenerateLimits:
        return cls(max_text_bytes, settings.max_tokens_for(model), frozenset(settings.token_limit_keys),
                   frozenset(settings.parameters) | frozenset(settings.token_limit_keys))


def _refuse(spec: ModelSpec, reason: Reason, message: str, name: str, *, is_input: bool = False) -> Refusal:
    extra = {"field": name, "input": name} if is_input else {"field": name}
    return Refusal(reason, message, model=spec.model, **extra)


def check_generate_request(spec: ModelSpec, body: bytes, limits: GenerateLimits) -> dict[str, Any]:
    """The body's JSON object when Triton can take it; else a Refusal naming the field."""
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise Refusal(Reason.SCHEMA, "a generate request is one JSON object: each key an input of the model "
                                     "or a parameter", model=spec.model)
    for name, value in doc.items():
        if name in spec.inputs:
            _check_input(spec, name, value, limits)
        elif name == "id":
            if not isinstance(value, str):
                raise _refuse(spec, Reason.SCHEMA, "'id' must be a string", name)
        elif name == "parameters":
            if not isinstance(value, dict):
                raise _refuse(spec, Reason.PARAMETER, "'parameters' must be an object of parameters", name)
            for key, item in value.items():
                _check_parameter(spec, key, item, limits, f"parameters.{key}")
        else:
            _check_parameter(spec, name, value, limits, name)
    missing = sorted(n for n, i in spec.inputs.items() if not i.optional and n not in doc)
    if missing:
        raise _refuse(spec, Reason.MISSING_INPUT, f"model {spec.model} requires input {missing[0]!r}", missing[0],
                      is_input=True)
    return doc


def _check_parameter(spec: ModelSpec, key: str, value: Any, limits: GenerateLimits, where: str) -> None:
    if key not in limits.parameters:
        known = ", ".join(sorted(spec.inputs))
        raise _refuse(spec, Reason.UNKNOWN_FIELD, f"{cut(where, 80)!r} is neither an input of model {spec.model} "
                                                  f"({known}) nor a parameter the sidecar knows "
                                                  "(generation.parameters)", cut(where, 80))
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, (str, int, float, bool)) or item is None:
            raise _refuse(spec, Reason.PARAMETER, f"parameter {where!r} must be a string, number or boolean "
                                                  "(or a list of them)", where)
        if isinstance(item, float) and not math.isfinite(item):
            raise _refuse(spec, Reason.NON_FINITE, f"parameter {where!r} is NaN or infinite", where)
    if key in limits.token_limit_keys:
        _check_token_limit(spec, where, value, limits)


def _check_token_limit(spec: ModelSpec, where: str, value: Any, limits: GenerateLimits,
                       is_input: bool = False) -> None:
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise _refuse(spec, Reason.DATATYPE, f"{where!r} must be a whole number of tokens, got {cut(repr(item))}",
                          where, is_input=is_input)
        if item > limits.max_tokens:
            raise _refuse(spec, Reason.TOO_MANY_TOKENS, f"{where!r} is {item}, above the ceiling of "
                                                        f"{limits.max_tokens} tokens for model {spec.model} "
                                                        "(generation.max_tokens)", where, is_input=is_input)


def _check_input(spec: ModelSpec, name: str, value: Any, limits: GenerateLimits) -> None:
    tensor = spec.inputs[name]
    items = value if isinstance(value, list) else [value]
    datatype = tensor.datatype
    for item in items:
        if isinstance(item, (list, dict)) or item is None:
            raise _refuse(spec, Reason.SHAPE, f"input {name!r} takes a value or a flat list of values", name,
                          is_input=True)
        if datatype == "BYTES":
            ok = isinstance(item, str)
            if ok and len(item) * 4 > limits.max_text_bytes and len(item.encode()) > limits.max_text_bytes:
                raise _refuse(spec, Reason.BYTES_TOO_LONG, f"input {name!r} is longer than {limits.max_text_bytes} "
                                                           "bytes (validation.max_bytes_element)", name, is_input=True)
        elif datatype == "BOOL":
            ok = isinstance(item, bool)
        elif datatype in _FLOAT_TYPES:
            ok = isinstance(item, (int, float)) and not isinstance(item, bool)
            if ok and not math.isfinite(item):
                raise _refuse(spec, Reason.NON_FINITE, f"input {name!r} is NaN or infinite", name, is_input=True)
        elif datatype in _INT_RANGE:
            ok = isinstance(item, int) and not isinstance(item, bool)
            low, high = _INT_RANGE[datatype]
            if ok and not low <= item <= high:
                raise _refuse(spec, Reason.OUT_OF_RANGE, f"input {name!r}: {item} does not fit {datatype}", name,
                              is_input=True)
        else:
            ok = True  # a datatype the generate extension has no JSON for: Triton's to judge
        if not ok:
            raise _refuse(spec, Reason.DATATYPE, f"input {name!r} is {datatype}; got {_kind(item)}", name,
                          is_input=True)
    if all(d > 0 for d in tensor.shape) and tensor.shape and math.prod(tensor.shape) != len(items):
        raise _refuse(spec, Reason.SHAPE, f"input {name!r} holds {math.prod(tensor.shape)} value(s) "
                                          f"(shape {list(tensor.shape)}), got {len(items)}", name, is_input=True)
    if name in limits.token_limit_keys:
        _check_token_limit(spec, name, value, limits, is_input=True)


def _kind(value: Any) -> str:
    return {bool: "a boolean", str: "a string", int: "an integer", float: "a number"}.get(type(value), "a value")


@dataclass
class ScreenedEvent:
    """One generate answer (or one event of a stream) as it may leave the pod."""

    data: bytes
    dropped: list[str] = field(default_factory=list)
    non_finite: list[str] = field(default_factory=list)
    #: Triton's own error, when the event is `{"error": ...}`.
    error: str = ""
    doc: dict[str, Any] = field(default_factory=dict)


#: Words Triton writes for non-finite floats in JSON; absent from an event = nothing to look for.
_NON_FINITE_WORDS = (b"NaN", b"Infinity")


def needs_screening(data: bytes, *, is_hidden: IsHidden | None, check_non_finite: bool) -> bool:
    """False when the event can be passed on unparsed: no filtering rule for the model, no error key,
    and no NaN/Infinity word anywhere in its text (the common case: most events are one token)."""
    if is_hidden is not None or b'"error"' in data:
        return True
    return check_non_finite and any(word in data for word in _NON_FINITE_WORDS)


def screen_event(data: bytes, *, is_hidden: IsHidden | None, check_non_finite: bool) -> ScreenedEvent:
    """Hidden outputs removed (the event re-encoded only then), NaN/Inf fields found, errors named."""
    try:
        doc = rapidjson.loads(data, number_mode=_NUMBER_MODE)
    except (ValueError, UnicodeDecodeError) as e:
        raise ResponseFormatError(f"an event that is not JSON: {cut(str(e))}") from e
    if not isinstance(doc, dict):
        raise ResponseFormatError("an event that is not a JSON object")
    if "error" in doc:
        return ScreenedEvent(data, error=str(doc["error"]), doc=doc)
    screened = ScreenedEvent(data, doc=doc)
    if is_hidden is not None:
        screened.dropped = [k for k in doc if k not in _ENVELOPE_KEYS and is_hidden(k)]
        if screened.dropped:
            for key in screened.dropped:
                del doc[key]
            screened.data = rapidjson.dumps(doc, number_mode=_NUMBER_MODE).encode()
    if check_non_finite:
        screened.non_finite = [k for k, v in doc.items() if _has_non_finite(v)]
    return screened


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


def is_several_responses_error(message: str) -> bool:
    return _SEVERAL_RESPONSES in message


def error_event(refusal: Refusal) -> bytes:
    """How a stream that already began says it failed: an event like Triton's own error events, with
    the sidecar's `reason`, so a client reading Triton's format recognises it."""
    return sse_event(rapidjson.dumps(refusal.body()).encode())

