//! The spans of the requests the front serves on a lane, kept as plain records while the request
//! runs and turned into the SDK's `SpanData` off its thread.
//!
//! Why not the SDK's own span on the request's task: an SDK span is made of attribute and event
//! vectors of `KeyValue`s built one by one, a lock, and a channel send to the batch processor when
//! it ends. Timed in a loop that costs ~3 µs a span, but in the front, between requests that evict
//! it from the caches, its thread paid 10-15 µs a sampled request (bench/RESULTS.md §1o): 1.2× the
//! whole request at sample rate 1.0. So a lane's span is what linkerd2-proxy keeps for its own: ids,
//! times, a few fields, written with no allocation but the record's; `Recorder`'s thread wakes a few
//! times a second, builds the `SpanData` of every record waiting, and hands them to the same batch
//! processor (and OTLP exporter) as the SDK's spans. The SDK keeps sampling and ids, the export,
//! and the spans Python writes (`PythonSpan`), which go through its tracer as before.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{Event, SpanContext, SpanId, SpanKind, Status};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks, SpanProcessor};

use crate::metrics::request::RequestMetrics;

use super::tracing::Route;

/// How often the recorder's thread hands waiting records on: well inside the export delay (5 s by
/// default), so a span is exported as soon as the SDK's spans are, and rare enough to cost nothing.
pub const HAND_ON_EVERY: Duration = Duration::from_millis(200);

/// One event of a record: a phase's end (`duration_ms` since the previous one) or a moment with
/// its own attributes (rare: a stream's end).
pub struct Noted {
    pub name: &'static str,
    pub at: SystemTime,
    pub duration_ms: Option<f64>,
    pub attributes: Vec<KeyValue>,
}

/// How a request ended, as its span's last attributes say.
pub enum Outcome {
    Http { status: u16 },
    Grpc { code: u8, name: &'static str },
}

/// A lane request's span: what it is, its events, and how it ended.
pub struct Record {
    pub context: SpanContext,
    /// The client's span when it sent a traceparent (remote), else INVALID (a new trace).
    pub parent: SpanId,
    pub route: Route,
    pub start: SystemTime,
    pub model: String,
    /// The client's pin, "" for none.
    pub version: String,
    pub request_id: String,
    pub body_bytes: usize,
    pub events: Vec<Noted>,
    pub end: SystemTime,
    pub outcome: Outcome,
    /// The refusal reason label, "" for none.
    pub reason: String,
    pub bytes_out: u64,
    /// A failed request's description (`[reason] message`, cut): the span's error status.
    pub error: Option<String>,
}

impl Record {
    /// The SDK's span of this record: the attributes and events the SDK span had, in the same order.
    fn span_data(self, scope: &InstrumentationScope) -> SpanData {
        let (routed, version) = match self.version.as_str() {
            "" => ("default", None),
            _ => ("pinned", Some(KeyValue::new("sidecar.model.version", self.version))),
        };
        let mut attributes = Vec::with_capacity(12);
        attributes.push(KeyValue::new("sidecar.model", self.model));
        attributes.push(KeyValue::new("sidecar.request_id", self.request_id));
        attributes.push(KeyValue::new("sidecar.routing.reason", routed));
        attributes.extend(version);
        match self.route {
            Route::Http(endpoint) => attributes.extend([
                KeyValue::new("sidecar.protocol", "http"),
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("http.route", endpoint.route()),
                KeyValue::new("http.request.body.size", self.body_bytes as i64),
            ]),
            Route::Grpc { service, method, .. } => attributes.extend([
                KeyValue::new("sidecar.protocol", "grpc"),
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", service),
                KeyValue::new("rpc.method", method),
                KeyValue::new("rpc.request.body.size", self.body_bytes as i64),
            ]),
        }
        match self.outcome {
            Outcome::Http { status } => attributes.extend([
                KeyValue::new("http.response.status_code", i64::from(status)),
                KeyValue::new("sidecar.status", status_text(status)),
                KeyValue::new("http.response.body.size", self.bytes_out as i64),
            ]),
            Outcome::Grpc { code, name } => attributes.extend([
                KeyValue::new("rpc.grpc.status_code", i64::from(code)),
                KeyValue::new("sidecar.status", name),
                KeyValue::new("rpc.response.body.size", self.bytes_out as i64),
            ]),
        }
        if !self.reason.is_empty() {
            attributes.push(KeyValue::new("sidecar.refusal.reason", self.reason));
        }
        let mut events = SpanEvents::default();
        events.events = self
            .events
            .into_iter()
            .map(|noted| {
                let mut attributes = noted.attributes;
                if let Some(ms) = noted.duration_ms {
                    attributes.push(KeyValue::new("sidecar.duration_ms", ms));
                }
                Event::new(noted.name, noted.at, attributes, 0)
            })
            .collect();
        SpanData {
            span_context: self.context,
            parent_span_id: self.parent,
            parent_span_is_remote: self.parent != SpanId::INVALID,
            span_kind: SpanKind::Server,
            name: Cow::Borrowed(self.route.span_name()),
            start_time: self.start,
            end_time: self.end,
            attributes,
            dropped_attributes_count: 0,
            events,
            links: SpanLinks::default(),
            status: match self.error {
                Some(description) => Status::error(description),
                None => Status::Unset,
            },
            instrumentation_scope: scope.clone(),
        }
    }
}

/// The status as the `sidecar.status` attribute: the statuses a front answers with are static
/// strings (no allocation per span).
pub fn status_text(status: u16) -> opentelemetry::Value {
    let text = match status {
        200 => "200",
        400 => "400",
        403 => "403",
        404 => "404",
        408 => "408",
        413 => "413",
        422 => "422",
        429 => "429",
        499 => "499",
        500 => "500",
        502 => "502",
        503 => "503",
        504 => "504",
        _ => return status.to_string().into(),
    };
    text.into()
}

/// Where ended records wait for the recorder's thread, and that thread.
pub struct Recorder {
    waiting: Arc<Mutex<Vec<Record>>>,
    /// Spans the batch processor holds and no export has taken yet (its gate's count).
    pending: Arc<AtomicUsize>,
    /// Records waiting and spans pending at most, together (tracing.queue_size): past it a record is
    /// dropped and counted, as the batch processor's gate drops a span.
    limit: usize,
    metrics: Arc<RequestMetrics>,
    stop: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
}

impl Recorder {
    /// Start the thread that hands records on to `processor` (the front's batch processor) `every`
    /// so often (HAND_ON_EVERY) and when it stops; `(pending, limit)`: the processor's count of the
    /// spans it holds, and tracing.queue_size, which bounds them and the records waiting together.
    pub fn start(
        processor: Arc<dyn SpanProcessor>,
        scope: InstrumentationScope,
        (pending, limit): (Arc<AtomicUsize>, usize),
        metrics: Arc<RequestMetrics>,
        every: Duration,
    ) -> std::io::Result<Recorder> {
        let waiting: Arc<Mutex<Vec<Record>>> = Arc::new(Mutex::new(Vec::new()));
        let (stop_tx, stop_rx) = std::sync::mpsc::channel();
        let handle = {
            let waiting = waiting.clone();
            std::thread::Builder::new()
                .name("sidecar-spans".to_owned())
                .spawn(move || hand_on(&waiting, processor.as_ref(), &scope, &stop_rx, every))?
        };
        Ok(Recorder { waiting, pending, limit, metrics, stop: Mutex::new(Some((stop_tx, handle))) })
    }

    /// An ended record: kept for the thread (no wake: it comes by itself), or dropped and counted
    /// when `limit` are already waiting.
    pub fn push(&self, record: Record) {
        let Ok(mut waiting) = self.waiting.lock() else {
            return;
        };
        if waiting.len() + self.pending.load(Ordering::Acquire) >= self.limit {
            drop(waiting);
            self.metrics.tracing_spans_dropped.inc(&["queue_full"]);
            return;
        }
        waiting.push(record);
    }

    /// Hand on what waits and stop the thread (blocking: at most one hand-on).
    pub fn stop(&self) {
        let stopping = self.stop.lock().ok().and_then(|mut stop| stop.take());
        if let Some((tx, handle)) = stopping {
            drop(tx);
            let _ = handle.join();
        }
    }
}

fn hand_on(
    waiting: &Mutex<Vec<Record>>,
    processor: &dyn SpanProcessor,
    scope: &InstrumentationScope,
    stop: &Receiver<()>,
    every: Duration,
) {
    // Two buffers swapped, each keeping its capacity: the front pushes into one while this thread
    // empties the other, so neither grows again by reallocation nor is freed here (a vector of a
    // few hundred records freed on this thread made the front's allocator consolidate its arena).
    let mut spare: Vec<Record> = Vec::new();
    loop {
        let stopping = !matches!(stop.recv_timeout(every), Err(RecvTimeoutError::Timeout));
        match waiting.lock() {
            Ok(mut waiting) => std::mem::swap(&mut *waiting, &mut spare),
            Err(_) => return,
        }
        for record in spare.drain(..) {
            processor.on_end(record.span_data(scope));
        }
        if stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{TraceFlags, TraceId, TraceState};
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::Span;

    use super::*;
    use crate::front::generate::Endpoint;

    /// What the recorder hands on, kept for the test.
    #[derive(Debug, Default)]
    struct Kept {
        spans: Mutex<Vec<SpanData>>,
        ends: AtomicUsize,
    }

    #[derive(Debug)]
    struct Keep(Arc<Kept>);

    impl SpanProcessor for Keep {
        fn on_start(&self, _span: &mut Span, _cx: &opentelemetry::Context) {}
        fn on_end(&self, span: SpanData) {
            self.0.ends.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut spans) = self.0.spans.lock() {
                spans.push(span);
            }
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    fn record(n: u8, version: &str, outcome: Outcome, reason: &str) -> Record {
        let context = SpanContext::new(
            TraceId::from_bytes([n; 16]),
            SpanId::from_bytes([n; 8]),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        );
        let now = SystemTime::now();
        Record {
            context,
            parent: SpanId::INVALID,
            route: Route::Http(Endpoint::Infer),
            start: now,
            model: "m".to_owned(),
            version: version.to_owned(),
            request_id: format!("r{n}"),
            body_bytes: 10,
            events: vec![Noted { name: "validation", at: now, duration_ms: Some(0.5), attributes: Vec::new() }],
            end: now,
            outcome,
            reason: reason.to_owned(),
            bytes_out: 20,
            error: (!reason.is_empty()).then(|| format!("[{reason}] no")),
        }
    }

    #[test]
    fn records_become_the_sdk_s_spans_and_past_the_limit_are_dropped_and_counted() {
        let kept = Arc::new(Kept::default());
        let metrics = Arc::new(RequestMetrics::new(vec![0.1, 1.0], vec![1.0, 10.0]));
        let scope = InstrumentationScope::builder("triton-sidecar").build();
        // Handed on only when it stops: the third record finds two waiting, whatever the machine's load.
        let every = Duration::from_secs(3600);
        let pending = Arc::new(AtomicUsize::new(0));
        let bound = (pending.clone(), 2);
        let recorder =
            Recorder::start(Arc::new(Keep(kept.clone())), scope, bound, metrics.clone(), every).expect("thread");
        recorder.push(record(1, "", Outcome::Http { status: 200 }, ""));
        recorder.push(record(2, "3", Outcome::Grpc { code: 8, name: "RESOURCE_EXHAUSTED" }, "overloaded"));
        recorder.push(record(3, "", Outcome::Http { status: 200 }, "")); // a third waiting: past the limit
        recorder.stop(); // hands on what waits, then ends
        assert_eq!(kept.ends.load(Ordering::SeqCst), 2);
        assert_eq!(metrics.tracing_spans_dropped.value(&["queue_full"]), Some(1));
        let spans = kept.spans.lock().expect("lock");
        let attribute = |span: &SpanData, key: &str| {
            span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.to_string())
        };
        let first = &spans[0];
        assert_eq!(first.name, "POST /v2/models/{model}/infer");
        assert_eq!(attribute(first, "sidecar.routing.reason").as_deref(), Some("default"));
        assert_eq!(attribute(first, "sidecar.model.version"), None);
        assert_eq!(attribute(first, "http.response.status_code").as_deref(), Some("200"));
        assert_eq!(first.status, Status::Unset);
        assert_eq!(first.events.events[0].name, "validation");
        assert_eq!(first.events.events[0].attributes[0].key.as_str(), "sidecar.duration_ms");
        let second = &spans[1];
        assert_eq!(attribute(second, "sidecar.model.version").as_deref(), Some("3"));
        assert_eq!(attribute(second, "sidecar.routing.reason").as_deref(), Some("pinned"));
        assert_eq!(attribute(second, "rpc.grpc.status_code").as_deref(), Some("8"));
        assert_eq!(attribute(second, "sidecar.refusal.reason").as_deref(), Some("overloaded"));
        assert_eq!(second.status, Status::error("[overloaded] no"));
        // Stopped, it hands nothing on any more.
        recorder.push(record(4, "", Outcome::Http { status: 200 }, ""));
        assert_eq!(kept.ends.load(Ordering::SeqCst), 2);
        // The processor's pending spans count against the same bound: with one record waiting and
        // one span pending, a record is refused.
        pending.store(1, Ordering::SeqCst);
        recorder.push(record(5, "", Outcome::Http { status: 200 }, ""));
        assert_eq!(metrics.tracing_spans_dropped.value(&["queue_full"]), Some(2));
    }
}
