"""Passive signals: what clients' answers say about a model between two probe rounds.

Consecutive Triton failures, or a NaN/Inf answer that the model's golden files do not expect, bring
the model's next probe round forward, so a fault seen by traffic is judged in milliseconds rather
than at the next probe interval. Under load a dead stub makes probes time out behind queued
requests; clients' answers still carry Triton's own diagnosis (the front types it: `stub_dead`),
which the healer is told about so that it does not wait for an unload that never finishes.

The core tells the health side through `HealthEvents`, callables that app.factory connects to the
model supervisors and the Triton watch: the serving core never imports health.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from sidecar.states import ModelStates, Transition

log = structlog.get_logger("sidecar.signals")


@dataclass(frozen=True)
class HealthEvents:
    """What serving tells the health side; each call only queues an event, never waits."""

    #: (model, cause): traffic saw the model fail; run its next probe round now.
    probe_soon: Callable[[str, str], None]
    #: (model): Triton told a client the model's stub process died.
    stub_dead: Callable[[str], None]
    #: (detail): a proxied request could not connect to Triton at all.
    triton_unreachable: Callable[[str], None]


class PassiveSignals:
    def __init__(self, *, states: ModelStates, failure_threshold: int, events: HealthEvents) -> None:
        self._threshold = failure_threshold
        self._events = events
        self._failures: collections.Counter[str] = collections.Counter()
        states.add_listener(self._on_transition)

    def _on_transition(self, t: Transition) -> None:
        self._failures[t.model] = 0

    def upstream_failed(self, model: str, cause: str, *, stub_dead: bool = False) -> None:
        if stub_dead:
            self._events.stub_dead(model)
        self._failures[model] += 1
        if self._failures[model] >= self._threshold:
            self._failures[model] = 0
            log.warning("passive_signal", model=model, signal="consecutive_failures", cause=cause)
            self._events.probe_soon(model, f"{self._threshold} failed requests in a row; last: {cause}")

    def upstream_answered(self, model: str) -> None:
        if self._failures[model]:
            self._failures[model] = 0

    def non_finite_answer(self, model: str, outputs: Sequence[str]) -> None:
        log.warning("passive_signal", model=model, signal="non_finite_output", outputs=list(outputs))
        self._events.probe_soon(model, f"answer held NaN/Inf in {', '.join(outputs)}")

