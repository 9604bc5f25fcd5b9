"""Operator commands: `check` (a CI/CD gate), `record` (write golden files), `validate` (offline).

`check` runs the very probe round the sidecar runs in production (`probes.probe_model`) once per model
and reports it; `record` turns one answer of a known-good server into a golden file that `check` (and
the sidecar) will accept; `validate` reads the config, the golden files and the per-model request
schemas without a server and names every problem it finds.

Exit codes, as for every sub-command (see sidecar.cli): 0 fine; 1 a model failed its check, or the
server's answer could not be recorded, or Triton did not answer; 2 bad usage or bad files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import yaml

from sidecar.config import CONFIG_SCHEMA, ConfigError, SidecarConfig, load_config
from sidecar.golden import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    ENDPOINTS,
    FLOAT_DATATYPES,
    GOLDEN_SUFFIXES,
    INFER,
    ExpectedText,
    GoldenCase,
    GoldenFileError,
    ReceivedOutput,
    check_request,
    dump_golden_case,
    golden_file_problems,
    load_golden_dir,
    load_golden_file,
    short_message,
)
from sidecar.probes import GOLDEN, SERVER_READY, ProbeResult, RoundResult, probe_model
from sidecar.triton import TritonClient, TritonError, TritonUnavailable
from sidecar.validation import load_request_rules

#: The CLI's exit codes (sidecar.cli defines the same; this module sits below it and cannot import it).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: Bound (s) on each call `check` and `record` make. Longer than the sidecar's probes.timeout_s (2 s):
#: a CI gate often runs right after the models were loaded, when first inferences are slow, and a
#: false failure there blocks a rollout.
DEFAULT_CALL_TIMEOUT_S = 10.0
#: The default golden directory, as in the sidecar's config.
DEFAULT_GOLDEN_DIR = Path("golden_requests")
#: Longest `error_contains` that `record` writes: enough to identify the rejection, short enough to
#: survive rewording of the rest of Triton's message (and its 300-character cut in TritonClient).
MAX_ERROR_CONTAINS_CHARS = 120
#: Triton puts "[request id: <id>] " in front of some messages; the id changes per request.
_REQUEST_ID_PREFIX = re.compile(r"^\s*\[request id: [^\]]*\]\s*")

#: Result words shared by the table and the JSON output.
PASS, FAIL, TIMEOUT, SKIPPED = "pass", "fail", "timeout", "skipped"
#: The check that is not a probe: enough golden cases for the model.
MIN_CASES = "min_cases"


class CommandError(Exception):
    """Bad arguments or input files for an operator command: exit 2 with one line."""


class RecordRefused(Exception):
    """The server's answer must not become a golden file (or there was no answer): exit 1."""


def add_parsers(commands: Any) -> None:
    """Register the operator sub-commands on the CLI's sub-parser set."""
    _add_check_parser(commands)
    _add_record_parser(commands)
    _add_validate_parser(commands)


def _run_reporting_usage_errors(handler: Any) -> Any:
    """Usage and file errors of these commands end like the CLI's own: one line on stderr, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except CommandError as e:
            print(f"triton-sidecar: error: {e}", file=sys.stderr)
            return EXIT_USAGE

    return run


def _number_argument(parse: Callable[[str], float], ok: Callable[[float], bool], kind: str,
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


_positive_seconds = _number_argument(float, lambda v: v > 0 and math.isfinite(v), "a number of seconds",
                                     "a positive number of seconds")
_non_negative_int = _number_argument(int, lambda v: v >= 0, "a whole number", "0 or more")
_tolerance = _number_argument(float, lambda v: v >= 0 and math.isfinite(v), "a number", "a finite number >= 0")


def _triton_url(text: str) -> str:
    if not re.fullmatch(r"https?://[^/\s]+/?", text):
        raise argparse.ArgumentTypeError(f"expected http://host:port (Triton's HTTP endpoint), got {text!r}")
    return text.rstrip("/")


# --------------------------------------------------------------------------------------------- check


def _add_check_parser(commands: Any) -> None:
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
    check.add_argument("--triton-url", required=True, type=_triton_url, metavar="URL",
                       help="Triton's HTTP endpoint, e.g. http://127.0.0.1:8000")
    check.add_argument("--golden-dir", type=Path, default=DEFAULT_GOLDEN_DIR, metavar="DIR",
                       help="directory of <model>/<case>.json golden files (default: golden_requests)")
    check.add_argument("--model", action="extend", nargs="+", metavar="NAME",
                       help="check these models (default: every model with a folder in the golden directory)")
    check.add_argument("--min-cases", type=_non_negative_int, default=1, metavar="N",
                       help="fail a model with fewer than N golden cases (default 1: a model with none "
                            "fails; 0 checks readiness and metadata only)")
    check.add_argument("--format", choices=("table", "json"), default="table",
                       help="table for people (default), json for pipelines")
    check.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_CALL_TIMEOUT_S, metavar="S",
                       help=f"bound on each call to Triton, in seconds (default {DEFAULT_CALL_TIMEOUT_S:g})")
    check.set_defaults(handler=_run_reporting_usage_errors(_cmd_check))


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
        out.append(f"check passed: {len(report.models)} models; {tally}")
    return "\n".join(out)


# -------------------------------------------------------------------------------------------- record


def _add_record_parser(commands: Any) -> None:
    record = commands.add_parser(
        "record",
        help="send a request to a known-good Triton and write its answer as a golden file",
        description=(
            "Send one v2 inference request (a JSON body as a client would POST it) to a known-good\n"
            "server and write a golden file whose expectations are the answer received. The file is\n"
            "checked against the server (the same probe `check` runs) before it is written.\n\n"
            "Floating-point outputs get --atol/--rtol; integer and BOOL outputs must match exactly.\n"
            "With --expect-error the request must be rejected with a 4xx, and the file pins that\n"
            "status and the start of Triton's message.\n\n"
            "exit codes: 0 written; 1 the answer cannot be recorded (NaN/Inf, an unexpected\n"
            "            rejection or acceptance, no answer); 2 bad usage or a bad request file"
        ),
        epilog=(
            "examples:\n"
            "  triton-sidecar record --triton-url http://127.0.0.1:8000 --model credit_risk \\\n"
            "      --request examples/requests/credit_risk.json \\\n"
            "      --out golden_requests/credit_risk/normal.json --description 'a typical applicant'\n"
            "  triton-sidecar record --triton-url http://127.0.0.1:8000 --model credit_risk \\\n"
            "      --request bad_shape.json --out golden_requests/credit_risk/abnormal_shape.json \\\n"
            "      --expect-error"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    record.add_argument("--triton-url", required=True, type=_triton_url, metavar="URL",
                        help="a known-good Triton's HTTP endpoint, e.g. http://127.0.0.1:8000")
    record.add_argument("--model", required=True, metavar="NAME", help="the model to send the request to")
    record.add_argument("--request", required=True, type=Path, metavar="FILE",
                        help="v2 inference request body (JSON); a golden file's request is taken too")
    record.add_argument("--out", required=True, type=Path, metavar="FILE",
                        help="golden file to write, usually golden_requests/<model>/<case>.json")
    record.add_argument("--atol", type=_tolerance, default=DEFAULT_ATOL, metavar="A",
                        help=f"absolute tolerance for floating-point outputs (default {DEFAULT_ATOL:g})")
    record.add_argument("--rtol", type=_tolerance, default=DEFAULT_RTOL, metavar="R",
                        help=f"relative tolerance for floating-point outputs (default {DEFAULT_RTOL:g})")
    record.add_argument("--description", metavar="TEXT", help="what the case stands for, for the next reader")
    record.add_argument("--version", default="", metavar="V",
                        help="model version to send to and to pin in the file (default: Triton's choice)")
    record.add_argument("--allow-non-finite", action="store_true",
                        help="record NaN/Inf outputs (only for a model that answers them on purpose)")
    record.add_argument("--expect-error", action="store_true",
                        help="record an abnormal input: the server must reject it with a 4xx")
    record.add_argument("--endpoint", choices=ENDPOINTS, default=None,
                        help="infer (default), or generate / generate_stream for a generative model: the "
                             "request is then its flat JSON body and the file pins the text of --text-field")
    record.add_argument("--text-field", default="text_output", metavar="NAME",
                        help="the output whose text a generate case pins (default text_output)")
    record.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_CALL_TIMEOUT_S, metavar="S",
                        help=f"bound on each call to Triton, in seconds (default {DEFAULT_CALL_TIMEOUT_S:g})")
    record.set_defaults(handler=_run_reporting_usage_errors(_cmd_record))


def _cmd_record(args: argparse.Namespace) -> int:
    out: Path = args.out
    if out.suffix != ".json":
        raise CommandError(f"{out}: record writes JSON; name the file <case>.json so the sidecar finds it")
    request, description, endpoint = read_request_file(args.request, args.endpoint)
    description = args.description if args.description is not None else (
        description or f"Recorded by triton-sidecar record from {args.request.name}.")
    try:
        golden = asyncio.run(record_case(
            args.triton_url, args.model, request,
            case_name=out.stem, description=description, version=args.version,
            atol=args.atol, rtol=args.rtol, allow_non_finite=args.allow_non_finite,
            expect_error=args.expect_error, timeout_s=args.timeout, endpoint=endpoint,
            text_field=args.text_field,
        ))
    except RecordRefused as e:
        print(f"triton-sidecar: record refused: {e}", file=sys.stderr)
        return EXIT_FAILED
    _write_atomically(out, dump_golden_case(golden))
    expect = golden["expect"]
    if "outputs" in expect:
        what = ", ".join(f"{name} {spec['datatype']} {spec['shape']}" for name, spec in expect["outputs"].items())
    elif "text" in expect:
        what = f"{expect['text']['field']} = {expect['text']['equals']!r}"
    else:
        what = f"rejection {expect['status']}" + (f" mentioning {expect['error_contains']!r}"
                                                   if expect.get("error_contains") else "")
    print(f"recorded {args.model}/{out.stem} -> {out} ({what})")
    return EXIT_OK


def read_request_file(path: Path, endpoint: str | None = None) -> tuple[dict[str, Any], str, str]:
    """The request body in `path` (or the request of a golden file), the golden description, and the
    endpoint: `endpoint` when given, else the golden file's, else infer."""
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise CommandError(f"{path}: cannot read the request file: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise CommandError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
    description = ""
    where = "$"
    if isinstance(raw, dict) and "request" in raw and "expect" in raw and "inputs" not in raw:
        description = raw.get("description", "") if isinstance(raw.get("description"), str) else ""
        endpoint = endpoint or (raw.get("endpoint") if raw.get("endpoint") in ENDPOINTS else None)
        raw, where = raw["request"], "$.request"
    endpoint = endpoint or INFER
    if endpoint != INFER:
        if not isinstance(raw, dict):
            raise CommandError(f"{path}: at {where}: a {endpoint} request is one JSON object of inputs and "
                               "parameters")
        return raw, description, endpoint
    try:
        check_request(raw, path, where)
    except GoldenFileError as e:
        raise CommandError(str(e)) from e
    return raw, description, endpoint


async def record_case(
    triton_url: str,
    model: str,
    request: Mapping[str, Any],
    *,
    case_name: str,
    description: str,
    version: str = "",
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    allow_non_finite: bool = False,
    expect_error: bool = False,
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    endpoint: str = INFER,
    text_field: str = "text_output",
) -> dict[str, Any]:
    """Ask the server, turn its answer into a golden file's content, and prove it passes a probe round.

    Raises RecordRefused when the answer must not be pinned, or when Triton does not answer.
    """
    triton = TritonClient(triton_url, timeout_s=timeout_s)
    try:
        try:
            ready = await triton.model_ready(model, version, timeout_s=timeout_s)
        except (TritonUnavailable, TritonError) as e:
            raise RecordRefused(f"Triton at {triton_url} did not answer whether {model} is ready: {e}") from e
        if not ready:
            # Without this, --expect-error would happily pin "unknown model" as the expected rejection.
            raise RecordRefused(f"model {model!r} is not ready on {triton_url}; record against a "
                                "known-good server with the model loaded")
        if endpoint != INFER:
            expect = await _record_generate(triton, model, request, case_name=case_name, version=version,
                                            endpoint=endpoint, text_field=text_field, expect_error=expect_error,
                                            timeout_s=timeout_s)
            return await _finish_record(triton, model, case_name, description, version, request, expect,
                                        timeout_s, endpoint)
        probe_case = GoldenCase(model=model, name=case_name, path=Path(f"{case_name}.json"),
                                request=request, version=version)
        try:
            outcome = await triton.infer_case(probe_case, timeout_s=timeout_s)
        except TritonUnavailable as e:
            raise RecordRefused(f"Triton at {triton_url} did not answer the inference: {e}") from e
        if outcome.status == 200:
            if expect_error:
                raise RecordRefused(f"{model} accepted the request (200) but --expect-error records only a "
                                    "rejection (4xx); drop --expect-error to pin its outputs")
            expect: dict[str, Any] = {"status": 200, "outputs": _expected_outputs(
                outcome.outputs, atol=atol, rtol=rtol, allow_non_finite=allow_non_finite)}
        elif 400 <= outcome.status <= 499:
            if not expect_error:
                raise RecordRefused(f"{model} rejected the request ({outcome.status}: {outcome.error}); pass "
                                    "--expect-error to record it as an abnormal-input case")
            expect = {"status": outcome.status}
            error_contains = stable_error_text(outcome.error)
            if error_contains:
                expect["error_contains"] = error_contains
        else:
            raise RecordRefused(f"Triton answered {outcome.status} ({outcome.error}): a server fault, not an "
                                "answer to pin; golden files hold 200 or 4xx")
        return await _finish_record(triton, model, case_name, description, version, request, expect, timeout_s)
    finally:
        await triton.close()


async def _finish_record(triton: TritonClient, model: str, case_name: str, description: str, version: str,
                         request: Mapping[str, Any], expect: dict[str, Any], timeout_s: float,
                         endpoint: str = INFER) -> dict[str, Any]:
    golden: dict[str, Any] = {"description": description}
    if version:
        golden["version"] = version
    if endpoint != INFER:
        golden["endpoint"] = endpoint
    golden["request"] = dict(request)
    golden["expect"] = expect
    await _prove_it_passes(triton, model, case_name, golden, timeout_s)
    return golden


async def _record_generate(triton: TritonClient, model: str, request: Mapping[str, Any], *, case_name: str,
                           version: str, endpoint: str, text_field: str, expect_error: bool,
                           timeout_s: float) -> dict[str, Any]:
    """A generate case's expectation: the text Triton answered (a stream's events concatenated), or
    its 4xx. Operators pin decoding in the request (temperature 0, a seed) so the text repeats."""
    probe_case = GoldenCase(model=model, name=case_name, path=Path(f"{case_name}.json"), request=request,
                            version=version, endpoint=endpoint,
                            text=ExpectedText(text_field, "equals", ""))
    try:
        outcome = await triton.generate_case(probe_case, timeout_s=timeout_s)
    except TritonUnavailable as e:
        raise RecordRefused(f"Triton did not answer the {endpoint} request: {e}") from e
    if outcome.status == 200 and not outcome.error:
        if expect_error:
            raise RecordRefused(f"{model} accepted the request (200) but --expect-error records only a "
                                "rejection (4xx); drop --expect-error to pin its text")
        if outcome.events == 0:
            raise RecordRefused(f"{model} answered no event: nothing to compare against later")
        return {"status": 200, "text": {"field": text_field, "equals": outcome.text}}
    if outcome.status == 200:
        raise RecordRefused(f"Triton's answer ended in an error ({outcome.error}): a fault, not an answer to pin")
    if 400 <= outcome.status <= 499:
        if not expect_error:
            raise RecordRefused(f"{model} rejected the request ({outcome.status}: {outcome.error}); pass "
                                "--expect-error to record it as an abnormal-input case")
        expect: dict[str, Any] = {"status": outcome.status}
        error_contains = stable_error_text(outcome.error)
        if error_contains:
            expect["error_contains"] = error_contains
        return expect
    raise RecordRefused(f"Triton answered {outcome.status} ({outcome.error}): a server fault, not an "
                        "answer to pin; golden files hold 200 or 4xx")


async def _prove_it_passes(triton: TritonClient, model: str, case_name: str, golden: Mapping[str, Any],
                           timeout_s: float) -> None:
    """Load the would-be file as the sidecar will and run the production probe round on it."""
    with tempfile.TemporaryDirectory(prefix="triton-sidecar-record-") as scratch:
        path = Path(scratch) / f"{case_name}.json"
        path.write_text(dump_golden_case(golden))
        try:
            case = load_golden_file(path, model=model)
        except GoldenFileError as e:
            raise RecordRefused(f"the recorded case would not load: {e}") from e
        round_ = await probe_model(triton, model, [case], timeout_s=timeout_s)
    if not round_.ok:
        raise RecordRefused(f"the recorded case does not pass check against {triton.url} right away "
                            f"(is the model deterministic?): {round_.cause}")


def _expected_outputs(received: Mapping[str, ReceivedOutput], *, atol: float, rtol: float,
                      allow_non_finite: bool) -> dict[str, Any]:
    if not received:
        raise RecordRefused("the answer holds no outputs: nothing to compare against later")
    outputs: dict[str, Any] = {}
    for name, output in received.items():
        flat = np.asarray(output.data).reshape(-1)
        spec: dict[str, Any] = {"datatype": output.datatype, "shape": list(output.shape)}
        if output.datatype in FLOAT_DATATYPES:
            bad = np.flatnonzero(~np.isfinite(flat.astype(np.float64)))
            if bad.size and not allow_non_finite:
                raise RecordRefused(
                    f"output {name} holds {flat[bad[0]]} at [{bad[0]}] ({bad.size} non-finite values): a "
                    "broken model's answer must not become the expectation; pass --allow-non-finite only "
                    "if the model answers NaN/Inf on purpose")
            spec["data"] = [_float_for_json(v, output.datatype, atol, rtol) for v in flat]
            spec["atol"], spec["rtol"] = atol, rtol
        elif output.datatype == "BYTES":
            spec["data"] = [_text_for_json(name, v) for v in flat]
        elif output.datatype == "BOOL":
            spec["data"] = [bool(v) for v in flat]
            spec["atol"], spec["rtol"] = 0, 0
        else:
            spec["data"] = [int(v) for v in flat]
            spec["atol"], spec["rtol"] = 0, 0  # class ids and counts: exact
        outputs[name] = spec
    return outputs


def _float_for_json(value: Any, datatype: str, atol: float, rtol: float) -> float | str:
    """The shortest decimal that reads back as the same FP16/FP32 value (0.4344863, not
    0.4344862699508667), unless the tolerances are too tight for it to still compare equal."""
    exact = float(value)
    if not math.isfinite(exact):
        return "NaN" if math.isnan(exact) else "Infinity" if exact > 0 else "-Infinity"
    if datatype == "FP64":
        return exact
    short = float(str(np.float16(value) if datatype == "FP16" else np.float32(value)))
    return short if abs(short - exact) <= atol + rtol * abs(short) else exact


def _text_for_json(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise RecordRefused(f"output {name} holds bytes that are not UTF-8 text: a golden file "
                            "cannot hold them") from None


def stable_error_text(message: str) -> str:
    """The part of Triton's message that identifies the rejection and survives from one request to
    the next: no "[request id: ...]" prefix, only the first sentence, at most
    MAX_ERROR_CONTAINS_CHARS characters, ending on a whole word."""
    text = _REQUEST_ID_PREFIX.sub("", message).strip()
    text = text.removesuffix("...")  # TritonClient cuts long messages
    text = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".").strip()
    if len(text) > MAX_ERROR_CONTAINS_CHARS:
        cut = text[:MAX_ERROR_CONTAINS_CHARS]
        text = cut.rsplit(" ", 1)[0] if " " in cut else cut
    return text


def _write_atomically(path: Path, text: str) -> None:
    """Write through a sibling file and a rename: a crash never leaves half a golden file behind
    (and the sibling's .tmp suffix is not one the sidecar reads)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as e:
        raise CommandError(f"{path}: cannot write the golden file: {e.strerror}") from e


# ------------------------------------------------------------------------------------------ validate


def _add_validate_parser(commands: Any) -> None:
    validate = commands.add_parser(
        "validate",
        help="check the config, golden files and request schemas offline (no server)",
        description=(
            "Check, without a server, everything the sidecar reads at start-up: the config file\n"
            "(with SIDECAR_* overrides from the environment), every golden file, and every per-model\n"
            "JSON Schema listed under validation.schemas (each must be a valid Draft 2020-12 schema).\n"
            "Every problem is listed with its file and JSON path, not only the first.\n\n"
            "exit codes: 0 no problems; 2 problems found"
        ),
        epilog=(
            "examples:\n"
            "  triton-sidecar validate --golden-dir golden_requests\n"
            "  triton-sidecar validate --config /etc/triton-sidecar/sidecar.yaml"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    validate.add_argument("--config", type=Path, metavar="FILE", help="YAML config file (default: defaults)")
    validate.add_argument("--golden-dir", type=Path, metavar="DIR",
                          help="golden directory (default: the config's golden_dir, else golden_requests)")
    validate.set_defaults(handler=_run_reporting_usage_errors(_cmd_validate))


@dataclass
class ValidationReport:
    problems: list[str]
    notes: list[str]
    config: str
    golden_dir: Path
    golden_files: int = 0
    models: int = 0
    schemas: int = 0


def _cmd_validate(args: argparse.Namespace) -> int:
    report = validate_files(args.config, args.golden_dir)
    for problem in report.problems:
        print(problem)
    for note in report.notes:
        print(f"note: {note}")
    checked = (f"config {report.config}, {report.golden_files} golden files for {report.models} models "
               f"in {report.golden_dir}, {report.schemas} request schemas")
    if report.problems:
        print(f"validate: {len(report.problems)} problem(s) ({checked})")
        return EXIT_USAGE
    print(f"validate: OK ({checked})")
    return EXIT_OK


def validate_files(config_path: Path | None, golden_dir: Path | None) -> ValidationReport:
    """Every problem in the config, the golden files and the request schemas, each naming its file."""
    config, raw, problems = _config_problems(config_path)
    if golden_dir is None:
        golden_dir = config.golden_dir if config is not None else Path(
            raw["golden_dir"] if isinstance(raw.get("golden_dir"), str) else DEFAULT_GOLDEN_DIR)
    report = ValidationReport(problems, [], str(config_path) if config_path else "defaults", golden_dir)
    _check_golden_dir(golden_dir, report)
    if config is not None:
        schemas: Mapping[str, Any] = config.validation.schemas
    else:
        section = raw.get("validation")
        found = section.get("schemas") if isinstance(section, dict) else None
        schemas = {m: f for m, f in found.items() if isinstance(f, str)} if isinstance(found, dict) else {}
    for model, file in schemas.items():
        report.schemas += 1
        report.problems.extend(_schema_problems(model, Path(file)))
    return report


def _config_problems(path: Path | None) -> tuple[SidecarConfig | None, dict[str, Any], list[str]]:
    """The loaded config (None if it does not load), the file's raw mapping, and every problem.

    `load_config` stops at the first problem; the schema's remaining complaints about the file are
    added so that one run lists all of them.
    """
    try:
        return load_config(path), _raw_config(path) if path else {}, []
    except ConfigError as e:
        first = str(e)
    raw = _raw_config(path) if path else {}
    problems = [first]
    validator = jsonschema.Draft202012Validator(CONFIG_SCHEMA)
    for error in sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path)):
        for problem in _config_error_lines(str(path), error):
            if problem not in problems:
                problems.append(problem)
    return None, raw, problems


def _raw_config(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}  # load_config has named the problem already
    return data if isinstance(data, dict) else {}


def _config_error_lines(source: str, error: jsonschema.ValidationError) -> list[str]:
    # Worded as sidecar.config words them, so the first problem is not listed twice.
    key_path = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known_keys = error.schema.get("properties", {})
        known = ", ".join(sorted(known_keys))
        return [f"{source}: unknown key {'.'.join(p for p in (key_path, extra) if p)!r} (known here: {known})"
                for extra in sorted(set(error.instance) - set(known_keys))]
    return [f"{source}: key {key_path or '(top level)'!r}: {short_message(error.message)}"]


def _check_golden_dir(golden_dir: Path, report: ValidationReport) -> None:
    if not golden_dir.is_dir():
        report.problems.append(f"{golden_dir}: golden directory not found")
        return
    for model_dir in sorted(p for p in golden_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        report.models += 1
        files = sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
        golden_files = [p for p in files if p.suffix in GOLDEN_SUFFIXES]
        for ignored in (p for p in files if p.suffix not in GOLDEN_SUFFIXES):
            report.notes.append(f"{ignored}: ignored (golden files end in {', '.join(GOLDEN_SUFFIXES)})")
        if not golden_files:
            report.notes.append(f"{model_dir}: no golden files: the sidecar will only check readiness")
        by_name: dict[str, Path] = {}
        for path in golden_files:
            if path.stem in by_name:
                report.problems.append(f"{path}: case name {path.stem!r} is also used by {by_name[path.stem]}")
            by_name.setdefault(path.stem, path)
            report.golden_files += 1
            report.problems.extend(golden_file_problems(path, model=model_dir.name))


def _schema_problems(model: str, path: Path) -> list[str]:
    """The schema file read by the sidecar's own loader: what stops the start stops `validate`, with
    the same line."""
    try:
        load_request_rules(path, model=model)
    except ConfigError as e:
        return [str(e)]
    return []


__all__ = [
    "CheckReport",
    "CommandError",
    "RecordRefused",
    "add_parsers",
    "read_request_file",
    "record_case",
    "render_table",
    "report_as_json",
    "run_check",
    "stable_error_text",
    "validate_files",
]
