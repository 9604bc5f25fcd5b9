"""`listen.front: rust`: listen.port served by the data plane's HTTP front (sidecar._dataplane.HttpFront).

The Rust front owns the socket. It reads every request head itself and enforces the listener's
bounds (header and keep-alive timeouts, URL and header sizes, smuggling refused, 413 with lingering
close, 408 for a slow body, 100-continue, listen.max_connections), and it serves
`POST /v2/models/{m}/infer`, `/generate` and `/generate_stream` (relayed event by event) to a model
published to it as a *lane* without entering Python, and the same to a version of it a client pins
(`/versions/{v}/...`, `x-model-version` on infer) once that version's spec is fetched: validation
(the generate body check with the model's GenerateLimits), breaker, Triton, screening and counters
all run on its runtime thread(s), after the front's own admission (front/admission.rs: a model
quarantined is refused, held for its heal or while a failed round is confirmed, and an unpinned
request routed to the fallback version, as Admission.admit and Router.route do). It also answers
the rest of the v2 routes as http_routes does (Triton's documents and statistics, a model's
readiness, the control API refused, the router's 404s and 405s: dataplane/src/front/documents.rs),
and inflates gzip/deflate/br infer bodies. Everything else (kubelet endpoints, /metrics, a filtered
model's pinned or ensemble documents, a version whose spec is not fetched yet or that is not loaded,
a rollout model's generate, a stream to a version a partial quarantine spares) is handed, with the
very bytes the client sent, to the Python listener (sidecar.fronts.http_listener) on a loopback port
behind it, which answers exactly as before.

With `tls.cert_file` set the front terminates TLS itself (rustls, dataplane/src/front/tls.rs): the
PEM bytes ServerTls loaded and checked are handed down at start and at every rotation its watch
finds, mutual TLS and the allowed SANs are checked in the handshake, and failed handshakes are
counted by reason in the data plane's atomics. The Python listener behind it stays plaintext on
loopback. With `listen.grpc_front: rust` the gRPC port is terminated the same way (ALPN h2, rotated
with listen.port) and the grpcio server behind it stays plaintext on loopback too.

This module is the control plane's side of that boundary:
- **down**: which models are lanes, with their spec, hidden outputs, NaN screening, generate limits
  (the drift windows the lanes bin measured answers in are DriftMonitor's, handed over at start)
  and the streams' idle bound, every guarded model's admission (suspect, may be held, fallback),
  and the refusal owed to requests (at Triton too, and the error event owed to open streams) when
  a model stops being trusted, the answers of /v2/health/live and /ready, what the document routes
  read (the guarded models, their filters and readiness, the statistics key, the exposed
  extensions) and, with the gRPC port on the front, grpc.health.v1's status of the pod and each
  model, and each rollout's route (its share now, cohort header, shadow rate, fallbacks, compare
  tolerances: the infer lane splits, shadows and compares by it): published at once on every state
  transition, suspect change and rollout change, and on a short tick for what changes without one
  (a spec fetched, a reload);
- **up**: the front's events (passive signals, requests ended at a quarantine, streams ended, the
  sampled access log, panics, a rollout's served answers and its shadows' ends), drained on the
  same tick and handed to the health loop and the log as the Python chain would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
from pathlib import Path
from typing import Any

import certifi
import structlog
from aiohttp import web

from sidecar import __version__
from sidecar._dataplane import HttpFront as NativeFront
from sidecar.config import ConfigError, TracingSection
from sidecar.fronts.appkeys import CONFIG, GRPC_BACK_PORT, HEARTBEATS, LIFECYCLE, SERVING, STATES, TLS, TRITON, WATCH
from sidecar.fronts.http_listener import SidecarListener
from sidecar.fronts.http_routes import (
    exposed_extension_names,
    live_refusal,
    model_ready_refusal,
    ready_refusal,
    serving_statuses,
)
from sidecar.fronts.tls import HANDSHAKE_TIMEOUT_S, ServerTls, TlsFileError, TlsMaterial
from sidecar.messages import cut
from sidecar.protocol.triton_errors import StubUnhealthy, triton_error
from sidecar.serving.core import ServingCore
from sidecar.serving.generation import error_event
from sidecar.serving.refusals import Refusal
from sidecar.serving.rollouts import RolloutState
from sidecar.serving.routing import fallback_version
from sidecar.states import ModelState, ModelStates, Transition
from sidecar.tracing.front_spans import FrontSpans

log = structlog.get_logger("sidecar.proxy")
tls_log = structlog.get_logger("sidecar.tls")

#: How often (s) the front's routine events (usable answers) are drained and its lanes looked at
#: again while it serves. Events the health loop or the log must have now (a failure, NaN/Inf, a
#: panic, an access-log line) wake the loop at once through a socket pair; state transitions,
#: reloads and whatever takes a lane away (a rollout, a spec
#: dropped) publish at once; traffic alone never wakes Python.
TICK_S = 0.05
#: The tick when the front has served nothing since the last one: what it still catches (a model
#: that may become a lane again, a spec fetched elsewhere) can wait this long, and an idle
#: sidecar wakes once a second instead of twenty times (issue 30's idle bound).
IDLE_TICK_S = 1.0

#: (version, its RequestSpec, its hidden outputs or None): a loaded version a client may pin.
PinnedVersion = tuple[str, Any, list[str] | None]

#: (model, its RequestSpec, hidden outputs or None, look for NaN/Inf, its native GenerateLimits,
#: generation.idle_timeout_s, its pinnable versions, stale: its last spec while a new one is fetched)
#: as the front takes a lane.
Lane = tuple[str, Any, list[str] | None, bool, Any, float, list[PinnedVersion], bool]

#: (model, status, JSON body, Retry-After, reason label, the same refusal as a stream's error event,
#: the versions whose requests at Triton it ends ("" = unversioned ones) or None for every version).
Ended = tuple[str, int, bytes, int | None, str, bytes, list[str] | None]

#: (model, suspect, may be held for a heal (not FAILED), the fallback version of an unpinned request
#: or ""): every guarded model, as the front's admission reads it (front/admission.rs).
Guard = tuple[str, bool, bool, str]


#: A rollout as the front routes by it: (model, stable, candidate, share, cohort_key lower-cased,
#: shadow rate now, [(version, fallback)], atol, rtol, [(output, atol, rtol)]).
RolloutRoute = tuple[str, str, str, float, str, float, list[tuple[str, str]], float, float,
                     list[tuple[str, float, float]]]

#: (path, status, JSON body or b"", Retry-After, reason label or ""): an answer that depends only on
#: the health loop's state (/v2/health/live, /v2/health/ready), served by the front as published.
Canned = tuple[str, int, bytes, int | None, str]

#: (status, JSON body, Retry-After) of a model's /ready refused from the sidecar's view, None when
#: Triton is asked.
ModelReady = tuple[int, bytes, int | None] | None
#: ([(model, named by an output filter, its /ready refusal, the filter's verdict on each output its
#: spec declares or None)] in the order admission names them, proxy.allow_statistics, the v2
#: extensions GET /v2 shows): what the front needs to answer the v2 document routes, the control
#: API's refusals and the router's 404s and 405s as http_routes does.
Documents = tuple[list[tuple[str, bool, ModelReady, list[tuple[str, bool]] | None]], bool, list[str]]
#: The front's runtime threads, as /healthz names them when they stop turning. The other way round,
#: the front answers /healthz and /readyz 503 itself when this loop stops touching it (every tick)
#: for longer than liveness.watchdog_stall_s (dataplane/src/front/watchdog.rs).
FRONT_RUNTIME = "the data plane's HTTP front (its runtime threads)"


class HttpFront:
    """The Rust front on listen.port, the Python listener behind it on loopback (same interface as
    SidecarListener: `start`, `port`, `open_connections`, `handovers`, `fast_requests`, `close`)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.back = SidecarListener(app, behind_front=True)
        self._native: NativeFront | None = None
        self._tick: asyncio.Task[None] | None = None
        self._published: tuple[Any, ...] | None = None
        #: Spec fetches begun for trusted models without one, so a model is a lane before its first
        #: request rather than after it.
        self._warming: dict[str, asyncio.Task[None]] = {}
        #: The last lane published for each model: while its spec is fetched anew (dropped for a heal
        #: or a reload) it stays the model's lane, marked stale, so that the front's admission holds
        #: or refuses its requests and the ones it lets through wait for the new spec, as the Python
        #: chain's do (front/admission.rs), instead of being handed to the Python app meanwhile.
        self._last_lanes: dict[str, Lane] = {}
        self._wake: socket.socket | None = None
        #: listen.grpc_port as bound by the data plane's gRPC front (listen.grpc_front: rust), else 0.
        self.grpc_port = 0
        #: Repository calls sent to Triton's gRPC port by the front (`repository_call`), by number,
        #: until their end comes up as an event.
        self._repository_calls: dict[int, asyncio.Future[tuple[int, str, str]]] = {}
        self._call_numbers = itertools.count(1)

    @property
    def core(self) -> ServingCore:
        return self.app[SERVING]

    async def start(self, host: str, port: int) -> None:
        config = self.app[CONFIG]
        await self.back.start("127.0.0.1", 0)
        listen, proxy = config.listen, config.proxy
        limits = {
            "listen.header_timeout_s": listen.header_timeout_s,
            "listen.keepalive_timeout_s": listen.keepalive_timeout_s,
            "listen.max_url_bytes": listen.max_url_bytes,
            "listen.max_header_bytes": listen.max_header_bytes,
            "listen.max_headers": listen.max_headers,
            "listen.max_connections": listen.max_connections,
            "listen.lingering_time_s": listen.lingering_time_s,
            "listen.lingering_timeout_s": listen.lingering_timeout_s,
            "listen.lingering_max_bytes": listen.lingering_max_bytes,
            "validation.max_body_bytes": config.validation.max_body_bytes,
            "proxy.client_body_timeout_s": proxy.client_body_timeout_s,
            "proxy.upstream_timeout_s": proxy.upstream_timeout_s,
            "triton.timeout_s": config.triton.timeout_s,
            "proxy.retry_after_s": proxy.retry_after_s,
            "proxy.max_in_flight_per_model": proxy.max_in_flight_per_model,
            "proxy.queue_size_per_model": proxy.queue_size_per_model,
            "proxy.block_non_finite_outputs": float(proxy.block_non_finite_outputs),
            "proxy.hold_during_heal_s": proxy.hold_during_heal_s,
            "proxy.hold_while_suspect_ms": proxy.hold_while_suspect_ms,
            "proxy.max_shadow_in_flight": proxy.max_shadow_in_flight,
            "logging.access_log_sample_rate": config.logging.access_log_sample_rate,
            "liveness.watchdog_stall_s": config.liveness.watchdog_stall_s,
            "tls.handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
        }
        upstream = config.triton.url.split("://", 1)[-1].rstrip("/")
        tls: ServerTls | None = self.app.get(TLS)
        try:
            self._native = NativeFront(host, port, listen.max_connections, listen.workers, self.back.port, upstream,
                                       {k: float(v) for k, v in limits.items()}, self.core.metrics.requests,
                                       tls=_tls_material(tls, tls.material) if tls is not None else None,
                                       tracing=_tracing(config.tracing), drift=self.core.drift.windows)
        except ValueError as e:  # rustls refused what OpenSSL accepted: a start-up error naming the key
            await self.back.close()
            raise TlsFileError(str(e)) from e
        if tls is not None:
            tls.add_reload_listener(self._reload_tls)
        native = self._native
        self.core.admission.add_holding_source(lambda: native.holding)
        self.core.shadows.front_in_flight = lambda: native.shadows_in_flight
        requests = self.core.requests
        if requests.spans is not None:
            # The spans of what Python answers (grpcio's calls, handed-over requests) are the front's
            # from now on: a call into it at each end instead of a Python SDK span (front_spans.py).
            requests.spans = FrontSpans(native, before=requests.spans)
        if listen.grpc_port and listen.grpc_front == "rust":
            self._serve_grpc(host)
        self.app[HEARTBEATS].watch(FRONT_RUNTIME, lambda: native.runtime_silent_for)
        # SIGTERM's drain waits for the requests the front serves on its own too (in flight, and
        # quiet for the same period as the Python listener's).
        self.app[LIFECYCLE].watch_front(lambda: native.in_flight, lambda: native.fast_requests, self.publish)
        self.app[WATCH].add_listener(self.publish)  # /v2/health/* follow Triton's status at once
        states: ModelStates = self.app[STATES]
        states.add_listener(self._on_transition)
        states.add_suspect_listener(self._on_suspect)
        self.core.add_change_listener(self.publish)
        self.core.specs.add_cached_listener(lambda _model, _version: self.publish())
        self._tick = asyncio.create_task(self._run_tick(), name="http-front-tick")
        # A heal's load and unload go to Triton's gRPC port through the front from now on (a load over
        # HTTP stalls the connections that share its worker thread in Triton: repository_call).
        self.app[TRITON].send_repository_calls_through(self.repository_call)
        self._wake = socket.socket(fileno=self._native.wake_fd())
        self._wake.setblocking(False)
        asyncio.get_running_loop().add_reader(self._wake.fileno(), self._woken)
        self.publish(force=True)

    def _serve_grpc(self, host: str) -> None:
        """listen.grpc_port on the front's runtime (listen.grpc_front: rust), the Python gRPC server
        (started with the app, plaintext on loopback) behind it. With tls.cert_file set the port is
        grpcs, terminated by the front from the same material as listen.port (ALPN h2), rotated with it
        (`_reload_tls`); the client certificate's subject reaches the server behind as a header."""
        config = self.app[CONFIG]
        listen = config.listen
        tls: ServerTls | None = self.app.get(TLS)
        assert self._native is not None
        try:
            self.grpc_port = self._native.serve_grpc(
                host, listen.grpc_port, listen.max_connections, self.app[GRPC_BACK_PORT], config.triton.grpc_url,
                listen.grpc_max_concurrent_streams, listen.max_connections, listen.grpc_max_connection_idle_s,
                listen.grpc_max_connection_age_s, listen.grpc_min_ping_interval_s,
                tls=_tls_material(tls, tls.material) if tls is not None else None)
        except ValueError as e:  # rustls refused what OpenSSL accepted: a start-up error naming the key
            raise TlsFileError(str(e)) from e
        log.info("grpc_listening", listen=f"{host}:{self.grpc_port}", triton=config.triton.grpc_url,
                 front="rust", tls=tls is not None)

    # -- the listener's interface (tests and the CLI read these) -------------------------------------

    @property
    def grpc_handovers(self) -> int:
        """gRPC calls the data plane's gRPC front handed to the Python gRPC server."""
        return self._native.grpc_counts[0] if self._native is not None else 0

    @property
    def grpc_served(self) -> int:
        """gRPC calls the data plane's gRPC front answered without Python: ModelInfer to a lane,
        grpc.health.v1 Check and Watch, server reflection streams."""
        return self._native.grpc_counts[1] if self._native is not None else 0

    @property
    def port(self) -> int:
        assert self._native is not None
        return self._native.port

    @property
    def open_connections(self) -> int:
        return self._native.open_connections if self._native is not None else 0

    @property
    def handovers(self) -> int:
        return self._native.handovers if self._native is not None else 0

    @property
    def fast_requests(self) -> int:
        return self._native.fast_requests if self._native is not None else 0

    @property
    def in_flight(self) -> int:
        return self._native.in_flight if self._native is not None else 0

    @property
    def upstream(self) -> UpstreamStats:
        """The front's own connections to Triton, counted as sidecar.upstream.UpstreamPool counts its."""
        assert self._native is not None
        return UpstreamStats(self._native)

    @property
    def settled(self) -> bool:
        """No spec fetch for a would-be lane is in flight: every trusted model the front can serve
        is published as a lane (tests wait for this before counting what the front served)."""
        return not self._warming

    @property
    def control_silent_for(self) -> float:
        """Seconds since this loop last touched the front (its watchdog of the control plane)."""
        return self._native.control_silent_for if self._native is not None else 0.0

    def stall_runtime(self, seconds: float) -> None:
        """Fault injection (tests, drills): block the front's runtime threads for `seconds`."""
        assert self._native is not None
        self._native.stall_runtime(seconds)

    def panic_next(self, model: str) -> None:
        """Fault injection (tests, drills): the next request the front serves to `model` panics in
        its task, which must end that request alone with 500 internal_error."""
        assert self._native is not None
        self._native.panic_next(model)

    async def close(self) -> None:
        """Stop accepting; requests in flight on the front finish (bounded by proxy.upstream_timeout_s),
        then the Python listener behind it closes."""
        for task in [self._tick, *self._warming.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._native is not None:
            self.app[TRITON].send_repository_calls_through(None)
        if self._wake is not None:  # once: a second close (a shutdown racing a test's stop) has nothing to do
            asyncio.get_running_loop().remove_reader(self._wake.fileno())
            self._wake.close()
            self._wake = None
        if self._native is not None:
            self.app[HEARTBEATS].forget(FRONT_RUNTIME)
            requests = self.core.requests
            if isinstance(requests.spans, FrontSpans):  # what is answered after the front stops: the SDK's
                requests.spans = requests.spans.before
            await asyncio.to_thread(self._native.close)
            self._drain_events()
        for waiting in self._repository_calls.values():  # a heal cut short by the shutdown
            if not waiting.done():
                waiting.set_result((0, "dropped", "the sidecar is shutting down"))
        await self.back.close()

    async def repository_call(self, action: str, model: str, timeout_s: float) -> tuple[int, str, str]:
        """A load or an unload ("load", "unload") of `model`, sent by the front to Triton's gRPC port
        (triton.grpc_url) with the repository header, bounded by `timeout_s`: (HTTP status that says
        the outcome, 0 without an answer; the gRPC code's name, or why no answer came: timeout,
        unreachable, dropped; Triton's message). Triton's HTTP server would run the load on the
        worker thread that received it and stall every connection that thread holds meanwhile
        (dataplane/src/front/grpc/repository.rs); its gRPC port keeps them apart."""
        native = self._native
        if native is None or self._wake is None:
            return 0, "unreachable", "the data plane's front is not running"
        triton = self.app[CONFIG].triton
        # Triton's --grpc-restricted-protocol looks for the header under this prefix (its HTTP
        # counterpart, --http-restricted-api, under the bare name).
        metadata = ([(f"triton-grpc-protocol-{triton.repository_header}", triton.repository_token)]
                    if triton.repository_header else [])
        number = next(self._call_numbers)
        answered = asyncio.get_running_loop().create_future()
        self._repository_calls[number] = answered
        try:
            native.repository_call(number, triton.grpc_url, action, model, metadata, timeout_s)
            return await answered
        finally:
            self._repository_calls.pop(number, None)

    def _reload_tls(self, material: TlsMaterial) -> None:
        """A rotation: new handshakes on the front's ports (listen.port, and listen.grpc_port when it
        serves it) use `material` from now on (open ones keep theirs)."""
        if self._native is None:
            return
        try:
            self._native.reload_tls(_tls_material(self.app[TLS], material))
        except ValueError as e:
            raise TlsFileError(str(e)) from e

    # -- down: lanes -------------------------------------------------------------------------------------

    def _on_transition(self, t: Transition) -> None:
        self.publish()

    def _on_suspect(self, model: str, suspect: bool) -> None:
        self.publish()

    def lanes(self) -> tuple[list[Lane], list[Ended], list[Guard]]:
        """The models the front may serve on its own now (with the versions a client may pin), the
        refusals owed to the requests at Triton (and the open streams) of models that are not
        trusted, for the versions they are not, and what the front's admission needs of every
        guarded model (suspect, held for a heal, fallback): a lane's model is served, held or
        refused by the front as Admission.admit would (front/admission.rs)."""
        core = self.core
        states: ModelStates = self.app[STATES]
        idle_s = core.config.generation.idle_timeout_s
        lanes: list[Lane] = []
        ended: list[Ended] = []
        guards: list[Guard] = []
        for model in states.names():
            health = states.get(model)
            if health is None:
                continue
            untrusted = health.untrusted_versions()
            if untrusted != frozenset():
                # Not serving: a request at Triton for a version it no longer trusts ends (unversioned
                # ones reach Triton's choice: Admission._end_waiting), and every open stream does
                # (Admission.until_untrusted).
                refusal = core.admission.quarantine_refusal(model)
                unversioned = set() if health.trusts("") else {""}
                versions = None if untrusted is None else sorted(untrusted | unversioned)
                ended.append((model, refusal.status, json.dumps(refusal.body()).encode(), refusal.retry_after,
                              refusal.reason.value, error_event(refusal), versions))
            trusted = health.trusts("")
            # Router.route's fallback for an unpinned request (no rollout: those stay the chain's).
            fallback = ""
            if not trusted and core.settings.version_fallback:
                fallback = fallback_version(health, health.default_version, None)
            guards.append((model, health.suspect, health.state is not ModelState.FAILED, fallback))
            rollout = core.rollouts.get(model)
            if rollout is not None:
                # Both versions pinnable lanes, so that the split's picks are the front's (`routes`).
                for version in (rollout.settings.stable, rollout.settings.candidate):
                    if version in health.loaded_versions and core.specs.cached(model, version) is None:
                        self._warm(model, version)
            spec = core.specs.cached(model, "")
            if spec is None:
                if trusted:
                    self._warm(model, "")
                last = self._last_lanes.get(model)
                if last is not None:
                    lanes.append((*last[:7], True))
                continue  # else the chain refuses or holds them (and fetches the spec)
            policy = core.policy(model)
            hidden: list[str] | None = None
            if policy.is_hidden is not None:
                if not spec.outputs:
                    self._last_lanes.pop(model, None)
                    continue  # outputs undeclared: only the Python filter can judge them by name
                hidden = sorted(o for o in spec.outputs if policy.is_hidden(o))
            if fallback and core.specs.cached(model, fallback) is None:
                self._warm(model, fallback)  # so that the next fallback request is the front's
            limits = core.generate_limits(model).native
            lane: Lane = (model, spec.native, hidden, policy.check_non_finite, limits, idle_s,
                          self._pinnable(model, health.loaded_versions), False)
            self._last_lanes[model] = lane
            lanes.append(lane)
        for model in [m for m in self._last_lanes if m not in states]:
            del self._last_lanes[model]  # released: its requests get the chain's 404
        return lanes, ended, guards

    def routes(self) -> list[RolloutRoute]:
        """Each rollout as its requests route now (Router.route, Router.shadow_target): the
        candidate's share, the cohort header, the shadow rate while progressing (0 otherwise), each
        version's fallback while it is not trusted, and the compare tolerances. The front's HTTP
        infer lane splits, shadows and compares by it (dataplane/src/front/shadow.rs); the
        decisions stay the Rollout's, on the evidence the front sends up."""
        core = self.core
        states: ModelStates = self.app[STATES]
        routes: list[RolloutRoute] = []
        for rollout in core.rollouts:
            health = states.get(rollout.model)
            if health is None:
                continue
            s = rollout.settings
            fallbacks = []
            if core.settings.version_fallback:
                for version in (s.stable, s.candidate):
                    other = "" if health.trusts(version) else fallback_version(health, version, rollout)
                    if other:
                        fallbacks.append((version, other))
            shadow_rate = s.shadow_rate if rollout.state is RolloutState.PROGRESSING else 0.0
            tolerances = sorted((output, t.atol, t.rtol) for output, t in s.compare_outputs.items())
            routes.append((rollout.model, s.stable, s.candidate, rollout.share, s.cohort_key.lower(), shadow_rate,
                           fallbacks, s.compare.atol, s.compare.rtol, tolerances))
        return routes

    def _pinnable(self, model: str, loaded: tuple[str, ...]) -> list[PinnedVersion]:
        """A lane's versions a client may pin on the front: loaded (routed_total names them; another
        is counted as "other" by the Python chain) and their spec fetched (by the Python chain, on
        the first request that pins one, or warmed as the model's fallback), screened as the model
        is. Whether one is trusted now is the front's admission's to judge (the published `Ended`)."""
        core = self.core
        policy = core.policy(model)
        pinnable: list[PinnedVersion] = []
        for version, spec in sorted(core.specs.cached_versions(model).items()):
            if version not in loaded or not version.isdigit():
                continue
            hidden: list[str] | None = None
            if policy.is_hidden is not None:
                if not spec.outputs:
                    continue  # outputs undeclared: only the Python filter can judge them by name
                hidden = sorted(o for o in spec.outputs if policy.is_hidden(o))
            pinnable.append((version, spec.native, hidden))
        return pinnable

    def _warm(self, model: str, version: str) -> None:
        """Fetch the spec of `version` of the model ("" = unversioned) in the background, so that
        its requests are the front's from the first one on."""
        key = f"{model}:{version}" if version else model
        if key in self._warming or self._tick is None:
            return

        async def fetch() -> None:
            try:
                await self.core.specs.get(model, version)
            except Exception as e:  # the Python chain fetches it again (and refuses) on a request
                log.debug("http_front_spec_not_fetched", model=model, version=version, cause=cut(repr(e), 200))
            finally:
                self._warming.pop(key, None)
            self.publish()

        self._warming[key] = asyncio.get_running_loop().create_task(fetch(), name=f"http-front-spec:{key}")

    def health(self) -> list[Canned]:
        """/v2/health/live and /v2/health/ready as the Python routes answer them now (one rule:
        http_routes' live_refusal and ready_refusal). Published on every tick and at once on a
        transition or a drain, so the front's answer is never older than a tick (50 ms while it
        serves, a second when idle); when this loop stalls the front forwards them again."""
        return [_canned(path, refusal(self.app))
                for path, refusal in (("/v2/health/live", live_refusal), ("/v2/health/ready", ready_refusal))]

    def serving(self) -> list[tuple[str, bool]] | None:
        """grpc.health.v1's status of "" and each guarded model (http_routes.serving_status, the rule
        the grpcio front's HealthService answers by), for the Rust gRPC front's Check and Watch; None
        when the gRPC port is not the front's. Published with the rest, at once on a transition, so a
        Watch sees a change as soon as the health loop makes it."""
        if not self.grpc_port:
            return None
        return serving_statuses(self.app)

    def documents(self) -> Documents:
        """What http_routes' document routes read of the control plane's state now."""
        core = self.core
        models = []
        for model in self.app[STATES].names():
            is_hidden = core.filter.for_model(model)
            spec = core.specs.cached(model, "") if is_hidden is not None else None
            judged = [(o, bool(is_hidden(o))) for o in spec.outputs] if is_hidden and spec and spec.outputs else None
            models.append((model, is_hidden is not None, _model_ready(model_ready_refusal(self.app, model)), judged))
        return models, core.settings.allow_statistics, sorted(exposed_extension_names(core))

    def publish(self, *, force: bool = False) -> None:
        if self._native is None:
            return
        lanes, ended, guards = self.lanes()
        health = self.health()
        serving = self.serving()
        documents = self.documents()
        routes = self.routes()
        key = (tuple((m, id(s), _names(h), c, id(g), i, tuple((v, id(vs), _names(vh)) for v, vs, vh in p), st)
                     for m, s, h, c, g, i, p, st in lanes),
               tuple((m, s, b, _names(v)) for m, s, b, *_, v in ended), tuple(health),
               tuple(serving) if serving is not None else None, tuple(guards),
               (tuple((m, f, r, None if j is None else tuple(j)) for m, f, r, j in documents[0]), documents[1],
                tuple(documents[2])),
               tuple((*r[:6], tuple(r[6]), r[7], r[8], tuple(r[9])) for r in routes))
        if key == self._published and not force:
            return
        self._native.publish(lanes, ended, health, serving, guards, documents, routes)
        self._published = key

    async def _run_tick(self) -> None:
        served: tuple[int, int] | None = None
        delay = TICK_S
        while True:
            await asyncio.sleep(delay)
            try:
                self._drain_events()
                self.publish()
            except Exception:
                log.exception("http_front_tick_failed")
            assert self._native is not None
            busy = (self._native.fast_requests, self._native.in_flight)
            delay = TICK_S if busy != served else IDLE_TICK_S
            served = busy

    # -- up: events -------------------------------------------------------------------------------------

    def _woken(self) -> None:
        assert self._wake is not None
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while self._wake.recv(4096):
                pass
        try:
            self._drain_events()
        except Exception:
            log.exception("http_front_events_failed")

    def _drain_events(self) -> None:
        if self._native is None:
            return
        events = self._native.drain_events()
        if not events:
            return
        core = self.core
        signals = core.signals
        for event in events:
            kind = event[0]
            if kind == "answered":
                signals.upstream_answered(event[1])
            elif kind == "log":
                (_, request_id, trace_id, model, method, path, status, duration_ms, reason, client_subject,
                 span_id) = event
                fields: dict[str, Any] = {"request_id": request_id, "trace_id": trace_id, "model": model,
                                          "protocol": "http", "method": method, "path": path, "status": status,
                                          "duration_ms": duration_ms}
                if span_id:  # traced by the front: the trace and the front's span in it
                    fields["span_id"] = span_id
                if reason:
                    fields["reason"] = reason
                if client_subject:
                    fields["client_subject"] = client_subject
                if status == 499:
                    log.info("client_disconnected", model=model, request_id=request_id,
                             cause="client closed the connection while Triton was answering; upstream call cancelled")
                (log.warning if status >= 500 else log.info)("proxy_request", **fields)
            elif kind == "grpc_log":
                _, request_id, trace_id, model, path, code, duration_ms, reason, client_subject, span_id = event
                fields = {"request_id": request_id, "trace_id": trace_id, "model": model, "protocol": "grpc",
                          "method": "grpc", "path": path, "status": code, "duration_ms": duration_ms}
                if span_id:
                    fields["span_id"] = span_id
                if reason:
                    fields["reason"] = reason
                if client_subject:
                    fields["client_subject"] = client_subject
                server_side = code in ("UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "DATA_LOSS")
                (log.warning if server_side else log.info)("proxy_request", **fields)
            elif kind == "failed":
                _, model, how, status, detail = event
                if how == "unreachable":
                    core._events.triton_unreachable(f"proxied request could not connect: {cut(detail, 160)}")
                elif how == "server_error":
                    stub_dead = isinstance(triton_error(status, detail), StubUnhealthy)
                    signals.upstream_failed(model, f"Triton answered {status}: {detail}", stub_dead=stub_dead)
                elif how in ("error_answer", "error_event"):
                    # Triton's error inside a 200: a generate answer {"error"} or a stream's error event
                    # (the event may be Triton's verdict that the stub died: SseStreamExchange.screen).
                    stub_dead = how == "error_event" and isinstance(triton_error(500, detail), StubUnhealthy)
                    signals.upstream_failed(model, f"Triton answered with an error: {detail}", stub_dead=stub_dead)
                else:
                    signals.upstream_failed(model, detail)
            elif kind == "non_finite":
                signals.non_finite_answer(event[1], event[2])
            elif kind == "recorded":
                core.drift.recorded(event[1])
            elif kind == "rollout_answered":
                _, model, version, latency_s, error = event
                core.front_answered(model, version, latency_s, error)
            elif kind == "shadow_ended":
                _, model, target, latency_s, outcome, nan, differences = event
                core.front_shadow_ended(model, target, latency_s, outcome, nan, differences)
            elif kind == "ended":
                _, model, count = event
                core.metrics.requests.quarantined(model, "ended_at_triton", count)
                log.warning("requests_ended_at_quarantine", model=model, requests=count,
                            cause="the model was quarantined while these requests waited at Triton; they were "
                                  "answered 503 with Retry-After and their connections to Triton closed")
            elif kind == "grpc_panic":
                _, model, request_id, cause = event
                log.error("proxy_internal_error", model=model, cause=cause, protocol="grpc", request_id=request_id)
            elif kind == "panic":
                log.error("proxy_internal_error", model=event[1], cause=event[2], protocol="http")
            elif kind == "tls_refused":
                _, reason, client_subject, protocol = event
                tls_log.warning("tls_client_refused", reason=reason, client_subject=client_subject, protocol=protocol)
            elif kind == "stream_ended":
                _, model, reason, count, cause = event
                log.warning("stream_ended", model=model, reason=reason, events=count, cause=cause)
            elif kind == "repository":
                _, number, status, code, message = event
                answered = self._repository_calls.get(number)
                if answered is not None and not answered.done():
                    answered.set_result((status, code, message))


class UpstreamStats:
    """The Rust front's pool to Triton, read live: the attributes UpstreamPool has for the same."""

    def __init__(self, native: NativeFront) -> None:
        self._native = native

    @property
    def connections_opened(self) -> int:
        return self._native.upstream_pool[0]

    @property
    def reused(self) -> int:
        return self._native.upstream_pool[1]

    @property
    def idle(self) -> int:
        return self._native.upstream_pool[2]

    @property
    def open_connections(self) -> int:
        return self._native.upstream_pool[3]


def _canned(path: str, refusal: Refusal | None) -> Canned:
    if refusal is None:
        return path, 200, b"", None, ""
    return path, refusal.status, json.dumps(refusal.body()).encode(), refusal.retry_after, refusal.reason.value


def _model_ready(refusal: Refusal | None) -> ModelReady:
    return None if refusal is None else (refusal.status, json.dumps(refusal.body()).encode(), refusal.retry_after)


def _names(names: list[str] | None) -> tuple[str, ...] | None:
    """A published list as part of the key `publish` compares (None stays None: it means "all")."""
    return tuple(names) if names is not None else None


def _tls_material(tls: ServerTls, material: TlsMaterial) -> tuple[bytes, bytes, bytes | None, list[str], str]:
    """What the front's rustls configuration is built from: the PEM bytes ServerTls checked, the
    allowed client SANs and the lowest version."""
    section = tls.section
    return material.cert_pem, material.key_pem, material.ca_pem, list(section.client_allowed_sans), section.min_version


def _tracing(section: TracingSection) -> tuple[str, bytes | None, tuple[bytes, bytes] | None, float, bool, str, str,
                                               list[tuple[str, str]], int, int, float, float] | None:
    """The resolved tracing section as the front takes it (it reads no environment and no file of its
    own): for an https:// collector, with the CA bundle both exporters trust and the client certificate
    both present when it asks for one; None while tracing is off."""
    if not section.enabled:
        return None
    ca_pem = identity = None
    if section.endpoint.startswith("https://"):
        ca_pem = _ca_bundle(section.ca_file)
        if section.client_cert_file:
            identity = (_read_tracing_file("client_cert_file", section.client_cert_file),
                        _read_tracing_file("client_key_file", section.client_key_file))
    return (section.endpoint, ca_pem, identity, section.sample_rate, section.parent_based, section.service_name,
            __version__, sorted(section.resource_attributes.items()), section.queue_size, section.batch_size,
            section.export_delay_s, section.export_timeout_s)


def _read_tracing_file(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"key 'tracing.{key}': cannot read {path!r}: {e.strerror}") from e


def _ca_bundle(ca_file: str) -> bytes:
    """tracing.ca_file's PEM, or the bundle Python's OTLP exporter (requests) trusts when it is unset:
    REQUESTS_CA_BUNDLE's or CURL_CA_BUNDLE's when the environment names one, else certifi's."""
    path = ca_file or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or certifi.where()
    return _read_tracing_file("ca_file", path)


def http_server(app: web.Application) -> SidecarListener | HttpFront:
    """What serves listen.port: `listen.front` (rust: the data plane's front; python: the listener)."""
    return HttpFront(app) if app[CONFIG].listen.front == "rust" else SidecarListener(app)
