"""Whose fault a failed probe round shows: one model's, which a reload heals, or Triton's process's,
which only a restart heals. Pure logic: no I/O, no clock of its own.

A reload replaces a model's instance; it cannot replace what the instance runs in. A CUDA context
broken by a sticky error (an illegal memory access, a device-side assert: every later CUDA call in
the process fails), or a Triton that fails every model at once, outlives any number of reloads, and
each reload of a large model costs minutes. The evidence that a fault is the process's, in the order
it is asked:

- `sticky_error`: Triton's error text names a sticky CUDA error (`STICKY_CUDA_ERRORS` in
  sidecar.protocol.triton_errors) or matches `healing.process_fault_patterns`;
- `breadth`: at least `healing.process_fault_min_models` guarded models failed within one probe
  interval with the same Triton error (the same error answer, model names and numbers aside, or no
  answer at all);
- `device`: every guarded model of one device (two or more) failed so;
- `history`: after a reload (a fresh instance), the model failed again with the same CUDA error.

A wrong answer (NaN, drift), a model that is not ready, metadata that changed and Triton's verdict on
one dead stub are a model's own faults: they are never shared evidence.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sidecar.health.probe_round import GOLDEN, METADATA, RoundResult
from sidecar.protocol.triton_errors import mentions_cuda, sticky_error

#: Longest signature kept: enough to tell two errors apart, short enough for a log line.
MAX_SIGNATURE_CHARS = 200


#: Signature of a probe that got no answer within probes.timeout_s: hangs of different models look alike.
NO_ANSWER = "no answer within the probe timeout"


class Evidence(str, enum.Enum):
    """What decided that a fault is the process's (the `cause` label of the escalations metric)."""

    STICKY_ERROR = "sticky_error"
    BREADTH = "breadth"
    DEVICE = "device"
    HISTORY = "history"


@dataclass(frozen=True)
class Failure:
    """What one failed round says about where its fault lives."""

    model: str
    #: clock() when the round was judged.
    at: float
    #: Triton's error as two models' errors compare: the model's name and numbers masked, lower case;
    #: "" for a model's own fault (a wrong answer, not ready, Triton's verdict on its stub).
    signature: str
    #: What failed, in Triton's words where it answered an error (for people: logs, /status).
    error: str
    #: The sticky error Triton's text names, or "".
    sticky: str = ""


@dataclass(frozen=True)
class Verdict:
    """The supervisor's verdict on an UNHEALTHY model: reload it (evidence None) or restart Triton."""

    model: str
    evidence: Evidence | None
    #: Every guarded model the evidence names (the model itself first).
    models: tuple[str, ...]
    signature: str
    error: str
    cause: str

    @property
    def process(self) -> bool:
        return self.evidence is not None


def signature(model: str, message: str, status: int = 0) -> str:
    """Triton's error as it compares across models: 'faulty_0_0' and 'other_0_0' alike."""
    text = re.sub(rf"(?<![a-z0-9]){re.escape(model.lower())}(?![a-z0-9])", "<model>", message.lower())
    text = re.sub(r"\s+", " ", re.sub(r"\d+", "#", text)).strip()
    return (f"{status} {text}" if status else text)[:MAX_SIGNATURE_CHARS]


def failure_of(model: str, result: RoundResult, *, at: float,
               patterns: Sequence[re.Pattern[str]] = ()) -> Failure | None:
    """The failure of a round, or None when it passed or could not judge the model."""
    if not result.conclusive:
        return None
    failed = result.failure
    if failed is None:
        return None
    shared = failed.probe in (GOLDEN, METADATA) and not failed.final
    if failed.error:
        sticky = sticky_error(failed.error, patterns) or ""
        if sticky:
            return Failure(model, at, f"sticky: {sticky}", failed.error, sticky)
        found = signature(model, failed.error, failed.status) if shared else ""
        return Failure(model, at, found, failed.error)
    if failed.timed_out and shared:
        return Failure(model, at, NO_ANSWER, failed.detail)
    return Failure(model, at, "", failed.detail)


def judge(failure: Failure, latest: Mapping[str, Failure | None], *, since: float, window_s: float,
          min_models: int, devices: Mapping[str, frozenset[str]]) -> Verdict:
    """The verdict on `failure`'s model, UNHEALTHY since `since` (clock()), given every guarded model's
    latest round (`latest`: None for a round that passed) and the devices each model's instances run on
    (empty when unknown). Other models count when they failed the same way within `window_s` (one
    probe interval) of this model's first failure, or later."""
    alike = [failure.model]
    if failure.signature:
        alike += sorted(m for m, f in latest.items()
                        if m != failure.model and f is not None and f.signature == failure.signature
                        and f.at >= since - window_s)
    models = tuple(alike)
    error = _short(failure.error)
    if failure.sticky:
        return Verdict(failure.model, Evidence.STICKY_ERROR, models, failure.signature, failure.error,
                       f"Triton's error names a sticky error ({failure.sticky!r}): every later call in Triton's "
                       f"process fails the same way, so a reload cannot help: {error}")
    if failure.signature and len(models) >= min_models:
        return Verdict(failure.model, Evidence.BREADTH, models, failure.signature, failure.error,
                       f"{len(models)} guarded models ({', '.join(models)}) failed within one probe interval with "
                       f"the same error, so the fault is Triton's, not one model's: {error}")
    if failure.signature and len(models) >= 2:
        for device in sorted(devices.get(failure.model, frozenset())):
            on_device = sorted(m for m, found in devices.items() if device in found)
            if len(on_device) >= 2 and set(on_device) <= set(models):
                return Verdict(failure.model, Evidence.DEVICE, tuple(on_device), failure.signature, failure.error,
                               f"every guarded model on device {device} ({', '.join(on_device)}) failed with the "
                               f"same error: {error}")
    return Verdict(failure.model, None, (failure.model,), failure.signature, failure.error,
                   "the model's own fault: a reload heals it")


def judge_after_reload(before: Failure, after: Failure) -> Verdict | None:
    """A process-level verdict when a fresh instance failed as the old one did with a CUDA error (a
    CUDA error that survives a reload lives in the process's context), else None."""
    if not after.signature or after.signature != before.signature:
        return None
    if not (before.sticky or mentions_cuda(before.error)):
        return None
    return Verdict(before.model, Evidence.HISTORY, (before.model,), before.signature, after.error,
                   f"a reload did not help: the fresh instance failed with the same CUDA error, which lives in "
                   f"Triton's process: {_short(after.error)}")


def devices_of(model_config: Mapping[str, object]) -> frozenset[str]:
    """The devices a model's instances run on, from Triton's model config (`instance_group`): `gpu:N`
    for each GPU named, `cpu` for CPU instances; empty when the config does not say."""
    found: set[str] = set()
    groups = model_config.get("instance_group")
    for group in groups if isinstance(groups, list) else ():
        if not isinstance(group, dict):
            continue
        kind = group.get("kind")
        if kind == "KIND_CPU":
            found.add("cpu")
        elif kind == "KIND_GPU":
            found.update(f"gpu:{g}" for g in group.get("gpus") or ())
    return frozenset(found)


def _short(text: str) -> str:
    return text if len(text) <= MAX_SIGNATURE_CHARS else text[:MAX_SIGNATURE_CHARS] + "..."
