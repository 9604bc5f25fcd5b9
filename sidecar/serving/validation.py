"""Request validation before anything reaches Triton, derived per model from its metadata and config.

Pure logic: bytes in, a verdict out; no I/O and no aiohttp. The proxy builds one `ModelSpec` per model
(and version) from Triton's answers, caches it, and calls `validate_infer_request` for every request.

Why the checks look the way they do:
- Triton answers **500** (not 400) to a request it cannot parse: malformed JSON, a bool or string
  where a number belongs, a non-string `id`, a shape that is not a list of unsigned integers, a
  `binary_data_output` that is not a bool, a `data` length that does not match the shape. Everything
  Triton would choke on is refused here, with a 4xx a person can act on.
- The JSON is parsed with python-rapidjson, the parser Triton itself uses, in its native number
  mode: the same documents are accepted as Triton accepts, about five times faster than `json`.
- Tensor values are never walked one by one: they become one numpy array per input, and every check
  on values (finite, fits the dtype, business-rule ranges) is vectorised. Binary tensors are viewed in
  place (`np.frombuffer`), never copied. The request body itself is forwarded unchanged.
- Optional per-model JSON Schema files (Draft 2020-12) check the request *envelope* (id, parameters,
  input names, shapes and datatypes, requested outputs), compiled once at start-up. Rules on tensor
  values go under the schema's `x-tensors` keyword and are checked with numpy, never by jsonschema.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import rapidjson

from sidecar.config import ValidationSection
from sidecar.messages import echo
from sidecar.protocol.datatypes import FLOAT_DATATYPES
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.request_rules import RequestRules, TensorRule

MALFORMED = Reason.MALFORMED


UNKNOWN_MODEL = Reason.UNKNOWN_MODEL


BODY_TOO_LARGE = Reason.BODY_TOO_LARGE


TOO_MANY_ELEMENTS = Reason.TOO_MANY_ELEMENTS


UNSUPPORTED_MEDIA_TYPE = Reason.UNSUPPORTED_MEDIA_TYPE


SCHEMA = Reason.SCHEMA


UNKNOWN_INPUT = Reason.UNKNOWN_INPUT


MISSING_INPUT = Reason.MISSING_INPUT


DATATYPE = Reason.DATATYPE


SHAPE = Reason.SHAPE


NON_FINITE = Reason.NON_FINITE


OUT_OF_RANGE = Reason.OUT_OF_RANGE


BYTES_TOO_LONG = Reason.BYTES_TOO_LONG


PARAMETER = Reason.PARAMETER


UNKNOWN_OUTPUT = Reason.UNKNOWN_OUTPUT


FILTERED_OUTPUT = Reason.FILTERED_OUTPUT


SHARED_MEMORY = Reason.SHARED_MEMORY


BUSINESS_RULE = Reason.BUSINESS_RULE




#: Bytes per element of each fixed-size datatype (BYTES has none; BF16 has no numpy dtype).
ELEMENT_SIZE = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2,
                "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2}


#: Little-endian dtypes for viewing binary tensors in place (Triton's binary extension is little-endian).
_BINARY_DTYPE = {"BOOL": "u1", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
                 "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
                 "FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "BF16": "<u2"}


_INT_DATATYPES = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"})


_FLOAT_MAX = {"FP16": float(np.finfo(np.float16).max), "FP32": float(np.finfo(np.float32).max),
              "FP64": float(np.finfo(np.float64).max)}


_INT_RANGE = {name: (int(np.iinfo(name.lower()).min), int(np.iinfo(name.lower()).max)) for name in _INT_DATATYPES}


#: Triton reads these request parameters with a fixed type and answers 500 for any other.
_REQUEST_PARAMETER_TYPES: Mapping[str, str] = {
    "binary_data_output": "bool", "priority": "uint", "timeout": "uint",
    "sequence_start": "bool", "sequence_end": "bool", "sequence_id": "uint_or_string",
}


_INPUT_PARAMETER_TYPES: Mapping[str, str] = {"binary_data_size": "uint", "binary_data": "bool"}


_OUTPUT_PARAMETER_TYPES: Mapping[str, str] = {"binary_data": "bool", "classification": "uint"}


_SHARED_MEMORY_PARAMETERS = frozenset({"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"})


_INT64_MAX = 2**63 - 1


_REQUEST_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})


_INPUT_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})


_OUTPUT_KEYS = frozenset({"name", "parameters"})


_NUMBER_MODE = rapidjson.NM_NATIVE | rapidjson.NM_NAN


#: Below this many bytes, letters are counted with bytes.count; above, with numpy (faster there).
_SMALL_TEXT = 4096


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


@dataclass(frozen=True)
class CheckedRequest:
    """What the proxy needs to know about a request that passed."""

    elements: int
    #: Outputs asked for by name; empty = all (minus hidden ones, removed from the answer).
    requested_outputs: tuple[str, ...]
    binary: bool
    #: The inputs as validated, (name, datatype, shape, values): values are the numpy array JSON data
    #: became, or the binary chunk (a view into the body, not a copy). Kept for the drift monitor, which
    #: reads them only for models it measures; holding them costs nothing else.
    inputs: tuple[tuple[str, str, tuple[int, ...], Any], ...] = ()


def validate_infer_request(spec: ModelSpec, body: bytes, header_length: int | None = None) -> CheckedRequest:
    """Check one infer request body against the model's spec; InvalidRequest says what is wrong.

    `header_length` is the Inference-Header-Content-Length (binary tensor extension), or None for a
    plain JSON body.
    """
    if header_length is not None and not 0 < header_length <= len(body):
        raise spec.refuse(MALFORMED, f"Inference-Header-Content-Length {header_length} is outside the "
                                          f"body (1..{len(body)} bytes)")
    view = memoryview(body)
    json_part = view[:header_length] if header_length is not None else view
    try:
        doc = parse_json(json_part, "inference header" if header_length is not None else "request body")
    except InvalidRequest as e:
        e.model = spec.model
        raise
    binary = view[header_length:] if header_length is not None else view[0:0]
    return _check_document(spec, doc, json_part, binary)


def validate_decoded_request(spec: ModelSpec, doc: Mapping[str, Any], binary: bytes | memoryview) -> CheckedRequest:
    """Check a request decoded from another wire (gRPC) with the very rules and messages of HTTP.

    `doc` has the v2 JSON shape (id, parameters, inputs, outputs); each input carries either `data`
    (typed values, as JSON would) or a `binary_data_size` parameter for its bytes in `binary`, in order.
    """
    return _check_document(spec, doc, memoryview(b""), memoryview(binary))


def _check_document(spec: ModelSpec, doc: Any, json_part: memoryview, binary: memoryview) -> CheckedRequest:
    if not isinstance(doc, dict):
        raise spec.refuse(SCHEMA, "the request must be a JSON object with 'inputs'")
    unknown = sorted(set(doc) - _REQUEST_KEYS)
    if unknown:
        raise spec.refuse(SCHEMA, f"unknown request field {echo(unknown[0])!r} "
                                       f"(known: {', '.join(sorted(_REQUEST_KEYS))})")
    if "id" in doc and not isinstance(doc["id"], str):
        raise spec.refuse(SCHEMA, "'id' must be a string")
    bools = _BoolCount()
    _check_parameters(spec, doc.get("parameters"), _REQUEST_PARAMETER_TYPES, "request", bools)
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise spec.refuse(SCHEMA, "'inputs' must be a non-empty list of tensors")
    requested = _check_requested_outputs(spec, doc.get("outputs"), bools)

    seen: set[str] = set()
    batch: int | None = None
    elements = 0
    offset = 0
    json_values: list[tuple[InputSpec, Any]] = []
    binary_values: list[tuple[InputSpec, memoryview]] = []
    decoded: list[tuple[str, str, tuple[int, ...], Any]] = []
    for i, tensor in enumerate(inputs):
        tspec, shape = _check_tensor_header(spec, tensor, i, seen, bools)
        count = math.prod(shape)
        elements += count
        if elements > spec.limits.max_elements:
            raise spec.refuse(TOO_MANY_ELEMENTS, f"the request holds more than {spec.limits.max_elements} "
                                                      "tensor elements (validation.max_elements)", tspec.name)
        if spec.max_batch_size:
            if not 1 <= shape[0] <= spec.max_batch_size:
                raise spec.refuse(SHAPE, f"batch size {shape[0]} of input {tspec.name!r} is outside "
                                              f"1..{spec.max_batch_size} (max_batch_size)", tspec.name)
            if batch is not None and shape[0] != batch:
                raise spec.refuse(SHAPE, f"input {tspec.name!r} has batch size {shape[0]}, another input "
                                              f"has {batch}: all inputs share one batch size", tspec.name)
            batch = shape[0]
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if "data" in tensor:
                raise spec.refuse(SCHEMA, f"input {tspec.name!r} has both 'data' and binary_data_size",
                                  tspec.name)
            if offset + size > len(binary):
                raise spec.refuse(SHAPE, f"input {tspec.name!r} announces {size} binary bytes, but only "
                                              f"{len(binary) - offset} follow the header", tspec.name)
            chunk = binary[offset: offset + size]
            offset += size
            _check_binary_size(spec, tspec, shape, count, chunk)
            binary_values.append((tspec, chunk))
            decoded.append((tspec.name, tspec.datatype, shape, chunk))
        elif "data" in tensor:
            json_values.append((tspec, tensor["data"]))
            values = _check_json_data(spec, tspec, shape, count, tensor["data"], bools)
            if values is not None:
                decoded.append((tspec.name, tspec.datatype, shape, values))
        else:
            raise spec.refuse(SCHEMA, f"input {tspec.name!r} has neither 'data' nor binary_data_size",
                              tspec.name)
    if offset != len(binary):
        raise spec.refuse(SHAPE, f"{len(binary) - offset} bytes follow the last binary input; "
                                      "binary_data_size values do not add up to the body")
    missing = sorted(n for n, t in spec.inputs.items() if not t.optional and n not in seen)
    if missing:
        raise spec.refuse(MISSING_INPUT, f"required input {missing[0]!r} is missing "
                                              f"(model inputs: {', '.join(sorted(spec.inputs))})", missing[0])
    _check_bools_in_numbers(spec, doc, json_part, bools, json_values)
    for tspec, chunk in binary_values:
        _check_binary_values(spec, tspec, chunk)
    if spec.rules is not None:
        _check_rules(spec, spec.rules, doc, json_values, binary_values)
    return CheckedRequest(elements=elements, requested_outputs=requested, binary=bool(len(binary)),
                          inputs=tuple(decoded))


class _BoolCount:
    """JSON `true`/`false` seen outside numeric tensor data; see _check_bools_in_numbers."""

    def __init__(self) -> None:
        self.true = 0
        self.false = 0

    def add(self, value: Any) -> None:
        if value is True:
            self.true += 1
        elif value is False:
            self.false += 1


def _check_parameters(spec: ModelSpec, params: Any, known: Mapping[str, str], where: str, bools: _BoolCount,
                      tensor: str = "") -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise spec.refuse(PARAMETER, f"{where} 'parameters' must be an object", tensor)
    for key, value in params.items():
        if key in _SHARED_MEMORY_PARAMETERS:
            raise spec.refuse(SHARED_MEMORY, "shared-memory tensors are not available through the sidecar; "
                                                  "send the data in the request", tensor)
        bools.add(value)
        kind = known.get(key)
        ok = (
            _is_uint(value) if kind == "uint"
            else isinstance(value, bool) if kind == "bool"
            else (_is_uint(value) or isinstance(value, str)) if kind == "uint_or_string"
            else isinstance(value, (str, bool)) or _is_int64(value)
            or (isinstance(value, float) and math.isfinite(value))
        )
        if not ok:
            expected = {"uint": "an unsigned integer", "bool": "true or false",
                        "uint_or_string": "an unsigned integer or a string"}.get(
                kind or "", "a string, a bool, an integer or a finite number")
            raise spec.refuse(PARAMETER, f"{where} parameter {echo(key)!r} must be {expected}, "
                                              f"got {echo(value)}", tensor)


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**64 - 1


def _is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value <= _INT64_MAX


def _check_requested_outputs(spec: ModelSpec, outputs: Any, bools: _BoolCount) -> tuple[str, ...]:
    if outputs is None:
        return ()
    if not isinstance(outputs, list):
        raise spec.refuse(SCHEMA, "'outputs' must be a list of {\"name\": ...} objects")
    names = []
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise spec.refuse(SCHEMA, "each requested output must be an object with a string 'name'")
        unknown = sorted(set(output) - _OUTPUT_KEYS)
        if unknown:
            raise spec.refuse(SCHEMA, f"unknown field {echo(unknown[0])!r} in requested output")
        name = output["name"]
        if name in spec.hidden_outputs or (not spec.outputs and spec.is_hidden is not None and spec.is_hidden(name)):
            raise spec.refuse(FILTERED_OUTPUT, f"output {name!r} of model {spec.model} is not available "
                                                    "outside the pod (filtering rules)")
        if spec.outputs and name not in spec.outputs:
            visible = ", ".join(sorted(set(spec.outputs) - spec.hidden_outputs))
            raise spec.refuse(UNKNOWN_OUTPUT, f"model {spec.model} has no output {echo(name)!r} "
                                                   f"(outputs: {visible})")
        if name in names:
            raise spec.refuse(SCHEMA, f"output {name!r} is requested twice")
        _check_parameters(spec, output.get("parameters"), _OUTPUT_PARAMETER_TYPES, f"output {name!r}", bools)
        names.append(name)
    return tuple(names)


def _check_tensor_header(spec: ModelSpec, tensor: Any, index: int, seen: set[str],
                         bools: _BoolCount) -> tuple[InputSpec, tuple[int, ...]]:
    if not isinstance(tensor, dict):
        raise spec.refuse(SCHEMA, f"inputs[{index}] must be an object with name, shape, datatype, data")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise spec.refuse(SCHEMA, f"inputs[{index}] needs a string 'name'")
    unknown = sorted(set(tensor) - _INPUT_KEYS)
    if unknown:
        raise spec.refuse(SCHEMA, f"unknown field {echo(unknown[0])!r} in input {echo(name)!r}", name)
    tspec = spec.inputs.get(name) if spec.inputs else _undeclared_input(spec, tensor, name)
    if tspec is None:
        raise spec.refuse(UNKNOWN_INPUT, f"model {spec.model} has no input {echo(name)!r} "
                                              f"(inputs: {', '.join(sorted(spec.inputs))})")
    if name in seen:
        raise spec.refuse(SCHEMA, f"input {name!r} is sent twice", name)
    seen.add(name)
    datatype = tensor.get("datatype")
    if datatype != tspec.datatype:
        raise spec.refuse(DATATYPE, f"input {name!r} must be {tspec.datatype}, got {echo(datatype)}", name)
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(_is_int64(d) and d >= 0 for d in shape):
        raise spec.refuse(SHAPE, f"input {name!r}: 'shape' must be a list of non-negative integers, "
                                      f"got {echo(shape)}", name)
    fits = len(shape) == len(tspec.shape) and all(
        want in (-1, got) for want, got in zip(tspec.shape, shape, strict=True))
    if not fits:
        raise spec.refuse(SHAPE, f"input {name!r} must have shape {list(tspec.shape)} (-1 = any), "
                                      f"got {echo(shape)}", name)
    _check_parameters(spec, tensor.get("parameters"), _INPUT_PARAMETER_TYPES, f"input {name!r}", bools, name)
    return tspec, tuple(shape)


def _undeclared_input(spec: ModelSpec, tensor: Mapping[str, Any], name: str) -> InputSpec:
    """The input as the client declares it, for a server whose metadata declares no inputs (MLServer's
    custom runtimes): its name and shape cannot be checked, but its datatype must be a v2 one, and
    its data must match that datatype and shape like any other input."""
    datatype = tensor.get("datatype")
    if datatype != "BYTES" and datatype not in ELEMENT_SIZE:
        raise spec.refuse(DATATYPE, f"input {echo(name)!r}: {echo(datatype)} is not a v2 datatype "
                                    f"({', '.join(sorted([*ELEMENT_SIZE, 'BYTES']))})", name)
    shape = tensor.get("shape")
    rank = len(shape) if isinstance(shape, list) else 0
    return InputSpec(name, datatype, (-1,) * rank)


def _check_json_data(spec: ModelSpec, tspec: InputSpec, shape: tuple[int, ...], count: int, data: Any,
                     bools: _BoolCount) -> np.ndarray | None:
    """The numeric values as one array (None for BYTES and BOOL), or InvalidRequest."""
    name, datatype = tspec.name, tspec.datatype
    if not isinstance(data, list):
        raise spec.refuse(SCHEMA, f"input {name!r}: 'data' must be a list", name)
    if datatype == "BYTES":
        _check_json_bytes(spec, tspec, count, data)
        return None
    if datatype == "BF16":
        raise spec.refuse(DATATYPE, f"input {name!r}: BF16 tensors can only be sent as binary data", name)
    try:
        values = np.array(data)
    except (ValueError, OverflowError) as e:
        raise spec.refuse(SHAPE, f"input {name!r}: 'data' is not a regular array of values "
                                      f"({echo(str(e))})", name) from e
    if values.size != count:
        raise spec.refuse(SHAPE, f"input {name!r}: shape {list(shape)} holds {count} values, "
                                      f"'data' has {values.size}", name)
    kind = values.dtype.kind
    if datatype == "BOOL":
        if kind != "b" and values.size:
            raise spec.refuse(DATATYPE, f"input {name!r}: BOOL data must be true/false", name)
        trues = int(np.count_nonzero(values))
        bools.true += trues
        bools.false += values.size - trues
        return None
    if kind not in "iuf" or (datatype in _INT_DATATYPES and kind == "f"):
        want = "integers" if datatype in _INT_DATATYPES else "numbers"
        raise spec.refuse(DATATYPE, f"input {name!r}: {datatype} data must be {want}", name)
    if not values.size:
        return values
    if datatype in _INT_DATATYPES:
        low, high = _INT_RANGE[datatype]
        vmin, vmax = int(values.min()), int(values.max())
        if vmin < low or vmax > high:
            bad = vmin if vmin < low else vmax
            raise spec.refuse(OUT_OF_RANGE, f"input {name!r}: value {bad} does not fit {datatype} "
                                                 f"({low}..{high})", name)
        return values
    # One pass for the common case: NaN propagates into the max, ±Inf and overflow exceed the bound.
    largest = float(np.abs(values).max())
    if largest <= _FLOAT_MAX[datatype]:
        return values
    as_float = values.astype(np.float64, copy=False)
    finite = np.isfinite(as_float)
    if not finite.all():
        # JSON has no NaN/Infinity: Triton's parser refuses them even when we would let them pass.
        raise spec.refuse(NON_FINITE, f"input {name!r}: NaN/Infinity at element "
                                           f"{int(np.argmin(finite))}; JSON numbers must be finite", name)
    largest = float(np.abs(as_float).max())
    if largest > _FLOAT_MAX[datatype] and spec.limits.reject_non_finite:
        raise spec.refuse(NON_FINITE, f"input {name!r}: value {largest:g} overflows {datatype} to "
                                           "infinity", name)
    return values


def _check_json_bytes(spec: ModelSpec, tspec: InputSpec, count: int, data: list[Any]) -> None:
    flat = _flatten_strings(spec, tspec.name, data)
    if len(flat) != count:
        raise spec.refuse(SHAPE, f"input {tspec.name!r}: shape holds {count} values, 'data' has "
                                      f"{len(flat)}", tspec.name)
    limit = spec.limits.max_bytes_element
    for i, value in enumerate(flat):
        if len(value) > limit and len(value.encode()) > limit:
            raise spec.refuse(BYTES_TOO_LONG, f"input {tspec.name!r}: element {i} is longer than {limit} "
                                                   "bytes (validation.max_bytes_element)", tspec.name)


def _flatten_strings(spec: ModelSpec, name: str, data: list[Any]) -> list[str]:
    flat: list[str] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                if len(stack) >= 64:
                    raise spec.refuse(SHAPE, f"input {name!r}: 'data' is nested too deeply", name)
                stack.append(iter(value))
                break
            if not isinstance(value, str):
                raise spec.refuse(DATATYPE, f"input {name!r}: BYTES data must be strings, got "
                                                 f"{echo(value)}", name)
            flat.append(value)
        else:
            stack.pop()
    return flat


def _check_bools_in_numbers(spec: ModelSpec, doc: Mapping[str, Any], json_part: memoryview, bools: _BoolCount,
                            values: Sequence[tuple[InputSpec, Any]]) -> None:
    """numpy turns [true, 1.5] into [1.0, 1.5], Triton answers 500 to it. Rather than walk every number,
    count the letters `u` (in `true`) and `l` (in `false`) in the raw text with numpy: when the keys and
    strings of the document plus the bools we know of (parameters, BOOL tensors) account for all of
    them, no number tensor holds a bool. Any mismatch (an escaped string, say) only costs the walk."""
    numeric = {id(data) for tspec, data in values if tspec.datatype not in ("BOOL", "BYTES")}
    u, ell = _letters_in_strings(doc, numeric)
    if len(json_part) < _SMALL_TEXT:
        raw = json_part.tobytes()  # bytes.count beats two numpy passes on short texts
        text_u, text_l = raw.count(b"u"), raw.count(b"l")
    else:
        text = np.frombuffer(json_part, dtype=np.uint8)
        text_u, text_l = int(np.count_nonzero(text == ord("u"))), int(np.count_nonzero(text == ord("l")))
    if text_u == u + bools.true and text_l == ell + bools.false:
        return
    for tspec, data in values:
        if tspec.datatype in ("BOOL", "BYTES"):
            continue
        stack = [data]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, bool):
                raise spec.refuse(DATATYPE, f"input {tspec.name!r}: {tspec.datatype} data must be numbers, "
                                                 f"got {str(node).lower()}", tspec.name)


def _letters_in_strings(node: Any, skip: set[int]) -> tuple[int, int]:
    """How many `u` and `l` the keys and strings of the document hold, number tensors skipped."""
    u = ell = 0
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            u += node.count("u")
            ell += node.count("l")
        elif isinstance(node, dict):
            for key, value in node.items():
                u += key.count("u")
                ell += key.count("l")
                stack.append(value)
        elif isinstance(node, list) and id(node) not in skip:
            stack.extend(node)
    return u, ell


def _check_binary_size(spec: ModelSpec, tspec: InputSpec, shape: tuple[int, ...], count: int,
                       chunk: memoryview) -> None:
    name, datatype = tspec.name, tspec.datatype
    if datatype == "BYTES":
        _check_binary_bytes(spec, tspec, count, chunk)
        return
    expected = count * ELEMENT_SIZE[datatype]
    if len(chunk) != expected:
        raise spec.refuse(SHAPE, f"input {name!r}: shape {list(shape)} of {datatype} is {expected} bytes, "
                                      f"binary_data_size is {len(chunk)}", name)


def _check_binary_bytes(spec: ModelSpec, tspec: InputSpec, count: int, chunk: memoryview) -> None:
    """BYTES in binary form: each element is a 4-byte little-endian length and that many bytes."""
    limit = spec.limits.max_bytes_element
    pos = 0
    for i in range(count):
        if pos + 4 > len(chunk):
            raise spec.refuse(SHAPE, f"input {tspec.name!r}: binary data ends after {i} of {count} "
                                          "BYTES elements", tspec.name)
        (length,) = struct.unpack_from("<I", chunk, pos)
        if length > limit:
            raise spec.refuse(BYTES_TOO_LONG, f"input {tspec.name!r}: element {i} is {length} bytes, "
                                                   f"more than {limit} (validation.max_bytes_element)", tspec.name)
        pos += 4 + length
    if pos != len(chunk):
        raise spec.refuse(SHAPE, f"input {tspec.name!r}: {count} BYTES elements take {pos} bytes, "
                                      f"binary_data_size is {len(chunk)}", tspec.name)


def _check_binary_values(spec: ModelSpec, tspec: InputSpec, chunk: memoryview) -> None:
    if (tspec.datatype not in FLOAT_DATATYPES and tspec.datatype != "BF16") or not spec.limits.reject_non_finite:
        return
    if not len(chunk):
        return
    values = np.frombuffer(chunk, dtype=_BINARY_DTYPE[tspec.datatype])
    if tspec.datatype == "BF16":
        finite = (values & 0x7F80) != 0x7F80  # exponent bits all ones = NaN or ±Inf
    else:
        finite = np.isfinite(values)
    if not finite.all():
        raise spec.refuse(NON_FINITE, f"input {tspec.name!r}: NaN or ±Inf at element "
                                           f"{int(np.argmin(finite))} (validation.reject_non_finite)", tspec.name)


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
            values = (np.array(_flatten_strings(spec, tspec.name, data), dtype=object)
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
