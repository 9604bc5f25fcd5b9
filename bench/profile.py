"""Where a process spends its time, sampled with py-spy (PyPI `py-spy`, not a project dependency:
`pip install py-spy`); used where a target is missed."""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def find_py_spy() -> str | None:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


def start_recording(pid: int, seconds: int, folded_path: Path, rate: int = 100) -> subprocess.Popen[bytes] | None:
    """Start `py-spy record` on `pid` for `seconds` (`rate` samples/s of the busy threads, folded
    stacks); None without py-spy."""
    binary = find_py_spy()
    if binary is None:
        return None
    return subprocess.Popen(
        [binary, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(rate),
         "--format", "raw", "--output", str(folded_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish_recording(process: subprocess.Popen[bytes] | None, timeout_s: float = 60) -> str | None:
    """Wait for py-spy; the error text when it failed (e.g. no ptrace permission), else None."""
    if process is None:
        return "py-spy is not installed"
    try:
        _, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return "py-spy did not finish"
    return None if process.returncode == 0 else err.decode(errors="replace")[-500:]


def summarise_folded(folded_path: Path, top: int = 20) -> dict[str, Any]:
    """Inclusive and self share of samples per function from py-spy's folded stacks
    (`frame;frame;frame count` per line, outermost frame first)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = waiting = 0
    for line in folded_path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        samples = int(count_text)
        frames = [_short_frame(f) for f in stack.split(";")]
        if frames[-1].startswith(_WAITING):
            waiting += samples  # the event loop waiting for I/O: not work
            continue
        total += samples
        for frame in set(frames):
            if not frame.endswith(_PLUMBING):
                inclusive[frame] += samples
        own[frames[-1]] += samples
    if not total:
        return {"samples": 0, "waiting_samples": waiting}
    return {
        "samples": total,
        "waiting_samples": waiting,
        "inclusive": [{"function": f, "share": round(n / total, 3)} for f, n in inclusive.most_common(top)],
        "self": [{"function": f, "share": round(n / total, 3)} for f, n in own.most_common(top)],
    }


#: Outer frames every sample passes through (the event loop, the CLI): not listed as inclusive.
_PLUMBING = ("(asyncio/runners.py)", "(asyncio/base_events.py)", "(asyncio/events.py)", "(sidecar/cli/run.py)",
             "(triton-sidecar)")
#: Leaf frames of a thread that waits (py-spy samples a blocked epoll_wait as active).
_WAITING = ("EpollSelector.select (", "select (selectors.py")


def _short_frame(frame: str) -> str:
    # py-spy writes "function (path/to/file.py:line)": keep the function and the file's last parts.
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, _ = where.rpartition(":")
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if parts else where
    return f"{name} ({short})"


def markdown(summary: dict[str, Any], rows: int = 12) -> str:
    if not summary.get("samples"):
        return "(no profile)\n"
    lines = [f"{summary['samples']} samples at work (shares below are of these; "
             f"{summary.get('waiting_samples', 0)} more waiting in epoll).", "",
             "| inclusive | function | | self | function |", "|---|---|---|---|---|"]
    for a, b in zip(summary["inclusive"][:rows], summary["self"][:rows], strict=False):
        lines.append(f"| {a['share']:.1%} | `{a['function']}` | | {b['share']:.1%} | `{b['function']}` |")
    return "\n".join(lines) + "\n"


def verdicts_and_profile_markdown(verdicts: list[dict[str, Any]], profile: dict[str, Any] | None) -> list[str]:
    """The lines an overhead benchmark's table ends with: each target met or not, then the profile."""
    lines: list[str] = []
    if verdicts:
        lines += ["", "| target | case | measured | met |", "|---|---|---|---|"]
        lines += [f"| {c['target']} | {c['case']} | {c['measured']} | {'yes' if c['met'] else '**no**'} |"
                  for c in verdicts]
    if profile:
        lines += ["", f"Profile of the sidecar ({profile.get('scenario', '')}, py-spy):", ""]
        lines.append(markdown(profile) if "error" not in profile else f"(no profile: {profile['error']})")
    return lines
