"""Drift reference files loaded at start and re-read on change, like golden files (in the same pass).

The serving core's drift monitor (sidecar.serving.drift) only parses references; the watching is the
reload machinery's (sidecar.health.reload.file_key: device, inode, mtime and size of what each name
resolves to, so a ConfigMap's symlink swap is seen). Both are wired here because serving and health
never import each other. A broken file is refused whole, at start (the start stops, the file and key
named) and at reload (logged, `reload_failures{what="drift_reference"}`, the last good references
of every model kept).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import structlog

from sidecar.config import ConfigError, DriftSection
from sidecar.health.reload import FileKey, file_key
from sidecar.metrics import SidecarMetrics
from sidecar.serving.drift import (
    DriftMonitor,
    Reference,
    ReferenceFileError,
    checked_reference,
    reference_files,
    reference_key,
)

log = structlog.get_logger("sidecar.drift")


def load_references(settings: DriftSection) -> dict[tuple[str, str], Reference]:
    """Every reference in drift.reference_dir, or ConfigError naming the broken file and key. A
    missing directory is no error: no model is measured."""
    try:
        return {reference_key(p): checked_reference(p) for p in reference_files(settings.reference_dir)}
    except ReferenceFileError as e:
        raise ConfigError(f"drift.reference_dir: {e}") from e


class ReferenceWatch:
    """Re-reads the reference directory when a file in it changes (or on `force`)."""

    def __init__(self, monitor: DriftMonitor, *, settings: Callable[[], DriftSection], metrics: SidecarMetrics) -> None:
        self.monitor = monitor
        self._settings = settings
        self._metrics = metrics
        self._seen = self._keys(settings().reference_dir)

    @staticmethod
    def _keys(directory: Path) -> tuple[Path, tuple[FileKey, ...]]:
        # The directory itself is part of the key: a reloaded config may point elsewhere.
        return directory, tuple(file_key(p) for p in reference_files(directory))

    def scan(self, *, force: bool = False) -> bool:
        """Load the directory if it changed; True when new references are in force."""
        directory = self._settings().reference_dir
        keys = self._keys(directory)
        if keys == self._seen and not force:
            return False
        self._seen = keys
        try:
            references = {reference_key(p): checked_reference(p) for p in reference_files(directory)}
        except (ReferenceFileError, OSError) as e:
            self.monitor.refused = str(e)
            self._metrics.reload_failures.labels(what="drift_reference").inc()
            log.error("drift_reference_refused", cause=str(e),
                      action="the last good references stay in force; fix the file to reload")
            return False
        self.monitor.refused = None
        self.monitor.replace_references(references)
        log.info("drift_references_loaded", reference_dir=str(directory),
                 models=sorted({model for model, _ in references}))
        return True

    def compare(self) -> None:
        """One pass of the reloader (sidecar.health.reload.LiveConfig.run, every RELOAD_POLL_S): load
        the directory if it changed; never raises (drift is advisory)."""
        try:
            self.scan()
        except Exception as e:
            log.error("drift_reference_refused", cause=f"unexpected error: {e!r}")
