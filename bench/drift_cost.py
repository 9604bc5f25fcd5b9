"""Drift measuring cost: CPU per request of the serving core's drift step, at drift.sample_rate 1.0.

    .venv/bin/python -m bench.drift_cost [--requests 20000] [--repeats 5]

What is timed is exactly what `ServingCore.infer` adds after screening for a model with a reference:
`DriftMonitor.wants` (the sampling decision), then `ServingCore.measure_drift` (decode the screened
answer's outputs on its wire, bin the request's inputs, already decoded by validation, and the
outputs into the sliding window). Request: credit_risk's 1x128 FP32 features; answer: one FP32
output (`scores`), as Triton writes it: JSON, the binary extension, and gRPC (typed contents and raw).
Also timed: the lanes' step in the data plane (`DriftWindows.observe_exchange`, what the HTTP front
runs without Python for a measured model), and the same step for a model without a reference (one
set lookup). No server runs; CPU time
is `time.process_time`, the best of `--repeats` runs of `--requests` requests each. The target
(issue 22) is 0.02 ms = 20 us per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from bench.machine import command_line, describe_machine, write_results
from sidecar.config import SidecarConfig
from sidecar.fronts.grpc_server import GrpcAnswer, GrpcInferExchange, decode_infer_request
from sidecar.fronts.http_routes import HttpInferExchange
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import ServingCore
from sidecar.serving.drift import DriftMonitor, parse_reference, reference_from_values
from sidecar.serving.passive_signals import HealthEvents
from sidecar.serving.validation import Limits, build_model_spec, validate_decoded_request, validate_infer_request
from sidecar.states import ModelStates

TARGET_US = 20.0

METADATA = {"name": "credit_risk", "versions": ["1"], "platform": "python",
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 128]}],
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 1]}]}
CONFIG = {"name": "credit_risk", "max_batch_size": 64,
          "input": [{"name": "features", "data_type": "TYPE_FP32", "dims": [128]}]}


def _core() -> ServingCore:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5000, 128)).astype(np.float32)
    scores = (1 / (1 + np.exp(-x @ (rng.standard_normal(128) / np.sqrt(128))))).reshape(-1, 1)
    doc = reference_from_values("credit_risk", "", {"features": ("FP32", x)}, {"scores": ("FP32", scores)})
    base = SidecarConfig()
    config = replace(base, drift=replace(base.drift, sample_rate=1.0))
    drift = DriftMonitor(config.drift, {("credit_risk", ""): parse_reference(doc, Path("credit_risk.json"))})
    return ServingCore(config, states=ModelStates(failure_threshold=1, success_threshold=1, clock=time.monotonic),
                       metrics=SidecarMetrics(CollectorRegistry()), fetch_document=_no_fetch,
                       cases_for=lambda model: (), drift=drift,
                       events=HealthEvents(probe_soon=lambda m: None, stub_dead=lambda m: None,
                                           triton_unreachable=lambda c: None))


async def _no_fetch(model: str, version: str, what: str) -> tuple[int, bytes]:
    raise AssertionError("no fetch in this benchmark")


def _cases(rng: np.random.Generator) -> dict[str, tuple[Any, Any, Any]]:
    """wire -> (checked request, screened answer, exchange class) for one 1x128 request."""
    spec = build_model_spec("credit_risk", "", METADATA, CONFIG, limits=Limits(4_000_000, 1 << 20, True))
    x = np.round(rng.standard_normal((1, 128)), 4).astype(np.float32)
    score = np.float32([[0.4213]])
    body = json.dumps({"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                   "data": [round(float(v), 4) for v in x.ravel()]}]}).encode()
    json_answer = json.dumps({"model_name": "credit_risk", "model_version": "1", "outputs": [
        {"name": "scores", "datatype": "FP32", "shape": [1, 1], "data": [0.4213]}]},
        separators=(",", ":")).encode()
    header = json.dumps({"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 512}}]}).encode()
    answer_header = json.dumps({"model_name": "credit_risk", "model_version": "1", "outputs": [
        {"name": "scores", "datatype": "FP32", "shape": [1, 1], "parameters": {"binary_data_size": 4}}]},
        separators=(",", ":")).encode()
    binary_answer = (200, {"Inference-Header-Content-Length": str(len(answer_header))}, answer_header + score.tobytes())

    grpc_request = pb.ModelInferRequest(model_name="credit_risk")
    tensor = grpc_request.inputs.add(name="features", datatype="FP32", shape=[1, 128])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    typed = pb.ModelInferResponse(model_name="credit_risk", model_version="1")
    out = typed.outputs.add(name="scores", datatype="FP32", shape=[1, 1])
    out.contents.fp32_contents.append(0.4213)
    raw_request = pb.ModelInferRequest(model_name="credit_risk", raw_input_contents=[x.tobytes()])
    raw_request.inputs.add(name="features", datatype="FP32", shape=[1, 128])
    raw = pb.ModelInferResponse(model_name="credit_risk", model_version="1", raw_output_contents=[score.tobytes()])
    raw.outputs.add(name="scores", datatype="FP32", shape=[1, 1])
    return {
        "http JSON": (validate_infer_request(spec, body), (200, {}, json_answer), HttpInferExchange),
        "http binary": (validate_infer_request(spec, header + x.tobytes(), len(header)), binary_answer,
                        HttpInferExchange),
        "grpc typed": (validate_decoded_request(spec, *decode_infer_request(grpc_request)),
                       GrpcAnswer(typed.SerializeToString()), GrpcInferExchange),
        "grpc raw": (validate_decoded_request(spec, *decode_infer_request(raw_request)),
                     GrpcAnswer(raw.SerializeToString()), GrpcInferExchange),
    }, spec


def _documents(rng: np.random.Generator) -> dict[str, tuple[bytes, int | None, bytes, int | None]]:
    """wire -> (request body, its header length, answer body, its header length) for the lane's step."""
    x = np.round(rng.standard_normal((1, 128)), 4).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                   "data": [round(float(v), 4) for v in x.ravel()]}]}).encode()
    answer = json.dumps({"model_name": "credit_risk", "model_version": "1", "outputs": [
        {"name": "scores", "datatype": "FP32", "shape": [1, 1], "data": [0.4213]}]}, separators=(",", ":")).encode()
    header = json.dumps({"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 512}}]}).encode()
    answer_header = json.dumps({"model_name": "credit_risk", "model_version": "1", "outputs": [
        {"name": "scores", "datatype": "FP32", "shape": [1, 1], "parameters": {"binary_data_size": 4}}]},
        separators=(",", ":")).encode()
    return {"http JSON": (body, None, answer, None),
            "http binary": (header + x.tobytes(), len(header), answer_header + np.float32([[0.4213]]).tobytes(),
                            len(answer_header))}


def _cpu_us(step: Callable[[], None], requests: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(requests):
            step()
        runs.append((time.process_time() - start) / requests * 1e6)
    return min(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.drift_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    core = _core()
    cases, spec = _cases(np.random.default_rng(3))
    rows = []
    for wire, (checked, answer, exchange) in cases.items():
        def step(checked: Any = checked, answer: Any = answer, exchange: Any = exchange) -> None:
            if core.drift.wants("credit_risk"):
                core.measure_drift("credit_risk", spec, checked, answer, exchange)

        rows.append((f"{wire}, with a reference", _cpu_us(step, args.requests, args.repeats)))
    # The lanes' own step (the HTTP front's, without Python): decode the request and the answer
    # in Rust and bin them, as dataplane/src/front/lane.rs does after screening.
    windows = core.drift.windows
    for wire, (body, header_length, answer, answer_length) in _documents(np.random.default_rng(3)).items():
        def lane_step(body: bytes = body, header_length: int | None = header_length, answer: bytes = answer,
                      answer_length: int | None = answer_length) -> None:
            windows.observe_exchange("credit_risk", "", True, body, header_length, answer, answer_length)

        rows.append((f"{wire}, the lane (data plane)", _cpu_us(lane_step, args.requests, args.repeats)))
    rows.append(("any wire, no reference", _cpu_us(lambda: core.drift.wants("other_model") and None,
                                                    args.requests, args.repeats)))
    readings = core.drift.readings("credit_risk")
    assert readings and readings[0].rows > 0, "the benchmark measured nothing: the seam is broken"
    table = "| request (1x128 FP32 in, 1 FP32 out) | CPU per request (us) | target |\n| --- | --- | --- |\n"
    table += "".join(f"| {name} | {us:.1f} | {'met' if us <= TARGET_US else 'MISSED'} (<= {TARGET_US:g}) |\n"
                     for name, us in rows)
    print(table)
    worst = max(us for _, us in rows)
    path = write_results("drift_cost", {"command": command_line(), "machine": describe_machine(),
                                        "requests": args.requests, "repeats": args.repeats,
                                        "cpu_us_per_request": dict(rows), "median_us": statistics.median(
                                            us for _, us in rows), "target_us": TARGET_US}, table)
    print(f"results: {path}")
    return 0 if worst <= TARGET_US else 1


if __name__ == "__main__":
    sys.exit(main())
