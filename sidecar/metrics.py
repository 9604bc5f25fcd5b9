"""The sidecar's Prometheus metrics, all on one injected `CollectorRegistry` (never the global one).

Label values are bounded: `model` always comes from Triton's repository or the config, never from a
request path that was not matched against them first.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from sidecar import __version__
from sidecar._dataplane import RequestMetrics
from sidecar.states import ModelState

PREFIX = "triton_sidecar"


#: Probe and proxy latencies: 1 ms to 10 s (a probe is bounded by probes.timeout_s).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


#: Heals and recoveries: a small python model reloads in ~1.5 s, a large GPU model in minutes.
#: Events in one generate stream: one per token, from a one-word answer to a long completion.
EVENT_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


#: The states of a version rollout (sidecar.serving.rollouts.RolloutState's values; metrics sits below serving).
ROLLOUT_STATES = ("gating", "progressing", "promoted", "aborted")


#: Why a model's probe round started (sidecar.health.supervisor): its time schedule, its traffic
#: (probes.every_requests), the confirmation of a failed round, or an event (a passive signal from
#: traffic, golden files changed, Triton's late verdict).
ROUND_CAUSES = ("time", "traffic", "confirmation", "event")

#: The evidence that escalates a fault to a restart (sidecar.health.fault_scope.Evidence's values).
ESCALATION_CAUSES = ("sticky_error", "breadth", "device", "history")


HEAL_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class SidecarMetrics:
    """Every metric family the sidecar exports, created once per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        self.build_info = Gauge(f"{PREFIX}_build_info", "Sidecar version (value is always 1).",
                                ["version"], registry=registry)
        self.build_info.labels(version=__version__).set(1)

        # Probes
        self.probes = Counter(f"{PREFIX}_probes", "Probes run, by model, probe kind and result "
                              "(success, failure, timeout).", ["model", "probe", "result"], registry=registry)
        self.probe_duration = Histogram(f"{PREFIX}_probe_duration_seconds", "Duration of one probe call.",
                                        ["model", "probe"], buckets=LATENCY_BUCKETS, registry=registry)
        self.consecutive_failures = Gauge(f"{PREFIX}_probe_consecutive_failures",
                                          "Probe rounds failed in a row, per model.", ["model"], registry=registry)
        self.probe_rounds = Counter(f"{PREFIX}_probe_rounds", "Probe rounds started, by model and cause (time: "
                                    "the interval; traffic: probes.every_requests live requests served; "
                                    "confirmation: a failed round confirmed at once; event: a passive signal, "
                                    "golden files changed or a late verdict).", ["model", "cause"],
                                    registry=registry)
        self.model_state = Gauge(f"{PREFIX}_model_state", "1 for the model's current state, 0 for the others.",
                                 ["model", "state"], registry=registry)

        # Healing
        self.heal_attempts = Counter(f"{PREFIX}_heal_attempts", "Heal attempts (unload, load, verify) by result.",
                                     ["model", "result"], registry=registry)
        self.heal_duration = Histogram(f"{PREFIX}_heal_duration_seconds", "Duration of one heal attempt.",
                                       ["model"], buckets=HEAL_BUCKETS, registry=registry)
        self.time_to_recover = Histogram(f"{PREFIX}_time_to_recover_seconds",
                                         "From the first failed probe to HEALTHY again.",
                                         ["model"], buckets=HEAL_BUCKETS, registry=registry)
        self.heal_errors = Counter(f"{PREFIX}_heal_errors", "Unexpected exceptions inside a heal (a bug or an "
                                   "unforeseen answer); the attempt counts as failed, the model is retried or "
                                   "escalated, never left HEALING.", ["model"], registry=registry)
        self.escalations = Counter(f"{PREFIX}_escalations", "Times a model went FAILED (healing exhausted "
                                   "or flapping); /healthz fails until a restart.", ["model"], registry=registry)
        self.restart_escalations = Counter(f"{PREFIX}_restart_escalations", "Process-level faults escalated to a "
                                           "restart of Triton without reloading, by the evidence that decided "
                                           "(sticky_error, breadth, device, history); carried over from "
                                           "healing.escalation_record_file, so it survives the sidecar's own "
                                           "restarts.", ["cause"], registry=registry)
        for cause in ESCALATION_CAUSES:
            self.restart_escalations.labels(cause=cause)

        # The sidecar's own long-lived tasks (sidecar.health.tasks)
        self.task_crashes = Counter(f"{PREFIX}_task_crashes", "Long-lived tasks that raised and were restarted "
                                    "with backoff, by task kind (supervisor, triton_watch, discovery, reload, "
                                    "rollouts): "
                                    "a kind, never a model name, so the label stays bounded; which model's "
                                    "supervisor crashed is in the task_crashed log event and /status.",
                                    ["task"], registry=registry)
        for kind in ("supervisor", "triton_watch", "discovery", "reload", "rollouts"):
            self.task_crashes.labels(task=kind)

        # Proxy
        # The per-request families are counted by the data plane (atomics in sidecar._dataplane) and read
        # by a collector at scrape time: same names, labels and buckets as ever.
        self.requests = RequestMetrics(list(LATENCY_BUCKETS), [float(b) for b in EVENT_COUNT_BUCKETS])
        registry.register(DataPlaneCollector(self.requests))
        # proxy_quarantined{model, outcome}: the data plane's counter too, counted by the admission of
        # whichever front took the request (`requests.quarantined(model, outcome)`).
        # proxy_in_flight{model}: the data plane's gauge, whichever front serves (DataPlaneCollector).

        # Reloads and discovery
        self.reload_failures = Counter(f"{PREFIX}_reload_failures", "Reloads refused (what: golden, config, "
                                       "drift_reference); the last good cases, settings and references stay in "
                                       "force.", ["what"], registry=registry)
        for what in ("golden", "config", "drift_reference"):
            self.reload_failures.labels(what=what)
        self.model_without_golden = Gauge(f"{PREFIX}_model_without_golden", "1 for a guarded model that has no "
                                          "golden files (probed by readiness and metadata only).", ["model"],
                                          registry=registry)

        # Generate streams (server-sent events from decoupled models): the data plane's families too
        # (DataPlaneCollector, _STREAM_HISTOGRAMS), whichever front relays the stream.

        # Client connections on listen.port: counted by the data plane (whichever front holds them) and
        # exported by DataPlaneCollector (_CONNECTION_COUNTERS, _CONNECTIONS_OPEN).

        # TLS (sidecar/fronts/tls.py): series exist only when tls.cert_file is set
        self.tls_cert_expiry = Gauge(f"{PREFIX}_tls_cert_expiry_timestamp_seconds", "notAfter of the certificate "
                                     "served now (Unix time), by tls.cert_file; a renewal that is not picked up "
                                     "shows here.", ["cert_file"], registry=registry)
        # tls_handshake_failures_total{reason}: counted by the data plane (either front terminates TLS on
        # listen.port; the Rust gRPC front on listen.grpc_port too) and exported by DataPlaneCollector
        # (_CONNECTION_COUNTERS); ServerTls makes its series at zero when tls.cert_file is set.

        # Version rollouts (sidecar.serving.rollouts, docs/rollouts.md)
        self.rollout_share = Gauge(f"{PREFIX}_rollout_share", "The candidate's share of unpinned traffic now.",
                                   ["model", "candidate"], registry=registry)
        self.rollout_state = Gauge(f"{PREFIX}_rollout_state", "1 for the rollout's current state (gating, "
                                   "progressing, promoted, aborted), 0 for the others.", ["model", "state"],
                                   registry=registry)
        self.rollout_compared = Counter(f"{PREFIX}_rollout_compared", "Answers of stable and candidate to the "
                                        "same request compared, by outcome (same, differs).",
                                        ["model", "candidate", "outcome"], registry=registry)
        # shadow_dropped_total{model}: counted by both halves (the Rust front's shadows, the Python
        # chain's) into the data plane's atomics, exported by DataPlaneCollector.

        # Tracing: tracing_spans_exported_total and tracing_spans_dropped_total{reason} are counted by
        # both exporters (Python's, sidecar/tracing/otel.py; the HTTP front's, front/tracing.rs) into
        # the data plane's atomics, exported by DataPlaneCollector (_TRACING_COUNTERS).

        # Triton
        self.triton_up = Gauge(f"{PREFIX}_triton_up", "1 when Triton answers /v2/health/live.", registry=registry)
        self.triton_ready = Gauge(f"{PREFIX}_triton_ready", "1 when Triton answers /v2/health/ready.",
                                  registry=registry)

    def track_model(self, model: str) -> None:
        """Create the model's series at zero, so dashboards and `rate()` see them from the start."""
        for state in ModelState:
            self.model_state.labels(model=model, state=state.value).set(0)
        self.consecutive_failures.labels(model=model).set(0)
        for cause in ROUND_CAUSES:
            self.probe_rounds.labels(model=model, cause=cause)
        for result in ("success", "failure"):
            self.heal_attempts.labels(model=model, result=result)
        self.escalations.labels(model=model)
        self.heal_errors.labels(model=model)

    def forget_model(self, model: str) -> None:
        """Drop a model's gauges once it is no longer guarded, so it does not read as stuck in a state.
        Counters stay: their history is still true."""
        series = [(self.model_state, (model, state.value)) for state in ModelState]
        series += [(self.consecutive_failures, (model,)), (self.model_without_golden, (model,))]
        for gauge, labels in series:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass

    def set_rollout(self, model: str, candidate: str, state: str, share: float) -> None:
        for each in ROLLOUT_STATES:
            self.rollout_state.labels(model=model, state=each).set(1 if each == state else 0)
        self.rollout_share.labels(model=model, candidate=candidate).set(share)
        for outcome in ("same", "differs"):
            self.rollout_compared.labels(model=model, candidate=candidate, outcome=outcome)

    def forget_rollout(self, model: str, candidate: str) -> None:
        """A rollout removed from the config: its gauges go (counters stay, their history is true)."""
        for gauge, labels in [(self.rollout_state, (model, s)) for s in ROLLOUT_STATES] + [
                (self.rollout_share, (model, candidate))]:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass

    def set_state(self, model: str, state: ModelState) -> None:
        for each in ModelState:
            self.model_state.labels(model=model, state=each.value).set(1 if each is state else 0)



#: The data plane's counter families: (key in RequestMetrics.collect(), name without _total, help, labels).
_DATA_PLANE_COUNTERS = (
    ("requests", f"{PREFIX}_proxy_requests", "Proxied requests by protocol (http, grpc), model and status (HTTP "
     "status, or gRPC status code name).", ("protocol", "model", "code")),
    ("rejections", f"{PREFIX}_proxy_rejections", "Requests refused before Triton, by protocol and reason.",
     ("protocol", "model", "reason")),
    ("internal_errors", f"{PREFIX}_proxy_internal_errors", "Requests the sidecar could not answer because of an "
     "unexpected error of its own (a bug: logged as proxy_internal_error with its traceback, answered 500 / "
     "INTERNAL).", ("protocol", "model")),
    ("outputs_filtered", f"{PREFIX}_outputs_filtered", "Outputs removed from answers.", ("model", "output")),
    ("routed", f"{PREFIX}_routed", "Requests sent to a chosen version, by why (split, pinned, shadow, fallback).",
     ("model", "version", "reason")),
    ("shadow_dropped", f"{PREFIX}_shadow_dropped", "Shadow calls not made because proxy.max_shadow_in_flight were "
     "already running.", ("model",)),
    ("quarantined", f"{PREFIX}_proxy_quarantined", "Requests to a quarantined model, by outcome (rejected, "
     "held_released, held_timeout, suspect_released, suspect_refused, suspect_timeout, ended_at_triton).",
     ("model", "outcome")),
)

#: Connection families: (key, name, help, labels, label values always shown with 0 until counted).
_CONNECTION_COUNTERS = (
    ("connections_refused", f"{PREFIX}_http_connections_refused", "Client connections accepted and closed at "
     "once: listen.max_connections were open.", (), [()]),
    ("connection_timeouts", f"{PREFIX}_http_connection_timeouts", "Client connections closed by a timeout, by "
     "phase (header: listen.header_timeout_s, keepalive: listen.keepalive_timeout_s).", ("phase",),
     [("header",), ("keepalive",)]),
    ("lingering_ends", f"{PREFIX}_http_lingering_ends", "Connections closed after an early refusal, by what "
     "ended the lingering (client_closed, drained, time, idle, bytes).", ("how",), []),
    ("tls_handshake_failures", f"{PREFIX}_tls_handshake_failures", "TLS connections refused, by reason (not_tls, "
     "no_client_certificate, client_certificate_rejected, client_san_not_allowed, protocol_version, timeout, "
     "client_closed, other): every failed handshake on listen.port, and on listen.grpc_port with "
     "listen.grpc_front: rust; with grpcio on listen.grpc_port only client_san_not_allowed (gRPC core fails the "
     "others unseen).", ("reason",), []),
)

#: Tracing's families, counted by both exporters (0 while tracing.endpoint is empty); the same shape.
_TRACING_COUNTERS = (
    ("tracing_spans_exported", f"{PREFIX}_tracing_spans_exported", "Spans the collector accepted.", (), [()]),
    ("tracing_spans_dropped", f"{PREFIX}_tracing_spans_dropped", "Spans lost, by reason (queue_full: "
     "tracing.queue_size spans were waiting and one was dropped; export_failed: the collector did not take a "
     "batch within tracing.export_timeout_s). Export never waits for a request, nor a request for export.",
     ("reason",), [("queue_full",), ("export_failed",)]),
)

_IN_FLIGHT = (f"{PREFIX}_proxy_in_flight", "Proxied requests in progress, per model.", ["model"])

_QUEUED = (f"{PREFIX}_proxy_queued", "Proxied requests waiting for a slot at Triton (the breaker's queue, at "
           "most proxy.queue_size_per_model), per model.", ["model"])

_CONNECTIONS_OPEN = (f"{PREFIX}_http_connections", "Client connections open on listen.port (served by the front "
                     "or handed to the Python app).")

_DURATION = (f"{PREFIX}_proxy_request_duration_seconds", "Proxied request duration, as the client saw it.",
             ("protocol", "model"))

#: The streams' histograms: (key in RequestMetrics.collect(), name, help, bucket bounds), by model.
_STREAM_HISTOGRAMS = (
    ("stream_first_event", f"{PREFIX}_stream_first_event_seconds", "From the request to the first event sent to "
     "the client.", LATENCY_BUCKETS),
    ("stream_inter_event", f"{PREFIX}_stream_inter_event_seconds", "Between two events of one stream, as sent "
     "to the client.", LATENCY_BUCKETS),
    ("stream_events", f"{PREFIX}_stream_events", "Events sent in one stream.", EVENT_COUNT_BUCKETS),
)

_STREAMS_IN_FLIGHT = (f"{PREFIX}_streams_in_flight", "Generate streams open, per model.", ["model"])

_STREAM_ENDINGS = (f"{PREFIX}_stream_endings", "Generate streams by how they ended (complete, or the reason of "
                   "their error event).", ("model", "outcome"))


class DataPlaneCollector:
    """The data plane's per-request counters, as Prometheus families at scrape time (one read of the
    atomics per series; nothing is kept here)."""

    def __init__(self, native: RequestMetrics) -> None:
        self._native = native
        self._bounds = [*(_le(b) for b in LATENCY_BUCKETS), "+Inf"]
        self._stream_bounds = {key: [*(_le(float(b)) for b in bounds), "+Inf"]
                               for key, _, _, bounds in _STREAM_HISTOGRAMS}

    def describe(self) -> Iterator[Metric]:
        """The families without samples: what the registry checks names against."""
        for _, name, help_text, labels in _DATA_PLANE_COUNTERS:
            yield CounterMetricFamily(name, help_text, labels=labels)
        yield HistogramMetricFamily(_DURATION[0], _DURATION[1], labels=_DURATION[2])
        for _, name, help_text, labels, _ in (*_CONNECTION_COUNTERS, *_TRACING_COUNTERS):
            yield CounterMetricFamily(name, help_text, labels=labels)
        yield GaugeMetricFamily(*_CONNECTIONS_OPEN)
        yield GaugeMetricFamily(*_IN_FLIGHT)
        for _, name, help_text, _ in _STREAM_HISTOGRAMS:
            yield HistogramMetricFamily(name, help_text, labels=["model"])
        yield GaugeMetricFamily(_STREAMS_IN_FLIGHT[0], _STREAMS_IN_FLIGHT[1], labels=_STREAMS_IN_FLIGHT[2])
        yield CounterMetricFamily(_STREAM_ENDINGS[0], _STREAM_ENDINGS[1], labels=_STREAM_ENDINGS[2])
        yield GaugeMetricFamily(*_QUEUED)

    def collect(self) -> Iterator[Metric]:
        now = self._native.collect()
        for key, name, help_text, labels in _DATA_PLANE_COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=labels)
            for values, count in now[key]:
                family.add_metric(values, count)
            yield family
        name, help_text, labels = _DURATION
        histogram = HistogramMetricFamily(name, help_text, labels=labels)
        for values, cumulative, total in now["duration"]:
            histogram.add_metric(values, list(zip(self._bounds, cumulative, strict=True)), total)
        yield histogram
        for key, name, help_text, labels, always in (*_CONNECTION_COUNTERS, *_TRACING_COUNTERS):
            family = CounterMetricFamily(name, help_text, labels=labels)
            counted = {tuple(values)[:len(labels)]: count for values, count in now[key]}  # "" for no labels
            for values in always:
                counted.setdefault(values, 0)
            for values, count in sorted(counted.items()):
                family.add_metric(list(values), count)
            yield family
        yield GaugeMetricFamily(*_CONNECTIONS_OPEN, value=now["connections_open"])
        in_flight = GaugeMetricFamily(_IN_FLIGHT[0], _IN_FLIGHT[1], labels=_IN_FLIGHT[2])
        for values, value in now["in_flight"]:
            in_flight.add_metric(values, value)
        yield in_flight
        for key, name, help_text, _ in _STREAM_HISTOGRAMS:
            histogram = HistogramMetricFamily(name, help_text, labels=["model"])
            for values, cumulative, total in now[key]:
                histogram.add_metric(values, list(zip(self._stream_bounds[key], cumulative, strict=True)), total)
            yield histogram
        streams = GaugeMetricFamily(_STREAMS_IN_FLIGHT[0], _STREAMS_IN_FLIGHT[1], labels=_STREAMS_IN_FLIGHT[2])
        for values, value in now["streams_in_flight"]:
            streams.add_metric(values, value)
        yield streams
        endings = CounterMetricFamily(_STREAM_ENDINGS[0], _STREAM_ENDINGS[1], labels=_STREAM_ENDINGS[2])
        for values, count in now["stream_endings"]:
            endings.add_metric(values, count)
        yield endings
        queued = GaugeMetricFamily(_QUEUED[0], _QUEUED[1], labels=_QUEUED[2])
        for values, value in now["queued"]:
            queued.add_metric(values, value)
        yield queued


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client's own histograms write it."""
    return floatToGoString(bound)
