"""Operator commands: `check` (a CI/CD gate), `record` (write golden files), `validate` (offline)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parsers(commands: Any) -> None:
    """Register the operator sub-commands on the CLI's sub-parser set."""
    del commands  # filled in by the operator-commands work


__all__ = ["add_parsers", "argparse"]
