"""Compare a received answer with a golden case's expected outputs (atol + rtol, NaN where expected).

The rule itself is the data plane's (dataplane/src/golden/compare.rs): one implementation, called
here by the health loop's probe rounds and by rollouts' comparison of two versions' answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sidecar import _dataplane
from sidecar.golden.cases import ExpectedOutput, GoldenCase, ReceivedOutput


@dataclass(frozen=True)
class Mismatch:
    """One way an answer differs from the expectation, in words an operator can act on."""

    output: str
    message: str

    def __str__(self) -> str:
        return self.message


def compare_outputs(case: GoldenCase, received: Mapping[str, ReceivedOutput]) -> list[Mismatch]:
    """Every way `received` differs from the case's expectation; empty means it matches."""
    mismatches: list[Mismatch] = []
    for name, expected in case.outputs.items():
        mismatches.extend(compare_output(name, expected, received.get(name)))
    return mismatches


def compare_output(name: str, expected: ExpectedOutput, got: ReceivedOutput | None) -> list[Mismatch]:
    """Every way one output differs from its expectation (also used to compare two versions' live
    answers, sidecar.serving.rollouts); empty means it matches."""
    answer = None if got is None else (got.datatype, tuple(got.shape), got.data)
    messages = _dataplane.compare_output(name, expected.datatype, expected.shape, expected.values, expected.atol,
                                         expected.rtol, answer)
    return [Mismatch(name, message) for message in messages]
