"""Admission: which requests may reach Triton, decided from the sidecar's own view of each model.

A request passes only for a model the sidecar guards (others would bypass quarantine) and only while
that model's answers are trusted (HEALTHY or DEGRADED). Otherwise it is refused at once with a
Retry-After, or, with `proxy.hold_during_heal_s`, held until the model is healed or the hold ends.
With `proxy.hold_while_suspect_ms`, a request that comes while a failed golden round is being
confirmed waits for the verdict (up to that long): served if the model passes, refused if it is
quarantined, instead of getting the answer the failed round just judged wrong.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from sidecar.config import ProxySection
from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.serving.refusals import Reason, Refusal
from sidecar.states import ModelState, ModelStates, Transition

log = structlog.get_logger("sidecar.proxy")


@dataclass(eq=False)
class AtTriton:
    """One request sent to Triton and not answered yet: ended at once if its model is quarantined."""

    task: asyncio.Task | None  # type: ignore[type-arg]
    version: str
    #: The refusal it ends with, once its model was quarantined while it waited.
    ended: Refusal | None = field(default=None)


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
        #: Set while no confirmation round runs; requests held while suspect wait on it.
        self._verdicts: dict[str, asyncio.Event] = {}
        #: Requests at Triton per model, so a quarantine can end them (see `sent`).
        self._at_triton: dict[str, set[AtTriton]] = {}
        #: Requests this chain holds now (hold_during_heal_s), per model; `holding` adds the fronts'.
        self._held: collections.Counter[str] = collections.Counter()
        #: What else holds requests (the Rust HTTP front): each gives [(model, count)] now.
        self._held_elsewhere: list[Callable[[], Iterable[tuple[str, int]]]] = []
        states.add_listener(self._on_transition)
        states.add_suspect_listener(self._on_suspect)
        states.add_release_listener(self._on_release)

    @property
    def holding(self) -> collections.Counter[str]:
        """Requests held now (hold_during_heal_s), per model, by this chain and by the fronts that
        hold on their own (models with none left out)."""
        held = collections.Counter(self._held)
        for source in self._held_elsewhere:
            held.update(dict(source()))
        return +held

    def add_holding_source(self, source: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """Count the requests a front holds itself (the Rust HTTP front's admission) in `holding`."""
        self._held_elsewhere.append(source)

    def _on_transition(self, t: Transition) -> None:
        serves = t.state_to.serves_traffic
        gate = self._gates.get(t.model)
        if gate is not None:
            (gate.set if serves else gate.clear)()
        alarm = self._alarms.get(t.model)
        if alarm is not None:
            (alarm.clear if serves else alarm.set)()
        if not serves and self._at_triton.get(t.model):
            self._end_waiting(t.model)

    # -- requests at Triton ------------------------------------------------------------------------------

    def sent(self, model: str, version: str) -> AtTriton:
        """Note a request the core is about to send to Triton; `done` when it is answered."""
        entry = AtTriton(asyncio.current_task(), version)
        waiting = self._at_triton.get(model)
        if waiting is None:
            waiting = self._at_triton[model] = set()
        waiting.add(entry)
        return entry

    def done(self, model: str, entry: AtTriton) -> None:
        self._at_triton[model].discard(entry)

    def _end_waiting(self, model: str) -> None:
        """The model was just quarantined: the requests waiting at Triton for a version it no longer
        trusts end now with 503 + Retry-After, instead of waiting out proxy.upstream_timeout_s at a
        hung instance or bringing back the answers just judged wrong. Their tasks are cancelled, so
        their connections to Triton are closed (never back in the pool) and gRPC calls cancelled."""
        health = self._states.get(model)
        ended = 0
        for entry in self._at_triton[model]:
            if entry.ended is None and entry.task is not None and (health is None or not health.trusts(entry.version)):
                entry.ended = self.quarantine_refusal(model)
                entry.ended.before_triton = False
                entry.task.cancel()
                ended += 1
        if ended:
            self._metrics.requests.quarantined(model, "ended_at_triton", ended)
            log.warning("requests_ended_at_quarantine", model=model, requests=ended,
                        cause="the model was quarantined while these requests waited at Triton; they were "
                              "answered 503 with Retry-After and their connections to Triton closed")

    def _on_release(self, model: str) -> None:
        """The model is no longer guarded: held requests wake (and are refused 404), open streams
        end, requests waiting for a verdict get one."""
        for events in (self._gates, self._alarms, self._verdicts):
            event = events.pop(model, None)
            if event is not None:
                event.set()

    def _on_suspect(self, model: str, suspect: bool) -> None:
        verdict = self._verdicts.get(model)
        if verdict is not None:
            (verdict.clear if suspect else verdict.set)()

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
        health = self._states.get(model)
        assert health is not None
        if health.trusts(version):
            if not health.suspect or self._settings.hold_while_suspect_ms <= 0:
                return
            if await self._verdict_came(model, version):
                return
        hold_s = self._settings.hold_during_heal_s
        if hold_s > 0 and health.state is not ModelState.FAILED:
            gate = self._gate(model)
            self._held[model] += 1
            try:
                async with asyncio.timeout(hold_s):
                    while not self.serves(model) and model in self._states:
                        await gate.wait()
            except TimeoutError:
                self._metrics.requests.quarantined(model, "held_timeout")
            else:
                if model not in self._states:
                    raise self.quarantine_refusal(model)  # released while held: 404, no series revived
                self._metrics.requests.quarantined(model, "held_released")
                return
            finally:
                self._held[model] -= 1
                if not self._held[model]:
                    del self._held[model]
        else:
            self._metrics.requests.quarantined(model, "rejected")
        raise self.quarantine_refusal(model)

    async def _verdict_came(self, model: str, version: str = "") -> bool:
        """Hold a request while the model's failed round is confirmed: True to serve it (the model
        passed, or the hold ended with the model still trusted), False when it was quarantined."""
        verdict = self._verdicts.get(model)
        if verdict is None:
            verdict = self._verdicts[model] = asyncio.Event()
        health = self._states.get(model)
        if health is None or not health.suspect:
            verdict.set()
        outcome = "suspect_released"
        try:
            async with asyncio.timeout(self._settings.hold_while_suspect_ms / 1000):
                await verdict.wait()
        except TimeoutError:
            outcome = "suspect_timeout"
        if not self.trusted(model, version):
            outcome = "suspect_refused"
        self._metrics.requests.quarantined(model, outcome)
        return outcome != "suspect_refused"

    def quarantine_refusal(self, model: str) -> Refusal:
        """Why the model's answers are not trusted now; for a model released meanwhile (no longer
        guarded: removed from `models`, or retired by its owner), the 404 any new request gets."""
        health = self._states.get(model)
        if health is None:
            return Refusal(Reason.UNKNOWN_MODEL, f"model {model} is no longer guarded by the sidecar (released)",
                           model=model)
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

