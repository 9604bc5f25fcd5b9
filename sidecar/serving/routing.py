"""Which version of a model answers a request: pinned, split by a rollout's step, or a fallback.

Pure logic, no wire and no I/O: the fronts only extract the pin (path `/versions/N`, header
`x-model-version`, gRPC `model_version` or `x-model-version` metadata) and the cohort key's value,
and the serving core asks `Router.route` before admission, so admission, validation and the answer's
screening all apply to the version that will answer.

- Pinned: the named version, always, even when it is quarantined (the client asked for it: 503).
- Split: a model with a rollout sends unpinned requests to its candidate with the current step's
  share, by a hash of the cohort key's value when one is configured (one user, one version; a
  user who reached the candidate at 5 % still does at 30 %), else at random.
- Fallback: an unpinned request whose version is not trusted (quarantined for that version only)
  goes to another loaded version the golden cases still vouch for, rollout or not.
- Otherwise the request is sent unversioned and Triton picks (the highest loaded version).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.messages import cut
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.rollouts import Rollout, Rollouts
from sidecar.states import ModelHealth, ModelStates

#: The request header (HTTP) and metadata key (gRPC) that pins a version.
VERSION_HEADER = "x-model-version"


PINNED = "pinned"


SPLIT = "split"


FALLBACK = "fallback"


SHADOW = "shadow"


#: Unpinned, no rollout, version trusted: Triton routes it (not counted).
DEFAULT = "default"


@dataclass(frozen=True)
class Route:
    #: The version to send to; "" = unversioned (Triton's choice).
    version: str
    reason: str
    #: The model's rollout, when it has one (the core records its answers there).
    rollout: Rollout | None = None


def pinned_version(path_version: str, header_version: str | None, model: str) -> str:
    """The version a request names: the path's, or the header's; both must agree (400 otherwise)."""
    header_version = (header_version or "").strip()
    if header_version and path_version and header_version != path_version:
        raise Refusal(Reason.SCHEMA, f"the path names version {cut(path_version)} of model {model} but "
                                     f"{VERSION_HEADER} names {cut(header_version)}; name one", model=model,
                      field=VERSION_HEADER)
    return path_version or header_version


def cohort_bucket(model: str, value: str) -> float:
    """A stable position in [0, 1) for one user of one model: the same value, the same version."""
    digest = hashlib.blake2b(f"{model}\0{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class Router:
    def __init__(self, *, states: ModelStates, rollouts: Rollouts, fallback: Callable[[], bool],
                 rng: random.Random | None = None) -> None:
        self._states = states
        self._rollouts = rollouts
        self._fallback = fallback
        self._rng = rng or random.Random()  # noqa: S311 - traffic split, not secrets

    def cohort_key(self, model: str) -> str:
        """The header whose value picks the version for this model ("" = none): the fronts read it."""
        rollout = self._rollouts.get(model)
        return rollout.settings.cohort_key if rollout is not None else ""

    def route(self, model: str, pinned: str, cohort: str = "") -> Route:
        rollout = self._rollouts.get(model)
        if pinned:
            return Route(pinned, PINNED, rollout)
        if rollout is not None:
            bucket = cohort_bucket(model, cohort) if cohort else self._rng.random()
            version, reason = rollout.pick(bucket), SPLIT
        else:
            version, reason = "", DEFAULT
        health = self._states.get(model)
        if health is not None and self._fallback() and not health.trusts(version):
            other = fallback_version(health, version or health.default_version, rollout)
            if other:
                return Route(other, FALLBACK, rollout)
        return Route(version, reason, rollout)

    def shadow_target(self, route: Route) -> str:
        """The version a served request's shadow goes to ("" = none): the rollout's other version,
        only for answers of its stable or candidate, never to a version that is not trusted."""
        rollout = route.rollout
        if rollout is None or route.reason == FALLBACK or not rollout.wants_shadow(self._rng.random()):
            return ""
        other = rollout.other(route.version)
        health = self._states.get(rollout.model)
        if not other or health is None or not health.trusts(other):
            return ""
        return other


def fallback_version(health: ModelHealth, reached: str, rollout: Rollout | None) -> str:
    """A trusted loaded version to serve instead of `reached` ("" = none): the rollout's other
    version first, else the highest trusted one."""
    if not reached:
        return ""
    candidates = [v for v in health.loaded_versions if v != reached and health.trusts(v)]
    if rollout is not None and rollout.other(reached) in candidates:
        return rollout.other(reached)
    numbered = [v for v in candidates if v.isdigit()]
    return max(numbered, key=int) if numbered else ""
