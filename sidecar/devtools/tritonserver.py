"""Start and stop a real Triton Inference Server from the `nvidia-pytriton` wheel, CPU only.

Used by the demo, the test suite and the benchmarks. Production pods run Triton's own image; this
module exists so that every test and figure comes from the real server, not a fake.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: How long a stop may take before whoever asked is told what Triton is waiting for.
SLOW_STOP_NOTICE_S = 1.0

#: How long a start may take before we give up: a cold start with a few python models takes 2-3 s
#: here, a loaded CI machine several times that.
DEFAULT_START_TIMEOUT_S = 90.0


class TritonServerError(RuntimeError):
    """The local tritonserver could not be found, started or stopped."""


@dataclass(frozen=True)
class TritonInstallation:
    """Where the wheel put the server binary, its libraries and the python backend stub."""

    binary: Path
    backends: Path
    stub: Path
    libs: Path

    @classmethod
    def find(cls) -> TritonInstallation:
        try:
            import pytriton
        except ImportError as e:
            raise TritonServerError(
                "nvidia-pytriton is not installed: pip install 'triton-sidecar[triton]'"
            ) from e
        root = Path(pytriton.__file__).parent / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        site = Path(pytriton.__file__).parent.parent
        found = cls(
            binary=root / "bin" / "tritonserver",
            backends=root / "backends",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
            libs=site / "nvidia_pytriton.libs",
        )
        for path in (found.binary, found.backends, found.stub, found.libs):
            if not path.exists():
                raise TritonServerError(f"incomplete nvidia-pytriton install: {path} is missing")
        return found


def free_port() -> int:
    """A TCP port on loopback that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def pick(cls) -> TritonPorts:
        return cls(http=free_port(), grpc=free_port(), metrics=free_port())


class LocalTriton:
    """One tritonserver process on loopback, in explicit model-control mode.

    `start()` returns once `/v2/health/ready` answers 200; `stop()` ends the server and every python
    backend stub it started (they share its process group).
    """

    def __init__(
        self,
        *,
        model_repository: Path,
        models: list[str],
        workdir: Path | None = None,
        ports: TritonPorts | None = None,
        restricted_repository_header: tuple[str, str] | None = None,
        log_verbose: int = 0,
        exit_timeout_s: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        """`extra_args`: more tritonserver flags, after the ones set here (e.g. `--trace-config ...`)."""
        self.model_repository = Path(model_repository)
        self.models = list(models)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="tritonserver-"))
        self.ports = ports or TritonPorts.pick()
        self.restricted_repository_header = restricted_repository_header
        self.log_verbose = log_verbose
        # Triton's --exit-timeout-secs (its default: 30 s). On SIGTERM Triton waits up to this long
        # for every model to unload, and an instance whose python stub was killed never finishes
        # unloading: without a short bound a stop after such a fault waits out the whole 30 s.
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = tuple(extra_args)
        self.log_path = self.workdir / "tritonserver.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise TritonServerError("tritonserver is not running")
        return self._process.pid

    def is_ready(self) -> bool:
        """Triton answers 200 on /v2/health/ready (every loaded model ready, in strict mode)."""
        return _http_ok(f"{self.url}/v2/health/ready")

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _prepare_backends(self, install: TritonInstallation) -> Path:
        # The python backend looks for its stub next to itself, so it needs a writable copy.
        backends = self.workdir / "backends"
        if not backends.exists():
            shutil.copytree(install.backends, backends)
            shutil.copy2(install.stub, backends / "python" / "triton_python_backend_stub")
        return backends

    def command(self) -> list[str]:
        install = TritonInstallation.find()
        backends = self._prepare_backends(install)
        cmd = [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            f"--http-port={self.ports.http}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--allow-gpu-metrics=false",
            f"--log-verbose={self.log_verbose}",
        ]
        if self.exit_timeout_s is not None:
            cmd.append(f"--exit-timeout-secs={self.exit_timeout_s}")
        if self.restricted_repository_header:
            key, value = self.restricted_repository_header
            cmd.append(f"--http-restricted-api=model-repository:{key}={value}")
            cmd.append(f"--grpc-restricted-protocol=model-repository:{key}={value}")
        cmd += [f"--load-model={name}" for name in self.models]
        cmd += self.extra_args
        return cmd

    def _environment(self) -> dict[str, str]:
        install = TritonInstallation.find()
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p
        )
        # The stub embeds the system interpreter; give it this environment's numpy.
        site_packages = sysconfig.get_paths()["purelib"]
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (site_packages, env.get("PYTHONPATH", "")) if p
        )
        return env

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> LocalTriton:
        if self.is_running():
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,
            )
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise TritonServerError(
                    f"tritonserver exited during start-up{self._hint()}; last log lines:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.1)
        raise TritonServerError(
            f"tritonserver not ready after {timeout_s:.0f} s; last log lines:\n{self.log_tail()}"
        )

    def _hint(self) -> str:
        if "No module named 'numpy'" in self.log_tail(200):
            # The stub embeds Debian's Python in isolated mode: virtualenvs and PYTHONPATH are ignored.
            return " (the python backend stub needs Debian's numpy: apt-get install python3-numpy)"
        return ""

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server and its stubs at once, as a crash would."""
        if self._process is None:
            return
        _signal_group(self._process.pid, signal.SIGKILL)
        self._process.wait()

    def stop(self, grace_s: float = 10.0, *, on_slow_stop: Callable[[str], None] | None = None) -> None:
        """SIGTERM, then SIGKILL after `grace_s`. Past the first second `on_slow_stop` is told what
        Triton is still waiting for (from its log), so a person at a terminal is not left guessing."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            first_wait_s = min(grace_s, SLOW_STOP_NOTICE_S) if on_slow_stop else grace_s
            try:
                process.wait(first_wait_s)
            except subprocess.TimeoutExpired:
                if on_slow_stop is not None:
                    left_s = grace_s - first_wait_s
                    on_slow_stop(f"Triton (pid {process.pid}) is still stopping: {self.stop_waits_for()}; "
                                 f"it is killed in {left_s:.0f} s at most")
                    try:
                        process.wait(left_s)
                    except subprocess.TimeoutExpired:
                        pass
        # Stubs of hung models outlive the server; they share its process group.
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()

    def stop_waits_for(self) -> str:
        """What a stopping Triton waits for, in its own words (its last countdown line)."""
        for line in reversed(self.log_tail(10).splitlines()):
            if "Timeout" in line and "Found" in line:
                found = line.split("Found", 1)[1].strip().strip('"')
                if "live models" in found and not found.startswith("0 live"):
                    return (f"it waits for {found.split(' and ')[0]} to unload (an instance whose python "
                            "stub was killed never does)")
                return f"it waits for {found}"
        return "no word from it in its log yet"

    def __enter__(self) -> LocalTriton:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:  # noqa: S310 - loopback only
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stub_pids(model: str, parent: int | None = None, version: str = "1") -> list[int]:
    """PIDs of the python backend stub processes serving `version` of `model` (found by their
    command line), only those started by the tritonserver process `parent` when given."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not cmdline or not cmdline[0].endswith(b"triton_python_backend_stub"):
            continue
        if not any(arg.endswith(f"/{model}/{version}/model.py".encode()) for arg in cmdline):
            continue
        if parent is not None and _parent_pid(entry) != parent:
            continue
        pids.append(int(entry.name))
    return pids


def _parent_pid(proc_entry: Path) -> int:
    try:
        # The command name in /proc/PID/stat is in parentheses and may hold spaces.
        return int((proc_entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1

