"""What the proxy tests share: requests for the example models, the filtering config of the seeds,
Triton's own counters, raw HTTP for limits, a count of entries into the Python request chain, and a
sidecar on its own thread for hypothesis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
import tritonclient.http as triton_http
from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.app.factory import create_app
from sidecar.cli.run import loop_factory
from sidecar.config import FilterRule, SidecarConfig
from sidecar.devtools.tritonserver import LocalTriton
from sidecar.fronts.http_front import HttpFront, http_server
from sidecar.golden.cases import load_golden_dir
from sidecar.states import ModelState
from tests.harness import GOLDEN, RunningSidecar, sidecar_config, start_sidecar, stop_sidecar, wait_for

#: The seeds' rule: credit models never let income_prob* leave the pod.
CREDIT_RULE = FilterRule(model="credit_.*", drop_outputs=("income_prob.*",))
EXAMPLE_MODELS = ["credit_risk", "image_classifier"]


def proxy_config(triton: LocalTriton, *, models: list[str] | None = None, golden_dir: Any = GOLDEN,
                 rules: tuple[FilterRule, ...] = (CREDIT_RULE,), **sections: dict) -> SidecarConfig:
    config = sidecar_config(triton, models=models or EXAMPLE_MODELS, golden_dir=golden_dir, **sections)
    return replace(config, filtering=replace(config.filtering, rules=rules))


async def started_and_healthy(start, config: SidecarConfig, timeout: float = 30) -> RunningSidecar:  # type: ignore[no-untyped-def]
    sidecar = await start(config)
    for model in config.models:
        await wait_for(lambda m=model: sidecar.state(m) is ModelState.HEALTHY, timeout, what=f"{model} HEALTHY")
    front = sidecar.server
    if isinstance(front, HttpFront):  # and served by the front from the first request on
        await wait_for(lambda: front.settled, timeout, what="the front's lanes published")
    return sidecar


async def served_by_front(front: Any, model: str, timeout: float = 10, *, settled: bool = True) -> None:
    """Wait until the Rust front publishes `model` as a lane (and, with settled, no spec fetch is in
    flight): before that its requests go to the Python chain, whose breaker and admission are not the
    front's, so a test of what the front serves would race the hand-over. A no-op on the Python listener."""
    if not isinstance(front, HttpFront):
        return
    await wait_for(lambda: model in {lane[0] for lane in front.lanes()[0]} and (front.settled or not settled),
                   timeout, what=f"{model} a lane on the front")


def features(rows: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 128)).astype(np.float32)


def credit_json(rows: int = 1, seed: int = 0, **extra: Any) -> dict[str, Any]:
    x = features(rows, seed)
    return {"inputs": [{"name": "features", "shape": [rows, 128], "datatype": "FP32", "data": x.tolist()}], **extra}


def image_json(batch: int = 1, seed: int = 0) -> dict[str, Any]:
    x = np.random.default_rng(seed).uniform(0, 1, (batch, 3, 32, 32)).astype(np.float32)
    return {"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}


def binary_request(name: str, array: np.ndarray, outputs: list[tuple[str, bool]] | None = None,
                   datatype: str = "FP32") -> tuple[bytes, dict[str, str]]:
    """A binary-extension infer body built by tritonclient itself, and its headers."""
    tensor = triton_http.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=True)
    requested = [triton_http.InferRequestedOutput(n, binary_data=b) for n, b in outputs] if outputs else None
    body, json_size = triton_http.InferenceServerClient.generate_request_body([tensor], outputs=requested)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


def decode_answer(body: bytes, headers: Any) -> dict[str, np.ndarray]:
    """Every output of an infer answer (JSON or binary) as numpy, by name."""
    length = headers.get("Inference-Header-Content-Length")
    result = triton_http.InferenceServerClient.parse_response_body(
        body, header_length=int(length) if length is not None else None)
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def output_names(body: bytes, headers: Any) -> list[str]:
    length = headers.get("Inference-Header-Content-Length")
    header = body[: int(length)] if length is not None else body
    return [o["name"] for o in json.loads(header)["outputs"]]


def triton_successes(triton: LocalTriton, model: str, version: str = "1") -> float:
    """Triton's own count of successful inferences of one version of a model (from its /metrics)."""
    with urllib.request.urlopen(triton.metrics_url, timeout=10) as response:
        text = response.read().decode()
    pattern = rf'^nv_inference_request_success\{{model="{re.escape(model)}",version="{re.escape(version)}"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def triton_counted(triton: LocalTriton, model: str, reaching: float, version: str = "1",
                         timeout: float = 5.0) -> float:
    """`triton_successes` once it reaches `reaching`, or at the deadline: Triton counts an answer a
    moment after sending it, so a count read once right after the answers can still lag. The caller
    asserts the exact value (one more than expected is a call that should not have reached Triton)."""
    deadline = time.monotonic() + timeout
    while (count := triton_successes(triton, model, version)) < reaching and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return count


async def raw_http(host: str, port: int, head: bytes, body_parts: list[bytes] = (),  # type: ignore[assignment]
                   read_timeout: float = 10.0) -> tuple[int, bytes]:
    """Send a hand-written request (for bodies no client library would send) and read the answer."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
            await writer.drain()
        async with asyncio.timeout(read_timeout):
            status_line = await reader.readline()
            data = await reader.read(65536)
        return int(status_line.split()[1]), data
    finally:
        writer.close()


def json_tail(raw: bytes) -> dict[str, Any]:
    """The JSON body at the end of a raw HTTP answer."""
    return json.loads(raw[raw.index(b"\r\n\r\n") + 4:])


class SidecarThread:
    """The real app on a loopback socket, driven by an event loop on its own thread, for tests that are
    synchronous (hypothesis drives its examples from plain functions)."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.loop = loop_factory(config)()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.sidecar: RunningSidecar | None = None

    def __enter__(self) -> SidecarThread:
        self.thread.start()
        self.sidecar = self._run(start_sidecar(self.config))
        for model in self.config.models:
            self._run(wait_for(lambda m=model: self.sidecar.state(m) is ModelState.HEALTHY, 30,  # type: ignore[union-attr]
                               what=f"{model} HEALTHY"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sidecar is not None:
            self._run(stop_sidecar(self.sidecar))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    @property
    def url(self) -> str:
        assert self.sidecar is not None
        return self.sidecar.url

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.url + path, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()


@contextlib.asynccontextmanager
async def served_like_production(
        config: SidecarConfig) -> AsyncIterator[tuple[web.Application, CollectorRegistry, str]]:
    """The app behind the very listener `triton-sidecar run` uses (sidecar.http_listener)."""
    registry = CollectorRegistry()
    app = create_app(config, registry=registry, golden=load_golden_dir(config.golden_dir))
    listener = http_server(app)
    await listener.start("127.0.0.1", 0)
    try:
        yield app, registry, f"http://127.0.0.1:{listener.port}"
    finally:
        await listener.close()


class PythonEntries:
    """Counts entries into the Python request chain while it is open: a request's scope, a refusal
    before one, an infer or generate (ServingCore.infer), a stream (ServingCore.stream)."""

    NAMES = (("request",), ("requests", "refuse_at_once"), ("infer",), ("stream",))

    def __init__(self, core: Any) -> None:
        self.count = 0
        self._patched: list[tuple[Any, str, Any]] = []
        for path in self.NAMES:
            owner = core
            for name in path[:-1]:
                owner = getattr(owner, name)
            self._patched.append((owner, path[-1], getattr(owner, path[-1])))

    def _counting(self, inner: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return inner(*args, **kwargs)
        return call

    def __enter__(self) -> PythonEntries:
        for owner, name, inner in self._patched:
            setattr(owner, name, self._counting(inner))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, inner in self._patched:
            setattr(owner, name, inner)
