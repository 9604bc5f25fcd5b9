//! `RequestMetrics`: the per-request counters of `metrics::request`, counted by whichever front
//! serves a request and read by sidecar/metrics.py's collector at scrape time.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::metrics::request;

#[pyclass(frozen, module = "sidecar._dataplane")]
pub struct RequestMetrics {
    inner: request::RequestMetrics,
}

#[pymethods]
impl RequestMetrics {
    #[new]
    fn new(latency_bounds: Vec<f64>) -> Self {
        RequestMetrics { inner: request::RequestMetrics::new(latency_bounds) }
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

    /// Requests counted under (protocol, model, code), 0 when none.
    fn requests(&self, protocol: &str, model: &str, code: &str) -> u64 {
        self.inner.requests.value(&[protocol, model, code]).unwrap_or(0)
    }

    /// Requests routed to (model, version, reason), 0 when none.
    fn routed_count(&self, model: &str, version: &str, reason: &str) -> u64 {
        self.inner.routed.value(&[model, version, reason]).unwrap_or(0)
    }

    /// Every series now: {family: [(label values, value)]} for the counters; the histogram as
    /// "duration": [(label values, cumulative bucket counts with +Inf last, sum)].
    fn collect<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let m = &self.inner;
        for (name, family) in [
            ("requests", &m.requests),
            ("rejections", &m.rejections),
            ("internal_errors", &m.internal_errors),
            ("outputs_filtered", &m.outputs_filtered),
            ("routed", &m.routed),
        ] {
            out.set_item(name, family.samples())?;
        }
        out.set_item("duration", m.duration.samples())?;
        Ok(out)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestMetrics>()
}
