"""Fixtures: one real Triton shared by the tests that do not break it, fresh models for those that
break a model, and a fresh Triton for those that break the server."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop

from sidecar.devtools.tritonserver import LocalTriton
from tests.harness import EXAMPLES, FreshModel, RunningSidecar, start_sidecar, stop_sidecar

EXAMPLE_MODELS = ["credit_risk", "image_classifier", "text_echo"]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """The tests' event loop is the one `run` serves on (sidecar.cli.run.event_loop_of): uvloop by
    default, asyncio's own in modules that set SERVES_ON_ASYNCIO_LOOP (TLS on)."""
    if getattr(item.module, "SERVES_ON_ASYNCIO_LOOP", False):  # type: ignore[attr-defined]
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


def _repository_copy(root: Path) -> Path:
    repository = root / "model_repository"
    shutil.copytree(EXAMPLES, repository)
    return repository


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    """The shared Triton: the example models, plus room for fresh models loaded by tests."""
    root = tmp_path_factory.mktemp("shared-triton")
    server = LocalTriton(model_repository=_repository_copy(root), models=EXAMPLE_MODELS, workdir=root / "work")
    server.start()
    yield server
    server.stop(grace_s=3)


@pytest.fixture(autouse=True)
def _shared_triton_is_left_ready(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves the shared Triton "not ready" would fail the tests after it in
    confusing ways; fail it instead, by name."""
    yield
    if "triton" not in request.fixturenames:
        return
    server: LocalTriton = request.getfixturevalue("triton")
    deadline = time.monotonic() + 10
    while not server.is_ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{request.node.nodeid} left the shared Triton not ready")
        time.sleep(0.1)


@pytest.fixture
def own_triton(tmp_path: Path) -> Iterator[LocalTriton]:
    """A Triton of the test's own, for tests that kill or restart the server."""
    server = LocalTriton(model_repository=_repository_copy(tmp_path), models=EXAMPLE_MODELS,
                         workdir=tmp_path / "work")
    server.start()
    yield server
    server.stop(grace_s=3)


@pytest.fixture
def fresh_model(triton: LocalTriton, tmp_path: Path) -> Iterator[FreshModel]:
    """A private fault-injectable model in the shared Triton, removed afterwards."""
    model = FreshModel.create(triton, tmp_path)
    yield model
    model.remove()


@pytest.fixture
async def sidecars() -> AsyncIterator[list[RunningSidecar]]:
    """Sidecars started by a test (append to the list); all stopped at the end."""
    started: list[RunningSidecar] = []
    yield started
    for running in started:
        await stop_sidecar(running)


@pytest.fixture
def start(sidecars: list[RunningSidecar]):  # type: ignore[no-untyped-def]
    async def _start(config, **options):  # type: ignore[no-untyped-def]
        running = await start_sidecar(config, **options)
        sidecars.append(running)
        return running

    return _start
