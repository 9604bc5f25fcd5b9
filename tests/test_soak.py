"""Reliability: a one-minute soak with faults, the short version of bench/soak.py (issue 7).

Steady proxied load through the real sidecar process in front of the real Triton while the faulted
model is broken in a new way every 12 s (NaN, drift, unloaded by someone else, stub killed, hung).
The same pass criteria as the ten-minute benchmark: no answer that is neither correct nor a 503 with
Retry-After, no wrong answer, except from the faulted model before the sidecar has quarantined it;
RSS growth under 10%; descriptors back where they started.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import SoakSettings, run_soak

pytestmark = [pytest.mark.fault, pytest.mark.timeout(420)]


def test_a_minute_of_load_with_faults_gets_only_correct_answers_or_503s(tmp_path: Path) -> None:
    settings = SoakSettings(duration_s=60, rate=50, fault_every_s=12, warmup_s=3)
    report = run_soak(settings, tmp_path)

    assert report.counts_steady["sent"] > 0 and report.counts_steady["correct"] == report.counts_steady["sent"], (
        report.counts_steady, report.examples_of_failures)
    assert len(report.faults) >= 2, report.faults
    assert report.passed, (report.failures, report.examples_of_failures, report.faults)
