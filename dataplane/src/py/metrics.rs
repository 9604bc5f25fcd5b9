//! `RequestMetrics`: the per-request counters of `metrics::request`, counted by whichever front
//! serves a request and read by sidecar/metrics.py's collector at scrape time.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::metrics::request;

#[pyclass(frozen, module = "sidecar._dataplane")]
pub struct RequestMetrics {
    /// Shared with the HTTP front's runtime, which counts into it without Python.
    pub(crate) inner: Arc<request::RequestMetrics>,
}

#[pymethods]
impl RequestMetrics {
    #[new]
    fn new(latency_bounds: Vec<f64>, event_count_bounds: Vec<f64>) -> Self {
        RequestMetrics { inner: Arc::new(request::RequestMetrics::new(latency_bounds, event_count_bounds)) }
    }

    /// One request answered with `code` after `seconds`.
    fn finish(&self, protocol: &str, model: &str, code: &str, seconds: f64) {
        self.inner.finish(protocol, model, code, seconds);
    }

    fn rejected(&self, protocol: &str, model: &str, reason: &str) {
        self.inner.rejections.inc(&[protocol, model, reason]);
    }

    fn internal_error(&self, protocol: &str, model: &str) {
        self.inner.internal_errors.inc(&[protocol, model]);
    }

    fn filtered(&self, model: &str, outputs: Vec<String>) {
        for output in &outputs {
            self.inner.outputs_filtered.inc(&[model, output]);
        }
    }

    fn routed(&self, model: &str, version: &str, reason: &str) {
        self.inner.routed.inc(&[model, version, reason]);
    }

    /// A shadow call of `model` not made: proxy.max_shadow_in_flight were running.
    fn shadow_dropped(&self, model: &str) {
        self.inner.shadow_dropped.inc(&[model]);
    }

    /// `n` requests to `model` met its quarantine with `outcome` (rejected, held_released, held_timeout,
    /// suspect_released, suspect_refused, suspect_timeout, ended_at_triton).
    #[pyo3(signature = (model, outcome, n = 1))]
    fn quarantined(&self, model: &str, outcome: &str, n: u64) {
        self.inner.quarantined.add(&[model, outcome], n);
    }

    /// Requests counted under (model, outcome) of proxy_quarantined_total, 0 when none.
    fn quarantined_count(&self, model: &str, outcome: &str) -> u64 {
        self.inner.quarantined.value(&[model, outcome]).unwrap_or(0)
    }

    /// A request to `model` went to Triton (+1) or came back (-1).
    fn in_flight_add(&self, model: &str, delta: i64) {
        self.inner.in_flight.add(&[model], delta);
    }

    /// A request to `model` began waiting for a breaker slot (+1) or stopped waiting (-1).
    fn queued_add(&self, model: &str, delta: i64) {
        self.inner.queued.add(&[model], delta);
    }

    /// A client connection on listen.port opened (+1) or closed (-1).
    fn connection_opened(&self, delta: i64) {
        self.inner.connections_open.fetch_add(delta, Ordering::Relaxed);
    }

    fn connection_refused(&self) {
        self.inner.connections_refused.inc(&[]);
    }

    fn connection_timeout(&self, phase: &str) {
        self.inner.connection_timeouts.inc(&[phase]);
    }

    fn lingering_end(&self, how: &str) {
        self.inner.lingering_ends.inc(&[how]);
    }

    /// `n` TLS handshakes failed for `reason` (0: only make the series, shown at zero).
    #[pyo3(signature = (reason, n = 1))]
    fn tls_handshake_failed(&self, reason: &str, n: u64) {
        self.inner.tls_handshake_failures.add(&[reason], n);
    }

    /// A stream to `model` took its breaker slot (+1) or gave it back (-1).
    fn stream_opened(&self, model: &str, delta: i64) {
        self.inner.streams.in_flight.add(&[model], delta);
    }

    /// A stream's first write to its client, `seconds` after the request began.
    fn stream_first_event(&self, model: &str, seconds: f64) {
        self.inner.streams.first_event.observe(&[model], seconds);
    }

    /// `seconds` between two writes of one stream.
    fn stream_inter_event(&self, model: &str, seconds: f64) {
        self.inner.streams.inter_event.observe(&[model], seconds);
    }

    /// A stream that began ended after `events` events; `outcome`: complete, or the ending's reason.
    fn stream_ended(&self, model: &str, events: u64, outcome: &str) {
        self.inner.streams.ended(model, events, outcome);
    }

    /// `n` spans the collector took (Python's exporter; the front's counts on its own).
    fn spans_exported(&self, n: u64) {
        self.inner.tracing_spans_exported.add(&[], n);
    }

    /// `n` spans lost for `reason` (queue_full, export_failed; 0: only make the series).
    fn spans_dropped(&self, reason: &str, n: u64) {
        self.inner.tracing_spans_dropped.add(&[reason], n);
    }

    /// Requests counted under (protocol, model, code), 0 when none.
    fn requests(&self, protocol: &str, model: &str, code: &str) -> u64 {
        self.inner.requests.value(&[protocol, model, code]).unwrap_or(0)
    }

    /// Requests routed to (model, version, reason), 0 when none.
    fn routed_count(&self, model: &str, version: &str, reason: &str) -> u64 {
        self.inner.routed.value(&[model, version, reason]).unwrap_or(0)
    }

    /// Every series now: {family: [(label values, value)]} for the counters; the histogram as
    /// "duration": [(label values, cumulative bucket counts with +Inf last, sum)], the streams'
    /// histograms alike ("stream_first_event", "stream_inter_event", "stream_events"), their gauge
    /// ("streams_in_flight") and counter ("stream_endings").
    fn collect<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let m = &self.inner;
        for (name, family) in [
            ("requests", &m.requests),
            ("rejections", &m.rejections),
            ("internal_errors", &m.internal_errors),
            ("outputs_filtered", &m.outputs_filtered),
            ("routed", &m.routed),
            ("shadow_dropped", &m.shadow_dropped),
            ("quarantined", &m.quarantined),
            ("connections_refused", &m.connections_refused),
            ("connection_timeouts", &m.connection_timeouts),
            ("lingering_ends", &m.lingering_ends),
            ("tls_handshake_failures", &m.tls_handshake_failures),
            ("tracing_spans_exported", &m.tracing_spans_exported),
            ("tracing_spans_dropped", &m.tracing_spans_dropped),
        ] {
            out.set_item(name, family.samples())?;
        }
        out.set_item("duration", m.duration.samples())?;
        out.set_item("connections_open", m.connections_open.load(Ordering::Relaxed))?;
        out.set_item("in_flight", m.in_flight.samples())?;
        out.set_item("stream_first_event", m.streams.first_event.samples())?;
        out.set_item("stream_inter_event", m.streams.inter_event.samples())?;
        out.set_item("stream_events", m.streams.events.samples())?;
        out.set_item("streams_in_flight", m.streams.in_flight.samples())?;
        out.set_item("stream_endings", m.streams.endings.samples())?;
        out.set_item("queued", m.queued.samples())?;
        Ok(out)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestMetrics>()
}
