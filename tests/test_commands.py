"""The operator commands against the real Triton: `record` writes what `check` accepts, `check` is a
gate that fails a broken model with a readable difference, and `validate` names every bad file offline.

The commands are driven through `sidecar.cli.main` in-process (their handlers call asyncio.run, so
these tests are plain sync tests), and once through the installed console script."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from sidecar.cli.check import render_table, report_as_json, run_check
from sidecar.cli.main import main
from sidecar.cli.record import stable_error_text
from sidecar.devtools.tritonserver import free_port
from sidecar.golden.cases import load_golden_dir, load_golden_file
from tests.harness import GOLDEN, REPO, SLACK_S, FreshModel

CONSOLE_SCRIPT = Path(sys.executable).parent / "triton-sidecar"
EXAMPLE_MODELS = ["credit_risk", "image_classifier"]
#: The example models every shipped golden case is checked against (text_echo: generate_stream).
CHECKED_MODELS = [*EXAMPLE_MODELS, "text_echo"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The command line in this process. `run` configures logging onto this test's captured stdout
    before it can fail; the configuration is put back, or every later test's log line would go to a
    closed file (and a supervisor that logs would crash)."""
    saved = structlog.get_config()
    try:
        code = main([str(a) for a in argv])
    finally:
        structlog.configure(**saved)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def parse_table(text: str) -> tuple[list[dict], list[str]]:
    """The check table's rows (a failure's extra difference lines folded into its row) and the footer."""
    lines = text.splitlines()
    assert lines[0].split() == ["MODEL", "CHECK", "CASE", "RESULT", "LATENCY", "DETAIL"]
    rows: list[dict] = []
    for i, line in enumerate(lines[1:], start=1):
        if not line:
            return rows, lines[i + 1:]
        if line.startswith(" "):
            rows[-1]["lines"].append(line.strip())
            continue
        model, check, case, result, latency, *detail = re.split(r"\s{2,}", line, maxsplit=5)
        rows.append({"model": model, "check": check, "case": None if case == "-" else case,
                     "result": result.lower(), "latency": latency, "lines": detail})
    raise AssertionError(f"no blank line before the footer in:\n{text}")


def check_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "check", *argv, "--format", "json")
    return code, json.loads(out)


@contextlib.contextmanager
def healed_afterwards(model: FreshModel) -> Iterator[None]:
    """Reload a model with a dead or hung stub (unload, load: what the sidecar's healer does) before
    the fixture removes it. Only unloaded, such a model stays UNLOADING for good, and the shared
    Triton stops answering ready for every later test."""
    try:
        yield
    finally:
        model.unload()
        model.load()


def write_request(path: Path, request: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(request))
    return path


# ---------------------------------------------------------------------------------------- record + check


@pytest.mark.parametrize("model", EXAMPLE_MODELS)
def test_record_then_check_round_trips_every_case_of_an_example_model(model, triton, tmp_path, capsys):
    shipped = load_golden_dir(GOLDEN, models=[model])[model]
    repository_files = {p: p.read_bytes() for p in GOLDEN.rglob("*") if p.is_file()}
    recorded_dir = tmp_path / "golden"
    for case in shipped:
        request = write_request(tmp_path / "requests" / f"{case.name}.json", dict(case.request))
        out = recorded_dir / model / f"{case.name}.json"
        extra = ["--expect-error"] if case.expects_error else []
        code, printed, err = run_cli(capsys, "record", "--triton-url", triton.url, "--model", model,
                                     "--request", request, "--out", out, *extra)
        assert (code, err) == (0, ""), err
        assert f"recorded {model}/{case.name} -> {out}" in printed

        recorded = load_golden_file(out, model=model)
        assert recorded.request["inputs"] == case.request["inputs"]
        assert recorded.expect_status == case.expect_status
        if case.expects_error:
            assert case.error_contains in recorded.error_contains
            assert "request id" not in recorded.error_contains
        for name, expected in case.outputs.items():
            got = recorded.outputs[name]
            assert (got.datatype, got.shape) == (expected.datatype, expected.shape)
            assert abs(got.data - expected.data).max() <= expected.atol

    code, out, _ = run_cli(capsys, "check", "--triton-url", triton.url, "--golden-dir", recorded_dir,
                           "--min-cases", len(shipped))
    assert code == 0, out
    rows, footer = parse_table(out)
    assert {(r["case"], r["result"]) for r in rows if r["check"] == "golden"} == {
        (c.name, "pass") for c in shipped}
    assert footer[-1].startswith(f"check passed: 1 model; {len(shipped)} of {len(shipped)} golden cases passed")
    assert {p: p.read_bytes() for p in GOLDEN.rglob("*") if p.is_file()} == repository_files


def test_record_takes_the_plain_example_request_and_writes_float32_values_compactly(triton, tmp_path, capsys):
    out = tmp_path / "golden" / "credit_risk" / "typical.json"
    code, _, err = run_cli(capsys, "record", "--triton-url", triton.url, "--model", "credit_risk",
                           "--request", REPO / "examples" / "requests" / "credit_risk.json", "--out", out,
                           "--description", "a typical applicant", "--atol", "1e-4", "--rtol", "0")
    assert code == 0, err
    text = out.read_text()
    body = json.loads(text)
    assert body["description"] == "a typical applicant"
    scores = body["expect"]["outputs"]["scores"]
    assert (scores["atol"], scores["rtol"], scores["shape"]) == (0.0001, 0, [1, 1])
    assert re.search(r'"data": \[0\.434486\d{0,3}\]', text), "shortest float32 decimal, on one line"
    assert not out.with_name(out.name + ".tmp").exists()


def test_record_refuses_a_rejection_unless_told_to_expect_it_and_an_answer_when_told(triton, tmp_path, capsys):
    short_row = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
    bad = write_request(tmp_path / "bad.json", short_row)
    out = tmp_path / "golden" / "credit_risk" / "abnormal.json"
    base = ["record", "--triton-url", triton.url, "--model", "credit_risk", "--out", out]

    code, _, err = run_cli(capsys, *base, "--request", bad)
    assert code == 1 and not out.exists()
    assert "rejected the request (400" in err and "pass --expect-error" in err

    code, _, err = run_cli(capsys, *base, "--request", REPO / "examples/requests/credit_risk.json", "--expect-error")
    assert code == 1 and not out.exists()
    assert "accepted the request (200) but --expect-error records only a rejection (4xx)" in err

    code, _, err = run_cli(capsys, *base, "--request", bad, "--expect-error")
    assert code == 0, err
    expect = json.loads(out.read_text())["expect"]
    assert expect == {"status": 400,
                      "error_contains": "unexpected shape for input 'features' for model 'credit_risk'"}


def test_record_refuses_a_model_that_is_not_loaded(triton, tmp_path, capsys):
    out = tmp_path / "g" / "nope" / "case.json"
    code, _, err = run_cli(capsys, "record", "--triton-url", triton.url, "--model", "no_such_model",
                           "--request", REPO / "examples/requests/credit_risk.json", "--out", out,
                           "--expect-error")
    assert code == 1 and not out.exists()
    assert "model 'no_such_model' is not ready" in err


@pytest.mark.fault
def test_record_refuses_nan_outputs_unless_allowed_and_then_pins_them(fresh_model, tmp_path, capsys):
    fresh_model.inject("nan")
    out = tmp_path / "golden" / fresh_model.name / "nan.json"
    base = ["record", "--triton-url", fresh_model.triton.url, "--model", fresh_model.name,
            "--request", REPO / "examples/requests/credit_risk.json", "--out", out]

    code, _, err = run_cli(capsys, *base)
    assert code == 1 and not out.exists()
    assert "output scores holds nan at [0]" in err and "--allow-non-finite" in err

    code, _, err = run_cli(capsys, *base, "--allow-non-finite")
    assert code == 0, err
    assert json.loads(out.read_text())["expect"]["outputs"]["scores"]["data"] == ["NaN"]
    assert load_golden_file(out, model=fresh_model.name).allows_non_finite
    code, printed, _ = run_cli(capsys, "check", "--triton-url", fresh_model.triton.url,
                               "--golden-dir", out.parent.parent)
    assert code == 0, printed


def test_record_names_the_file_and_path_of_a_bad_request(tmp_path, capsys):
    request = write_request(tmp_path / "r.json", {"inputs": [
        {"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0]}]})
    code, _, err = run_cli(capsys, "record", "--triton-url", "http://127.0.0.1:1", "--model", "m",
                           "--request", request, "--out", tmp_path / "m" / "c.json")
    assert code == 2
    assert err == f"triton-sidecar: error: {request}: at $.inputs[0].data: 2 values, but shape [1, 3] holds 3\n"

    code, _, err = run_cli(capsys, "record", "--triton-url", "http://127.0.0.1:1", "--model", "m",
                           "--request", request, "--out", tmp_path / "m" / "c.yaml")
    assert code == 2 and "record writes JSON" in err


@pytest.mark.parametrize(("message", "kept"), [
    ("[request id: <id_unknown>] unexpected shape for input 'features' for model 'credit_risk'. Expected "
     "[-1,128], got [1,64]. NOTE: Setting a non-zero max_batch_size ...",
     "unexpected shape for input 'features' for model 'credit_risk'"),
    ("[request id: 7f3c-11] image pixels must lie in [0, 1]", "image pixels must lie in [0, 1]"),
    ("features must be finite numbers", "features must be finite numbers"),
    ("x" * 400, "x" * 120),
])
def test_recorded_error_text_is_the_stable_start_of_tritons_message(message, kept):
    assert stable_error_text(message) == kept


def test_record_then_check_round_trips_the_generative_model_s_cases(triton, tmp_path, capsys):
    shipped = load_golden_dir(GOLDEN, models=["text_echo"])["text_echo"]
    recorded_dir = tmp_path / "golden"
    for case in shipped:
        request = write_request(tmp_path / "requests" / f"{case.name}.json", dict(case.request))
        out = recorded_dir / "text_echo" / f"{case.name}.json"
        extra = ["--expect-error"] if case.expects_error else []
        code, printed, err = run_cli(capsys, "record", "--triton-url", triton.url, "--model", "text_echo",
                                     "--endpoint", case.endpoint, "--request", request, "--out", out, *extra)
        assert (code, err) == (0, ""), err
        recorded = load_golden_file(out, model="text_echo")
        assert (recorded.endpoint, recorded.request, recorded.expect_status) == (
            case.endpoint, case.request, case.expect_status)
        assert recorded.text == case.text, printed
    code, out, _ = run_cli(capsys, "check", "--triton-url", triton.url, "--golden-dir", recorded_dir)
    assert code == 0, out


def test_record_refuses_to_pin_generate_on_a_streaming_answer(triton, tmp_path, capsys):
    request = write_request(tmp_path / "two_words.json", {"text_input": "alpha beta"})
    code, _, err = run_cli(capsys, "record", "--triton-url", triton.url, "--model", "text_echo",
                           "--endpoint", "generate", "--request", request, "--out", tmp_path / "x.json")
    assert code == 1 and "exactly 1 response" in err, err
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------------------------------------ check


def test_check_against_the_shipped_golden_requests_passes_through_the_console_script(triton):
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "check", "--triton-url", triton.url, "--golden-dir", str(GOLDEN),
         "--min-cases", "3"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows, footer = parse_table(result.stdout)
    assert {r["model"] for r in rows} == set(CHECKED_MODELS)
    assert all(r["result"] == "pass" for r in rows)
    assert footer == [f"check passed: 3 models; 10 of 10 golden cases passed, Triton {triton.url}"]


@pytest.mark.fault
def test_check_fails_a_drifted_model_with_the_first_differences(fresh_model, capsys):
    fresh_model.inject("drift")
    code, out, _ = run_cli(capsys, "check", "--triton-url", fresh_model.triton.url,
                           "--golden-dir", fresh_model.golden_dir)
    assert code == 1, out
    rows, footer = parse_table(out)
    results = {(r["check"], r["case"]): r for r in rows}
    assert results[("metadata", None)]["result"] == "pass"
    assert results[("golden", "abnormal_shape")]["result"] == "pass"  # Triton still rejects it itself
    normal = results[("golden", "normal")]
    assert normal["result"] == "fail" and normal["latency"].endswith(" ms")
    assert re.fullmatch(r"scores\[0\] expected 0\.4345±5\.3e-05, got 0\.\d{4}", normal["lines"][0])
    boundary = results[("golden", "boundary")]  # its saturated second row still scores 0
    assert [line.split(" got ")[0] for line in boundary["lines"]] == ["scores[0] expected 0.4378±5.4e-05,"]
    assert footer[0].startswith(f"FAIL {fresh_model.name}: golden case boundary: scores[0] expected 0.4378")
    assert footer[-1].startswith("check FAILED: 1 of 1 models failed; 1 of 3 golden cases passed")


def test_each_difference_of_a_failed_case_gets_its_own_line(triton, tmp_path, capsys):
    body = json.loads((GOLDEN / "credit_risk" / "boundary.json").read_text())
    body["expect"]["outputs"]["scores"]["data"] = [0.9, 0.5]
    path = tmp_path / "golden" / "credit_risk" / "wrong.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(body))
    code, out, _ = run_cli(capsys, "check", "--triton-url", triton.url, "--golden-dir", path.parent.parent)
    assert code == 1
    wrong = next(r for r in parse_table(out)[0] if r["case"] == "wrong")
    assert wrong["lines"] == ["scores[0] expected 0.9000±0.0001, got 0.4378",
                              "scores[1] expected 0.5000±6.0e-05, got 9.269e-09"]


@pytest.mark.fault
def test_check_fails_a_model_whose_stub_was_killed(fresh_model, capsys):
    fresh_model.kill_stub()
    with healed_afterwards(fresh_model):
        code, out, _ = run_cli(capsys, "check", "--triton-url", fresh_model.triton.url,
                               "--golden-dir", fresh_model.golden_dir)
    assert code == 1, out
    rows, footer = parse_table(out)
    failed = [r for r in rows if r["result"] != "pass"]
    assert failed and {r["model"] for r in failed} == {fresh_model.name}
    assert footer[0].startswith(f"FAIL {fresh_model.name}: ")


@pytest.mark.fault
def test_json_output_holds_the_same_facts_as_the_table(fresh_model, triton, tmp_path, capsys):
    golden = tmp_path / "golden"
    shutil.copytree(fresh_model.golden_dir / fresh_model.name, golden / fresh_model.name)
    shutil.copytree(GOLDEN / "credit_risk", golden / "credit_risk")
    fresh_model.inject("drift")
    args = ["--triton-url", triton.url, "--golden-dir", golden]

    table_code, table, _ = run_cli(capsys, "check", *args)
    json_code, report = check_json(capsys, *args)

    assert table_code == json_code == 1
    rows, footer = parse_table(table)
    facts_from_table = [(r["model"], r["check"], r["case"], r["result"], r["lines"]) for r in rows]
    facts_from_json = [
        (m["model"], c["check"], c["case"], c["result"], c["differences"] or ([c["detail"]] if c["detail"] else []))
        for m in report["models"] for c in m["checks"]
    ]
    assert facts_from_table == facts_from_json
    # Two runs, so the latencies differ; both say which checks were timed (skipped ones are not).
    assert [r["latency"] == "-" for r in rows] == [
        c["latency_ms"] is None for m in report["models"] for c in m["checks"]]
    assert (report["ok"], report["triton_answered"]) == (False, True)
    assert {m["model"]: m["ok"] for m in report["models"]} == {"credit_risk": True, fresh_model.name: False}
    assert report["summary"] == {"models": 2, "models_failed": 1, "cases": 6, "cases_passed": 4}
    assert [line for line in footer if line.startswith("FAIL ")] == [
        f"FAIL {m['model']}: {m['cause']}" for m in report["models"] if not m["ok"]]


def test_both_renderings_of_one_report_agree_on_every_latency(triton):
    cases = load_golden_dir(GOLDEN)
    report = asyncio.run(run_check(triton.url, cases, golden_dir=GOLDEN, min_cases=3, timeout_s=10))
    rows, _ = parse_table(render_table(report))
    as_json = json.loads(json.dumps(report_as_json(report)))
    timed = [c for m in as_json["models"] for c in m["checks"]]
    assert len(rows) == len(timed) == 19  # 3 models × (server, model ready, metadata) + 10 cases
    # The table shows tenths of a millisecond, the JSON hundredths: equal within the table's rounding.
    for row, check in zip(rows, timed, strict=True):
        assert abs(float(row["latency"].removesuffix(" ms")) - check["latency_ms"]) <= 0.055, (row, check)
    assert [(r["model"], r["check"], r["case"], r["result"]) for r in rows] == [
        (m["model"], c["check"], c["case"], c["result"]) for m in as_json["models"] for c in m["checks"]]


@pytest.mark.fault
def test_check_stops_a_hung_model_at_the_timeout_and_skips_its_remaining_cases(fresh_model, capsys):
    fresh_model.inject("hang")
    with healed_afterwards(fresh_model):
        started = time.monotonic()
        code, out, _ = run_cli(capsys, "check", "--triton-url", fresh_model.triton.url,
                               "--golden-dir", fresh_model.golden_dir, "--timeout", "1")
        elapsed = time.monotonic() - started
    assert code == 1
    assert elapsed < 1 + SLACK_S, "one hung case costs one timeout, not one per case"
    golden = [(r["case"], r["result"], r["lines"]) for r in parse_table(out)[0] if r["check"] == "golden"]
    assert golden == [
        ("abnormal_shape", "pass", []),  # rejected by Triton before the model runs
        ("boundary", "timeout", ["no answer within 1 s"]),
        ("normal", "skipped", ["not run: golden case boundary timed out"]),
    ]


def test_min_cases_fails_a_model_with_too_few_golden_cases(triton, tmp_path, capsys):
    golden = tmp_path / "golden"
    (golden / "credit_risk").mkdir(parents=True)
    shutil.copy(GOLDEN / "credit_risk" / "normal.json", golden / "credit_risk" / "normal.json")
    args = ["check", "--triton-url", triton.url, "--golden-dir", golden]

    assert run_cli(capsys, *args)[0] == 0
    code, out, _ = run_cli(capsys, *args, "--min-cases", "3")
    assert code == 1
    rows, _ = parse_table(out)
    assert rows[-1]["check"] == "min_cases" and rows[-1]["result"] == "fail"
    assert rows[-1]["lines"] == [f"1 golden case(s) in {golden / 'credit_risk'}, --min-cases asks for at least 3"]
    assert [r["result"] for r in rows[:-1]] == ["pass"] * 4  # the probes themselves passed

    code, report = check_json(capsys, "--triton-url", triton.url, "--golden-dir", GOLDEN, "--min-cases", "3")
    assert code == 0 and report["min_cases"] == 3


def test_check_of_a_named_model_without_golden_files_fails_unless_min_cases_is_zero(triton, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    args = ["check", "--triton-url", triton.url, "--golden-dir", tmp_path / "empty", "--model", "credit_risk",
            "image_classifier"]
    assert run_cli(capsys, *args)[0] == 1
    code, out, _ = run_cli(capsys, *args, "--min-cases", "0")
    assert code == 0, out
    assert [(r["model"], r["check"]) for r in parse_table(out)[0]] == [
        (model, check) for model in ("credit_risk", "image_classifier")
        for check in ("server_ready", "model_ready", "metadata")]


def test_check_exits_1_with_a_clear_line_when_triton_does_not_answer(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, out, _ = run_cli(capsys, "check", "--triton-url", url, "--golden-dir", GOLDEN, "--timeout", "2")
    assert code == 1
    rows, footer = parse_table(out)
    assert rows[0]["check"] == "server_ready" and rows[0]["result"] == "fail"
    assert footer[-1].startswith(f"check FAILED: Triton at {url} did not answer (server ready: Triton unreachable")
    assert footer[-1].endswith("3 of 3 models could not be judged")
    code, report = check_json(capsys, "--triton-url", url, "--golden-dir", GOLDEN)
    assert code == 1 and report["triton_answered"] is False


def test_check_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    code, out, err = run_cli(capsys, "check", "--triton-url", "http://127.0.0.1:1",
                             "--golden-dir", tmp_path / "missing")
    assert (code, out) == (2, "")
    assert err == f"triton-sidecar: error: {tmp_path / 'missing'}: golden directory not found (pass --golden-dir)\n"

    bad = tmp_path / "golden" / "credit_risk" / "broken.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{")
    code, _, err = run_cli(capsys, "check", "--triton-url", "http://127.0.0.1:1", "--golden-dir", bad.parent.parent)
    assert code == 2 and err.startswith(f"triton-sidecar: error: {bad}: not valid JSON") and err.count("\n") == 1

    with pytest.raises(SystemExit) as exited:
        main(["check", "--triton-url", "127.0.0.1:8000"])
    assert exited.value.code == 2
    assert "expected http://host:port" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["check", "record", "validate"])
def test_every_command_explains_itself_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    assert "examples:\n  triton-sidecar " + command in help_text
    assert "exit codes:" in help_text


# --------------------------------------------------------------------------------------------- validate


GOOD_CASE = json.loads((GOLDEN / "credit_risk" / "normal.json").read_text())


def _bad_golden_json(d: Path) -> str:
    path = d / "golden" / "m" / "case.json"
    path.write_text('{"request": {"inputs": []},\n  "expect": }')
    return f"{path}: not valid JSON (line 2, column 13): Expecting value"


def _unknown_golden_key(d: Path) -> str:
    path = d / "golden" / "m" / "case.json"
    path.write_text(json.dumps({**GOOD_CASE, "expected": {}}))
    return f"{path}: at $: Additional properties are not allowed ('expected' was unexpected)"


def _shape_data_mismatch(d: Path) -> str:
    path = d / "golden" / "m" / "short.json"
    body = json.loads(json.dumps(GOOD_CASE))
    body["request"]["inputs"][0]["data"] = body["request"]["inputs"][0]["data"][:100]
    path.write_text(json.dumps(body))
    return f"{path}: at $.request.inputs[0].data: 100 values, but shape [1, 128] holds 128"


def _bad_config_key(d: Path) -> str:
    (d / "sidecar.yaml").write_text(f"golden_dir: {d / 'golden'}\nprobes:\n  intervall_s: 2\n")
    return (f"{d / 'sidecar.yaml'}: unknown key 'probes.intervall_s' "
            "(known here: every_requests, failure_threshold, interval_s")


def _bad_schema_file(d: Path) -> str:
    (d / "credit_risk.schema.json").write_text(json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
        "properties": {"inputs": {"type": "arrray"}}}))
    (d / "sidecar.yaml").write_text(
        f"golden_dir: {d / 'golden'}\nvalidation:\n  schemas:\n    credit_risk: {d / 'credit_risk.schema.json'}\n")
    return (f"{d / 'credit_risk.schema.json'}: at $.properties.inputs.type: not a valid Draft 2020-12 schema: "
            "'arrray' is not valid under any of the given schemas")


def _missing_schema_file(d: Path) -> str:
    (d / "sidecar.yaml").write_text(
        f"golden_dir: {d / 'golden'}\nvalidation:\n  schemas:\n    credit_risk: {d / 'nowhere.json'}\n")
    return (f"{d / 'nowhere.json'}: cannot read the request schema for credit_risk "
            "(validation.schemas.credit_risk): No such file or directory")


def _schema_file_not_json(d: Path) -> str:
    (d / "s.json").write_text("{'type': 'object'}")
    (d / "sidecar.yaml").write_text(f"golden_dir: {d / 'golden'}\nvalidation:\n  schemas:\n    m: {d / 's.json'}\n")
    return f"{d / 's.json'}: not valid JSON (line 1, column 2)"


BAD_FILES = {
    "golden file is not JSON": _bad_golden_json,
    "golden file has an unknown key": _unknown_golden_key,
    "golden data does not fill its shape": _shape_data_mismatch,
    "config has an unknown key": _bad_config_key,
    "request schema is not a valid schema": _bad_schema_file,
    "request schema file is missing": _missing_schema_file,
    "request schema file is not JSON": _schema_file_not_json,
}


@pytest.fixture
def no_sidecar_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("SIDECAR_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_validate_names_the_file_and_path_of_each_kind_of_bad_file(kind, tmp_path, capsys, no_sidecar_env):
    (tmp_path / "golden" / "m").mkdir(parents=True)
    expected = BAD_FILES[kind](tmp_path)
    config = tmp_path / "sidecar.yaml"
    args = ["--config", config] if config.exists() else ["--golden-dir", tmp_path / "golden"]
    code, out, err = run_cli(capsys, "validate", *args)
    assert (code, err) == (2, ""), out
    problems = [line for line in out.splitlines() if not line.startswith(("note:", "validate:"))]
    assert len(problems) == 1, out
    assert problems[0].startswith(expected)
    assert out.splitlines()[-1].startswith("validate: 1 problem (")


def test_validate_reports_every_problem_not_only_the_first(tmp_path, capsys, no_sidecar_env):
    (tmp_path / "golden" / "m").mkdir(parents=True)
    expected = [make(tmp_path) for make in (_bad_golden_json, _shape_data_mismatch, _bad_schema_file)]
    (tmp_path / "golden" / "m" / "two_mistakes.json").write_text(json.dumps(
        {**GOOD_CASE, "expect": {"status": 600, "outputz": {}}}))
    (tmp_path / "sidecar.yaml").write_text(
        (tmp_path / "sidecar.yaml").read_text() + "probes:\n  intervall_s: 2\n  timeout_s: -1\nhealng: {}\n")
    code, out, _ = run_cli(capsys, "validate", "--config", tmp_path / "sidecar.yaml")
    assert code == 2
    two = tmp_path / "golden" / "m" / "two_mistakes.json"
    for wanted in [
        *expected,
        f"{tmp_path / 'sidecar.yaml'}: unknown key 'healng'",
        f"{tmp_path / 'sidecar.yaml'}: unknown key 'probes.intervall_s'",
        f"{tmp_path / 'sidecar.yaml'}: key 'probes.timeout_s': -1 is less than or equal to the minimum of 0",
        f"{two}: at $.expect: Additional properties are not allowed ('outputz' was unexpected)",
        f"{two}: at $.expect.status: 600 is greater than the maximum of 501",
    ]:
        assert sum(line.startswith(wanted) for line in out.splitlines()) == 1, f"{wanted!r} not once in:\n{out}"
    assert out.splitlines()[-1].startswith("validate: 8 problems (")


def test_validate_accepts_the_shipped_files_and_a_good_schema(tmp_path, capsys, no_sidecar_env, monkeypatch):
    schema = tmp_path / "credit_risk.schema.json"
    schema.write_text(json.dumps({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                                  "required": ["inputs"], "x-tensors": {"features": {"minimum": -10}}}))
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"validation:\n  schemas:\n    credit_risk: {schema}\n")
    monkeypatch.chdir(REPO)  # golden_dir defaults to golden_requests, relative to the working directory
    code, out, _ = run_cli(capsys, "validate", "--config", config)
    assert code == 0, out
    assert out.splitlines()[-1] == (f"validate: OK (config {config}, 10 golden files for 3 models in "
                                    "golden_requests, 1 request schema)")


def test_validate_counts_one_of_a_kind_in_the_singular(tmp_path, capsys, no_sidecar_env):
    model = tmp_path / "golden" / "credit_risk"
    model.mkdir(parents=True)
    shutil.copy(GOLDEN / "credit_risk" / "normal.json", model / "normal.json")
    code, out, _ = run_cli(capsys, "validate", "--golden-dir", tmp_path / "golden")
    assert code == 0, out
    assert out.splitlines()[-1] == (f"validate: OK (config defaults, 1 golden file for 1 model in "
                                    f"{tmp_path / 'golden'}, 0 request schemas)")


def test_validate_of_the_deployments_config_says_its_golden_dir_is_inside_the_pod(capsys, no_sidecar_env,
                                                                                   monkeypatch):
    """k8s/base/sidecar.yaml names /etc/triton-sidecar/golden_requests, where the pod mounts them."""
    monkeypatch.chdir(REPO)
    config = Path("k8s/base/sidecar.yaml")
    code, out, _ = run_cli(capsys, "validate", "--config", config)
    assert code == 2
    problems = [line for line in out.splitlines() if not line.startswith(("note:", "validate:"))]
    assert problems == [
        "/etc/triton-sidecar/golden_requests: golden directory not found (golden_dir in k8s/base/sidecar.yaml; "
        "a path inside the pod? pass --golden-dir with the repository's copy, e.g. --golden-dir golden_requests)"]
    # What the message says to do works: the deployment's config with the repository's golden files.
    code, out, _ = run_cli(capsys, "validate", "--config", config, "--golden-dir", "golden_requests")
    assert code == 0, out
    assert out.splitlines()[-1].startswith("validate: OK (config k8s/base/sidecar.yaml, 10 golden files for 3 models")
    # A directory named on the command line is the reader's own choice: no guess about pods.
    code, out, _ = run_cli(capsys, "validate", "--golden-dir", "/nonexistent/golden")
    assert code == 2 and "/nonexistent/golden: golden directory not found\n" in out


def test_the_demo_explains_itself(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    description = help_text.split("\n\n")[1]
    assert description.startswith("Start a real Triton Inference Server"), help_text
    assert "Ctrl-C" in description and "example: triton-sidecar demo" in help_text


def test_validate_notes_files_the_sidecar_would_ignore(tmp_path, capsys, no_sidecar_env):
    model = tmp_path / "golden" / "credit_risk"
    model.mkdir(parents=True)
    shutil.copy(GOLDEN / "credit_risk" / "normal.json", model / "normal.json")
    (model / "boundary.jsn").write_text("{}")
    (tmp_path / "golden" / "other").mkdir()
    code, out, _ = run_cli(capsys, "validate", "--golden-dir", tmp_path / "golden")
    assert code == 0, out
    assert f"note: {model / 'boundary.jsn'}: ignored (golden files end in .json, .yaml, .yml)" in out
    assert f"note: {tmp_path / 'golden' / 'other'}: no golden files" in out


#: Schema files that `validate` once passed and that stopped the sidecar at start: it read YAML and
#: never looked at `x-tensors` or at rules on tensor data, which the start-up loader refuses.
STARTUP_REFUSED_SCHEMAS = {
    "YAML, not JSON": ("schema.yaml", "type: object\nrequired: [inputs]\n", "not valid JSON (line 1, column 1)"),
    "bad x-tensors rule": ("schema.json", json.dumps({"x-tensors": {"features": {"minimum": "low"}}}),
                           "at $.x-tensors.features.minimum: 'low' is not of type 'number'"),
    "rule on tensor data": ("schema.json", json.dumps(
        {"properties": {"inputs": {"items": {"properties": {"data": {"items": {"maximum": 1}}}}}}}),
        "the schema constrains tensor 'data'"),
}


@pytest.mark.parametrize("kind", list(STARTUP_REFUSED_SCHEMAS))
def test_validate_refuses_a_schema_file_that_stops_the_start_with_the_same_line_as_run(
        kind, tmp_path, capsys, no_sidecar_env):
    name, content, complaint = STARTUP_REFUSED_SCHEMAS[kind]
    schema = tmp_path / name
    schema.write_text(content)
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"golden_dir: {GOLDEN}\nvalidation:\n  schemas:\n    credit_risk: {schema}\n")

    code, out, _ = run_cli(capsys, "validate", "--config", config)
    problems = [line for line in out.splitlines() if not line.startswith(("note:", "validate:"))]
    assert code == 2 and len(problems) == 1, out
    assert problems[0].startswith(f"{schema}: ") and complaint in problems[0], problems[0]

    # `run` refuses it before it listens or reaches Triton: the same line, exit 2.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    run = subprocess.run([sys.executable, "-m", "sidecar", "run", "--config", str(config)], capture_output=True,
                         text=True, timeout=60, cwd=REPO, env=env)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == f"triton-sidecar: error: {problems[0]}"


@pytest.mark.parametrize("healing, says", [
    ({"escalation_record_file": "/nonexistent/escalations.json"},
     "key 'healing.escalation_record_file': folder /nonexistent does not exist"),
    ({"process_fault_patterns": ["(unclosed"]}, "key 'healing.process_fault_patterns.0': not a regular expression"),
])
def test_run_stops_on_a_bad_escalation_setting_with_one_line_naming_the_file_and_key(
        healing, says, tmp_path, capsys, no_sidecar_env):
    config = tmp_path / "sidecar.yaml"
    config.write_text(json.dumps({"triton": {"url": "http://127.0.0.1:1"}, "healing": healing}))
    code, out, err = run_cli(capsys, "run", "--config", config)
    assert (code, out) == (2, "")
    assert err.startswith(f"triton-sidecar: error: {config}: {says}") and err.count("\n") == 1, err
