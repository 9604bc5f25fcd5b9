"""Debian packages a benchmark needs (nginx, wrk), installed with apt-get when missing."""

from __future__ import annotations

import os
import shutil
import subprocess


class MissingTool(RuntimeError):
    """A Debian tool is missing and cannot be installed here (not root, or apt-get failed)."""


def ensure_debian_package(binary: str, package: str | None = None) -> str:
    """The path of `binary`, installing its Debian package first when it is not on PATH."""
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found:
        return found
    package = package or binary
    if os.geteuid() != 0:
        raise MissingTool(f"{binary} is missing: run `sudo apt-get install -y {package}` first")
    print(f"installing the Debian package {package} (apt-get) ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, text=True)
    install = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
                             env=env, capture_output=True, text=True)
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if install.returncode != 0 or not found:
        raise MissingTool(f"apt-get install {package} failed:\n{update.stderr[-500:]}{install.stderr[-1500:]}")
    return found
