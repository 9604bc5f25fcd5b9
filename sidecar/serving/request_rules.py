"""Per-model request schema files (JSON Schema + x-tensors value rules): compiled once at start, checked per request."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

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
class TensorRule:
    """Value rules for one input tensor, checked vectorised (from a schema's `x-tensors`)."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    enum: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class RequestRules:
    """A model's business rules: a compiled JSON Schema for the envelope, and tensor value rules."""

    path: Path
    envelope: jsonschema.protocols.Validator | None
    tensors: Mapping[str, TensorRule] = field(default_factory=dict)


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
    tensors = {
        name: TensorRule(
            minimum=rule.get("minimum"), maximum=rule.get("maximum"),
            exclusive_minimum=rule.get("exclusiveMinimum"), exclusive_maximum=rule.get("exclusiveMaximum"),
            enum=tuple(rule["enum"]) if "enum" in rule else None,
        )
        for name, rule in tensors_raw.items()
    }
    envelope = {k: v for k, v in raw.items() if k != "x-tensors"}
    validator = jsonschema.Draft202012Validator(envelope, format_checker=jsonschema.FormatChecker())
    return RequestRules(path=path, envelope=validator if envelope else None, tensors=tensors)


def _mentions_data(node: Any) -> bool:
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and "data" in props:
            return True
        return any(_mentions_data(v) for k, v in node.items() if k != "x-tensors")
    if isinstance(node, list):
        return any(_mentions_data(v) for v in node)
    return False





