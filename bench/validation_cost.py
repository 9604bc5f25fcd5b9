"""Validation cost: the sidecar's request validation vs a plain JSON Schema through `jsonschema`.

    .venv/bin/python -m bench.validation_cost [--repeats 7] [--min-time 0.2]

The same FP32 JSON request (1x128, 16x128, 64x128, 256x128) is checked by
`sidecar.serving.validation.validate_infer_request` (parse with rapidjson, shape/datatype/count checks,
vectorised finiteness) and by `jsonschema.Draft202012Validator` after `json.loads`, with a schema of
the v2 request whose data items are typed per element ({"type": "number"}). Both validators are
built once, as the sidecar does at start-up; the timings include parsing the body. No server runs:
the model spec is credit_risk's (features FP32 [-1, 128]) with max_batch_size 256, so that every size
is a valid request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jsonschema

from bench.inference import features, json_request
from bench.machine import command_line, describe_machine, write_results
from sidecar.serving import validation

SIZES = [1, 16, 64, 256]
TARGET_SPEEDUP_AT_64 = 20.0
TARGET_MS_AT_64 = 1.0

METADATA = {
    "name": "credit_risk", "versions": ["1"], "platform": "python",
    "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 128]}],
    "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 1]},
                {"name": "income_prob", "datatype": "FP32", "shape": [-1, 1]}],
}
CONFIG = {"name": "credit_risk", "max_batch_size": 256,
          "input": [{"name": "features", "data_type": "TYPE_FP32", "dims": [128]}]}

#: What a careful hand-written JSON Schema for this model's v2 request looks like.
PLAIN_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["inputs"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object"},
        "inputs": {
            "type": "array", "minItems": 1, "maxItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype", "data"],
                "additionalProperties": False,
                "properties": {
                    "name": {"const": "features"},
                    "datatype": {"const": "FP32"},
                    "shape": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 1, "maximum": 256},
                                                               {"const": 128}], "items": False, "minItems": 2},
                    "parameters": {"type": "object"},
                    "data": {"type": "array", "minItems": 128, "maxItems": 256 * 128, "items": {"type": "number"}},
                },
            },
        },
        "outputs": {"type": "array", "items": {"type": "object", "required": ["name"],
                                               "properties": {"name": {"enum": ["scores"]}}}},
    },
}


def sidecar_validator() -> Callable[[bytes], Any]:
    limits = validation.Limits(max_elements=4_000_000, max_bytes_element=1024 * 1024, reject_non_finite=True)
    spec = validation.build_model_spec("credit_risk", "1", METADATA, CONFIG, limits=limits,
                                       is_hidden=lambda name: name == "income_prob")
    return lambda body: validation.validate_infer_request(spec, body)


def jsonschema_validator() -> Callable[[bytes], Any]:
    checker = jsonschema.Draft202012Validator(PLAIN_SCHEMA)
    return lambda body: checker.validate(json.loads(body))


def time_per_call(fn: Callable[[bytes], Any], body: bytes, repeats: int, min_time_s: float) -> list[float]:
    """Seconds per call: `repeats` samples, each a loop long enough to last `min_time_s`."""
    loops, elapsed = 1, 0.0
    while True:  # calibrate like timeit
        started = time.perf_counter()
        for _ in range(loops):
            fn(body)
        elapsed = time.perf_counter() - started
        if elapsed >= min_time_s / 5:
            break
        loops *= 2
    loops = max(1, int(loops * (min_time_s / elapsed)))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(loops):
            fn(body)
        samples.append((time.perf_counter() - started) / loops)
    return samples


def check_agreement(sidecar: Callable[[bytes], Any], plain: Callable[[bytes], Any]) -> list[str]:
    """Both accept the valid request and refuse the same invalid ones: they do comparable work."""
    problems = []
    good = json.loads(json_request(features(2)).body)
    bad_value = json.loads(json.dumps(good))
    bad_value["inputs"][0]["data"][5] = "0.5"
    bad_shape = json.loads(json.dumps(good))
    bad_shape["inputs"][0]["shape"] = [2, 64]
    for label, doc, should_pass in (("valid", good, True), ("string in data", bad_value, False),
                                    ("wrong shape", bad_shape, False)):
        body = json.dumps(doc).encode()
        for name, fn in (("sidecar", sidecar), ("jsonschema", plain)):
            try:
                fn(body)
                passed = True
            except (validation.InvalidRequest, jsonschema.ValidationError):
                passed = False
            if passed != should_pass:
                problems.append(f"{name} {'accepted' if passed else 'refused'} the {label} request")
    return problems


def run(args: argparse.Namespace) -> dict[str, Any]:
    sidecar, plain = sidecar_validator(), jsonschema_validator()
    problems = check_agreement(sidecar, plain)
    if problems:
        raise SystemExit("the validators disagree: " + "; ".join(problems))
    rows = []
    for rows_n in SIZES:
        body = json_request(features(rows_n)).body
        ours = time_per_call(sidecar, body, args.repeats, args.min_time)
        theirs = time_per_call(plain, body, args.repeats, args.min_time)
        row = {"request": f"{rows_n}x128 FP32 JSON", "body_bytes": len(body),
               "sidecar_ms": round(statistics.median(ours) * 1000, 4),
               "jsonschema_ms": round(statistics.median(theirs) * 1000, 4),
               "sidecar_ms_samples": [round(s * 1000, 4) for s in ours],
               "jsonschema_ms_samples": [round(s * 1000, 4) for s in theirs]}
        row["speedup"] = round(row["jsonschema_ms"] / row["sidecar_ms"], 1)
        rows.append(row)
        print(f"{row['request']:20} {len(body):8} B  sidecar {row['sidecar_ms']:8.4f} ms  "
              f"jsonschema {row['jsonschema_ms']:8.3f} ms  {row['speedup']:6.1f}x", flush=True)
    at64 = next(r for r in rows if r["request"].startswith("64x"))
    verdicts = [
        {"target": f"≥ {TARGET_SPEEDUP_AT_64:g}× faster than jsonschema at 64x128", "measured": at64["speedup"],
         "met": at64["speedup"] >= TARGET_SPEEDUP_AT_64},
        {"target": f"< {TARGET_MS_AT_64:g} ms at 64x128", "measured": at64["sidecar_ms"],
         "met": at64["sidecar_ms"] < TARGET_MS_AT_64},
    ]
    return {"benchmark": "validation_cost", "command": command_line(), "machine": describe_machine(),
            "settings": {"repeats": args.repeats, "min_time_s": args.min_time, "jsonschema": jsonschema_version()},
            "rows": rows, "verdicts": verdicts}


def jsonschema_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("jsonschema")


def markdown(result: dict[str, Any]) -> str:
    lines = ["| request | body bytes | sidecar ms | jsonschema ms | speed-up |", "|---|---|---|---|---|"]
    lines += [f"| {r['request']} | {r['body_bytes']} | {r['sidecar_ms']} | {r['jsonschema_ms']} | {r['speedup']}× |"
              for r in result["rows"]]
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {v['target']} | {v['measured']} | {'yes' if v['met'] else '**no**'} |" for v in result["verdicts"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.validation_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed samples per size (default 7)")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per sample (default 0.2)")
    args = parser.parse_args(argv)
    result = run(args)
    table = markdown(result)
    path = write_results("validation_cost", result, table)
    print(f"\n{table}\nresults: {path}")
    return 0 if all(v["met"] for v in result["verdicts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
