"""Readiness, decided once for every endpoint that answers it.

The kubelet's `/readyz`, the v2 `/v2/health/ready` and `/v2/models/{m}/ready`, gRPC `ServerReady` and
`ModelReady`, and `grpc.health.v1` all read `Readiness`: a client, a load balancer and the kubelet
never disagree about whether the pod (or one model) should get traffic. The pod is ready when it is
not draining, Triton is ready, models were discovered and every model is ready; a model is ready when
its answers are trusted (HEALTHY or DEGRADED), the health loop still vouches for that state (its
supervisor completed a round within `liveness.watchdog_stall_s`: a state nobody re-checks is not
trusted) and, with `probes.require_golden`, it has golden files.

What readiness needs from the health side (Triton's readiness as the watch last saw it, why the
health loop does not vouch for a model) is handed in by the app as a small protocol and a callable:
the serving core never imports the health loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sidecar.serving.lifecycle import Lifecycle
from sidecar.states import ModelStates


class TritonReadiness(Protocol):
    """Triton's own readiness as last observed (sidecar.health.triton_watch.TritonWatch)."""

    @property
    def ready(self) -> bool: ...

    @property
    def detail(self) -> str: ...


#: For a model name: why the health loop does not vouch for its state (no golden files where
#: probes.require_golden wants them, a supervisor that completes no round), or "".
HealthDoubts = Callable[[str], str]


class Readiness:
    def __init__(self, *, lifecycle: Lifecycle, states: ModelStates, triton: TritonReadiness,
                 doubts: HealthDoubts) -> None:
        self._lifecycle = lifecycle
        self._states = states
        self._triton = triton
        self._doubts = doubts

    def problems(self) -> list[str]:
        """Why the pod should not get inference traffic now; empty when it should."""
        problems = self._pod_wide()
        if not len(self._states):
            problems.append("no models discovered yet")
        for model in self._states.names():
            problems += self._own(model)
        return problems

    def model_problems(self, model: str) -> list[str]:
        """Why this model should not get traffic now (the pod-wide reasons included); empty when it
        should. A model the sidecar does not guard is never ready."""
        return self._pod_wide() + self._own(model)

    def _pod_wide(self) -> list[str]:
        problems = []
        if self._lifecycle.draining:
            problems.append("shutting down")
        if not self._triton.ready:
            problems.append(f"Triton not ready: {self._triton.detail}")
        return problems

    def _own(self, model: str) -> list[str]:
        health = self._states.get(model)
        if health is None:
            return [f"model {model} is not guarded by the sidecar"]
        problems = []
        if not health.state.serves_traffic:
            problems.append(f"model {model} {health.state.value}: {health.cause}")
        doubt = self._doubts(model)
        if doubt:
            problems.append(doubt)
        return problems
