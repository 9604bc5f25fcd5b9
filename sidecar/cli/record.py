"""`triton-sidecar record`: turn one answer of a known-good server into a golden file."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sidecar.cli.arguments import (
    DEFAULT_CALL_TIMEOUT_S,
    EXIT_FAILED,
    EXIT_OK,
    CommandError,
    RecordRefused,
    positive_seconds,
    reporting_usage_errors,
    tolerance,
    triton_url,
)
from sidecar.golden.cases import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    ENDPOINTS,
    INFER,
    ExpectedText,
    GoldenCase,
    GoldenFileError,
    ReceivedOutput,
    check_request,
    dump_golden_case,
    load_golden_file,
)
from sidecar.health.infer_body import decode_answer
from sidecar.health.probe_round import probe_model
from sidecar.health.triton_client import TritonClient
from sidecar.protocol.datatypes import FLOAT_DATATYPES
from sidecar.protocol.triton_errors import TritonError, TritonUnavailable

# numpy is imported inside the functions that use it: a running sidecar (gRPC off) loads none (issue 30).

#: Longest `error_contains` that `record` writes: enough to identify the rejection, short enough to
#: survive rewording of the rest of Triton's message (and its 300-character cut in TritonClient).
MAX_ERROR_CONTAINS_CHARS = 120


#: Triton puts "[request id: <id>] " in front of some messages; the id changes per request.
_REQUEST_ID_PREFIX = re.compile(r"^\s*\[request id: [^\]]*\]\s*")


def add_record_parser(commands: Any) -> None:
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
    record.add_argument("--triton-url", required=True, type=triton_url, metavar="URL",
                        help="a known-good Triton's HTTP endpoint, e.g. http://127.0.0.1:8000")
    record.add_argument("--model", required=True, metavar="NAME", help="the model to send the request to")
    record.add_argument("--request", required=True, type=Path, metavar="FILE",
                        help="v2 inference request body (JSON); a golden file's request is taken too")
    record.add_argument("--out", required=True, type=Path, metavar="FILE",
                        help="golden file to write, usually golden_requests/<model>/<case>.json")
    record.add_argument("--atol", type=tolerance, default=DEFAULT_ATOL, metavar="A",
                        help=f"absolute tolerance for floating-point outputs (default {DEFAULT_ATOL:g})")
    record.add_argument("--rtol", type=tolerance, default=DEFAULT_RTOL, metavar="R",
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
    record.add_argument("--timeout", type=positive_seconds, default=DEFAULT_CALL_TIMEOUT_S, metavar="S",
                        help=f"bound on each call to Triton, in seconds (default {DEFAULT_CALL_TIMEOUT_S:g})")
    record.set_defaults(handler=reporting_usage_errors(_cmd_record))


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
    # The answer's outputs as numpy arrays of their datatypes: they are written out as they came.
    triton = TritonClient(triton_url, timeout_s=timeout_s, read_outputs=decode_answer)
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
    import numpy as np

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
    import numpy as np

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

