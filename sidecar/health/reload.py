"""Golden files and configuration reloaded without a restart.

Kubernetes updates a ConfigMap volume in place by an atomic swap of its `..data` symlink; an
operator may also edit files or send SIGHUP. Every `RELOAD_POLL_S` (and at once on SIGHUP) the
golden directory and the config file are compared with what was last read: the device, inode, mtime
and size of the file each name resolves to (stat follows symlinks), so a symlink swap is seen as a
different file even when the new file's times are old.

What changed is loaded with the very loaders start-up uses (`load_model_dir`, `load_config`). A
model folder with a broken file is refused whole: an error log event and
`reload_failures{what="golden"}`, and the model keeps probing with its last good cases, because a
ConfigMap update is one change and half of it is not a case set anyone wrote. A config that does not
load is refused the same way (`what="config"`). Settings read once at start-up (ports, addresses,
Triton's URL and header, the proxy's pools, logging) are kept and logged as needing a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from sidecar.config import ConfigError, SidecarConfig, load_config
from sidecar.golden.cases import GoldenCase, GoldenFileError, golden_files, golden_model_dirs, load_model_dir
from sidecar.metrics import SidecarMetrics

log = structlog.get_logger("sidecar.reload")


#: How often (s) the files are compared: a ConfigMap update is seen within this (plus the
#: kubelet's own sync delay); each pass is a few stat() calls per file, nothing is read unless changed.
RELOAD_POLL_S = 1.0


#: Top-level keys read once at start-up: the sockets and their TLS settings (the certificate files
#: themselves are watched by sidecar.fronts.tls), the Triton client, the proxy's connection
#: pool and breakers, the logging setup, and the watched directory itself. A change is logged as
#: needing a restart and the running value is kept.
RESTART_ONLY = frozenset({"triton", "listen", "tls", "golden_dir", "proxy", "logging", "tracing"})


#: One file as last seen: name, and the device, inode, mtime (ns) and size of what it resolves to.
#: One stat() per file and pass (a realpath() would cost several more and tell nothing new: the
#: file behind a swapped symlink is another inode).
FileKey = tuple[str, int, int, int, int]


def file_key(path: Path) -> FileKey:
    try:
        st = os.stat(path)
        return (path.name, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        return (path.name, 0, 0, 0, -1)  # gone mid-swap: differs from any real file, so read again


#: A directory's listing is reused while the directory's own key is unchanged (creating, removing or
#: renaming an entry changes its mtime), but only a listing taken more than this (s) after that mtime:
#: an entry created in the same timestamp tick as the listing would leave the mtime as it was.
LISTING_TRUST_S = 1.0


class DirectoryListings:
    """Directory listings kept between reload passes. Listing the golden folders was most of what a
    pass cost (one scandir per model folder every second: about 0.1 % of a core at 10 models, half
    the gap to issue 18's idle target); a stat of the folder tells whether its entries changed."""

    def __init__(self) -> None:
        self._kept: dict[Path, tuple[FileKey, list[Path]]] = {}

    def list(self, directory: Path, lister: Callable[[Path], list[Path]], *, force: bool = False) -> list[Path]:
        """`lister(directory)`, or the entries it gave last time if the directory has not changed."""
        key = file_key(directory)
        kept = self._kept.get(directory)
        if kept is not None and kept[0] == key and not force:
            return kept[1]
        listed_at_ns = time.time_ns()
        entries = lister(directory)
        if key[4] >= 0 and listed_at_ns - key[3] > LISTING_TRUST_S * 1e9:
            self._kept[directory] = (key, entries)
        else:
            self._kept.pop(directory, None)  # gone, or changed too recently to trust its mtime
        return entries

    def keep_only(self, directories: set[Path]) -> None:
        """Forget the listings of directories no longer watched."""
        for directory in set(self._kept) - directories:
            del self._kept[directory]


@dataclass(frozen=True)
class GoldenRefusal:
    """A model folder the last reload refused; the model kept its previous cases."""

    error: str
    #: time.time() of the refusal.
    at: float


class GoldenStore:
    """The golden cases in force, by model, and when each model's files were last loaded.

    `cases` is the one mapping the prober and the serving core read; a reload replaces a model's
    tuple of cases whole (never edits a case), so a probe round already running keeps a consistent set.
    """

    def __init__(self, golden_dir: Path, cases: Mapping[str, Sequence[GoldenCase]], *, metrics: SidecarMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.golden_dir = golden_dir
        self._metrics = metrics
        self._clock = clock
        # What is on disk now stands for `cases` (loaded by the caller just before): a file changed
        # in between is not seen until it changes again or SIGHUP forces a full reload.
        self._seen: dict[str, tuple[FileKey, ...]] = {}
        for model_dir in golden_model_dirs(golden_dir):
            try:
                self._seen[model_dir.name] = tuple(file_key(p) for p in golden_files(model_dir))
            except OSError:
                continue
        self.cases: dict[str, tuple[GoldenCase, ...]] = {m: tuple(c) for m, c in cases.items()}
        now = clock()
        self.loaded_at: dict[str, float] = {m: now for m in self.cases}
        self.refused: dict[str, GoldenRefusal] = {}
        self._listings = DirectoryListings()

    def cases_for(self, model: str) -> Sequence[GoldenCase]:
        return self.cases.get(model, ())

    def scan(self, *, force: bool = False) -> list[str]:
        """Load what changed on disk (everything when `force`); the models whose cases changed."""
        changed: list[str] = []
        present = {d.name: d for d in self._listings.list(self.golden_dir, golden_model_dirs, force=force)}
        self._listings.keep_only({self.golden_dir, *present.values()})
        for model in sorted(set(self._seen) - set(present)):
            del self._seen[model]
            self.refused.pop(model, None)
            if self.cases.pop(model, None) is not None:
                self.loaded_at[model] = self._clock()
                changed.append(model)
                log.info("golden_files_removed", model=model, golden_dir=str(self.golden_dir))
        for model, model_dir in present.items():
            try:
                key = tuple(file_key(p) for p in self._listings.list(model_dir, golden_files, force=force))
            except OSError:
                continue  # the folder went away between listing and reading: next pass sees it
            if not force and self._seen.get(model) == key:
                continue
            self._seen[model] = key
            try:
                cases = load_model_dir(model_dir)
            except (GoldenFileError, OSError) as e:
                self._refuse(model, str(e))
                continue
            self.refused.pop(model, None)
            self.cases[model] = cases
            self.loaded_at[model] = self._clock()
            changed.append(model)
            log.info("golden_files_loaded", model=model, golden_cases=len(cases), cases=[c.name for c in cases])
        return changed

    def _refuse(self, model: str, error: str) -> None:
        kept = len(self.cases.get(model, ()))
        self.refused[model] = GoldenRefusal(error, self._clock())
        self._metrics.reload_failures.labels(what="golden").inc()
        log.error("golden_reload_refused", model=model, cause=error, kept_cases=kept,
                  action=f"model {model} keeps its {kept} last good case(s); fix the file to reload")


def merge_reloadable(current: SidecarConfig, new: SidecarConfig) -> tuple[SidecarConfig, list[str]]:
    """`new` with every start-up-only key of `current` kept, and the dotted keys that differ there."""
    taken: dict[str, Any] = {}
    needs_restart: list[str] = []
    for f in dataclasses.fields(SidecarConfig):
        if f.name == "source":
            continue
        old, fresh = getattr(current, f.name), getattr(new, f.name)
        if old == fresh:
            continue
        if f.name in RESTART_ONLY:
            needs_restart.extend(_changed_keys(f.name, old, fresh))
        else:
            taken[f.name] = fresh
    if current.listen.grpc_port and current.validation.max_body_bytes != new.validation.max_body_bytes:
        # HTTP reads the new limit at once; the gRPC server's message limit is a channel argument
        # gRPC core took when the server was built (sidecar.fronts.grpc_server.server_options).
        needs_restart.append("validation.max_body_bytes")
    if current.healing.escalation_record_file != new.healing.escalation_record_file:
        # The record is opened once, at start (sidecar.health.escalation_record): a record moved while
        # running would split the count it exists to keep.
        needs_restart.append("healing.escalation_record_file")
    return dataclasses.replace(current, **taken), needs_restart


def _changed_keys(name: str, old: Any, new: Any) -> list[str]:
    if dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new):
        return [f"{name}.{f.name}" for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]
    return [name]


class LiveConfig:
    """The configuration and golden cases in force now. A reload builds a new frozen config and
    swaps it in here; every part that may change reads `live.config` when it needs it, and the
    parts that copied a section at start (prober, healer, states, serving core) are handed the new
    one by `apply` (sidecar.app)."""

    def __init__(self, config: SidecarConfig, *, golden: GoldenStore, metrics: SidecarMetrics,
                 path: Path | None = None, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.golden = golden
        self.path = path
        self._environ = environ
        self._metrics = metrics
        self._clock = clock
        self.loaded_at = clock()
        #: Dotted keys changed in the file that only a restart applies.
        self.needs_restart: tuple[str, ...] = ()
        self._seen = file_key(path) if path is not None else None
        self._trigger = asyncio.Event()

    def request_reload(self) -> None:
        """SIGHUP: re-read every file now, changed or not (also re-reads request schema files)."""
        self._trigger.set()

    def refuse(self, what: str, cause: str) -> None:
        self._metrics.reload_failures.labels(what=what).inc()
        log.error("reload_refused", what=what, cause=cause, action="the running configuration is kept")

    def read_config(self, *, force: bool = False) -> SidecarConfig | None:
        """The config to swap in when the file changed (or `force`), else None; a file that does not
        load is refused (logged, counted) and None returned."""
        if self.path is None:
            return None
        key = file_key(self.path)
        if not force and key == self._seen:
            return None
        self._seen = key
        try:
            new = load_config(self.path, self._environ)
        except ConfigError as e:
            self.refuse("config", str(e))
            return None
        merged, needs_restart = merge_reloadable(self.config, new)
        if needs_restart and tuple(needs_restart) != self.needs_restart:
            log.warning("config_needs_restart", keys=needs_restart, config=str(self.path),
                        cause="these settings are read once at start-up; the running values are kept")
        self.needs_restart = tuple(needs_restart)
        if merged == self.config and not force:
            return None
        return merged

    def commit(self, config: SidecarConfig) -> None:
        changed = [f.name for f in dataclasses.fields(SidecarConfig)
                   if getattr(config, f.name) != getattr(self.config, f.name)]
        self.config = config
        self.loaded_at = self._clock()
        log.info("config_reloaded", config=str(self.path), changed=changed)

    async def run(self, *, apply_config: Callable[[SidecarConfig], None],
                  golden_changed: Callable[[list[str]], None], poll_s: float = RELOAD_POLL_S,
                  also_compare: Callable[[], None] | None = None) -> None:
        """Compare the files every `poll_s` and at once on SIGHUP; never ends on an error, because the
        sidecar must keep guarding with what it has. `also_compare` (never raising) compares other
        watched files in the same pass (the drift references): one timer for all of them rather than
        a loop each (issue 18's idle budget, bench/RESULTS.md §4c)."""
        while True:
            try:
                async with asyncio.timeout(poll_s):
                    await self._trigger.wait()
            except TimeoutError:
                pass
            force = self._trigger.is_set()
            self._trigger.clear()
            if force:
                log.info("reload_requested", cause="SIGHUP")
            self.reload_once(apply_config=apply_config, golden_changed=golden_changed, force=force)
            if also_compare is not None:
                also_compare()

    def reload_once(self, *, apply_config: Callable[[SidecarConfig], None],
                    golden_changed: Callable[[list[str]], None], force: bool = False) -> None:
        try:
            config = self.read_config(force=force)
            if config is not None:
                try:
                    apply_config(config)  # raises before changing anything if a schema file is broken
                except ConfigError as e:
                    self.refuse("config", str(e))
                else:
                    self.commit(config)
        except Exception as e:  # a reload bug must not stop the guarding
            self.refuse("config", f"unexpected error: {e!r}")
        try:
            changed = self.golden.scan(force=force)
            if changed:
                golden_changed(changed)
        except Exception as e:  # same: keep the last good cases and go on
            self.refuse("golden", f"unexpected error: {e!r}")

