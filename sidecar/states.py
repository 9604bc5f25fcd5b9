"""Per-model health state machine. Pure logic: no I/O, no clock of its own, no aiohttp.

    UNKNOWN -> WARMING -> HEALTHY <-> DEGRADED -> UNHEALTHY -> HEALING -> HEALTHY
                                                               HEALING -> FAILED (healing exhausted)
                                                               HEALING -> UNHEALTHY (a reload did not help:
                                                                          Triton's process is at fault)

DEGRADED means "failed fewer than failure_threshold rounds in a row": still served, still ready.
A failure Triton itself declares final (a dead python stub) skips the threshold: no further round
can pass before a reload, so counting them only delays the heal.
FAILED is terminal for this process: only a restart (kubelet, via /healthz) moves on from it.

SUSPECT is not a state but a flag beside it: a golden round just failed and its confirmation round
(run at once, not an interval later) is under way. The state does not move for it (the model is
still served while DEGRADED); a listener may hold requests until the confirmation decides.

Every time comes from the clock `ModelStates` is given: no time is read here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class ModelState(str, enum.Enum):
    UNKNOWN = "UNKNOWN"
    WARMING = "WARMING"
    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"
    UNHEALTHY = "UNHEALTHY"
    HEALING = "HEALING"
    FAILED = "FAILED"

    @property
    def serves_traffic(self) -> bool:
        """States whose answers we trust: the pod is ready and the proxy forwards."""
        return self in (ModelState.HEALTHY, ModelState.DEGRADED)

    @property
    def quarantined(self) -> bool:
        """States in which the proxy refuses the model's inference traffic."""
        return self in (ModelState.UNHEALTHY, ModelState.HEALING, ModelState.FAILED)


@dataclass(frozen=True)
class Transition:
    model: str
    state_from: ModelState
    state_to: ModelState
    cause: str
    at: float
    #: For a return to HEALTHY after failures: seconds since the first failed probe.
    recovered_after_s: float | None = None


class ModelHealth:
    """The state of one model, moved by probe rounds and heal outcomes."""

    def __init__(self, model: str, *, failure_threshold: int, success_threshold: int) -> None:
        self.model = model
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.state = ModelState.UNKNOWN
        self.since = 0.0
        self.cause = "not probed yet"
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.first_failure_at: float | None = None
        #: While not serving: the versions the failing probes blame, the others still answer
        #: correctly (empty = the whole model is untrusted).
        self.broken_versions: frozenset[str] = frozenset()
        #: The version unversioned requests reach (the server's routing; "" = not known).
        self.default_version = ""
        #: Every version the server has loaded (from the model's metadata; empty = not known): the
        #: versions an unpinned request may fall back to (sidecar.serving.routing).
        self.loaded_versions: tuple[str, ...] = ()
        #: A confirmation round runs after a failed one (see the module docstring).
        self.suspect = False

    def trusts(self, version: str) -> bool:
        """May a request for `version` ("" = unversioned) be served? While the model is quarantined
        for one version's failures, the others are still trusted, except during a heal (the reload
        takes every version down)."""
        if self.state.serves_traffic:
            return True
        if not self.broken_versions or self.state not in (ModelState.UNHEALTHY, ModelState.FAILED):
            return False
        reached = version or self.default_version
        return bool(reached) and reached not in self.broken_versions

    def untrusted_versions(self) -> frozenset[str] | None:
        """The versions a pinned request may not be served now (as `trusts` judges a version by
        name): empty while the model serves traffic, the broken ones while it is quarantined for
        theirs alone, None when every version is untrusted (the whole model)."""
        if self.state.serves_traffic:
            return frozenset()
        if not self.broken_versions or self.state not in (ModelState.UNHEALTHY, ModelState.FAILED):
            return None
        return self.broken_versions

    def _move(self, to: ModelState, cause: str, now: float) -> Transition | None:
        if to is self.state:
            self.cause = cause
            return None
        recovered_after = None
        if to is ModelState.HEALTHY and self.first_failure_at is not None:
            recovered_after = now - self.first_failure_at
            self.first_failure_at = None
        transition = Transition(self.model, self.state, to, cause, now, recovered_after)
        self.state, self.since, self.cause = to, now, cause
        return transition

    def begin_warmup(self, now: float) -> Transition | None:
        if self.state is not ModelState.UNKNOWN:
            return None
        return self._move(ModelState.WARMING, "first probe round started", now)

    def probe_passed(self, now: float) -> Transition | None:
        if self.state in (ModelState.HEALING, ModelState.FAILED):
            return None  # the healer owns these states
        self.broken_versions = frozenset()
        self.consecutive_failures = 0
        self.consecutive_successes += 1
        if self.state in (ModelState.UNKNOWN, ModelState.WARMING):
            return self._move(ModelState.HEALTHY, "all probes passed", now)
        if self.state is ModelState.HEALTHY:
            return None
        if self.consecutive_successes >= self.success_threshold:
            return self._move(ModelState.HEALTHY, f"probes passed {self.consecutive_successes} time(s) in a row", now)
        return None

    def probe_failed(self, cause: str, now: float, *, final: bool = False,
                     versions: frozenset[str] = frozenset()) -> Transition | None:
        """`final`: Triton said the fault lasts until a reload (see the module docstring).
        `versions`: the versions the failure is confined to (empty: the whole model)."""
        if self.state in (ModelState.HEALING, ModelState.FAILED):
            return None
        self.broken_versions = versions
        self.consecutive_successes = 0
        self.consecutive_failures += 1
        if self.first_failure_at is None:
            self.first_failure_at = now
        if final or self.consecutive_failures >= self.failure_threshold:
            return self._move(ModelState.UNHEALTHY, cause, now)
        if self.state in (ModelState.UNKNOWN, ModelState.WARMING):
            # Still warming up: not served yet, so nothing to degrade; keep counting.
            return self._move(ModelState.WARMING, cause, now)
        return self._move(ModelState.DEGRADED, cause, now)

    def heal_started(self, cause: str, now: float) -> Transition | None:
        if self.state is ModelState.FAILED:
            return None
        return self._move(ModelState.HEALING, cause, now)

    def heal_succeeded(self, cause: str, now: float) -> Transition | None:
        self.broken_versions = frozenset()
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        return self._move(ModelState.HEALTHY, cause, now)

    def await_restart(self, cause: str, now: float) -> Transition | None:
        """A process-level fault was escalated to a restart of Triton: quarantined, not reloaded (the
        restart reloads every model). UNHEALTHY, not FAILED: nothing is wrong with the model's artefact."""
        if self.state is ModelState.FAILED:
            return None
        return self._move(ModelState.UNHEALTHY, cause, now)

    def fail(self, cause: str, now: float) -> Transition | None:
        """Healing is exhausted or the model flaps: give up until a restart."""
        return self._move(ModelState.FAILED, cause, now)


TransitionListener = Callable[[Transition], None]


#: Told (model, suspect) when a confirmation round starts (True) and when it has decided (False).
SuspectListener = Callable[[str, bool], None]


class ModelStates:
    """The health of every guarded model; tells a listener about each transition."""

    def __init__(self, *, failure_threshold: int, success_threshold: int,
                 clock: Callable[[], float], listener: TransitionListener | None = None) -> None:
        self._models: dict[str, ModelHealth] = {}
        self._failure_threshold = failure_threshold
        self._success_threshold = success_threshold
        self._clock = clock
        self._listeners: list[TransitionListener] = [listener] if listener else []
        self._suspect_listeners: list[SuspectListener] = []
        self._release_listeners: list[Callable[[str], None]] = []

    def add_listener(self, listener: TransitionListener) -> None:
        self._listeners.append(listener)

    def add_suspect_listener(self, listener: SuspectListener) -> None:
        self._suspect_listeners.append(listener)

    def add_release_listener(self, listener: Callable[[str], None]) -> None:
        """Told the model's name once it is no longer tracked (`forget`)."""
        self._release_listeners.append(listener)

    def now(self) -> float:
        """The clock every state time is read from (time.monotonic in production)."""
        return self._clock()

    def set_suspect(self, model: str, suspect: bool) -> None:
        """Flag (or clear) a running confirmation round; listeners hear of changes only."""
        health = self._models.get(model)
        if health is None or health.suspect is suspect:
            return
        health.suspect = suspect
        for listener in self._suspect_listeners:
            listener(model, suspect)

    def track(self, model: str) -> ModelHealth:
        if model not in self._models:
            self._models[model] = ModelHealth(
                model, failure_threshold=self._failure_threshold, success_threshold=self._success_threshold
            )
        return self._models[model]

    def forget(self, model: str) -> None:
        """Stop tracking a model that is no longer guarded (released, not failed); what waits on the
        model (held requests, open streams) hears of it, as it would of a transition."""
        if self._models.pop(model, None) is not None:
            for listener in self._release_listeners:
                listener(model)

    def reconfigure(self, *, failure_threshold: int, success_threshold: int) -> None:
        """New thresholds from a reloaded config, for every model now and later; counts so far stay."""
        self._failure_threshold, self._success_threshold = failure_threshold, success_threshold
        for health in self._models.values():
            health.failure_threshold, health.success_threshold = failure_threshold, success_threshold

    def __contains__(self, model: object) -> bool:
        return model in self._models

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def get(self, model: str) -> ModelHealth | None:
        return self._models.get(model)

    def names(self) -> list[str]:
        return sorted(self._models)

    def apply(self, model: str, change: Callable[[ModelHealth, float], Transition | None]) -> Transition | None:
        """Run one state change on a model and announce the transition, if any."""
        transition = change(self._models[model], self._clock())
        if transition is not None:
            for listener in self._listeners:
                listener(transition)
        return transition

    def all_serving(self) -> bool:
        return bool(self._models) and all(h.state.serves_traffic for h in self._models.values())

    def failed(self) -> list[str]:
        return sorted(m for m, h in self._models.items() if h.state is ModelState.FAILED)

