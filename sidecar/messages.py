"""Short, safe texts for error messages: client input and Triton's words echoed in errors stay
short (one readable line), and every message names a place in a document the same way."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

#: Characters of a client's value echoed back in a validation error.
MAX_ECHO_CHARS = 80


def counted(count: int, noun: str) -> str:
    """`1 model`, `3 models`: a count with its noun in the number a reader expects (regular plurals)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def cut(text: str, limit: int = 120) -> str:
    """`text`, or its first `limit` characters ending in "..."."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_message(message: str, limit: int = 160) -> str:
    """jsonschema echoes whole values (a 3072-float list); keep messages to one readable line."""
    return cut(message, limit)


def echo(value: Any) -> str:
    """A client's value as it is quoted in an error: its text, or its JSON, cut short."""
    return cut(value if isinstance(value, str) else json.dumps(value, default=repr), MAX_ECHO_CHARS)


def json_path(parts: Iterable[Any], root: str = "$") -> str:
    """`$.request.inputs[0].data` from jsonschema's path parts: how every message names a place."""
    out = root
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out
