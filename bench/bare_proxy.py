"""The floor of a proxy on the sidecar's own stack: dataplane/examples/bare_proxy.rs, hyper on one
current-thread tokio runtime passing every request through to Triton with no check at all.

`bench.dataplane --floor` runs it as one more leg (`bare`), HTTP/1.1 in front of Triton's HTTP port
and h2c in front of its gRPC port, so the throughput any proxy of this design can reach on this
machine is measured in the same run as the sidecar's, Envoy's and nginx's. Built on first use with
`cargo build --release --example bare_proxy` (the crate's release build: minutes the first time).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sidecar.devtools.tritonserver import free_port

CRATE = Path(__file__).resolve().parent.parent / "dataplane"


def build() -> Path:
    """The example's binary, built (or found up to date) by cargo."""
    env = {**os.environ}
    env.setdefault("PYO3_PYTHON", sys.executable)  # the lib's build script needs a Python
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "bare_proxy",
                    "--manifest-path", str(CRATE / "Cargo.toml")], check=True, env=env)
    return CRATE / "target" / "release" / "examples" / "bare_proxy"


class BareProxy:
    """One `bare_proxy MODE PORT UPSTREAM` process; `stop()` always ends it."""

    def __init__(self, binary: Path, *, mode: str, upstream_port: int, workdir: Path) -> None:
        self.binary, self.mode, self.upstream_port = binary, mode, upstream_port
        self.workdir = Path(workdir)
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("bare_proxy is not running")
        return self._process.pid

    def start(self, timeout_s: float = 10.0) -> BareProxy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / f"{self.mode}.log", "ab") as log:
            self._process = subprocess.Popen([str(self.binary), self.mode, str(self.port), str(self.upstream_port)],
                                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"bare_proxy exited: {(self.workdir / f'{self.mode}.log').read_text()[-1000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"bare_proxy {self.mode} not listening on {self.port} after {timeout_s:.0f} s")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
