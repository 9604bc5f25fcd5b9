"""Golden requests: real inference requests whose answers are known, and the comparison of answers.

A golden file is `<golden_dir>/<model>/<case>.json` (or .yaml):

    {"description": "...", "version": "1",
     "request": {"inputs": [{"name", "shape", "datatype", "data"}], "outputs": [{"name"}]},
     "expect": {"status": 200,
                "outputs": {"scores": {"datatype": "FP32", "shape": [1, 1], "data": [0.731],
                                       "atol": 1e-5, "rtol": 1e-4}}}}

or, for an abnormal input the model must reject, `"expect": {"status": 400, "error_contains": "..."}`
(501 for a decoupled model over /infer: Triton serves it on streams only).


A generative model's case names its endpoint (`infer` is the default) and expects text:

    {"endpoint": "generate_stream", "request": {"text_input": "alpha beta", "max_tokens": 8},
     "expect": {"status": 200, "text": {"field": "text_output", "equals": "alpha beta"},
                "max_first_event_s": 0.5, "max_total_s": 2.0}}

`text` compares the named field (for a stream, concatenated over all events) with one of `equals`,
`contains` or `regex` (Python syntax, searched anywhere); the two bounds are optional.
This module does not talk to Triton; `compare_outputs` judges an answer already received.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import yaml

from sidecar.messages import json_path, short_message
from sidecar.protocol.datatypes import DATATYPES, FLOAT_DATATYPES, numpy_dtypes

if TYPE_CHECKING:
    import numpy as np

#: Default tolerances: float32 answers written out as JSON decimals round-trip within these.
DEFAULT_ATOL = 1e-5


DEFAULT_RTOL = 1e-4


GOLDEN_SUFFIXES = (".json", ".yaml", ".yml")


_NON_FINITE_WORDS = {"NaN": math.nan, "nan": math.nan, "Infinity": math.inf, "inf": math.inf,
                     "-Infinity": -math.inf, "-inf": -math.inf}


class _GoldenYamlLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-05` (no dot) as a string; tolerances copied from JSON must stay numbers."""


_GoldenYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class GoldenFileError(ValueError):
    """A golden file is malformed; the message names the file and the JSON path."""


_SHAPE = {"type": "array", "items": {"type": "integer", "minimum": 0}}


_DATATYPE = {"enum": sorted(DATATYPES)}


INFER = "infer"


GENERATE = "generate"


GENERATE_STREAM = "generate_stream"


ENDPOINTS = (INFER, GENERATE, GENERATE_STREAM)


_TEXT_MATCHES = ("equals", "contains", "regex")


GOLDEN_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["request", "expect"],
    "properties": {
        "description": {"type": "string"},
        "version": {"type": ["string", "integer"]},
        "endpoint": {"enum": list(ENDPOINTS)},
        # infer requests are checked against _INFER_REQUEST_SCHEMA; generate requests are one flat
        # object of inputs and parameters, checked by the sidecar's own generate check at probe time.
        "request": {"type": "object"},
        "expect": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "status": {"type": "integer", "minimum": 200, "maximum": 501},
                "error_contains": {"type": "string"},
                "text": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["field"],
                    "minProperties": 2,
                    "maxProperties": 2,
                    "properties": {"field": {"type": "string", "minLength": 1}, "equals": {"type": "string"},
                                   "contains": {"type": "string", "minLength": 1},
                                   "regex": {"type": "string", "minLength": 1}},
                },
                "max_first_event_s": {"type": "number", "exclusiveMinimum": 0},
                "max_total_s": {"type": "number", "exclusiveMinimum": 0},
                "outputs": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["datatype", "shape", "data"],
                        "properties": {
                            "datatype": _DATATYPE,
                            "shape": _SHAPE,
                            "data": {"type": "array"},
                            "atol": {"type": "number", "minimum": 0},
                            "rtol": {"type": "number", "minimum": 0},
                        },
                    },
                },
            },
        },
    },
}


#: An infer request as golden files hold it (the v2 JSON request).
_INFER_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object"},
        "inputs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "shape", "datatype", "data"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "shape": _SHAPE,
                    "datatype": _DATATYPE,
                    "data": {"type": "array"},
                    "parameters": {"type": "object"},
                },
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
            },
        },
    },
}


_VALIDATOR = jsonschema.Draft202012Validator(GOLDEN_SCHEMA)


@dataclass(frozen=True)
class ExpectedOutput:
    datatype: str
    shape: tuple[int, ...]
    #: Flat expected values as sidecar._dataplane.compare_output reads them: from a golden file,
    #: float64 little-endian bytes for numbers (NaN/Inf allowed) and a tuple of str for BYTES; a
    #: numpy array when rollouts compare one version's answer with another's.
    values: Any
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL

    @property
    def data(self) -> np.ndarray:
        """The values as a flat numpy array (float64, or object for BYTES), made when asked for: the
        health loop never asks, so a running sidecar does not import numpy for its golden cases."""
        import numpy as np

        if isinstance(self.values, bytes):
            return np.frombuffer(self.values, dtype="<f8")
        return np.asarray(self.values, dtype=np.object_ if self.datatype == "BYTES" else np.float64)

    def floats(self) -> tuple[float, ...]:
        """A numeric output's expected values as floats (() for BYTES)."""
        if isinstance(self.values, bytes):
            return tuple(v for (v,) in struct.iter_unpack("<d", self.values))
        if self.datatype == "BYTES":
            return ()
        return tuple(float(v) for v in self.data)


@dataclass(frozen=True)
class ReceivedOutput:
    datatype: str
    shape: tuple[int, ...]
    #: The values, flat or shaped: in the health loop as sidecar._dataplane.read_answer hands them
    #: (float64 little-endian bytes for numbers, a list of bytes or str for BYTES); a numpy array of
    #: the datatype's dtype from sidecar.health.infer_body.decode_answer (the record command, tests).
    data: Any


@dataclass(frozen=True)
class ExpectedText:
    """A generate answer's text field (for a stream: concatenated over its events) and the match."""

    field: str
    #: "equals", "contains" or "regex"
    match: str
    value: str

    def mismatch(self, text: str) -> str | None:
        """None when `text` matches; else what an operator reads in the probe's cause."""
        if self.match == "equals":
            ok = text == self.value
        elif self.match == "contains":
            ok = self.value in text
        else:
            ok = re.search(self.value, text) is not None
        if ok:
            return None
        want = {"equals": "", "contains": "containing ", "regex": "matching "}[self.match]
        return f"{self.field} expected {want}{_short_text(self.value)!r}, got {_short_text(text)!r}"


def _short_text(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class GoldenCase:
    model: str
    name: str
    path: Path
    request: Mapping[str, Any]
    description: str = ""
    version: str = ""
    expect_status: int = 200
    error_contains: str = ""
    outputs: Mapping[str, ExpectedOutput] = field(default_factory=dict)
    #: infer, generate or generate_stream (Triton's generate extension: LLM backends).
    endpoint: str = INFER
    text: ExpectedText | None = None
    #: Bounds (s) on the time to the first event and on the whole answer; None = only probes.timeout_s.
    max_first_event_s: float | None = None
    max_total_s: float | None = None

    @property
    def expects_error(self) -> bool:
        return self.expect_status != 200

    @property
    def is_generate(self) -> bool:
        return self.endpoint != INFER

    @property
    def input_datatypes(self) -> dict[str, str]:
        if self.is_generate:
            return {}  # generate keys are inputs or parameters; Triton's metadata decides which
        return {i["name"]: i["datatype"] for i in self.request["inputs"]}

    @property
    def allows_non_finite(self) -> bool:
        """True when some expected output holds NaN or Inf on purpose."""
        return any(o.datatype in FLOAT_DATATYPES and not all(map(math.isfinite, o.floats()))
                   for o in self.outputs.values())


def load_golden_dir(golden_dir: Path, models: Iterable[str] | None = None) -> dict[str, tuple[GoldenCase, ...]]:
    """Every case under `golden_dir`, by model; `models` limits which model folders are read."""
    wanted = set(models) if models is not None else None
    cases: dict[str, tuple[GoldenCase, ...]] = {}
    for model_dir in golden_model_dirs(golden_dir):
        if wanted is not None and model_dir.name not in wanted:
            continue
        cases[model_dir.name] = load_model_dir(model_dir)
    return cases


def cases_for_version(cases: Iterable[GoldenCase], version: str) -> tuple[GoldenCase, ...]:
    """The cases that judge one version: those naming it, else every unversioned case aimed at it."""
    named = tuple(c for c in cases if c.version == version)
    if named:
        return named
    return tuple(replace(c, version=version) for c in cases if not c.version)


def aim_unversioned(cases: Iterable[GoldenCase], version: str) -> tuple[GoldenCase, ...]:
    """The cases with every unversioned one aimed at `version` ("" = left as they are)."""
    if not version:
        return tuple(cases)
    return tuple(c if c.version else replace(c, version=version) for c in cases)


def golden_model_dirs(golden_dir: Path) -> list[Path]:
    """The model folders of a golden directory. Names starting with "." are skipped: a Kubernetes
    ConfigMap volume holds `..data` and `..<timestamp>` folders next to the symlinks it exposes."""
    # os.scandir, not Path.iterdir + is_dir: the reload loop lists these every second, and a
    # directory entry knows its type without a stat per file (an idle sidecar's CPU, issue 18).
    try:
        with os.scandir(golden_dir) as entries:
            return sorted(Path(e.path) for e in entries if not e.name.startswith(".") and e.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def golden_files(model_dir: Path) -> list[Path]:
    """One model's golden files, in the order they are probed."""
    with os.scandir(model_dir) as entries:
        return sorted(Path(e.path) for e in entries
                      if os.path.splitext(e.name)[1] in GOLDEN_SUFFIXES and not e.name.startswith(".") and e.is_file())


def load_model_dir(model_dir: Path) -> tuple[GoldenCase, ...]:
    """Every case of one model folder, or GoldenFileError for the first broken file: start-up and
    reloads both load through here, so a file a reload accepts is one a restart would accept."""
    return tuple(load_golden_file(p, model=model_dir.name) for p in golden_files(model_dir))


_REQUEST_VALIDATOR = jsonschema.Draft202012Validator(_INFER_REQUEST_SCHEMA)


def check_request(request: Any, path: Path, where: str = "$.request") -> None:
    """A v2 inference request as golden files hold it: schema, and data lengths that fit shapes."""
    errors = sorted(_REQUEST_VALIDATOR.iter_errors(request), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        raise GoldenFileError(f"{path}: at {json_path(error.absolute_path, where)}: {short_message(error.message)}")
    for i, tensor in enumerate(request["inputs"]):
        _check_data_matches_shape(path, f"{where}.inputs[{i}]", tensor)


def golden_file_problems(path: Path, *, model: str) -> list[str]:
    """Every problem of a golden file (the first one `load_golden_file` raises, then the schema's
    other complaints), each naming the file and the JSON path; empty when the file loads."""
    try:
        load_golden_file(path, model=model)
        return []
    except GoldenFileError as e:
        problems = [str(e)]
    try:
        raw = _read(path)
    except GoldenFileError:
        return problems  # unreadable or unparsable: the one problem above says so
    for error in sorted(_VALIDATOR.iter_errors(raw), key=lambda e: list(e.absolute_path)):
        problem = f"{path}: at {json_path(error.absolute_path)}: {short_message(error.message)}"
        if problem not in problems:
            problems.append(problem)
    return problems


def load_golden_file(path: Path, *, model: str) -> GoldenCase:
    raw = _read(path)
    errors = sorted(_VALIDATOR.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        raise GoldenFileError(f"{path}: at {json_path(error.absolute_path)}: {short_message(error.message)}")
    endpoint = raw.get("endpoint", INFER)
    if endpoint == INFER:
        check_request(raw["request"], path)
    expect = raw["expect"]
    text, bounds = _generate_expectations(path, endpoint, expect)
    outputs = {}
    for name, spec in expect.get("outputs", {}).items():
        where = f"$.expect.outputs.{name}"
        _check_data_matches_shape(path, where, spec)
        outputs[name] = ExpectedOutput(
            datatype=spec["datatype"],
            shape=tuple(spec["shape"]),
            values=_expected_values(path, where, spec),
            atol=float(spec.get("atol", DEFAULT_ATOL)),
            rtol=float(spec.get("rtol", DEFAULT_RTOL)),
        )
    status = int(expect.get("status", 200))
    if status == 200 and not outputs and text is None:
        needs = "'text'" if endpoint != INFER else "'outputs'"
        raise GoldenFileError(f"{path}: at $.expect: a status-200 case needs {needs} to compare")
    if status != 200 and text is not None:
        raise GoldenFileError(f"{path}: at $.expect.text: an error case ({status}) expects no text")
    if status != 200 and outputs:
        raise GoldenFileError(f"{path}: at $.expect.outputs: an error case ({status}) expects no outputs")
    # 501: what Triton answers over HTTP /infer for a decoupled model (served only on streams).
    if status != 200 and not (400 <= status <= 499 or status == 501):
        raise GoldenFileError(f"{path}: at $.expect.status: expect 200, a 4xx or 501, got {status}")
    return GoldenCase(
        model=model,
        name=path.stem,
        path=path,
        request=raw["request"],
        description=raw.get("description", ""),
        version=str(raw.get("version", "")),
        expect_status=status,
        error_contains=expect.get("error_contains", ""),
        outputs=outputs,
        endpoint=endpoint,
        text=text,
        max_first_event_s=bounds[0],
        max_total_s=bounds[1],
    )


def _generate_expectations(path: Path, endpoint: str, expect: Mapping[str, Any]
                           ) -> tuple[ExpectedText | None, tuple[float | None, float | None]]:
    """The text expectation and time bounds of a generate case; refused on an infer case."""
    keys = [k for k in ("text", "max_first_event_s", "max_total_s") if k in expect]
    if endpoint == INFER:
        if keys:
            raise GoldenFileError(f"{path}: at $.expect.{keys[0]}: only for generate and generate_stream cases "
                                  "(set \"endpoint\")")
        return None, (None, None)
    if "outputs" in expect:
        raise GoldenFileError(f"{path}: at $.expect.outputs: a {endpoint} case compares 'text', not tensors")
    if "max_first_event_s" in expect and endpoint != GENERATE_STREAM:
        raise GoldenFileError(f"{path}: at $.expect.max_first_event_s: only a generate_stream case has events")
    text = None
    if "text" in expect:
        spec = expect["text"]
        match = next(k for k in _TEXT_MATCHES if k in spec)
        if match == "regex":
            try:
                re.compile(spec["regex"])
            except re.error as e:
                raise GoldenFileError(f"{path}: at $.expect.text.regex: not a regular expression: {e}") from e
        text = ExpectedText(spec["field"], match, spec[match])
    first = expect.get("max_first_event_s")
    total = expect.get("max_total_s")
    return text, (float(first) if first is not None else None, float(total) if total is not None else None)


def _read(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise GoldenFileError(f"{path}: cannot read: {e.strerror}") from e
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return yaml.load(text, Loader=_GoldenYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except json.JSONDecodeError as e:
        raise GoldenFileError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
    except yaml.YAMLError as e:
        raise GoldenFileError(f"{path}: not valid YAML: {getattr(e, 'problem', e)}") from e


def _check_data_matches_shape(path: Path, where: str, tensor: Mapping[str, Any]) -> None:
    count = flat_length(tensor["data"])
    expected = math.prod(tensor["shape"])
    if count != expected:
        raise GoldenFileError(
            f"{path}: at {where}.data: {count} values, but shape {list(tensor['shape'])} holds {expected}"
        )


def flat_length(data: Any) -> int:
    """Number of scalars in a (possibly nested) JSON `data` list."""
    if isinstance(data, list):
        return sum(flat_length(d) for d in data)
    return 1


def flatten(data: Any) -> list[Any]:
    """The scalars of a (possibly nested) JSON `data` list, in C order."""
    if isinstance(data, list):
        return [x for d in data for x in flatten(d)]
    return [data]


def _expected_values(path: Path, where: str, spec: Mapping[str, Any]) -> bytes | tuple[Any, ...]:
    """ExpectedOutput.values of a golden file's output: a tuple for BYTES, else float64 bytes."""
    flat = flatten(spec["data"])
    if spec["datatype"] == "BYTES":
        return tuple(flat)
    values = []
    for i, value in enumerate(flat):
        if isinstance(value, str) and value in _NON_FINITE_WORDS:
            value = _NON_FINITE_WORDS[value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if spec["datatype"] == "BOOL" and isinstance(value, bool):
                values.append(float(value))
                continue
            raise GoldenFileError(f"{path}: at {where}.data[{i}]: expected a number, got {value!r}")
        values.append(float(value))
    return struct.pack(f"<{len(values)}d", *values)


def request_as_arrays(case: GoldenCase) -> list[tuple[str, str, np.ndarray]]:
    """(name, datatype, array shaped as declared) for each input of the case's request (numpy: the
    health loop encodes requests without it, sidecar.health.infer_body)."""
    import numpy as np

    tensors = []
    for tensor in case.request["inputs"]:
        datatype = tensor["datatype"]
        flat = flatten(tensor["data"])
        if datatype == "BYTES":
            array = np.array([v.encode() if isinstance(v, str) else v for v in flat], dtype=np.object_)
        else:
            array = np.array(flat, dtype=numpy_dtypes()[datatype])
        tensors.append((tensor["name"], datatype, array.reshape(tensor["shape"])))
    return tensors


def dump_golden_case(case: Mapping[str, Any]) -> str:
    """A golden file's JSON text: indented for people, with each `data` list on one line."""
    placeholders: dict[str, str] = {}

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                if key == "data" and isinstance(value, list):
                    token = f"@@data{len(placeholders)}@@"
                    placeholders[token] = json.dumps(value, allow_nan=True)
                    out[key] = token
                else:
                    out[key] = inline(value)
            return out
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    text = json.dumps(inline(case), indent=2)
    for token, data in placeholders.items():
        text = text.replace(f'"{token}"', data)
    return text + "\n"

