"""What the sub-commands share: exit codes, argument types, defaults and the usage-error wrapper.

Exit codes, for every sub-command: 0 fine; 1 a model failed its check, or the server's answer could
not be recorded, or Triton did not answer; 2 bad usage or bad files (one line on stderr naming the
file and key).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The CLI's exit codes.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


#: Bound (s) on each call `check` and `record` make. Longer than the sidecar's probes.timeout_s (2 s):
#: a CI gate often runs right after the models were loaded, when first inferences are slow, and a
#: false failure there blocks a rollout.
DEFAULT_CALL_TIMEOUT_S = 10.0


#: The default golden directory, as in the sidecar's config.
DEFAULT_GOLDEN_DIR = Path("golden_requests")

#: Result words shared by the table and the JSON output.
PASS, FAIL, TIMEOUT, SKIPPED = "pass", "fail", "timeout", "skipped"


#: The check that is not a probe: enough golden cases for the model.
MIN_CASES = "min_cases"


#: The source checkout (the demo's example models and golden files).
REPO_ROOT = Path(__file__).resolve().parents[2]


class UsageError(Exception):
    """Bad arguments, config or golden files: exit 2 with one line."""


class CommandError(Exception):
    """Bad arguments or input files for an operator command: exit 2 with one line."""


class RecordRefused(Exception):
    """The server's answer must not become a golden file (or there was no answer): exit 1."""


def reporting_usage_errors(handler: Any) -> Any:
    """Usage and file errors of these commands end like the CLI's own: one line on stderr, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except CommandError as e:
            print(f"triton-sidecar: error: {e}", file=sys.stderr)
            return EXIT_USAGE

    return run


def number_argument(parse: Callable[[str], float], ok: Callable[[float], bool], kind: str,
                     rule: str) -> Callable[[str], float]:
    """An argparse `type` that parses `kind` and keeps values for which `ok` holds, naming `rule`."""

    def convert(text: str) -> float:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return convert


positive_seconds = number_argument(float, lambda v: v > 0 and math.isfinite(v), "a number of seconds",
                                     "a positive number of seconds")


non_negative_int = number_argument(int, lambda v: v >= 0, "a whole number", "0 or more")


tolerance = number_argument(float, lambda v: v >= 0 and math.isfinite(v), "a number", "a finite number >= 0")


def triton_url(text: str) -> str:
    if not re.fullmatch(r"https?://[^/\s]+/?", text):
        raise argparse.ArgumentTypeError(f"expected http://host:port (Triton's HTTP endpoint), got {text!r}")
    return text.rstrip("/")

