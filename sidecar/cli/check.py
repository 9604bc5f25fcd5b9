"""`triton-sidecar check`: the production probe round, once per model, as a CI/CD gate."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.cli.arguments import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_GOLDEN_DIR,
    EXIT_FAILED,
    EXIT_OK,
    FAIL,
    MIN_CASES,
    PASS,
    SKIPPED,
    TIMEOUT,
    CommandError,
    non_negative_int,
    positive_seconds,
    reporting_usage_errors,
    triton_url,
)
from sidecar.golden.cases import (
    GoldenCase,
    load_golden_dir,
)
from sidecar.health.probe_round import GOLDEN, SERVER_READY, ProbeResult, RoundResult, probe_model
from sidecar.health.triton_client import TritonClient
from sidecar.messages import counted


def add_check_parser(commands: Any) -> None:
    check = commands.add_parser(
        "check",
        help="run the golden probes once against a running Triton (a CI/CD gate)",
        description=(
            "Run the probes the sidecar runs in production once against a running Triton: server\n"
            "ready, model ready, metadata declares what the golden requests use, then every golden\n"
            "case (infer and compare). Prints pass/fail and latency per model and case, and for a\n"
            "failure the first differences.\n\n"
            "exit codes: 0 every model passed; 1 a model failed, or Triton did not answer;\n"
            "            2 bad usage or a bad golden file"
        ),
        epilog=(
            "examples:\n"
            "  triton-sidecar check --triton-url http://127.0.0.1:8000\n"
            "  triton-sidecar check --triton-url http://127.0.0.1:8000 --model credit_risk --min-cases 3\n"
            "  triton-sidecar check --triton-url http://triton:8000 --format json > check.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("--triton-url", required=True, type=triton_url, metavar="URL",
                       help="Triton's HTTP endpoint, e.g. http://127.0.0.1:8000")
    check.add_argument("--golden-dir", type=Path, default=DEFAULT_GOLDEN_DIR, metavar="DIR",
                       help="directory of <model>/<case>.json golden files (default: golden_requests)")
    check.add_argument("--model", action="extend", nargs="+", metavar="NAME",
                       help="check these models (default: every model with a folder in the golden directory)")
    check.add_argument("--min-cases", type=non_negative_int, default=1, metavar="N",
                       help="fail a model with fewer than N golden cases (default 1: a model with none "
                            "fails; 0 checks readiness and metadata only)")
    check.add_argument("--format", choices=("table", "json"), default="table",
                       help="table for people (default), json for pipelines")
    check.add_argument("--timeout", type=positive_seconds, default=DEFAULT_CALL_TIMEOUT_S, metavar="S",
                       help=f"bound on each call to Triton, in seconds (default {DEFAULT_CALL_TIMEOUT_S:g})")
    check.set_defaults(handler=reporting_usage_errors(_cmd_check))


@dataclass(frozen=True)
class CheckRow:
    """One line of the report: one probe of one model (or the min-cases rule), with its verdict."""

    check: str
    case: str
    result: str
    latency_s: float | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.result == PASS

    @property
    def differences(self) -> list[str]:
        """A failure's detail one fact a line (probes join compare_outputs' mismatches with '; ')."""
        if self.result not in (FAIL, TIMEOUT):
            return []
        return [part for part in self.detail.split("; ") if part]


@dataclass(frozen=True)
class ModelCheck:
    model: str
    cases: int
    rows: tuple[CheckRow, ...]
    #: False when Triton itself did not answer, so the model could not be judged.
    conclusive: bool = True

    @property
    def ok(self) -> bool:
        return self.conclusive and all(row.ok for row in self.rows)

    @property
    def cases_passed(self) -> int:
        return sum(1 for row in self.rows if row.check == GOLDEN and row.ok)

    @property
    def cause(self) -> str:
        failed = next((row for row in self.rows if not row.ok), None)
        if failed is None:
            return "all checks passed"
        where = f"golden case {failed.case}" if failed.case else failed.check.replace("_", " ")
        return f"{where}: {failed.detail}"


@dataclass(frozen=True)
class CheckReport:
    triton_url: str
    golden_dir: Path
    min_cases: int
    models: tuple[ModelCheck, ...]

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.models)

    @property
    def triton_answered(self) -> bool:
        return all(m.conclusive for m in self.models)


def _cmd_check(args: argparse.Namespace) -> int:
    golden_dir: Path = args.golden_dir
    if not golden_dir.is_dir():
        raise CommandError(f"{golden_dir}: golden directory not found (pass --golden-dir)")
    wanted = list(dict.fromkeys(args.model)) if args.model else None
    cases = load_golden_dir(golden_dir, models=wanted)
    models = wanted if wanted is not None else sorted(cases)
    if not models:
        raise CommandError(f"{golden_dir}: no <model>/ folders with golden requests: nothing to check "
                           "(to check only readiness, name models with --model and pass --min-cases 0)")
    report = asyncio.run(run_check(
        args.triton_url, {m: cases.get(m, ()) for m in models},
        golden_dir=golden_dir, min_cases=args.min_cases, timeout_s=args.timeout,
    ))
    if args.format == "json":
        print(json.dumps(report_as_json(report), indent=2))
    else:
        print(render_table(report))
    return EXIT_OK if report.ok else EXIT_FAILED


async def run_check(
    triton_url: str,
    cases: Mapping[str, Sequence[GoldenCase]],
    *,
    golden_dir: Path,
    min_cases: int,
    timeout_s: float,
) -> CheckReport:
    """One probe round per model, in order, through the production `probe_model`.

    Models run one after another so each latency is the model's own, not a share of a burst. Once
    Triton has not answered, the remaining models are not probed: each would only wait for the same
    silence, up to `timeout_s` apiece.
    """
    triton = TritonClient(triton_url, timeout_s=timeout_s)
    results: list[ModelCheck] = []
    silent_since = ""
    try:
        for model, model_cases in cases.items():
            rows: list[CheckRow] = []
            if silent_since:
                rows.append(CheckRow(SERVER_READY, "", SKIPPED, None,
                                     f"not probed: Triton did not answer the probes of {silent_since}"))
                rows.extend(_skipped(model_cases, "Triton did not answer"))
                results.append(ModelCheck(model, len(model_cases), tuple(rows), conclusive=False))
                continue
            round_ = await probe_model(triton, model, model_cases, timeout_s=timeout_s)
            rows.extend(_rows_from_round(round_, model_cases))
            if len(model_cases) < min_cases:
                rows.append(CheckRow(MIN_CASES, "", FAIL, None,
                                     f"{len(model_cases)} golden case(s) in {golden_dir / model}, "
                                     f"--min-cases asks for at least {min_cases}"))
            if not round_.conclusive:
                silent_since = model
            results.append(ModelCheck(model, len(model_cases), tuple(rows), conclusive=round_.conclusive))
    finally:
        await triton.close()
    return CheckReport(triton_url, golden_dir, min_cases, tuple(results))


def _rows_from_round(round_: RoundResult, cases: Sequence[GoldenCase]) -> list[CheckRow]:
    rows = [_row(result) for result in round_.results]
    done = {result.case for result in round_.results if result.probe == GOLDEN}
    not_run = [case for case in cases if case.name not in done]
    if not_run:
        failed = next((r for r in round_.results if not r.ok), None)
        if failed is not None and failed.probe == GOLDEN:
            reason = f"golden case {failed.case} timed out"
        else:
            reason = f"{failed.probe.replace('_', ' ')} failed" if failed else "not probed"
        rows.extend(_skipped(not_run, reason))
    return rows


def _row(result: ProbeResult) -> CheckRow:
    verdict = PASS if result.ok else TIMEOUT if result.timed_out else FAIL
    return CheckRow(result.probe, result.case, verdict, result.duration_s, result.detail)


def _skipped(cases: Iterable[GoldenCase], reason: str) -> list[CheckRow]:
    return [CheckRow(GOLDEN, case.name, SKIPPED, None, f"not run: {reason}") for case in cases]


def report_as_json(report: CheckReport) -> dict[str, Any]:
    """The report for pipelines: the same rows as the table, with latencies in milliseconds."""
    return {
        "ok": report.ok,
        "triton_url": report.triton_url,
        "triton_answered": report.triton_answered,
        "golden_dir": str(report.golden_dir),
        "min_cases": report.min_cases,
        "summary": {
            "models": len(report.models),
            "models_failed": sum(1 for m in report.models if not m.ok),
            "cases": sum(m.cases for m in report.models),
            "cases_passed": sum(m.cases_passed for m in report.models),
        },
        "models": [
            {
                "model": m.model,
                "ok": m.ok,
                "cases": m.cases,
                "cases_passed": m.cases_passed,
                "conclusive": m.conclusive,
                "cause": "" if m.ok else m.cause,
                "checks": [
                    {
                        "check": row.check,
                        "case": row.case or None,
                        "result": row.result,
                        "ok": row.ok,
                        "latency_ms": None if row.latency_s is None else round(row.latency_s * 1000, 2),
                        "detail": row.detail,
                        "differences": row.differences,
                    }
                    for row in m.rows
                ],
            }
            for m in report.models
        ],
    }


_TABLE_HEADER = ("MODEL", "CHECK", "CASE", "RESULT", "LATENCY", "DETAIL")


def render_table(report: CheckReport) -> str:
    """The report for people: one aligned row per check; a failure's differences one per line."""
    lines: list[tuple[str, ...]] = []
    for m in report.models:
        for row in m.rows:
            latency = "-" if row.latency_s is None else f"{row.latency_s * 1000:.1f} ms"
            details = (row.differences or [row.detail]) if row.result != SKIPPED else [row.detail]
            result = row.result if row.ok or row.result == SKIPPED else row.result.upper()
            lines.append((m.model, row.check, row.case or "-", result, latency, details[0]))
            lines.extend(("", "", "", "", "", more) for more in details[1:])
    widths = [max(len(r[i]) for r in [_TABLE_HEADER, *lines]) for i in range(len(_TABLE_HEADER) - 1)]

    def fmt(cells: tuple[str, ...]) -> str:
        columns = enumerate(zip(cells[:-1], widths, strict=True))
        parts = [cell.rjust(w) if i == 4 else cell.ljust(w) for i, (cell, w) in columns]  # latency right
        return "  ".join([*parts, cells[-1]]).rstrip()

    out = [fmt(_TABLE_HEADER), *(fmt(line) for line in lines), ""]
    failed = [m for m in report.models if not m.ok]
    out.extend(f"FAIL {m.model}: {m.cause}" for m in failed if m.conclusive)
    cases = sum(m.cases for m in report.models)
    passed = sum(m.cases_passed for m in report.models)
    tally = f"{passed} of {cases} golden cases passed, Triton {report.triton_url}"
    silent = [m for m in report.models if not m.conclusive]
    if silent:
        out.append(f"check FAILED: Triton at {report.triton_url} did not answer ({silent[0].cause}); "
                   f"{len(silent)} of {len(report.models)} models could not be judged")
    elif failed:
        out.append(f"check FAILED: {len(failed)} of {len(report.models)} models failed; {tally}")
    else:
        out.append(f"check passed: {counted(len(report.models), 'model')}; {tally}")
    return "\n".join(out)

