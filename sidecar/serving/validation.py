"""Request validation before anything reaches Triton, derived per model from its metadata and config.

Pure logic: bytes in, a verdict out; no I/O and no aiohttp. The proxy builds one `ModelSpec` per model
(and version) from Triton's answers, caches it, and calls `validate_infer_request` for every request.

The checks themselves are the data plane's, in Rust (`dataplane/src/serving/validation.rs`, reached
through `sidecar._dataplane.RequestSpec`): one implementation for every wire, each problem refused with
a 4xx that names the field, in the order and the words clients have always read. Why they look the
way they do is told there: Triton answers 500, not 400, to what it cannot parse, so everything it
would choke on is refused here.

The per-model rule files (`validation.schemas`: a JSON Schema over the request envelope, `x-tensors`
rules on values) are checked there too, last, when the spec carries one (`ModelSpec.rules`, handed
down once). What stays here: the spec as Python's serving core holds it, and the strict JSON reader
the generate bodies are read with (python-rapidjson, the parser Triton itself uses: duplicate keys
refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import rapidjson

from sidecar._dataplane import CheckedBody, RequestRefused, RequestSpec
from sidecar.config import ValidationSection
from sidecar.messages import echo
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.request_rules import RequestRules

# numpy is imported inside the functions that use it: a running sidecar (gRPC off) loads none (issue 30).

MALFORMED = Reason.MALFORMED
BUSINESS_RULE = Reason.BUSINESS_RULE


#: Bytes per element of each fixed-size datatype (BYTES has none; BF16 has no numpy dtype).
ELEMENT_SIZE = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2,
                "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2}


_NUMBER_MODE = rapidjson.NM_NATIVE | rapidjson.NM_NAN


class InvalidRequest(Refusal):
    """A request refused before Triton: what is wrong, and which input (if one) it concerns."""

    def __init__(self, reason: Reason, message: str, *, model: str = "", input: str = "") -> None:
        super().__init__(reason, message, model=model)
        self.input = input
        if input:
            self.extra["input"] = input


class _StrictObject(dict):  # type: ignore[type-arg]
    """A JSON object that refuses duplicate keys: we would validate the last, Triton use the first."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            raise ValueError(f"duplicate key {echo(key)!s} in a JSON object")
        dict.__setitem__(self, key, value)


class _Decoder(rapidjson.Decoder):  # type: ignore[misc]
    def start_object(self) -> _StrictObject:
        return _StrictObject()


_DECODER = _Decoder(number_mode=_NUMBER_MODE)


def parse_json(data: bytes | memoryview, what: str = "request body") -> Any:
    """The JSON document in `data`, or InvalidRequest(malformed) saying where it breaks."""
    try:
        return _DECODER(bytes(data) if isinstance(data, memoryview) else data)
    except RecursionError as e:
        raise InvalidRequest(MALFORMED, f"{what} is nested too deeply") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(MALFORMED, f"{what} is not valid JSON: {echo(str(e))}") from e

@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    #: Full shape as clients send it, batch dim first when the model batches; -1 = any size.
    shape: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class Limits:
    max_elements: int
    max_bytes_element: int
    reject_non_finite: bool

    @classmethod
    def from_settings(cls, settings: ValidationSection) -> Limits:
        return cls(settings.max_elements, settings.max_bytes_element, settings.reject_non_finite)


@dataclass(frozen=True)
class ModelSpec:
    """What a valid request to one model (version) looks like; built once from metadata and config."""

    model: str
    version: str
    inputs: Mapping[str, InputSpec]
    #: Every output the model declares, by name -> datatype (hidden ones included).
    outputs: Mapping[str, str]
    #: Outputs that never leave the pod (filtering rules): asking for one by name is a 403.
    hidden_outputs: frozenset[str]
    #: 0 = the model does not batch; else the first dim of every input is the batch, 1..max.
    max_batch_size: int
    limits: Limits
    rules: RequestRules | None = None
    #: The filtering rules' verdict by output name, for servers whose metadata declares no outputs.
    is_hidden: Callable[[str], bool] | None = None
    #: The model may send many responses to one request (LLM backends): generate_stream, not infer.
    decoupled: bool = False
    #: The data plane's copy of this spec, which runs the checks (built here, once per spec).
    native: RequestSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "native", RequestSpec(
            self.model, [(t.name, t.datatype, list(t.shape), t.optional) for t in self.inputs.values()],
            list(self.outputs), sorted(self.hidden_outputs), self.max_batch_size, self.limits.max_elements,
            self.limits.max_bytes_element, self.limits.reject_non_finite, self.is_hidden,
            self.rules.native if self.rules is not None else None))

    def refuse(self, reason: Reason, message: str, input: str = "") -> InvalidRequest:
        return InvalidRequest(reason, message, model=self.model, input=input)


def build_model_spec(
    model: str,
    version: str,
    metadata: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    limits: Limits,
    is_hidden: Callable[[str], bool] | None = None,
    rules: RequestRules | None = None,
) -> ModelSpec:
    """The request spec from Triton's model metadata (shapes as clients see them) and model config
    (max_batch_size, optional inputs)."""
    optional = {i.get("name"): bool(i.get("optional", False)) for i in config.get("input", []) or []}
    inputs = {
        t["name"]: InputSpec(t["name"], t["datatype"], tuple(int(d) for d in t.get("shape", [])),
                             optional.get(t["name"], False))
        for t in metadata.get("inputs", [])
    }
    outputs = {t["name"]: t["datatype"] for t in metadata.get("outputs", [])}
    hidden = frozenset(name for name in outputs if is_hidden is not None and is_hidden(name))
    return ModelSpec(model=model, version=version, inputs=inputs, outputs=outputs, hidden_outputs=hidden,
                     max_batch_size=int(config.get("max_batch_size", 0) or 0), limits=limits, rules=rules,
                     is_hidden=is_hidden,
                     decoupled=bool((config.get("model_transaction_policy") or {}).get("decoupled", False)))


class CheckedRequest:
    """What the proxy needs to know about a request that passed."""

    __slots__ = ("_inputs", "binary", "body", "elements", "native", "requested_outputs")

    def __init__(self, elements: int, requested_outputs: tuple[str, ...], binary: bool, *,
                 native: CheckedBody | None = None, body: bytes = b"") -> None:
        self.elements = elements
        #: Outputs asked for by name; empty = all (minus hidden ones, removed from the answer).
        self.requested_outputs = requested_outputs
        self.binary = binary
        self.native = native
        self.body = body
        self._inputs: tuple[tuple[str, str, tuple[int, ...], Any], ...] | None = None

    @property
    def inputs(self) -> tuple[tuple[str, str, tuple[int, ...], Any], ...]:
        """The numeric and binary inputs as validated, (name, datatype, shape, values): values are a
        numpy array of JSON data, or the binary chunk (a view into the body, not a copy). Decoded on
        first use: only the drift monitor reads them, and only for the models it measures."""
        if self._inputs is None:
            self._inputs = tuple(self._decode()) if self.native is not None else ()
        return self._inputs

    def _decode(self) -> list[tuple[str, str, tuple[int, ...], Any]]:
        import numpy as np

        assert self.native is not None
        body = memoryview(self.body)
        decoded = []
        for name, datatype, shape, index, offset, size in self.native.layout():
            if index < 0:
                decoded.append((name, datatype, tuple(shape), body[offset: offset + size]))
            elif datatype not in ("BOOL", "BYTES"):
                numbers = self.native.json_numbers(index)
                if numbers is not None:
                    dtype, raw = numbers
                    decoded.append((name, datatype, tuple(shape), np.frombuffer(raw, dtype=dtype).reshape(shape)))
        return decoded


def validate_infer_request(spec: ModelSpec, body: bytes, header_length: int | None = None) -> CheckedRequest:
    """Check one infer request body against the model's spec; InvalidRequest says what is wrong.

    `header_length` is the Inference-Header-Content-Length (binary tensor extension), or None for a
    plain JSON body. The checks are the data plane's (`sidecar._dataplane`, Rust), the model's rule
    file's (when it has one) last among them.
    """
    try:
        native = spec.native.validate(body, header_length)
    except RequestRefused as e:
        reason, message, input = e.args
        raise InvalidRequest(Reason(reason), message, model=spec.model, input=input) from None
    return CheckedRequest(native.elements, native.requested_outputs, native.binary, native=native, body=body)


def validate_decoded_request(spec: ModelSpec, doc: Mapping[str, Any], binary: bytes | memoryview) -> CheckedRequest:
    """Check a request decoded from another wire (gRPC) with the very rules and messages of HTTP.

    `doc` has the v2 JSON shape (id, parameters, inputs, outputs); each input carries either `data`
    (typed values, as JSON would) or a `binary_data_size` parameter for its bytes in `binary`, in order.
    It is written out as the binary extension's JSON header (NaN kept as Triton's parser reads it) and
    checked as an HTTP request would be: one implementation of every check, whatever the wire.
    """
    header = rapidjson.dumps(doc, number_mode=rapidjson.NM_NAN).encode()
    return validate_infer_request(spec, header + bytes(binary), len(header))
