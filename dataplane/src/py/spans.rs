//! Spans of the requests Python answers, made by the front's tracer (`HttpFront.open_span`): the
//! Python side names the span and writes its attributes, the front samples, records and exports it
//! (`front::tracing::PythonSpan`), so that no Python SDK span is made per request.

use std::sync::Mutex;

use opentelemetry::{KeyValue, Value};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString};

use crate::front::tracing::PythonSpan;

/// `(key, value)` pairs as Python gives them, each value a str, bool, int or float (OpenTelemetry's
/// primitive values), told apart by type checks. Not a derived enum: it would try each variant in
/// turn and build a Python exception for every miss (three for a str), which cost more per call
/// than the span itself (~7 µs an event, issue 32's gRPC spans).
fn key_values(attributes: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<Vec<KeyValue>> {
    attributes.into_iter().map(|(key, value)| Ok(KeyValue::new(key, attribute_value(&value)?))).collect()
}

fn attribute_value(value: &Bound<'_, PyAny>) -> PyResult<Value> {
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(Value::from(text.to_str()?.to_owned()));
    }
    // bool before int: a Python bool is an int too.
    if let Ok(flag) = value.cast::<PyBool>() {
        return Ok(Value::from(flag.is_true()));
    }
    if value.is_instance_of::<PyInt>() {
        return Ok(Value::from(value.extract::<i64>()?));
    }
    if let Ok(number) = value.cast::<PyFloat>() {
        return Ok(Value::from(number.value()));
    }
    let kind = value.get_type().name().map_or_else(|_| "?".to_owned(), |name| name.to_string());
    Err(PyTypeError::new_err(format!("a span attribute's value is a str, bool, int or float, not {kind}")))
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
    fn set(&self, attributes: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<()> {
        let attributes = key_values(attributes)?;
        if let Ok(mut open) = self.open.lock() {
            if let Some(span) = open.as_mut() {
                span.set(attributes);
            }
        }
        Ok(())
    }

    /// An event now: a phase of the request that ended (`sidecar.duration_ms`), a wait.
    fn event(&self, name: String, attributes: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<()> {
        let attributes = key_values(attributes)?;
        if let Ok(mut open) = self.open.lock() {
            if let Some(span) = open.as_mut() {
                span.event(name, attributes);
            }
        }
        Ok(())
    }

    /// End it with these last attributes; `error`: a failed request's description (an error status).
    #[pyo3(signature = (attributes, error = None))]
    fn end(&self, attributes: Vec<(String, Bound<'_, PyAny>)>, error: Option<&str>) -> PyResult<()> {
        let attributes = key_values(attributes)?;
        let span = self.open.lock().ok().and_then(|mut open| open.take());
        if let Some(mut span) = span {
            span.set(attributes);
            span.end(error);
        }
        Ok(())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestSpan>()
}
