"""A real Seldon MLServer (the same v2 protocol as Triton, another implementation) for the tests
that prove the sidecar guards any v2 server. MLServer lives in a virtualenv of its own
(`make test` builds `.venv-mlserver`): its pins (fastapi, pydantic, protobuf) are not ours."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from sidecar.devtools.tritonserver import free_port

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "tests" / "mlserver_models"
#: Where `make test` installs MLServer; SIDECAR_TEST_MLSERVER names another `mlserver` binary.
DEFAULT_BINARY = REPO / ".venv-mlserver" / "bin" / "mlserver"


def mlserver_binary() -> Path | None:
    binary = Path(os.environ.get("SIDECAR_TEST_MLSERVER", DEFAULT_BINARY))
    return binary if binary.exists() else None


class LocalMLServer:
    """`mlserver start` on a copy of tests/mlserver_models, on loopback ports of its own."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary = binary
        self.repository = workdir / "mlserver_models"
        shutil.copytree(MODELS, self.repository)
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.ports = SimpleNamespace(http=self.http_port, grpc=self.grpc_port)  # as LocalTriton's
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = workdir / "mlserver.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout_s: float = 60) -> LocalMLServer:
        # parallel_workers 0: the models run in the server process (its worker pool does not start
        # next to uvloop 0.23, and one process is all a test needs).
        (self.repository / "settings.json").write_text(json.dumps({
            "host": "127.0.0.1", "http_port": self.http_port, "grpc_port": self.grpc_port,
            "metrics_port": self.metrics_port, "parallel_workers": 0, "debug": False}))
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen([str(self.binary), "start", str(self.repository)], stdout=log,
                                             stderr=subprocess.STDOUT, cwd=self.repository, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"mlserver exited during start-up; log:\n{self.log_tail()}")
            if self.get("/v2/models/doubler/ready")[0] == 200:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"mlserver not ready after {timeout_s} s; log:\n{self.log_tail()}")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, OSError):
            return 0, b""

    def post(self, path: str, body: dict) -> tuple[int, object]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def index(self) -> dict[str, str]:
        _, entries = self.post("/v2/repository/index", {})
        return {e["name"]: e.get("state", "") for e in entries or []}  # type: ignore[union-attr]

    def inject(self, kind: str, model: str = "doubler") -> None:
        (self.repository / model / "fault").write_text(kind)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(5)
