"""The escalations to a restart, kept in a file that outlives the sidecar's process.

A restart of the pod's containers ends the sidecar's process too, and with it any count in memory: a
pod whose restarts do not help would look new after each one. `healing.escalation_record_file` puts
the record on an emptyDir (k8s/base/deployment.yaml: `sidecar-state`), which lives as long as the pod
and survives the restarts of its containers. The kubelet's downward API cannot stand in for it: it
exposes no container restart count.

The file is small JSON, rewritten whole through a temporary file and a rename, so a restart in the
middle of a write leaves the old record or the new one, never half of one. A record that cannot be
read is logged and started afresh: it must never stop the sidecar that guards the models.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from sidecar.config import ConfigError

log = structlog.get_logger("sidecar.healer")


#: Format of the file; a record of another version is started afresh rather than misread.
RECORD_VERSION = 1


@dataclass(frozen=True)
class PastEscalation:
    """One escalation to a restart, as the record keeps it."""

    #: Unix time (s): a monotonic clock does not survive the process.
    at: float
    cause: str
    evidence: str
    signature: str
    models: tuple[str, ...]


class EscalationRecord:
    """Every escalation of this pod so far: count by evidence and the last one."""

    def __init__(self, path: Path | None = None, *, wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.wall = wall
        self.by_cause: dict[str, int] = {}
        self.last: PastEscalation | None = None

    @classmethod
    def open(cls, setting: str, *, source: str = "defaults", wall: Callable[[], float] = time.time) -> EscalationRecord:
        """The record at `healing.escalation_record_file` ("" : in memory only), set in `source` (the
        config file). A folder that does not exist or cannot be written stops the start (ConfigError
        naming the file and key): the record would be lost at the first restart, silently."""
        if not setting:
            return cls(None, wall=wall)
        path = Path(setting)
        folder = path.parent
        key = f"{source}: key 'healing.escalation_record_file'"
        if not folder.is_dir():
            raise ConfigError(f"{key}: folder {folder} does not exist (mount an emptyDir there)")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(f"{key}: {path} cannot be written")
        record = cls(path, wall=wall)
        record._read()
        return record

    @property
    def count(self) -> int:
        return sum(self.by_cause.values())

    def add(self, escalation: PastEscalation) -> None:
        self.by_cause[escalation.evidence] = self.by_cause.get(escalation.evidence, 0) + 1
        self.last = escalation
        self._write()

    def seconds_since_last(self) -> float | None:
        return None if self.last is None else max(0.0, self.wall() - self.last.at)

    def _read(self) -> None:
        assert self.path is not None
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as e:
            log.error("escalation_record_unreadable", path=str(self.path), cause=str(e))
            return
        try:
            doc = json.loads(raw)
            if doc.get("version") != RECORD_VERSION:
                raise ValueError(f"version {doc.get('version')!r}, expected {RECORD_VERSION}")
            self.by_cause = {str(k): int(v) for k, v in doc["by_cause"].items()}
            last = doc.get("last")
            self.last = None if last is None else PastEscalation(
                at=float(last["at"]), cause=str(last["cause"]), evidence=str(last["evidence"]),
                signature=str(last["signature"]), models=tuple(str(m) for m in last["models"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.error("escalation_record_unreadable", path=str(self.path), cause=f"started afresh: {e}")
            self.by_cause, self.last = {}, None

    def _write(self) -> None:
        if self.path is None:
            return
        doc: dict[str, Any] = {"version": RECORD_VERSION, "by_cause": self.by_cause,
                               "last": asdict(self.last) if self.last is not None else None}
        scratch = self.path.with_name(self.path.name + ".tmp")
        try:
            scratch.write_text(json.dumps(doc))
            os.replace(scratch, self.path)
        except OSError as e:
            # The escalation goes on (the restart is what heals); only its memory is lost.
            log.error("escalation_record_unwritable", path=str(self.path), cause=str(e))
