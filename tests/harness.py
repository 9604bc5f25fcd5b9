"""What the tests need around the real Triton: fresh fault-injectable models, a sidecar on a real
loopback socket, and waiting on conditions with deadlines (never bare sleeps)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from sidecar.app.factory import create_app
from sidecar.config import SidecarConfig, load_config
from sidecar.devtools.tritonserver import LocalTriton, stub_pids
from sidecar.fronts.appkeys import ROSTER, STATES
from sidecar.fronts.http_front import HttpFront, http_server
from sidecar.fronts.http_listener import SidecarListener
from sidecar.golden.cases import load_golden_dir
from sidecar.health.triton_client import TritonClient
from sidecar.states import ModelState, Transition

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "model_repository"
FAULTY_TEMPLATE = REPO / "tests" / "models" / "faulty"
#: A decoupled text model (generate_stream) with faults: the generative counterpart of `faulty`.
FAULTY_TEXT_TEMPLATE = REPO / "tests" / "models" / "faulty_text"
GOLDEN = REPO / "golden_requests"

#: Probe settings scaled down for tests: a fault is detected in a second or two. The timeout stays
#: above 1 s because Triton takes 1 s to report a dead python stub ("Stub process ... is not healthy").
FAST_PROBES = {"interval_s": 0.5, "timeout_s": 1.5, "failure_threshold": 2, "success_threshold": 1, "jitter": 0.1}
FAST_HEALING = {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "unload_timeout_s": 2.0, "load_timeout_s": 30.0}
#: Extra time allowed on top of a computed bound: this machine is shared and noisy.
SLACK_S = 2.0

_counter = itertools.count(1)


async def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05,
                   what: str = "condition") -> Any:
    """Poll `predicate` (sync or async) until it returns something truthy, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what}")
        await asyncio.sleep(interval)


def triton_post(triton: LocalTriton, path: str, body: dict | None = None) -> tuple[int, Any]:
    headers = dict([triton.restricted_repository_header]) if triton.restricted_repository_header else {}
    request = urllib.request.Request(f"{triton.url}{path}", data=json.dumps(body or {}).encode(), method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else None


@dataclass
class FreshModel:
    """A private copy of the fault-injectable model, loaded into a running Triton under a new name."""

    triton: LocalTriton
    name: str
    path: Path
    golden_dir: Path

    @classmethod
    def create(cls, triton: LocalTriton, scratch: Path, prefix: str = "faulty", *,
               template: Path = FAULTY_TEMPLATE, golden_from: str = "credit_risk") -> FreshModel:
        """A copy of `template` named `<prefix>_<pid>_<n>`, probed with the golden cases of `golden_from`."""
        name = f"{prefix}_{os.getpid()}_{next(_counter)}"
        path = triton.model_repository / name
        shutil.copytree(template, path)
        config = (path / "config.pbtxt").read_text().replace(f'name: "{template.name}"', f'name: "{name}"')
        (path / "config.pbtxt").write_text(config)
        golden_dir = scratch / f"golden-{name}"
        (golden_dir / name).mkdir(parents=True)
        for case in (GOLDEN / golden_from).glob("*.json"):
            shutil.copy(case, golden_dir / name / case.name)
        model = cls(triton, name, path, golden_dir)
        model.load()
        return model

    def load(self) -> None:
        status, body = triton_post(self.triton, f"/v2/repository/models/{self.name}/load")
        assert status == 200, f"loading {self.name} failed: {body}"

    def unload(self) -> None:
        triton_post(self.triton, f"/v2/repository/models/{self.name}/unload")

    def index_state(self) -> str | None:
        _, index = triton_post(self.triton, "/v2/repository/index")
        return next((e.get("state") for e in index or [] if e.get("name") == self.name), None)

    def stubs(self) -> list[int]:
        return stub_pids(self.name, parent=self.triton.pid)

    def kill_stub(self) -> int:
        pids = self.stubs()
        assert len(pids) == 1, f"expected one stub for {self.name}, found {pids}"
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def inject(self, kind: str) -> None:
        """Damage the running stub's memory: `nan`, `drift` or `hang` (see tests/models/faulty)."""
        (self.path / "1" / "fault").write_text(kind)
        for pid in self.stubs():
            os.kill(pid, signal.SIGUSR1)

    def load_slowly(self, seconds: float) -> None:
        """Make every future load take `seconds` more (initialize() waits them out)."""
        (self.path / "1" / "load_delay_s").write_text(str(seconds))

    def break_files(self) -> None:
        """Make every future load fail: the model file no longer imports."""
        (self.path / "1" / "model.py").write_text("raise RuntimeError('model file corrupted by the test')\n")

    def remove(self) -> None:
        """Leave the shared Triton ready for the next test. An instance whose stub died or hangs
        never finishes unloading and keeps the server "not ready" (strict readiness); a fresh load
        replaces it, and that healthy instance then unloads cleanly."""
        self.load_quietly()
        self.unload()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.index_state() in ("UNLOADING", "READY", "LOADING"):
            time.sleep(0.05)
        for pid in self.stubs():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def load_quietly(self) -> None:
        triton_post(self.triton, f"/v2/repository/models/{self.name}/load")


#: What serves listen.port in this run: the configured default (rust), or the Python listener alone
#: with SIDECAR_TEST_FRONT=python.
TEST_FRONT = os.environ.get("SIDECAR_TEST_FRONT", load_config(None, environ={}).listen.front)
#: What serves listen.grpc_port: the configured default (rust, the data plane's gRPC front) unless
#: SIDECAR_TEST_GRPC_FRONT says otherwise; grpcio with the Python listener (the config's own rule).
TEST_GRPC_FRONT = os.environ.get(
    "SIDECAR_TEST_GRPC_FRONT", "python" if TEST_FRONT == "python" else load_config(None, environ={}).listen.grpc_front)


def sidecar_config(server: LocalTriton, /, *, models: list[str], golden_dir: Path, **sections: dict) -> SidecarConfig:
    """The default config pointed at `triton`, with fast probes; `sections` override whole keys."""
    base = load_config(None, environ={})
    probes = replace(base.probes, **{**FAST_PROBES, **sections.pop("probes", {})})
    healing = replace(base.healing, **{**FAST_HEALING, **sections.pop("healing", {})})
    config = replace(
        base,
        triton=replace(base.triton, url=server.url, metrics_url=server.metrics_url,
                       grpc_url=f"127.0.0.1:{server.ports.grpc}"),
        # No gRPC front unless a test asks for one (with a free port): tests run many sidecars.
        # SIDECAR_TEST_FRONT=python runs a suite against the Python listener alone (make test does,
        # for the listener's modules); the configured default (rust, the data plane's front) else.
        # SIDECAR_TEST_GRPC_FRONT=python serves the gRPC port of every test that opens one with grpcio
        # alone (make test's third pass, over the gRPC modules); TEST_GRPC_FRONT says which.
        listen=replace(base.listen, host="127.0.0.1", port=0, grpc_port=0, front=TEST_FRONT,
                       grpc_front=TEST_GRPC_FRONT),
        models=tuple(models),
        golden_dir=golden_dir,
        probes=probes,
        healing=healing,
    )
    for name, values in sections.items():
        config = replace(config, **{name: replace(getattr(config, name), **values)})
    return config


@dataclass
class RunningSidecar:
    """The production app (create_app) on a real loopback socket, plus what the test observes."""

    server: SidecarListener | HttpFront
    session: aiohttp.ClientSession
    registry: CollectorRegistry
    transitions: list[Transition] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def app(self):  # type: ignore[no-untyped-def]
        return self.server.app

    def state(self, model: str) -> ModelState:
        return self.app[STATES].get(model).state

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as response:
            return response.status, await response.json()

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def first_transition_to(self, model: str, *states: ModelState, after: float = float("-inf")) -> Transition | None:
        """The model's first move into one of `states` (later than `after`, a clock() time)."""
        return next((t for t in self.transitions if t.model == model and t.state_to in states and t.at > after),
                    None)


async def start_sidecar(config: SidecarConfig, *, config_path: Path | None = None,
                        triton: TritonClient | None = None) -> RunningSidecar:
    """`config_path`: the file to watch for reloads; `triton`: a client of the test's own (it closes
    it); by default the app makes and closes one."""
    registry = CollectorRegistry()
    app = create_app(config, registry=registry, golden=load_golden_dir(config.golden_dir), triton=triton,
                     config_path=config_path)
    running = RunningSidecar(http_server(app), aiohttp.ClientSession(), registry)
    app[STATES].add_listener(running.transitions.append)
    await running.server.start("127.0.0.1", 0)
    return running


async def stop_sidecar(running: RunningSidecar) -> None:
    await running.session.close()
    await running.server.close()


class EndpointRecorder:
    """Polls /healthz and /readyz in the background and keeps every status seen, with times."""

    def __init__(self, sidecar: RunningSidecar, period_s: float = 0.05) -> None:
        self.sidecar = sidecar
        self.period_s = period_s
        self.healthz: list[tuple[float, int]] = []
        self.readyz: list[tuple[float, int]] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for path, seen in (("/healthz", self.healthz), ("/readyz", self.readyz)):
                status, _ = await self.sidecar.get(path)
                seen.append((time.monotonic(), status))
            await asyncio.sleep(self.period_s)

    def start(self) -> EndpointRecorder:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def looked_after(sidecar: RunningSidecar, moment: float, model: str) -> None:
    """Wait until the model's supervisor has looked at its request count after `moment` (monotonic)."""
    traffic = sidecar.app[ROSTER].supervisors.get(model).traffic  # type: ignore[union-attr]
    await wait_for(lambda: traffic.looked_at > moment, 2, interval=0.005, what="the supervisor's next look")
