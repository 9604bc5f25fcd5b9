"""Per-model request schema files (JSON Schema + x-tensors value rules): read and checked once at start-up.

The file is checked here (its JSON, its draft, the meta-schema, the shape of `x-tensors`, no rule on
tensor `data`), where a broken one stops the start with one ConfigError naming file and key. The
per-request check is the data plane's (`dataplane/src/serving/request_rules.rs`): the file's JSON is
handed down once, compiled there, and checked by `RequestSpec.validate` for every wire, the Rust front's
lanes and the Python chain alike (one implementation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from sidecar._dataplane import RequestRules as NativeRules
from sidecar.config import ConfigError, ValidationSection
from sidecar.messages import echo, json_path, short_message

#: The one draft request schemas are applied as; a file that declares another would be misread.
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


_TENSOR_RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            "minimum": {"type": "number"},
            "maximum": {"type": "number"},
            "exclusiveMinimum": {"type": "number"},
            "exclusiveMaximum": {"type": "number"},
            "enum": {"type": "array", "minItems": 1, "items": {"type": ["number", "string", "boolean"]}},
        },
    },
}

@dataclass(frozen=True)
class RequestRules:
    """A model's business rules: its file, and the data plane's compiled copy (envelope schema and
    x-tensors value rules) that every request to the model is checked with."""

    path: Path
    native: NativeRules


def load_schemas(section: ValidationSection) -> dict[str, RequestRules]:
    """Every model's request schema, by model: what start-up loads, and what `validate` checks."""
    return {model: load_request_rules(path, model=model) for model, path in section.schemas.items()}


def load_request_rules(path: Path | str, *, model: str) -> RequestRules:
    """Read and compile one model's schema file once at start-up; ConfigError names the file and the
    key (`validation.schemas.<model>`, or the JSON path inside the file). `triton-sidecar validate`
    calls this very function, so a file it passes is one the sidecar starts with."""
    path = Path(path)
    key = f"validation.schemas.{model}"
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the request schema for {model} ({key}): {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg} ({key})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: not UTF-8 text ({key})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a request schema is a JSON object, got {type(raw).__name__} ({key})")
    declared = raw.get("$schema")
    if declared is not None and str(declared).rstrip("#") != DRAFT_2020_12:
        raise ConfigError(f"{path}: at $.$schema: declares {echo(declared)!r}, but request schemas are applied "
                          f"as Draft 2020-12 ({DRAFT_2020_12})")
    meta = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA,
                                           format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    # The deepest error first: the meta-schema's own complaint about a top-level anyOf says less.
    error = next(iter(sorted(meta.iter_errors(raw), key=lambda err: [str(p) for p in err.absolute_path])), None)
    if error is not None:
        raise ConfigError(f"{path}: at {json_path(error.absolute_path)}: not a valid Draft 2020-12 schema: "
                          f"{short_message(error.message)}")
    tensors_raw = raw.get("x-tensors", {})
    error = next(iter(jsonschema.Draft202012Validator(_TENSOR_RULE_SCHEMA).iter_errors(tensors_raw)), None)
    if error is not None:
        raise ConfigError(f"{path}: at {json_path(error.absolute_path, '$.x-tensors')}: "
                          f"{short_message(error.message)}")
    if _mentions_data(raw):
        raise ConfigError(
            f"{path}: the schema constrains tensor 'data'; tensor values are not walked through JSON Schema "
            "(cost), put value rules under x-tensors: {<input>: {minimum, maximum, enum, ...}}"
        )
    try:
        native = NativeRules(path.name, json.dumps(raw))
    except ValueError as e:  # what the crate cannot compile that the meta-schema let through
        raise ConfigError(f"{path}: {e} ({key})") from e
    return RequestRules(path=path, native=native)


def _mentions_data(node: Any) -> bool:
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and "data" in props:
            return True
        return any(_mentions_data(v) for k, v in node.items() if k != "x-tensors")
    if isinstance(node, list):
        return any(_mentions_data(v) for v in node)
    return False
