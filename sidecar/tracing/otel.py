"""The sidecar's spans on the OpenTelemetry SDK, exported over OTLP/HTTP (protobuf) in batches.

Imported only when `tracing.endpoint` is set (`sidecar.app.factory`), so a sidecar without tracing
never loads the SDK. `start_tracing` builds the tracer providers, the sampler, the batch processor and
the exporter; the app owns the result and shuts it down at exit (`OtelTracing.shutdown`).

Export never blocks anything: an ended span is put on a bounded queue (`tracing.queue_size`) that the
SDK's worker thread drains in batches; when the queue is full the oldest span is dropped, and a batch
the collector does not take within `tracing.export_timeout_s` is lost. Both are counted in
`triton_sidecar_tracing_spans_dropped_total{reason}`.

Sampling: requests without a sampled parent and probe rounds are kept at `tracing.sample_rate`
(parent-based unless `tracing.parent_based` is off); heals are always kept, through a second provider
with the always-on sampler that shares the same processor and resource.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import requests
import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sidecar import __version__
from sidecar.config import TracingSection
from sidecar.messages import cut
from sidecar.metrics import SidecarMetrics
from sidecar.tracing.spans import (
    Attributes,
    Span,
    TracedRequest,
    outcome_attributes,
    request_attributes,
    request_span_name,
    upstream_trace,
)

log = structlog.get_logger("sidecar.tracing")


#: The instrumentation scope every span is made under.
SCOPE = "triton-sidecar"


class CountedExporter(SpanExporter):
    """The OTLP exporter, with every span the collector took or did not take counted."""

    def __init__(self, exporter: SpanExporter, *, metrics: SidecarMetrics) -> None:
        self._exporter = exporter
        self._counts = metrics.requests  # the data plane's atomics, which the HTTP front counts into too

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._exporter.export(spans)
        except Exception as e:  # the SDK would log and forget it; count it as the loss it is
            log.warning("tracing_export_failed", spans=len(spans), error=type(e).__name__, cause=cut(str(e), 200))
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._counts.spans_exported(len(spans))
        else:
            self._counts.spans_dropped("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class CountedBatchSpanProcessor(BatchSpanProcessor):
    """The SDK's batch processor, with the spans its full queue drops counted: the SDK drops the
    oldest span silently (a log line), and a dropped span is what the operator needs to see."""

    def __init__(self, exporter: SpanExporter, *, settings: TracingSection, metrics: SidecarMetrics) -> None:
        super().__init__(exporter, max_queue_size=settings.queue_size,
                         schedule_delay_millis=settings.export_delay_s * 1000,
                         max_export_batch_size=settings.batch_size,
                         export_timeout_millis=settings.export_timeout_s * 1000)
        self._counts = metrics.requests
        self._shutdown_ms = settings.export_timeout_s * 1000
        # The SDK's queue (a deque bounded by max_queue_size); None if a future SDK hides it, and then
        # the queue's drops go uncounted rather than the sidecar failing to start.
        self._queue = getattr(getattr(self, "_batch_processor", None), "_queue", None)

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if queue is not None and queue.maxlen is not None and len(queue) >= queue.maxlen:
            self._counts.spans_dropped("queue_full", 1)
        super().on_end(span)

    def shutdown(self) -> None:
        """The last export, bounded by tracing.export_timeout_s (the SDK would wait up to 30 s for a
        collector that does not answer); what is left then is lost."""
        batch = getattr(self, "_batch_processor", None)
        if batch is None:
            super().shutdown()
            return
        batch.shutdown(timeout_millis=self._shutdown_ms)


def sampler_of(settings: TracingSection) -> Sampler:
    """tracing.sample_rate for new traces; parent-based: an incoming context's decision is kept."""
    ratio = TraceIdRatioBased(settings.sample_rate)
    return ParentBased(ratio) if settings.parent_based else ratio


def start_tracing(settings: TracingSection, *, metrics: SidecarMetrics, protocols: frozenset[str],
                  exporter: SpanExporter | None = None) -> OtelTracing:
    """The providers, the batch processor and the OTLP/HTTP exporter for `settings` (its endpoint
    set). `protocols`: the requests that get a server span (those whose front forwards the span's
    traceparent to Triton). `exporter`: another exporter (tests); the OTLP one reads its headers,
    certificates and compression from the standard OTEL_EXPORTER_OTLP_* variables, as the SDKs do."""
    resource = Resource({"service.name": settings.service_name, "service.version": __version__,
                         "telemetry.sdk.language": "python", "telemetry.sdk.name": "opentelemetry",
                         **settings.resource_attributes})
    # certificate_file: tracing.ca_file, the bundle the Rust front's exporter trusts too (None: the
    # exporter's own default; OTEL_EXPORTER_OTLP_CERTIFICATE is already in ca_file).
    exporter = exporter or OTLPSpanExporter(
        endpoint=settings.endpoint, timeout=settings.export_timeout_s, certificate_file=settings.ca_file or None,
        client_certificate_file=settings.client_cert_file or None, client_key_file=settings.client_key_file or None,
        session=_PinnedCaSession() if settings.ca_file else None)
    processor = CountedBatchSpanProcessor(CountedExporter(exporter, metrics=metrics), settings=settings,
                                          metrics=metrics)
    # The app shuts them down (no atexit hook per provider: tests build many apps in one process).
    sampled = TracerProvider(resource=resource, sampler=sampler_of(settings), shutdown_on_exit=False)
    always = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
    for provider in (sampled, always):
        provider.add_span_processor(processor)
    log.info("tracing_started", endpoint=settings.endpoint, sample_rate=settings.sample_rate,
             parent_based=settings.parent_based, service_name=settings.service_name)
    return OtelTracing(sampled=sampled, always=always, protocols=protocols)


class _OtelSpan:
    """A recording span as the health loop writes to it (sidecar.tracing.spans.Span)."""

    __slots__ = ("span",)

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def set(self, attributes: Attributes) -> None:
        self.span.set_attributes(attributes)

    def failed(self, description: str) -> None:
        self.span.set_status(Status(StatusCode.ERROR, cut(description, 500)))

    def event(self, name: str, attributes: Attributes) -> None:
        self.span.add_event(name, attributes)


def _hex_ids(span: trace.Span) -> tuple[str, str] | None:
    """(trace_id, span_id) in hex when the span is sampled (an unsampled span's ids lead nowhere)."""
    context = span.get_span_context()
    if not context.trace_flags.sampled:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def _upstream_of(context: trace.SpanContext) -> tuple[tuple[str, str], ...]:
    """The traceparent (and tracestate) naming a sampled span as the parent of Triton's spans."""
    return upstream_trace(f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}",
                          context.trace_state.to_header() if context.trace_state else None)


class _PinnedCaSession(requests.Session):
    """requests lets REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) win over a session's own `verify` (its
    issue 3829): the exporter would then ignore tracing.ca_file wherever the image sets those
    variables. The CA bundle set here is kept; proxies and the rest still come from the environment."""

    def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        settings["verify"] = self.verify if verify is None else verify
        return settings


class OtelTracing:
    """The sidecar's spans: the health loop's (sidecar.tracing.spans.HealthSpans) and one server span
    per request of the traced protocols (RequestSpans)."""

    def __init__(self, *, sampled: TracerProvider, always: TracerProvider, protocols: frozenset[str]) -> None:
        self._sampled = sampled
        self._always = always
        self.protocols = protocols
        self._tracer = sampled.get_tracer(SCOPE, __version__)
        self._heal_tracer = always.get_tracer(SCOPE, __version__)
        self._propagator = TraceContextTextMapPropagator()

    # -- the health loop -----------------------------------------------------------------------------

    def probe_round(self, model: str, cause: str) -> AbstractContextManager[Span]:
        return self._current(self._tracer, "probe round", {"sidecar.model": model, "sidecar.probe.started_by": cause},
                             context=otel_context.Context())

    def heal(self, model: str, cause: str) -> AbstractContextManager[Span]:
        return self._current(self._heal_tracer, "heal", {"sidecar.model": model, "sidecar.heal.cause": cut(cause, 500)},
                             context=otel_context.Context())

    def heal_step(self, step: str, model: str, attempt: int) -> AbstractContextManager[Span]:
        return self._current(self._heal_tracer, step, {"sidecar.model": model, "sidecar.heal.attempt": attempt})

    def current_trace(self) -> tuple[tuple[str, str], ...]:
        context = trace.get_current_span().get_span_context()
        if not context.is_valid or not context.trace_flags.sampled:
            return ()
        return _upstream_of(context)

    @contextmanager
    def _current(self, tracer: trace.Tracer, name: str, attributes: Attributes,
                 context: otel_context.Context | None = None) -> Iterator[Span]:
        """A span current for the block (a child of the current one unless `context` is given), with its
        ids bound to the log context while it is sampled. An exception marks it failed and goes on."""
        with tracer.start_as_current_span(name, context=context, attributes=attributes, record_exception=False,
                                          set_status_on_exception=False, end_on_exit=True) as span:
            ids = _hex_ids(span)
            tokens = None if ids is None else structlog.contextvars.bind_contextvars(trace_id=ids[0], span_id=ids[1])
            try:
                yield _OtelSpan(span)
            except Exception as e:
                span.set_status(Status(StatusCode.ERROR, cut(str(e) or type(e).__name__, 500)))
                raise
            finally:
                if tokens is not None:
                    structlog.contextvars.reset_contextvars(**tokens)

    # -- requests --------------------------------------------------------------------------------------

    def start(self, scope: TracedRequest, traceparent: str | None, tracestate: str | None, *, method: str,
              path: str, route: str) -> None:
        carrier = {"traceparent": traceparent} if traceparent else {}
        if traceparent and tracestate:
            carrier["tracestate"] = tracestate
        # No traceparent: a new trace, from an empty context (never an ambient one).
        parent = self._propagator.extract(carrier) if carrier else otel_context.Context()
        span = self._tracer.start_span(request_span_name(scope, method=method, path=path, route=route),
                                       context=parent, kind=SpanKind.SERVER,
                                       attributes=request_attributes(scope, method=method, path=path, route=route))
        ids = _hex_ids(span)
        if ids is None:
            return  # not sampled: the client's own traceparent goes on to Triton, as without tracing
        scope.span = span
        scope.trace_id, scope.span_id = ids
        scope.upstream_trace = _upstream_of(span.get_span_context())

    def annotate(self, scope: TracedRequest, attributes: Attributes) -> None:
        scope.span.set_attributes(attributes)

    def event(self, scope: TracedRequest, name: str, attributes: Attributes) -> None:
        scope.span.add_event(name, attributes)

    def end(self, scope: TracedRequest, *, code: str, reason: str, failed: bool, description: str) -> None:
        span = scope.span
        span.set_attributes(outcome_attributes(scope, code=code, reason=reason))
        if failed:
            span.set_status(Status(StatusCode.ERROR, cut(description, 500)))
        span.end()

    # -- lifecycle -------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Export what is queued (bounded by tracing.export_timeout_s) and stop the worker thread.
        Blocking: the app runs it in a thread at exit."""
        for provider in (self._always, self._sampled):
            provider.shutdown()

