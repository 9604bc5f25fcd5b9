//! Spans of the requests Python answers, made by the front's tracer (`HttpFront.open_span`): the
//! Python side names the span and writes its attributes, the front samples, records and exports it
//! (`front::tracing::PythonSpan`), so that no Python SDK span is made per request.

use std::sync::Mutex;

use opentelemetry::KeyValue;
use pyo3::prelude::*;

use crate::front::tracing::PythonSpan;

/// An attribute's value as Python gives it (OpenTelemetry's primitive values). `bool` first: a
/// Python bool is an int too.
#[derive(FromPyObject)]
pub enum AttributeValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

fn key_values(attributes: Vec<(String, AttributeValue)>) -> Vec<KeyValue> {
    attributes
        .into_iter()
        .map(|(key, value)| match value {
            AttributeValue::Bool(v) => KeyValue::new(key, v),
            AttributeValue::Int(v) => KeyValue::new(key, v),
            AttributeValue::Float(v) => KeyValue::new(key, v),
            AttributeValue::Str(v) => KeyValue::new(key, v),
        })
        .collect()
}

/// One sampled request span (sidecar/tracing/front_spans.py writes it). Ended once; a second end, or
/// an attribute after it, is ignored.
#[pyclass(module = "sidecar._dataplane", name = "RequestSpan", frozen)]
pub struct RequestSpan {
    open: Mutex<Option<PythonSpan>>,
    #[pyo3(get)]
    traceparent: String,
    #[pyo3(get)]
    tracestate: Option<String>,
    #[pyo3(get)]
    trace_id: String,
    #[pyo3(get)]
    span_id: String,
}

impl RequestSpan {
    pub fn new(span: PythonSpan) -> Self {
        RequestSpan {
            traceparent: span.traceparent.clone(),
            tracestate: span.tracestate.clone(),
            trace_id: span.trace_id().to_owned(),
            span_id: span.span_id().to_owned(),
            open: Mutex::new(Some(span)),
        }
    }
}

#[pymethods]
impl RequestSpan {
    /// Set attributes: `(key, value)` pairs, each value a str, bool, int or float.
    fn set(&self, attributes: Vec<(String, AttributeValue)>) {
        if let Ok(mut open) = self.open.lock() {
            if let Some(span) = open.as_mut() {
                span.set(key_values(attributes));
            }
        }
    }

    /// An event now: a phase of the request that ended (`sidecar.duration_ms`), a wait.
    fn event(&self, name: String, attributes: Vec<(String, AttributeValue)>) {
        if let Ok(mut open) = self.open.lock() {
            if let Some(span) = open.as_mut() {
                span.event(name, key_values(attributes));
            }
        }
    }

    /// End it with these last attributes; `error`: a failed request's description (an error status).
    #[pyo3(signature = (attributes, error = None))]
    fn end(&self, attributes: Vec<(String, AttributeValue)>, error: Option<&str>) {
        let span = self.open.lock().ok().and_then(|mut open| open.take());
        if let Some(mut span) = span {
            span.set(key_values(attributes));
            span.end(error);
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestSpan>()
}
