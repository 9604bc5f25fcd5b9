"""The health side's Triton client (the probes' calls on a pool of its own, the rest on one aiohttp
session), against the real shared Triton: every call answers as tritonclient's did, and failures
come out typed (TritonError with Triton's status and words, TritonUnavailable for no connection,
TritonTimeout for no answer in time)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.devtools.tritonserver import free_port
from sidecar.golden.cases import load_golden_dir
from sidecar.health.triton_client import TritonClient
from sidecar.protocol.triton_errors import TritonError, TritonTimeout, TritonUnavailable
from tests.harness import GOLDEN


async def test_every_call_answers_the_probes_on_one_kept_alive_connection_the_rest_on_one_session(triton):
    client = TritonClient(triton.url, timeout_s=5.0)
    try:
        assert await client.server_live() and await client.server_ready()
        assert await client.model_ready("credit_risk") and not await client.model_ready("no_such_model")
        assert (await client.model_metadata("credit_risk"))["name"] == "credit_risk"
        assert (await client.model_config("credit_risk"))["name"] == "credit_risk"
        index = await client.repository_index()
        assert {"name": "credit_risk", "state": "READY"}.items() <= next(
            e for e in index if e["name"] == "credit_risk").items()
        case = next(c for c in load_golden_dir(GOLDEN)["credit_risk"] if c.expect_status == 200)
        outcome = await client.infer_case(case)
        assert outcome.status == 200 and outcome.outputs
        session = client._http
        await client.server_ready()
        assert client._http is session and session is not None, "one session for the other calls"
        # One probe call after another: readiness, metadata and golden infer all reused one connection.
        assert client._pool.connections_opened == 1 and client._pool.reused >= 5, (
            client._pool.connections_opened, client._pool.reused)
    finally:
        await client.close()


async def test_failures_are_typed_with_triton_s_status_and_words(triton):
    client = TritonClient(triton.url, timeout_s=5.0)
    try:
        with pytest.raises(TritonError) as unknown:
            await client.model_metadata("no_such_model")
        assert unknown.value.status in (400, 404) and "no_such_model" in unknown.value.message
        with pytest.raises(TritonError) as version:
            await client.model_metadata("credit_risk", version="99")
        assert version.value.status >= 400 and "99" in version.value.message
        # A server without a config to give (MLServer has no config endpoint) answers 404: no config.
        assert await client.model_config("credit_risk", version="99") == {}
    finally:
        await client.close()


async def test_no_connection_is_unavailable_and_no_answer_is_a_timeout():
    refused = TritonClient(f"http://127.0.0.1:{free_port()}", timeout_s=2.0)
    with pytest.raises(TritonUnavailable) as no_server:
        await refused.server_live()
    assert not isinstance(no_server.value, TritonTimeout)
    await refused.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # accept, read the request, never answer

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    mute = TritonClient(f"http://127.0.0.1:{port}", timeout_s=0.3)
    try:
        with pytest.raises(TritonTimeout):
            await mute.model_metadata("credit_risk")
    finally:
        await mute.close()
        server.close()


#: Runs in a fresh interpreter (this one imported numpy long ago): the production app on a real
#: socket, gRPC off, probing every example model's golden cases until each has passed a few rounds.
_PROBING_SIDECAR = """
import asyncio, sys, types
from sidecar.states import ModelState
from tests.harness import GOLDEN, sidecar_config, start_sidecar, stop_sidecar, wait_for

triton = types.SimpleNamespace(url={url!r}, metrics_url={metrics_url!r}, ports=types.SimpleNamespace(grpc=0))
models = {models!r}

async def main():
    running = await start_sidecar(sidecar_config(triton, models=models, golden_dir=GOLDEN))
    try:
        def rounds(model):
            return running.metric("triton_sidecar_probes_total", model=model, probe="golden", result="success") or 0
        await wait_for(lambda: all(running.state(m) == ModelState.HEALTHY and rounds(m) >= 3 for m in models), 60)
    finally:
        await stop_sidecar(running)
    print(sorted(m for m in sys.modules if m.partition(".")[0] in ("numpy", "grpc", "tritonclient", "ml_dtypes")))

asyncio.run(main())
"""


def test_a_sidecar_probing_golden_cases_imports_no_numpy(triton):
    """Issue 30's idle footprint: the health loop encodes, reads and compares golden answers through
    the data plane (numpy alone is ~6 MB of an idle sidecar's RSS), and with gRPC off nothing loads
    numpy, grpcio or tritonclient."""
    from tests.conftest import EXAMPLE_MODELS

    code = _PROBING_SIDECAR.format(url=triton.url, metrics_url=triton.metrics_url, models=EXAMPLE_MODELS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
