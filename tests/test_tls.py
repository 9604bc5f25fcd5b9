"""TLS and mutual TLS on the sidecar's ports, in front of the real shared Triton, with certificates made
in the test: tritonclient over HTTPS and gRPC-over-TLS gets Triton's own answers, a plaintext client
gets none, a renewed certificate (a `..data` symlink swap, as the kubelet does it) serves new
connections within 2 s while open ones keep answering, a broken renewal is refused, mutual TLS refuses
every client that is not allowed, and the plaintext probe port keeps the kubelet and Prometheus going."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import pytest
import structlog.testing
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2 as pb

from sidecar.app.probe_port import ProbeListener
from sidecar.cli.main import main
from sidecar.config import ConfigError, load_config
from sidecar.devtools.tritonserver import free_port
from sidecar.fronts.appkeys import SERVING, TLS
from sidecar.fronts.grpc_server import SERVICE
from sidecar.fronts.tls import HANDSHAKE_REASONS, handshake_reason
from sidecar.serving.drift import load_reference
from sidecar.states import ModelState
from tests.harness import GOLDEN, REPO, TEST_FRONT, TEST_GRPC_FRONT, wait_for
from tests.proxy_support import credit_json, features, proxy_config, started_and_healthy
from tests.tls_support import (
    HttpsConnection,
    Issued,
    SecretVolume,
    client_context,
    issue,
    make_ca,
    served_serial,
    server_cert,
)

ALLOWED_SAN = "spiffe://bank.example/ns/fraud/sa/scorer"

#: With TLS on the Python front, `run` serves on asyncio's own loop (sidecar.cli.run.event_loop_of): so do these tests
#: (tests/conftest.py: pytest_asyncio_loop_factories).
SERVES_ON_ASYNCIO_LOOP = True

#: The front the `run` command is started with (make test runs this file again with python).
FRONT = TEST_FRONT
#: What serves listen.grpc_port (tests/harness.py): by default the data plane's gRPC front, which
#: terminates TLS itself with rustls, refuses a SAN at the handshake, honours min_version and counts
#: its failed handshakes by reason; make test runs this file again with grpcio (python).
GRPC_FRONT = TEST_GRPC_FRONT


@pytest.fixture(scope="module")
def ca() -> Issued:
    return make_ca()


def tls_config(triton, volume: SecretVolume, *, mutual: bool = False, sans: tuple[str, ...] = (),  # type: ignore[no-untyped-def]
               grpc_port: bool = True, **sections):
    config = proxy_config(triton, **sections)
    tls = replace(config.tls, cert_file=str(volume.cert_file), key_file=str(volume.key_file),
                  client_ca_file=str(volume.ca_file) if mutual else "", client_allowed_sans=sans)
    listen = replace(config.listen, grpc_port=free_port() if grpc_port else 0)
    logging = replace(config.logging, access_log_sample_rate=1.0)
    return replace(config, tls=tls, listen=listen, logging=logging)


def _grpc_inputs(x: np.ndarray) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor]


def _https_infer(port: int, ca_file: Path, x: np.ndarray) -> tuple[np.ndarray, dict, np.ndarray]:
    """tritonclient.http over HTTPS (its own thread: geventhttpclient blocks): infer, metadata, infer
    again on the same keep-alive connection (the second one follows an aiohttp hand-over)."""
    client = triton_http.InferenceServerClient(f"localhost:{port}", ssl=True, ssl_options={"ca_certs": str(ca_file)})
    try:
        tensor = triton_http.InferInput("features", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        first = client.infer("credit_risk", [tensor]).as_numpy("scores")
        metadata = client.get_model_metadata("credit_risk")
        again = client.infer("credit_risk", [tensor]).as_numpy("scores")
        return first, metadata, again
    finally:
        client.close()


def _direct_scores(triton, x: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    direct = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.ports.grpc}")
    return direct.infer("credit_risk", _grpc_inputs(x)).as_numpy("scores")


async def _plaintext_answer(port: int) -> bytes:
    """What a plaintext HTTP client reads back from a TLS port (b"" when the connection just ends)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(4096), 10)
    except ConnectionError:
        return b""
    finally:
        writer.close()


def _handshake_failures(sidecar, reason: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("triton_sidecar_tls_handshake_failures_total", reason=reason) or 0.0


# -- start-up -------------------------------------------------------------------------------------------------------


def test_half_a_tls_setup_is_refused_with_the_missing_key_named(tmp_path):
    config = tmp_path / "sidecar.yaml"
    config.write_text("tls:\n  cert_file: /etc/tls/tls.crt\n")
    with pytest.raises(ConfigError, match=r"tls\.key_file"):
        load_config(config, environ={})
    config.write_text("tls:\n  client_allowed_sans: [spiffe://x]\n  cert_file: a\n  key_file: b\n")
    with pytest.raises(ConfigError, match=r"tls\.client_allowed_sans"):
        load_config(config, environ={})
    config.write_text("tls:\n  min_version: '1.1'\n")
    with pytest.raises(ConfigError, match=r"tls\.min_version"):
        load_config(config, environ={})


@pytest.mark.parametrize("broken", ["cert_garbage", "key_of_another_cert", "ca_garbage", "missing_key", "expired"])
def test_a_bad_certificate_key_or_ca_file_stops_the_start_with_one_line_naming_it(broken, ca, tmp_path):
    good = server_cert(ca)
    cert, key = good.write(tmp_path, "server")
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    named = {"cert_garbage": cert, "key_of_another_cert": key, "ca_garbage": ca_file, "missing_key": key,
             "expired": cert}[broken]
    if broken == "cert_garbage":
        cert.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    elif broken == "key_of_another_cert":
        key.write_bytes(server_cert(ca).key_pem)
    elif broken == "ca_garbage":
        ca_file.write_text("hello\n")
    elif broken == "missing_key":
        key.unlink()
    else:
        issue(ca, "old", dns=("localhost",), days=-1, not_before_days=-10).write(tmp_path, "server")
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"golden_dir: {GOLDEN}\nlisten: {{port: {free_port()}, grpc_port: 0}}\n"
                      f"tls: {{cert_file: {cert}, key_file: {key}, client_ca_file: {ca_file}}}\n")
    run = subprocess.run([sys.executable, "-m", "sidecar", "run", "--config", str(config)], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and str(named) in err[0], err


def _plain_get(url: str) -> tuple[int, bytes] | None:
    """Status and body of a plaintext GET, or None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return None


async def test_run_serves_tls_on_both_ports_and_plaintext_probes_only_on_probe_port(triton, ca, tmp_path):
    """The `run` command as the tls overlay starts it (the files and the probe port from the
    environment): the kubelet's plaintext probes and Prometheus' scrape on listen.probe_port, nothing
    plaintext on listen.port or listen.grpc_port."""
    volume = SecretVolume(tmp_path / "secret")
    served = server_cert(ca)
    volume.install(served, ca)
    port, grpc_port, probe_port = free_port(), free_port(), free_port()
    env = {"SIDECAR_TRITON_URL": triton.url, "SIDECAR_LISTEN_HOST": "127.0.0.1", "SIDECAR_LISTEN_PORT": str(port),
           "SIDECAR_LISTEN_GRPC_PORT": str(grpc_port), "SIDECAR_LISTEN_PROBE_PORT": str(probe_port),
           "SIDECAR_TLS_CERT_FILE": str(volume.cert_file), "SIDECAR_TLS_KEY_FILE": str(volume.key_file),
           "SIDECAR_MODELS": "credit_risk", "SIDECAR_GOLDEN_DIR": str(GOLDEN), "SIDECAR_PROBES_INTERVAL_S": "0.3",
           "SIDECAR_LISTEN_FRONT": FRONT, "SIDECAR_LISTEN_GRPC_FRONT": GRPC_FRONT}
    process = subprocess.Popen([sys.executable, "-m", "sidecar", "run"], cwd=REPO, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    probes = f"http://127.0.0.1:{probe_port}"
    try:
        await wait_for(lambda: (_plain_get(probes + "/readyz") or (0,))[0] == 200, 30, what="/readyz 200 on probe_port")
        assert _plain_get(probes + "/healthz")[0] == 200  # type: ignore[index]
        status, metrics = _plain_get(probes + "/metrics")  # type: ignore[misc]
        assert status == 200 and b"triton_sidecar_tls_cert_expiry_timestamp_seconds" in metrics
        assert _plain_get(probes + "/v2/models/credit_risk")[0] == 404  # type: ignore[index]

        assert not (await _plaintext_answer(port)).startswith(b"HTTP/")
        assert await served_serial(port, ca) == served.cert.serial_number
        connection = await HttpsConnection.open(port, client_context(ca))
        try:
            status, body = await connection.request("POST", "/v2/models/credit_risk/infer",
                                                    json.dumps(credit_json()).encode())
            assert status == 200 and b"scores" in body, body
        finally:
            connection.close()
        assert await _grpc_live(grpc_port, ca, None) == grpc.StatusCode.OK
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await channel.unary_unary(f"/{SERVICE}/ServerLive")(pb.ServerLiveRequest().SerializeToString(),
                                                                     timeout=5)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
            stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    started = [json.loads(line) for line in stdout.splitlines() if '"sidecar_started"' in line]
    assert started and started[0]["tls"] is True and started[0]["probe_port"] == probe_port, stdout[-2000:]
    # The Python front's TLS needs asyncio's loop whatever listen.event_loop says; the Rust front
    # terminates TLS on its own runtime, so the sidecar keeps uvloop.
    assert started[0]["event_loop"] == ("asyncio" if FRONT == "python" else "uvloop")


async def test_run_with_the_rust_front_terminates_tls_there_and_keeps_uvloop(triton, ca, tmp_path):
    """`listen.front: rust` with tls.cert_file starts (it was refused before the front had TLS): the
    front serves HTTPS with the files Python loaded, the probe port stays plaintext, and Python's loop
    is uvloop, since no TLS hand-over happens on it any more."""
    volume = SecretVolume(tmp_path / "secret")
    served = server_cert(ca)
    volume.install(served, ca)
    port, probe_port = free_port(), free_port()
    env = {"SIDECAR_TRITON_URL": triton.url, "SIDECAR_LISTEN_HOST": "127.0.0.1", "SIDECAR_LISTEN_PORT": str(port),
           "SIDECAR_LISTEN_GRPC_PORT": "0", "SIDECAR_LISTEN_PROBE_PORT": str(probe_port),
           "SIDECAR_LISTEN_FRONT": "rust", "SIDECAR_TLS_CERT_FILE": str(volume.cert_file),
           "SIDECAR_TLS_KEY_FILE": str(volume.key_file), "SIDECAR_MODELS": "credit_risk",
           "SIDECAR_GOLDEN_DIR": str(GOLDEN), "SIDECAR_PROBES_INTERVAL_S": "0.3"}
    process = subprocess.Popen([sys.executable, "-m", "sidecar", "run"], cwd=REPO, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        await wait_for(lambda: (_plain_get(f"http://127.0.0.1:{probe_port}/readyz") or (0,))[0] == 200, 30,
                       what="/readyz 200 on probe_port")
        assert not (await _plaintext_answer(port)).startswith(b"HTTP/")
        assert await served_serial(port, ca) == served.cert.serial_number
        connection = await HttpsConnection.open(port, client_context(ca))
        try:
            status, body = await connection.request("POST", "/v2/models/credit_risk/infer",
                                                    json.dumps(credit_json()).encode())
            assert status == 200 and b"scores" in body, body
        finally:
            connection.close()
        status, metrics = _plain_get(f"http://127.0.0.1:{probe_port}/metrics")  # type: ignore[misc]
        assert status == 200 and b'triton_sidecar_tls_handshake_failures_total{reason="not_tls"} 1.0' in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
            stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    started = [json.loads(line) for line in stdout.splitlines() if '"sidecar_started"' in line]
    assert started and started[0]["tls"] is True and started[0]["event_loop"] == "uvloop", stdout[-2000:]


# -- serving over TLS ----------------------------------------------------------------------------------------------


async def test_https_and_grpc_over_tls_answer_like_triton_and_plaintext_gets_no_answer(triton, start, ca, tmp_path):
    volume = SecretVolume(tmp_path / "secret")
    served = server_cert(ca)
    volume.install(served, ca)
    config = tls_config(triton, volume)
    sidecar = await started_and_healthy(start, config)  # golden probes run as ever (they go to Triton)
    port = sidecar.server.port
    x = features(rows=2, seed=5)
    want = _direct_scores(triton, x)

    first, metadata, again = await asyncio.to_thread(_https_infer, port, volume.ca_file, x)
    assert np.array_equal(first, want) and np.array_equal(again, want)
    assert [o["name"] for o in metadata["outputs"]] == ["scores"]  # filtered as over plaintext

    target = f"localhost:{config.listen.grpc_port}"
    proxied = grpcclient_aio.InferenceServerClient(target, ssl=True, root_certificates=str(volume.ca_file))
    try:
        got = await proxied.infer("credit_risk", _grpc_inputs(x))
        assert np.array_equal(got.as_numpy("scores"), want)
        assert got.as_numpy("income_prob") is None
    finally:
        await proxied.close()

    # Plaintext on either port: no answer, only a failed handshake (counted by reason).
    assert not (await _plaintext_answer(port)).startswith(b"HTTP/")
    await wait_for(lambda: _handshake_failures(sidecar, "not_tls") >= 1, 5, what="not_tls counted")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await channel.unary_unary(f"/{SERVICE}/ServerLive")(pb.ServerLiveRequest().SerializeToString(), timeout=5)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    if GRPC_FRONT == "rust":  # the data plane's gRPC front counts its port's failed handshakes too
        await wait_for(lambda: _handshake_failures(sidecar, "not_tls") >= 2, 5, what="not_tls counted on gRPC")

    assert sidecar.metric("triton_sidecar_tls_cert_expiry_timestamp_seconds", cert_file=str(volume.cert_file)) == \
        pytest.approx(served.cert.not_valid_after_utc.timestamp())
    assert await served_serial(port, ca) == served.cert.serial_number
    assert await served_serial(config.listen.grpc_port, ca, alpn=("h2",)) == served.cert.serial_number


async def test_a_renewed_certificate_serves_new_connections_within_2s_while_open_ones_keep_answering(
        triton, start, ca, tmp_path):
    volume = SecretVolume(tmp_path / "secret")
    old = server_cert(ca)
    volume.install(old, ca)
    config = tls_config(triton, volume)
    sidecar = await started_and_healthy(start, config)
    port, grpc_port = sidecar.server.port, config.listen.grpc_port
    probes = ProbeListener(sidecar.app)
    await probes.start("127.0.0.1", 0)
    seen: list[int] = []

    async def probe_all_along() -> None:
        while True:
            async with sidecar.session.get(f"http://127.0.0.1:{probes.port}/readyz") as answer:
                seen.append(answer.status)
            await asyncio.sleep(0.05)

    prober = asyncio.create_task(probe_all_along())
    body = credit_json(rows=1, seed=3)
    long_lived = await HttpsConnection.open(port, client_context(ca))
    channel = grpc.aio.secure_channel(f"localhost:{grpc_port}", grpc.ssl_channel_credentials(ca.cert_pem))
    live = channel.unary_unary(f"/{SERVICE}/ServerLive")
    try:
        assert (await long_lived.request("POST", "/v2/models/credit_risk/infer", json.dumps(body).encode()))[0] == 200
        assert pb.ServerLiveResponse.FromString(await live(pb.ServerLiveRequest().SerializeToString(), timeout=5)).live

        new = server_cert(ca)
        swapped = time.monotonic()
        volume.install(new, ca)
        await wait_for(lambda: sidecar.app[TLS].material.serial == new.cert.serial_number, 2, what="new pair loaded")
        assert await served_serial(port, ca) == new.cert.serial_number
        assert await served_serial(grpc_port, ca, alpn=("h2",)) == new.cert.serial_number
        assert time.monotonic() - swapped < 2.0

        # Connections made before the swap go on, with the certificate they were made with.
        assert long_lived.serial == old.cert.serial_number
        status, answer = await long_lived.request("POST", "/v2/models/credit_risk/infer", json.dumps(body).encode())
        assert status == 200 and b"scores" in answer
        assert (await long_lived.request("GET", "/v2/models/credit_risk"))[0] == 200  # handed to aiohttp, over TLS
        assert pb.ServerLiveResponse.FromString(await live(pb.ServerLiveRequest().SerializeToString(), timeout=5)).live
        assert await _grpc_live(grpc_port, ca, None) == grpc.StatusCode.OK  # and a new one, on the new certificate
        assert sidecar.metric("triton_sidecar_tls_cert_expiry_timestamp_seconds", cert_file=str(volume.cert_file)) \
            == pytest.approx(new.cert.not_valid_after_utc.timestamp())
    finally:
        long_lived.close()
        await channel.close()
        prober.cancel()
        await asyncio.gather(prober, return_exceptions=True)
        await probes.close()
    assert seen and set(seen) == {200}


async def test_a_connection_whose_request_goes_to_the_python_app_stays_encrypted_to_its_end(
        triton, start, ca, tmp_path):
    """With listen.front: rust, a chunked infer to a pinned version is handed over with its connection
    to the Python app behind the front; every answer on that connection still travels over TLS."""
    volume = SecretVolume(tmp_path / "secret")
    volume.install(server_cert(ca), ca)
    sidecar = await started_and_healthy(start, tls_config(triton, volume, grpc_port=False))
    x = features(rows=2, seed=11)
    want = _direct_scores(triton, x)
    body = json.dumps({"inputs": [{"name": "features", "shape": [2, 128], "datatype": "FP32",
                                   "data": x.tolist()}]}).encode()
    connection = await HttpsConnection.open(sidecar.server.port, client_context(ca))
    try:
        pinned, unpinned = "/v2/models/credit_risk/versions/1/infer", "/v2/models/credit_risk/infer"
        for path, chunked in ((pinned, True), (unpinned, False)):
            status, answer = await connection.request("POST", path, body, chunked=chunked)
            assert status == 200, answer
            scores = next(o for o in json.loads(answer)["outputs"] if o["name"] == "scores")
            assert np.allclose(np.array(scores["data"], dtype=np.float32).reshape(want.shape), want)
        status, metadata = await connection.request("GET", "/v2/models/credit_risk")
        assert status == 200 and [o["name"] for o in json.loads(metadata)["outputs"]] == ["scores"]
        assert sidecar.server.handovers >= 1
    finally:
        connection.close()
    await wait_for(lambda: sidecar.server.open_connections == 0, 10, what="the connection closed")


async def test_a_broken_renewal_is_refused_naming_the_file_and_the_old_certificate_stays(triton, start, ca, tmp_path):
    volume = SecretVolume(tmp_path / "secret")
    old = server_cert(ca)
    volume.install(old, ca)
    sidecar = await started_and_healthy(start, tls_config(triton, volume, grpc_port=False))
    port = sidecar.server.port
    with structlog.testing.capture_logs() as logs:
        volume.write(server_cert(ca).cert_pem, server_cert(ca).key_pem, ca.cert_pem)  # key of another cert
        await wait_for(lambda: sidecar.metric("triton_sidecar_reload_failures_total", what="tls") == 1, 5,
                       what="the broken pair refused")
    refused = [e for e in logs if e["event"] == "tls_reload_refused"]
    assert len(refused) == 1 and str(volume.key_file) in refused[0]["cause"]
    assert await served_serial(port, ca) == old.cert.serial_number
    assert _handshake_failures(sidecar, "other") == 0
    # The next good renewal goes through.
    fixed = server_cert(ca)
    volume.install(fixed, ca)
    await wait_for(lambda: sidecar.app[TLS].material.serial == fixed.cert.serial_number, 2, what="fixed pair loaded")
    assert await served_serial(port, ca) == fixed.cert.serial_number


async def test_min_version_1_3_refuses_a_tls_1_2_client_and_counts_it(triton, start, ca, tmp_path):
    volume = SecretVolume(tmp_path / "secret")
    volume.install(server_cert(ca), ca)
    rust_grpc = GRPC_FRONT == "rust"  # grpcio's credentials have no minimum version: only rustls' do
    config = tls_config(triton, volume, grpc_port=rust_grpc)
    config = replace(config, tls=replace(config.tls, min_version="1.3"))
    sidecar = await started_and_healthy(start, config)
    old_client = client_context(ca)
    old_client.maximum_version = ssl.TLSVersion.TLSv1_2
    assert await _https_status(sidecar.server.port, old_client) is None
    await wait_for(lambda: _handshake_failures(sidecar, "protocol_version") >= 1, 5, what="protocol_version counted")
    assert await _https_status(sidecar.server.port, client_context(ca)) == 200  # TLS 1.3 goes through
    if rust_grpc:
        old_h2 = client_context(ca, alpn=("h2",))
        old_h2.maximum_version = ssl.TLSVersion.TLSv1_2
        assert not await _handshake_completes(config.listen.grpc_port, old_h2)
        await wait_for(lambda: _handshake_failures(sidecar, "protocol_version") >= 2, 5,
                       what="protocol_version counted on gRPC")
        assert await _handshake_completes(config.listen.grpc_port, client_context(ca, alpn=("h2",)))
        assert await _grpc_live(config.listen.grpc_port, ca, None) == grpc.StatusCode.OK


async def _handshake_completes(port: int, context: ssl.SSLContext) -> bool:
    """Whether a TLS handshake with `context` completes on `port`."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=context,
                                                                   server_hostname="localhost"), 10)
    except (ssl.SSLError, ConnectionError):
        return False
    writer.close()
    return True


# -- mutual TLS ----------------------------------------------------------------------------------------------------


async def _https_status(port: int, context: ssl.SSLContext) -> int | None:
    """The status of one infer over a new connection, or None when the connection was refused."""
    try:
        connection = await HttpsConnection.open(port, context)
    except (ssl.SSLError, ConnectionError):
        return None
    try:
            return (await connection.request("POST", "/v2/models/credit_risk/infer",
                                         json.dumps(credit_json()).encode()))[0]
    except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
        return None
    finally:
        connection.close()


async def _grpc_live(port: int, ca: Issued, client: Issued | None,
                     metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    credentials = grpc.ssl_channel_credentials(
        ca.cert_pem, client.key_pem if client else None, client.cert_pem if client else None)
    async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
        try:
            await channel.unary_unary(f"/{SERVICE}/ServerLive")(pb.ServerLiveRequest().SerializeToString(), timeout=5,
                                                                metadata=metadata or None)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_mutual_tls_refuses_every_client_without_an_allowed_certificate_on_both_ports(
        triton, start, ca, tmp_path):
    volume = SecretVolume(tmp_path / "secret")
    volume.install(server_cert(ca), ca)
    config = tls_config(triton, volume, mutual=True, sans=(ALLOWED_SAN,))
    sidecar = await started_and_healthy(start, config)
    port, grpc_port = sidecar.server.port, config.listen.grpc_port
    allowed = issue(ca, "fraud-scorer", uris=(ALLOWED_SAN,), client=True)
    other_san = issue(ca, "batch-job", uris=("spiffe://bank.example/ns/batch/sa/job",), client=True)
    other_ca = issue(make_ca("another CA"), "fraud-scorer", uris=(ALLOWED_SAN,), client=True)
    folder = tmp_path / "clients"

    with structlog.testing.capture_logs() as logs:
        assert await _https_status(port, client_context(ca, allowed, folder)) == 200
    access = [e for e in logs if e["event"] == "proxy_request"]
    assert access and "CN=fraud-scorer" in access[-1]["client_subject"]
    assert all("PRIVATE KEY" not in str(e) for e in logs)

    assert await _https_status(port, client_context(ca)) is None
    await wait_for(lambda: _handshake_failures(sidecar, "no_client_certificate") >= 1, 5, what="no certificate")
    assert await _https_status(port, client_context(ca, other_ca, folder)) is None
    await wait_for(lambda: _handshake_failures(sidecar, "client_certificate_rejected") >= 1, 5, what="other CA")
    assert await _https_status(port, client_context(ca, other_san, folder)) is None
    await wait_for(lambda: _handshake_failures(sidecar, "client_san_not_allowed") >= 1, 5, what="SAN refused")

    with structlog.testing.capture_logs() as logs:
        assert await _grpc_live(grpc_port, ca, allowed) == grpc.StatusCode.OK
        # A subject the client names itself is never taken for its certificate's.
        assert await _grpc_live(grpc_port, ca, allowed, (("x-sidecar-client-subject", "CN=admin"),)) \
            == grpc.StatusCode.OK
    access = [e for e in logs if e["event"] == "proxy_request" and e["protocol"] == "grpc"]
    assert len(access) == 2 and all(e["client_subject"].startswith("CN=fraud-scorer") for e in access), access
    before = {reason: _handshake_failures(sidecar, reason) for reason in HANDSHAKE_REASONS}
    assert await _grpc_live(grpc_port, ca, None) == grpc.StatusCode.UNAVAILABLE
    assert await _grpc_live(grpc_port, ca, other_ca) == grpc.StatusCode.UNAVAILABLE
    if GRPC_FRONT == "rust":
        # rustls refuses the SAN in the handshake, as on listen.port, and counts every reason.
        with structlog.testing.capture_logs() as logs:
            assert await _grpc_live(grpc_port, ca, other_san) == grpc.StatusCode.UNAVAILABLE

            def refused() -> list[dict]:
                return [e for e in logs if e["event"] == "tls_client_refused" and e["protocol"] == "grpc"]
            await wait_for(lambda: bool(refused()), 5, what="the refusal logged")
        assert refused()[0]["client_subject"].startswith("CN=batch-job"), refused()
        for reason in ("no_client_certificate", "client_certificate_rejected", "client_san_not_allowed"):
            await wait_for(lambda r=reason: _handshake_failures(sidecar, r) > before[r], 5,  # type: ignore[misc]
                           what=f"{reason} counted on gRPC")
    else:  # grpcio cannot refuse a verified certificate in its handshake: the call is refused
        assert await _grpc_live(grpc_port, ca, other_san) == grpc.StatusCode.UNAUTHENTICATED

    # tritonclient.grpc with a client certificate: Triton's own answer.
    key_file, cert_file = folder / "allowed.key", folder / "allowed.crt"
    key_file.write_bytes(allowed.key_pem)
    cert_file.write_bytes(allowed.cert_pem)
    proxied = grpcclient_aio.InferenceServerClient(f"localhost:{grpc_port}", ssl=True,
                                                   root_certificates=str(volume.ca_file),
                                                   private_key=str(key_file), certificate_chain=str(cert_file))
    try:
        x = features(rows=1, seed=9)
        want = _direct_scores(triton, x)
        served = sidecar.server.grpc_served if GRPC_FRONT == "rust" else 0
        infers = 0

        async def inferred() -> bool:
            """One infer; on the Rust gRPC front, until its lane (not grpcio behind it) answered one."""
            nonlocal infers
            assert np.array_equal((await proxied.infer("credit_risk", _grpc_inputs(x))).as_numpy("scores"), want)
            infers += 1
            return GRPC_FRONT != "rust" or sidecar.server.grpc_served > served

        def infer_logged() -> list[dict]:
            return [e for e in logs if e["event"] == "proxy_request" and str(e.get("path", "")).endswith("/ModelInfer")]

        with structlog.testing.capture_logs() as logs:
            await wait_for(inferred, 10, what="a ModelInfer answered")
            # The Rust gRPC front's lane sends its access records up asynchronously: wait for them.
            await wait_for(lambda: len(infer_logged()) >= infers, 5, what="every ModelInfer's access record")
        # Passed through to grpcio or served by the lane: each record names the certificate's subject.
        assert all(e.get("client_subject", "").startswith("CN=fraud-scorer") for e in infer_logged()), infer_logged()
    finally:
        await proxied.close()

    # The kubelet presents no certificate: the probe port answers it in plaintext, and only it.
    probes = ProbeListener(sidecar.app)
    await probes.start("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{probes.port}"
        for path in ("/healthz", "/readyz"):
            async with sidecar.session.get(base + path) as answer:
                assert answer.status == 200
        async with sidecar.session.get(base + "/metrics") as answer:
            assert "triton_sidecar_tls_handshake_failures_total" in await answer.text()
        async with sidecar.session.post(base + "/v2/models/credit_risk/infer", json=credit_json()) as answer:
            assert answer.status == 404 and "probe port" in (await answer.json())["error"]
    finally:
        await probes.close()


async def test_record_reference_live_reaches_a_sidecar_behind_mutual_tls(triton, start, ca, tmp_path):
    """`record-reference --live` is the one command that talks to the sidecar's TLS port: it verifies
    the sidecar's certificate against --ca-file and presents --cert-file; without them it is refused."""
    volume = SecretVolume(tmp_path / "secret")
    volume.install(server_cert(ca), ca)
    config = tls_config(triton, volume, mutual=True, grpc_port=False, drift={"reference_dir": tmp_path / "reference"})
    sidecar = await started_and_healthy(start, config)
    port = sidecar.server.port
    recorder = issue(ca, "drift-recorder", client=True)
    cert, key = recorder.write(tmp_path, "recorder")
    out = tmp_path / "recorded"
    base = ["record-reference", "--model", "credit_risk", "--live", "500", "--sidecar-url", f"https://localhost:{port}",
            "--out", str(out), "--timeout", "60"]
    with_ca = [*base, "--ca-file", str(volume.ca_file)]

    # No client certificate: the handshake is refused, exit 1, nothing written.
    assert await asyncio.to_thread(main, with_ca) == 1
    await wait_for(lambda: _handshake_failures(sidecar, "no_client_certificate") >= 1, 5, what="no certificate")
    # A CA file that is not one: a usage error, before any connection.
    assert main([*base, "--ca-file", str(tmp_path / "missing.crt"), "--cert-file", str(cert),
                 "--key-file", str(key)]) == 2
    assert main([*with_ca, "--cert-file", str(cert)]) == 2  # a certificate without its key
    assert not out.exists()

    monitor = sidecar.app[SERVING].drift
    recording = asyncio.ensure_future(asyncio.to_thread(main, [*with_ca, "--cert-file", str(cert),
                                                               "--key-file", str(key)]))
    await wait_for(lambda: "credit_risk" in monitor.recorders, 10, what="the live recording registered")
    client = await HttpsConnection.open(port, client_context(ca, issue(ca, "scorer", client=True), tmp_path / "c"))
    try:
        for seed in range(32):  # 32 x 16 rows >= 500
            status, _ = await client.request("POST", "/v2/models/credit_risk/infer",
                                             json.dumps(credit_json(rows=16, seed=seed)).encode())
            assert status == 200
    finally:
        client.close()
    assert await asyncio.wait_for(recording, 30) == 0
    assert load_reference(out / "credit_risk.json").rows == 500


async def test_healing_works_as_ever_with_tls_on(triton, start, ca, tmp_path, fresh_model):
    volume = SecretVolume(tmp_path / "secret")
    volume.install(server_cert(ca), ca)
    config = tls_config(triton, volume, grpc_port=False, models=[fresh_model.name],
                        golden_dir=fresh_model.golden_dir)
    sidecar = await started_and_healthy(start, config)
    fresh_model.kill_stub()
    await wait_for(lambda: sidecar.first_transition_to(fresh_model.name, ModelState.HEALING) is not None, 30,
                   what="heal started")
    await wait_for(lambda: sidecar.state(fresh_model.name) is ModelState.HEALTHY, 60, what="healed")


def test_handshake_failures_are_labelled_with_a_bounded_reason():
    http_request = ssl.SSLError(1, "[SSL: HTTP_REQUEST] http request")
    http_request.reason = "HTTP_REQUEST"
    no_cert = ssl.SSLError(1, "peer did not return a certificate")
    no_cert.reason = "PEER_DID_NOT_RETURN_A_CERTIFICATE"
    odd = ssl.SSLError(1, "something new")
    odd.reason = "SOMETHING_NEW_IN_OPENSSL_4"
    cases = {
        http_request: "not_tls",
        no_cert: "no_client_certificate",
        ConnectionAbortedError("SSL handshake is taking longer than 10.0 seconds: aborting the connection"):
            "timeout",
        ConnectionResetError(): "client_closed",
        ssl.SSLEOFError(8, "EOF occurred in violation of protocol"): "client_closed",
        odd: "other",
    }
    for error, reason in cases.items():
        assert handshake_reason(error) == reason, error
        assert reason in HANDSHAKE_REASONS


def _https_post_16mb(port: int, ca_file: Path) -> tuple[int, dict]:
    """http.client over TLS writes the whole 16 MB body before it reads a byte of the answer."""
    connection = http.client.HTTPSConnection("localhost", port, timeout=60,
                                             context=ssl.create_default_context(cafile=str(ca_file)))
    try:
        connection.request("POST", "/v2/models/credit_risk/infer", body=b"\0" * (16 * 2**20),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


async def test_a_413_over_tls_is_read_by_a_client_that_writes_its_whole_body_first(triton, start, ca, tmp_path):
    # A TLS transport cannot half-close: the sidecar lingers reading the body all the same.
    volume = SecretVolume(tmp_path / "secret")
    volume.install(server_cert(ca), ca)
    sidecar = await started_and_healthy(start, tls_config(triton, volume, grpc_port=False,
                                                          validation={"max_body_bytes": 4 * 2**20}))
    status, doc = await asyncio.to_thread(_https_post_16mb, sidecar.server.port, volume.ca_file)
    assert status == 413 and doc["reason"] == "body_too_large", doc
    await wait_for(lambda: sidecar.server.open_connections == 0, 10, what="the connection closed")
