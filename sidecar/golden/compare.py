"""Compare a received answer with a golden case's expected outputs (atol + rtol, NaN where expected)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.golden.cases import ExpectedOutput, GoldenCase, ReceivedOutput


@dataclass(frozen=True)
class Mismatch:
    """One way an answer differs from the expectation, in words an operator can act on."""

    output: str
    message: str

    def __str__(self) -> str:
        return self.message


#: How many differing elements one output reports; the rest are counted.
MAX_REPORTED_ELEMENTS = 3


def compare_outputs(case: GoldenCase, received: Mapping[str, ReceivedOutput]) -> list[Mismatch]:
    """Every way `received` differs from the case's expectation; empty means it matches."""
    mismatches: list[Mismatch] = []
    for name, expected in case.outputs.items():
        mismatches.extend(compare_output(name, expected, received.get(name)))
    return mismatches


def compare_output(name: str, expected: ExpectedOutput, got: ReceivedOutput | None) -> list[Mismatch]:
    """Every way one output differs from its expectation (also used to compare two versions' live
    answers, sidecar.serving.rollouts); empty means it matches."""
    if got is None:
        return [Mismatch(name, f"output {name} missing from the answer")]
    if got.datatype != expected.datatype:
        return [Mismatch(name, f"{name} datatype expected {expected.datatype}, got {got.datatype}")]
    if tuple(got.shape) != expected.shape:
        return [Mismatch(name, f"{name} shape expected {list(expected.shape)}, got {list(got.shape)}")]
    return _compare_values(name, expected, got.data.reshape(-1))


def _compare_values(name: str, expected: ExpectedOutput, got: np.ndarray) -> list[Mismatch]:
    if expected.datatype == "BYTES":
        wrong = [i for i, (e, g) in enumerate(zip(expected.data, got, strict=True)) if _as_bytes(e) != _as_bytes(g)]
        return [
            Mismatch(name, f"{name}[{i}] expected {expected.data[i]!r}, got {got[i]!r}")
            for i in wrong[:MAX_REPORTED_ELEMENTS]
        ] + _more(name, len(wrong))
    want = expected.data
    have = got.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        close = np.abs(have - want) <= expected.atol + expected.rtol * np.abs(want)
    # NaN only matches NaN, and ±Inf only the same infinity, and only where the golden file says so.
    both_nan = np.isnan(want) & np.isnan(have)
    same_inf = np.isinf(want) & (have == want)
    ok = (close & np.isfinite(want) & np.isfinite(have)) | both_nan | same_inf
    wrong = np.flatnonzero(~ok)
    reported = [
        Mismatch(name, f"{name}[{i}] expected {_fmt(want[i])}±{_fmt_tol(expected, want[i])}, got {_fmt(have[i])}")
        for i in wrong[:MAX_REPORTED_ELEMENTS]
    ]
    return reported + _more(name, len(wrong))


def _more(name: str, wrong: int) -> list[Mismatch]:
    extra = wrong - MAX_REPORTED_ELEMENTS
    return [Mismatch(name, f"{name}: {extra} more elements differ")] if extra > 0 else []


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"


def _fmt_tol(expected: ExpectedOutput, value: float) -> str:
    tol = expected.atol + expected.rtol * abs(value) if math.isfinite(value) else 0.0
    return f"{tol:.4f}" if tol >= 1e-4 else f"{tol:.1e}"

