"""The sidecar as production runs it: `triton-sidecar run --config FILE` in a process of its own, so
that its CPU time, RSS and descriptors can be read from /proc without the benchmark's own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from sidecar.devtools.tritonserver import LocalTriton, free_port

#: The credit_risk-like models' filtering rule: income_prob never leaves the pod.
CREDIT_FILTER_RULE = {"model": "credit_risk.*", "drop_outputs": ["income_prob"]}


class SidecarProcessError(RuntimeError):
    """The sidecar subprocess did not start, or did not become ready in time."""


def sidecar_settings(
    triton: LocalTriton, *, models: list[str], golden_dir: Path, port: int | None = None, **sections: Any
) -> dict[str, Any]:
    """A config file's content for a sidecar in front of `triton`, on loopback; `sections` are merged
    into the top-level keys (probes, healing, proxy, validation, filtering, logging, ...)."""
    settings: dict[str, Any] = {
        "triton": {"url": triton.url, "metrics_url": triton.metrics_url, "grpc_url": f"127.0.0.1:{triton.ports.grpc}"},
        "listen": {"host": "127.0.0.1", "port": port or free_port(), "grpc_port": 0},
        "golden_dir": str(golden_dir),
        "models": list(models),
        "logging": {"format": "json", "level": "info"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key] = {**settings[key], **value}
        else:
            settings[key] = value
    return settings


class SidecarProcess:
    """One `triton-sidecar run` child process in its own session; `stop()` always ends it."""

    def __init__(self, settings: dict[str, Any], workdir: Path, *, launcher: list[str] | None = None) -> None:
        self.settings = settings
        #: What runs `run --config FILE` (default: the venv's triton-sidecar; a benchmark may wrap it).
        self.launcher = launcher
        self.workdir = Path(workdir)
        self.config_path = self.workdir / "sidecar.yaml"
        self.log_path = self.workdir / "sidecar.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where readiness is asked: the plaintext probe port when there is one (TLS on the main port)."""
        listen = self.settings["listen"]
        return f"http://127.0.0.1:{listen.get('probe_port') or listen['port']}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise SidecarProcessError("the sidecar is not running")
        return self._process.pid

    def start(self, *, ready_timeout_s: float = 120.0, wait_ready: bool = True) -> SidecarProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.settings, sort_keys=False))
        launcher = self.launcher or [str(Path(sys.executable).parent / "triton-sidecar")]
        # Only the file configures it: SIDECAR_* variables of the caller's shell must not leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [*launcher, "run", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        try:
            if wait_ready:
                self.wait_ready(ready_timeout_s)
            else:
                self.wait_listening(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _get(self, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, None
        except (urllib.error.URLError, OSError, ValueError):
            return 0, None

    def status(self) -> dict[str, Any]:
        code, body = self._get("/status")
        if code != 200 or body is None:
            raise SidecarProcessError(f"/status answered {code}")
        return body

    def _wait(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise SidecarProcessError(f"the sidecar exited; last log lines:\n{self.log_tail()}")
            if predicate():
                return
            time.sleep(0.1)
        raise SidecarProcessError(f"the sidecar was not {what} after {timeout_s:.0f} s:\n{self.log_tail()}")

    def wait_listening(self, timeout_s: float) -> None:
        self._wait(lambda: self._get("/healthz")[0] in (200, 503), timeout_s, "listening")

    def wait_ready(self, timeout_s: float) -> None:
        """Until /readyz answers 200: every guarded model probed and HEALTHY."""
        self._wait(lambda: self._get("/readyz")[0] == 200, timeout_s, "ready")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # drains: readiness fails, in-flight requests finish
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
