"""Request validation before anything reaches Triton, derived per model from its metadata and config.

Pure logic: bytes in, a verdict out; no I/O and no aiohttp. The proxy builds one `ModelSpec` per model
(and version) from Triton's answers, caches it, and calls `validate_infer_request` for every request.

The checks themselves are the data plane's, in Rust (`dataplane/src/serving/validation.rs`, reached
through `sidecar._dataplane.RequestSpec`): one implementation for every wire, each problem refused with
a 4xx that names the field, in the order and the words clients have always read. Why they look the
way they do is told there: Triton answers 500, not 400, to what it cannot parse, so everything it
would choke on is refused here.

What stays here: the spec as Python's serving core holds it, the optional per-model JSON Schema
files (Draft 2020-12, compiled once at start-up) over the request *envelope* with their `x-tensors`
rules on values (checked with numpy), and the strict JSON reader the generate bodies and those rule
files are read with (python-rapidjson, the parser Triton itself uses: duplicate keys refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import rapidjson

from sidecar._dataplane import CheckedBody, RequestRefused, RequestSpec
from sidecar.config import ValidationSection
from sidecar.messages import echo
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.request_rules import RequestRules, TensorRule

MALFORMED = Reason.MALFORMED
BUSINESS_RULE = Reason.BUSINESS_RULE


#: Bytes per element of each fixed-size datatype (BYTES has none; BF16 has no numpy dtype).
ELEMENT_SIZE = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2,
                "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2}


#: Little-endian dtypes for viewing binary tensors in place (Triton's binary extension is little-endian).
_BINARY_DTYPE = {"BOOL": "u1", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
                 "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
                 "FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "BF16": "<u2"}


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
            self.limits.max_bytes_element, self.limits.reject_non_finite, self.is_hidden))

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
    plain JSON body. The checks are the data plane's (`sidecar._dataplane`, Rust); the per-model rule
    files, when a model has one, are checked here after them.
    """
    try:
        native = spec.native.validate(body, header_length)
    except RequestRefused as e:
        reason, message, input = e.args
        raise InvalidRequest(Reason(reason), message, model=spec.model, input=input) from None
    checked = CheckedRequest(native.elements, native.requested_outputs, native.binary, native=native, body=body)
    if spec.rules is not None:
        split = header_length if header_length is not None else len(body)
        doc = parse_json(memoryview(body)[:split], "inference header" if header_length is not None else "request body")
        _check_rules_of(spec, spec.rules, doc, checked)
    return checked


def validate_decoded_request(spec: ModelSpec, doc: Mapping[str, Any], binary: bytes | memoryview) -> CheckedRequest:
    """Check a request decoded from another wire (gRPC) with the very rules and messages of HTTP.

    `doc` has the v2 JSON shape (id, parameters, inputs, outputs); each input carries either `data`
    (typed values, as JSON would) or a `binary_data_size` parameter for its bytes in `binary`, in order.
    It is written out as the binary extension's JSON header (NaN kept as Triton's parser reads it) and
    checked as an HTTP request would be: one implementation of every check, whatever the wire.
    """
    header = rapidjson.dumps(doc, number_mode=rapidjson.NM_NAN).encode()
    return validate_infer_request(spec, header + bytes(binary), len(header))


def _check_rules_of(spec: ModelSpec, rules: RequestRules, doc: Mapping[str, Any], checked: CheckedRequest) -> None:
    """The model's rule file over the request that passed the data plane's checks."""
    body = memoryview(checked.body)
    json_values: list[tuple[InputSpec, Any]] = []
    binary_values: list[tuple[InputSpec, memoryview]] = []
    for name, datatype, shape, index, offset, size in checked.native.layout():
        tspec = spec.inputs.get(name) or InputSpec(name, datatype, (-1,) * len(shape))
        if index >= 0:
            json_values.append((tspec, doc["inputs"][index]["data"]))
        else:
            binary_values.append((tspec, body[offset: offset + size]))
    _check_rules(spec, rules, doc, json_values, binary_values)


def _flatten_strings(data: list[Any]) -> list[Any]:
    """The elements of a nested BYTES `data` list in order (already checked to be strings)."""
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def binary_tensor(datatype: str, chunk: memoryview | bytes) -> np.ndarray:
    """A fixed-size binary tensor viewed in place (no copy)."""
    return np.frombuffer(chunk, dtype=_BINARY_DTYPE[datatype])


def _check_rules(spec: ModelSpec, rules: RequestRules, doc: Mapping[str, Any],
                 json_values: Sequence[tuple[InputSpec, Any]],
                 binary_values: Sequence[tuple[InputSpec, memoryview]]) -> None:
    if rules.envelope is not None:
        envelope = dict(doc)
        envelope["inputs"] = [{k: v for k, v in t.items() if k != "data"} for t in doc["inputs"]]
        error = next(iter(rules.envelope.iter_errors(envelope)), None)
        if error is not None:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
            raise spec.refuse(BUSINESS_RULE, f"request breaks {rules.path.name} at ${where}: "
                                                  f"{echo(error.message)}")
    for tspec, data in json_values:
        rule = rules.tensors.get(tspec.name)
        if rule is not None:
            values = (np.array(_flatten_strings(data), dtype=object)
                      if tspec.datatype == "BYTES" else np.asarray(data))
            _check_tensor_rule(spec, rules, tspec, rule, values.reshape(-1))
    for tspec, chunk in binary_values:
        rule = rules.tensors.get(tspec.name)
        if rule is not None and tspec.datatype not in ("BYTES", "BF16"):
            _check_tensor_rule(spec, rules, tspec, rule, binary_tensor(tspec.datatype, chunk))


def _check_tensor_rule(spec: ModelSpec, rules: RequestRules, tspec: InputSpec, rule: TensorRule,
                       values: np.ndarray) -> None:
    if not values.size:
        return
    name = tspec.name
    where = f"input {name!r} breaks {rules.path.name}"
    if rule.enum is not None:
        allowed = np.array(rule.enum, dtype=object if tspec.datatype == "BYTES" else None)
        ok = np.isin(values, allowed)
        if not ok.all():
            i = int(np.argmin(ok))
            raise spec.refuse(BUSINESS_RULE, f"{where}: element {i} = {echo(values[i].item())} is not one "
                                                  f"of {echo(list(rule.enum))}", name)
    if tspec.datatype == "BYTES":
        return
    checks = ((rule.minimum, np.less, "below the minimum"), (rule.maximum, np.greater, "above the maximum"),
              (rule.exclusive_minimum, np.less_equal, "not above the exclusive minimum"),
              (rule.exclusive_maximum, np.greater_equal, "not below the exclusive maximum"))
    for bound, breaks, words in checks:
        if bound is None:
            continue
        bad = breaks(values, bound)
        if bad.any():
            i = int(np.argmax(bad))
            raise spec.refuse(BUSINESS_RULE, f"{where}: element {i} = {values[i].item()!r} is {words} "
                                                  f"{bound!r}", name)
