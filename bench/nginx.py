"""Debian's nginx as a plain reverse proxy in front of Triton: the floor a proxy can approach.

Configured from scratch in a temp dir (no /etc/nginx), loopback only, `daemon off` as a child
process in its own session, one worker (the sidecar has one event loop too), keep-alive to Triton.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.debian import ensure_debian_package
from sidecar.devtools.tritonserver import free_port

NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    # Bodies up to 8 MiB stay in memory: a 256x128 FP32 JSON request is about 300 KB, and a temp
    # file write per request would measure the disk, not the proxy.
    client_max_body_size 64m;
    client_body_buffer_size 8m;
    proxy_buffer_size 64k;
    proxy_buffers 16 64k;
    keepalive_requests 1000000;
    upstream triton {{
        server 127.0.0.1:{upstream_port};
        keepalive 32;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://triton;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


class NginxProxy:
    """`nginx -c <generated conf>` in front of 127.0.0.1:upstream_port; `stop()` always ends it."""

    def __init__(self, *, upstream_port: int, workdir: Path) -> None:
        self.binary = ensure_debian_package("nginx")
        self.upstream_port = upstream_port
        self.workdir = Path(workdir)
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("nginx is not running")
        return self._process.pid

    def start(self, timeout_s: float = 10.0) -> NginxProxy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o755)  # the worker drops root; it must still reach its temp dirs
        conf = self.workdir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(workdir=self.workdir, port=self.port, upstream_port=self.upstream_port))
        with open(self.workdir / "stdout.log", "ab") as log:
            self._process = subprocess.Popen(
                [self.binary, "-c", str(conf), "-p", str(self.workdir), "-e", str(self.workdir / "error.log")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise RuntimeError(f"nginx exited: {(self.workdir / 'error.log').read_text()[-1000:]}")
                try:
                    with urllib.request.urlopen(f"{self.url}/v2/health/live", timeout=1):
                        return self
                except urllib.error.HTTPError:
                    return self  # nginx answers: the proxy is up, whatever Triton says
                except (urllib.error.URLError, OSError):
                    time.sleep(0.05)
            raise RuntimeError(f"nginx not answering on {self.url} after {timeout_s:.0f} s")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)  # the master and its worker share the session
            except ProcessLookupError:
                break
            try:
                process.wait(5)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(process.pid, signal.SIGKILL)  # a worker may outlive its master
        except ProcessLookupError:
            pass
        process.wait()
