"""Triton's generate extension, wire-free: the request check, the server-sent-event stream, screening.

`POST .../generate` and `.../generate_stream` take one flat JSON object: each top-level key is one of
the model's inputs (a scalar or a flat list) or a request parameter, and `parameters` may hold more
parameters. Triton turns what it does not recognise into parameters without a word, and answers 500
to a value of the wrong type, so the sidecar checks the body first (`check_generate_request`):
unknown keys, wrong types, oversized text, a max_tokens-like value above the model's ceiling.

Triton streams `data: {json}\n\n` events (server-sent events). `EventSplitter` (sidecar.protocol.sse)
cuts the byte stream into events as it arrives, without waiting for more than one event;
`screen_event` removes hidden outputs and finds NaN/Inf in numeric fields and Triton's own error
events. An event that needs no change is passed on byte for byte.

The rules themselves are the data plane's (`dataplane/src/serving/generation.rs`, issue 30); what
stays here are the types the fronts hold and the calls into `sidecar._dataplane`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import rapidjson

from sidecar._dataplane import AnswerNotV2, GenerateRefused
from sidecar._dataplane import GenerateLimits as NativeGenerateLimits
from sidecar._dataplane import generate_event_needs_screening as _needs_screening
from sidecar._dataplane import screen_generate_event as _screen_event
from sidecar.config import GenerationSection
from sidecar.protocol.sse import sse_event
from sidecar.serving.filtering import IsHidden, ResponseFormatError
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.validation import InvalidRequest, ModelSpec, parse_json

#: What Triton says when `generate` (one answer) meets a model that sent several responses.
_SEVERAL_RESPONSES = "exactly 1 response"


@dataclass(frozen=True)
class GenerateLimits:
    """What a generate request to one model may ask for: built once per model and configuration
    (`ServingCore.generate_limits`), with the data plane's copy that runs the check."""

    #: Longest text input, in UTF-8 bytes (validation.max_bytes_element).
    max_text_bytes: int
    #: Ceiling on every `token_limit_keys` value for this model (generation.max_tokens[_per_model]).
    max_tokens: int
    token_limit_keys: frozenset[str]
    #: Keys accepted besides the model's inputs (generation.parameters and token_limit_keys).
    parameters: frozenset[str]
    native: NativeGenerateLimits = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "native", NativeGenerateLimits(
            self.max_text_bytes, self.max_tokens, sorted(self.token_limit_keys), sorted(self.parameters)))

    @classmethod
    def for_model(cls, settings: GenerationSection, model: str, max_text_bytes: int) -> GenerateLimits:
        return cls(max_text_bytes, settings.max_tokens_for(model), frozenset(settings.token_limit_keys),
                   frozenset(settings.parameters) | frozenset(settings.token_limit_keys))


class GenerateBody(Mapping[str, Any]):
    """A generate body that passed: its JSON object, read on first use (the check itself runs in the
    data plane and hands nothing back; no caller on the request path reads the object)."""

    __slots__ = ("_body", "_doc")

    def __init__(self, body: bytes) -> None:
        self._body = body
        self._doc: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        if self._doc is None:
            self._doc = parse_json(self._body)
        return self._doc

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def check_generate_request(spec: ModelSpec, body: bytes, limits: GenerateLimits) -> GenerateBody:
    """The body when Triton can take it; else a Refusal naming the field. The checks are the data
    plane's (`dataplane/src/serving/generation.rs`): unknown keys, wrong types, oversized text, a
    max_tokens-like value above the model's ceiling, missing inputs; the first in document order."""
    try:
        limits.native.check(spec.native, body)
    except GenerateRefused as e:
        label, message, name, is_input = e.args
        reason = Reason(label)
        if reason is Reason.MALFORMED:
            raise InvalidRequest(reason, message) from None  # as parse_json says it: no model named
        extra = ({"field": name, "input": name} if is_input else {"field": name}) if name else {}
        raise Refusal(reason, message, model=spec.model, **extra) from None
    return GenerateBody(body)


@dataclass
class ScreenedEvent:
    """One generate answer (or one event of a stream) as it may leave the pod."""

    data: bytes
    dropped: list[str] = field(default_factory=list)
    non_finite: list[str] = field(default_factory=list)
    #: Triton's own error, when the event is `{"error": ...}`.
    error: str = ""


def needs_screening(data: bytes, *, is_hidden: IsHidden | None, check_non_finite: bool) -> bool:
    """False when the event can be passed on unparsed: no filtering rule for the model, no error key,
    and no NaN/Infinity word anywhere in its text (the common case: most events are one token)."""
    return _needs_screening(data, is_hidden is not None, check_non_finite)


def screen_event(data: bytes, *, is_hidden: IsHidden | None, check_non_finite: bool) -> ScreenedEvent:
    """Hidden outputs removed, NaN/Inf fields found, errors named. The rule is the data plane's
    (`dataplane/src/serving/generation.rs`): hidden members are cut out of Triton's text and the
    others kept byte for byte; an event that needs no change is the very `data` passed in."""
    try:
        new_data, dropped, non_finite, error = _screen_event(data, is_hidden, check_non_finite)
    except AnswerNotV2 as e:
        raise ResponseFormatError(str(e)) from None
    return ScreenedEvent(data if new_data is None else new_data, dropped, non_finite, error or "")


def is_several_responses_error(message: str) -> bool:
    return _SEVERAL_RESPONSES in message


def error_event(refusal: Refusal) -> bytes:
    """How a stream that already began says it failed: an event like Triton's own error events, with
    the sidecar's `reason`, so a client reading Triton's format recognises it."""
    return sse_event(rapidjson.dumps(refusal.body()).encode())

