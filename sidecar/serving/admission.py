"""Admission: which requests may reach Triton, decided from the sidecar's own view of each model.

A request passes only for a model the sidecar guards (others would bypass quarantine) and only while
that model's answers are trusted (HEALTHY or DEGRADED). Otherwise it is refused at once with a
Retry-After, or, with `proxy.hold_during_heal_s`, held until the model is healed or the hold ends.
"""

from __future__ import annotations

import asyncio

from sidecar.config import ProxySection
from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.serving.refusals import Reason, Refusal
from sidecar.states import ModelState, ModelStates, Transition

#: Model label for requests that name no model, and for names the sidecar does not track: metric
#: labels stay bounded whatever paths clients send.
SERVER_LABEL = "_server_"


UNKNOWN_LABEL = "_unknown_"


class Admission:
    def __init__(self, *, states: ModelStates, settings: ProxySection, metrics: SidecarMetrics) -> None:
        self._states = states
        self._settings = settings
        self._metrics = metrics
        #: Set while the model serves traffic; held requests wait on it.
        self._gates: dict[str, asyncio.Event] = {}
        #: Set while the model does NOT serve traffic; open streams wait on it to end themselves.
        self._alarms: dict[str, asyncio.Event] = {}
        states.add_listener(self._on_transition)

    def _on_transition(self, t: Transition) -> None:
        serves = t.state_to.serves_traffic
        gate = self._gates.get(t.model)
        if gate is not None:
            (gate.set if serves else gate.clear)()
        alarm = self._alarms.get(t.model)
        if alarm is not None:
            (alarm.clear if serves else alarm.set)()

    def label(self, model: str) -> str:
        """The bounded metric label for a model name a client sent."""
        return model if model in self._states else UNKNOWN_LABEL

    def tracked(self, model: str) -> None:
        """Refuse a model the sidecar does not guard: 404, or 503 before discovery has run."""
        if model in self._states:
            return
        if not len(self._states):
            raise Refusal(Reason.NOT_VERIFIED, "the sidecar has not discovered Triton's models yet",
                          retry_after=self._settings.retry_after_s)
        raise Refusal(Reason.UNKNOWN_MODEL, f"unknown model {cut(model)!r}; served: {', '.join(self._states.names())}")

    def check_version(self, model: str, version: str) -> None:
        if version and not version.isdigit():
            raise Refusal(Reason.UNKNOWN_MODEL, f"model {model} has no version {cut(version)!r} "
                                                "(versions are numbers)", model=model)

    def trusted(self, model: str, version: str = "") -> bool:
        """Are answers from `version` of the model ("" = the one unversioned requests reach) trusted?"""
        health = self._states.get(model)
        return health is not None and health.trusts(version)

    def serves(self, model: str) -> bool:
        health = self._states.get(model)
        return health is not None and health.state.serves_traffic

    async def admit(self, model: str, version: str = "") -> None:
        """Return while the model's answers are trusted (for the version the request reaches: a
        version whose golden cases pass is served while another is quarantined); else hold (if
        configured) or refuse."""
        if self.trusted(model, version):
            return
        health = self._states.get(model)
        assert health is not None
        hold_s = self._settings.hold_during_heal_s
        if hold_s > 0 and health.state is not ModelState.FAILED:
            gate = self._gate(model)
            try:
                async with asyncio.timeout(hold_s):
                    while not self.serves(model):
                        await gate.wait()
            except TimeoutError:
                self._metrics.quarantined.labels(model=model, outcome="held_timeout").inc()
            else:
                self._metrics.quarantined.labels(model=model, outcome="held_released").inc()
                return
        else:
            self._metrics.quarantined.labels(model=model, outcome="rejected").inc()
        raise self.quarantine_refusal(model)

    def quarantine_refusal(self, model: str) -> Refusal:
        health = self._states.get(model)
        assert health is not None
        reason = Reason.QUARANTINED if health.state.quarantined else Reason.NOT_VERIFIED
        which = f"version {', '.join(sorted(health.broken_versions))} of " if health.broken_versions else ""
        return Refusal(reason, f"{which}model {model} is {health.state.value} ({cut(health.cause, 200)}); "
                               "its answers are not trusted right now", model=model,
                       retry_after=self._settings.retry_after_s, state=health.state.value)

    async def until_untrusted(self, model: str) -> None:
        """Return as soon as the model stops serving traffic (a stream open to it must end)."""
        alarm = self._alarms.get(model)
        if alarm is None:
            alarm = self._alarms[model] = asyncio.Event()
            if not self.serves(model):
                alarm.set()
        await alarm.wait()

    def _gate(self, model: str) -> asyncio.Event:
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = asyncio.Event()
            if self.serves(model):
                gate.set()
        return gate

