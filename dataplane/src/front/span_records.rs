//! The spans of the requests the front serves on a lane, kept as plain records while the request
//! runs, and the one thread that makes every span of the front OTLP and posts it.
//!
//! Why not the SDK's own span on the request's task: an SDK span is made of attribute and event
//! vectors of `KeyValue`s built one by one, a lock, and a channel send to the batch processor when
//! it ends. Timed in a loop that costs ~3 µs a span, but in the front, between requests that evict
//! it from the caches, its thread paid 10-15 µs a sampled request (bench/RESULTS.md §1o): 1.2× the
//! whole request at sample rate 1.0. So a lane's span is what linkerd2-proxy keeps for its own: ids,
//! times, a few fields, written with no allocation but the record's; `Recorder`'s thread wakes a few
//! times a second, builds the `SpanData` of every record waiting and posts them in batches through
//! the SDK's OTLP exporter, with the spans the SDK's tracer made (Python's, `PythonSpan`), which
//! `QueueProcessor` puts on the same queue. The SDK keeps sampling and ids, the spans Python writes,
//! the OTLP encoding and the export.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::trace::{Event, SpanContext, SpanId, SpanKind, Status};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanEvents, SpanExporter, SpanLinks, SpanProcessor};

use crate::metrics::request::RequestMetrics;

use super::tracing::Route;

/// How often the span thread takes what waits: well inside the export delay (5 s by default), and
/// rare enough to cost nothing; a batch of tracing.batch_size goes as soon as the thread has it.
pub const HAND_ON_EVERY: Duration = Duration::from_millis(200);

/// One event of a record: a phase's end (its `sidecar.duration_ms` counts from the previous phase's
/// end, or the record's opening) or a moment with its own attributes (rare: a stream's end). One
/// monotonic clock read each, made wall-clock time on the span thread (`Clock`).
pub struct Noted {
    pub name: &'static str,
    pub at: Instant,
    pub phase: bool,
    pub attributes: Vec<KeyValue>,
}

/// The two clocks read together when a record opens: every later moment of the record is a
/// monotonic reading, turned into wall-clock time from this pair off the request's thread.
#[derive(Clone, Copy)]
pub struct Clock {
    pub instant: Instant,
    pub wall: SystemTime,
}

impl Clock {
    pub fn now() -> Clock {
        Clock { instant: Instant::now(), wall: SystemTime::now() }
    }

    /// The wall-clock time of the monotonic reading `at`.
    pub fn wall(self, at: Instant) -> SystemTime {
        match at.checked_duration_since(self.instant) {
            Some(after) => self.wall + after,
            None => self.wall - self.instant.duration_since(at),
        }
    }
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
    /// When the request's head was read: the span's start.
    pub start: Instant,
    /// When the record opened (the first phase counts from here), with the wall clock then.
    pub opened: Clock,
    pub model: String,
    /// The version the request went to (the client's pin, or the fallback), "" for none.
    pub version: String,
    /// Why it went there (routing.Router.route's reason).
    pub routed: super::state::Routed,
    pub request_id: String,
    pub body_bytes: usize,
    pub events: Vec<Noted>,
    pub end: Instant,
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
            _ => (self.routed.label(), Some(KeyValue::new("sidecar.model.version", self.version))),
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
        let clock = self.opened;
        let mut mark = clock.instant;
        let mut events = SpanEvents::default();
        events.events = self
            .events
            .into_iter()
            .map(|noted| {
                let mut attributes = noted.attributes;
                if noted.phase {
                    let ms = noted.at.saturating_duration_since(mark).as_secs_f64() * 1000.0;
                    attributes.push(KeyValue::new("sidecar.duration_ms", ms));
                    mark = noted.at;
                }
                Event::new(noted.name, clock.wall(noted.at), attributes, 0)
            })
            .collect();
        SpanData {
            span_context: self.context,
            parent_span_id: self.parent,
            parent_span_is_remote: self.parent != SpanId::INVALID,
            span_kind: SpanKind::Server,
            name: Cow::Borrowed(self.route.span_name()),
            start_time: clock.wall(self.start),
            end_time: clock.wall(self.end),
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

/// What waits for the span thread: a lane's record, or a span the SDK made (those Python writes
/// through `HttpFront.open_span`, and the front's refusals), handed in by `QueueProcessor`.
pub enum Waiting {
    Record(Box<Record>),
    Span(Box<SpanData>),
}

/// What the span thread is asked besides its round every HAND_ON_EVERY.
enum Control {
    /// Export everything now and say how it went (the SDK provider's force_flush).
    Flush(SyncSender<OTelSdkResult>),
    /// A last round, then end: what is not posted by the deadline is lost (and counted).
    Stop(Instant),
}

/// The export settings the thread keeps (tracing.batch_size, export_delay_s, queue_size).
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    /// How often the thread takes what waits (HAND_ON_EVERY).
    pub every: Duration,
    pub batch_size: usize,
    pub export_delay: Duration,
    /// tracing.export_timeout_s: each post's bound, and the last round's at shutdown.
    pub export_timeout: Duration,
    /// Spans waiting and spans taken but not yet posted, together: past it a span is dropped and counted.
    pub queue_size: usize,
}

/// The queue of ended spans and the one thread that makes them OTLP and posts them.
///
/// One thread, not the SDK's batch processor behind a thread of the front's: a record became the
/// SDK's span on one thread, crossed a channel, and was encoded on another up to a batch later, the
/// memory cold by then; here it is made the SDK's span, encoded by the SDK's OTLP exporter and
/// freed in one pass, a batch at a time (bench/RESULTS.md §1p). The exporter, its protobuf and its
/// HTTP client are still the SDK's; what the batch processor gave (a bounded queue that never
/// blocks, batches of tracing.batch_size, an export at least every tracing.export_delay_s, a
/// last export at shutdown) is kept, each drop counted.
pub struct Recorder {
    waiting: Arc<Mutex<Vec<Waiting>>>,
    /// Spans the thread has taken off the queue and not yet handed to an export.
    held: Arc<AtomicUsize>,
    limit: usize,
    metrics: Arc<RequestMetrics>,
    /// tracing.export_timeout_s: how long stopping waits for the collector, at most.
    export_timeout: Duration,
    control: Mutex<Option<(Sender<Control>, JoinHandle<()>)>>,
}

impl Recorder {
    /// Start the span thread: it makes `scope`'s spans of the records, and posts them with
    /// `exporter` (the SDK's OTLP exporter, counted), blocking on `runtime` for each post.
    pub fn start<E: SpanExporter + 'static>(
        exporter: E,
        scope: InstrumentationScope,
        batching: Batching,
        metrics: Arc<RequestMetrics>,
        runtime: tokio::runtime::Handle,
    ) -> std::io::Result<Recorder> {
        let waiting: Arc<Mutex<Vec<Waiting>>> = Arc::new(Mutex::new(Vec::new()));
        let held = Arc::new(AtomicUsize::new(0));
        let (control_tx, control_rx) = std::sync::mpsc::channel();
        let handle = {
            let thread = SpanThread {
                waiting: waiting.clone(),
                held: held.clone(),
                exporter,
                scope,
                batching,
                runtime,
                metrics: metrics.clone(),
                deadline: None,
            };
            std::thread::Builder::new().name("sidecar-spans".to_owned()).spawn(move || thread.run(&control_rx))?
        };
        Ok(Recorder {
            waiting,
            held,
            limit: batching.queue_size,
            metrics,
            export_timeout: batching.export_timeout,
            control: Mutex::new(Some((control_tx, handle))),
        })
    }

    /// An ended record.
    pub fn push(&self, record: Box<Record>) {
        self.push_waiting(Waiting::Record(record));
    }

    /// Kept for the thread (no wake: it comes by itself), or dropped and counted when
    /// tracing.queue_size spans already wait or are being exported.
    fn push_waiting(&self, span: Waiting) {
        let Ok(mut waiting) = self.waiting.lock() else {
            return;
        };
        if waiting.len() + self.held.load(Ordering::Acquire) >= self.limit {
            drop(waiting);
            self.metrics.tracing_spans_dropped.inc(&["queue_full"]);
            return;
        }
        waiting.push(span);
    }

    /// Export what waits now; the result of the exports (blocking: one round of the thread).
    pub fn flush(&self) -> OTelSdkResult {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let sent = match self.control.lock() {
            Ok(control) => control.as_ref().is_some_and(|(control, _)| control.send(Control::Flush(tx)).is_ok()),
            Err(_) => false,
        };
        if !sent {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        rx.recv().unwrap_or(Err(OTelSdkError::AlreadyShutdown))
    }

    /// Export what waits and stop the thread, waiting tracing.export_timeout_s from now at most
    /// (and for a post already under way, itself so bounded). A second stop does nothing.
    pub fn stop(&self) {
        let stopping = self.control.lock().ok().and_then(|mut control| control.take());
        if let Some((tx, handle)) = stopping {
            let _ = tx.send(Control::Stop(Instant::now() + self.export_timeout));
            drop(tx);
            let _ = handle.join();
        }
    }
}

/// The span thread's own state.
struct SpanThread<E> {
    waiting: Arc<Mutex<Vec<Waiting>>>,
    held: Arc<AtomicUsize>,
    exporter: E,
    scope: InstrumentationScope,
    batching: Batching,
    runtime: tokio::runtime::Handle,
    metrics: Arc<RequestMetrics>,
    /// Set for the last round (tracing.export_timeout_s from when stopping was asked): what is not
    /// posted by then is lost, so that stopping waits one bound at most whatever is left (but a post
    /// already under way), as the batch processor's shutdown did.
    deadline: Option<Instant>,
}

impl<E: SpanExporter> SpanThread<E> {
    fn run(mut self, control: &Receiver<Control>) {
        // Two buffers swapped, each keeping its capacity: the front pushes into one while this thread
        // empties the other, so neither grows again by reallocation nor is freed here.
        let mut spare: Vec<Waiting> = Vec::new();
        let mut batch: Vec<SpanData> = Vec::new();
        let mut last_export = Instant::now();
        loop {
            let (stopping, flush) = match control.recv_timeout(self.batching.every) {
                Err(RecvTimeoutError::Timeout) => (false, None),
                Ok(Control::Flush(reply)) => (false, Some(reply)),
                Ok(Control::Stop(deadline)) => {
                    self.deadline = Some(deadline);
                    (true, None)
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Dropped without a stop: the front's runtime, which posts, may be gone, so
                    // nothing more is posted (what waits is counted lost).
                    self.deadline = Some(Instant::now());
                    (true, None)
                }
            };
            match self.waiting.lock() {
                Ok(mut waiting) => std::mem::swap(&mut *waiting, &mut spare),
                Err(_) => return,
            }
            let mut result = Ok(());
            self.held.fetch_add(spare.len(), Ordering::AcqRel);
            for waiting in spare.drain(..) {
                batch.push(match waiting {
                    Waiting::Record(record) => (*record).span_data(&self.scope),
                    Waiting::Span(span) => *span,
                });
                if batch.len() >= self.batching.batch_size {
                    result = result.and(self.export(&mut batch));
                    last_export = Instant::now();
                }
            }
            let due = last_export.elapsed() >= self.batching.export_delay;
            if !batch.is_empty() && (due || stopping || flush.is_some()) {
                result = result.and(self.export(&mut batch));
                last_export = Instant::now();
            }
            if let Some(reply) = flush {
                let _ = reply.send(result);
            }
            if stopping {
                let _ = self.exporter.shutdown();
                return;
            }
        }
    }

    /// Post `batch` (emptied) through the SDK's exporter; its outcome is counted by the exporter.
    fn export(&mut self, batch: &mut Vec<SpanData>) -> OTelSdkResult {
        let spans = std::mem::take(batch);
        self.held.fetch_sub(spans.len(), Ordering::AcqRel);
        let n = spans.len() as u64;
        let Some(deadline) = self.deadline else {
            return self.runtime.block_on(self.exporter.export(spans));
        };
        // The last round: what the collector has not taken by the deadline is lost, and counted.
        let left = deadline.saturating_duration_since(Instant::now());
        let posted = if left.is_zero() {
            None // no timer asked of a runtime that may have ended
        } else {
            self.runtime.block_on(async { tokio::time::timeout(left, self.exporter.export(spans)).await }).ok()
        };
        posted.unwrap_or_else(|| {
            self.metrics.tracing_spans_dropped.add(&["export_failed"], n);
            Err(OTelSdkError::Timeout(self.batching.export_timeout))
        })
    }
}

/// The provider's span processor: the spans the SDK makes (Python's, the refusals') join the lanes'
/// records on the span thread's queue.
#[derive(Debug)]
pub struct QueueProcessor(pub Arc<Recorder>);

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder").field("limit", &self.limit).finish()
    }
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.push_waiting(Waiting::Span(Box::new(span)));
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.flush()
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        // The last round waits tracing.export_timeout_s at most (Recorder::stop).
        self.0.stop();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{TraceFlags, TraceId, TraceState};
    use opentelemetry_sdk::error::OTelSdkResult;

    use super::*;
    use crate::front::generate::Endpoint;
    use crate::front::state::Routed;

    /// What the span thread exported, kept for the test: each batch, and whether it was shut down.
    #[derive(Debug, Default)]
    struct Kept {
        batches: Mutex<Vec<Vec<SpanData>>>,
        shut_down: AtomicUsize,
    }

    #[derive(Debug)]
    struct Keep(Arc<Kept>);

    impl SpanExporter for Keep {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            if let Ok(mut batches) = self.0.batches.lock() {
                batches.push(batch);
            }
            Ok(())
        }
        fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
            self.0.shut_down.fetch_add(1, Ordering::SeqCst);
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
        let opened = Clock::now();
        let now = opened.instant;
        Record {
            context,
            parent: SpanId::INVALID,
            route: Route::Http(Endpoint::Infer),
            start: now,
            opened,
            model: "m".to_owned(),
            version: version.to_owned(),
            routed: if version.is_empty() { Routed::Default } else { Routed::Pinned },
            request_id: format!("r{n}"),
            body_bytes: 10,
            events: vec![Noted {
                name: "validation",
                at: now + Duration::from_micros(500),
                phase: true,
                attributes: Vec::new(),
            }],
            end: now,
            outcome,
            reason: reason.to_owned(),
            bytes_out: 20,
            error: (!reason.is_empty()).then(|| format!("[{reason}] no")),
        }
    }

    #[test]
    fn records_and_the_sdk_s_spans_are_exported_in_batches_and_past_the_bound_dropped_and_counted() {
        let kept = Arc::new(Kept::default());
        let metrics = Arc::new(RequestMetrics::new(vec![0.1, 1.0], vec![1.0, 10.0]));
        let scope = InstrumentationScope::builder("triton-sidecar").build();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        // The thread comes only when asked (flush, stop): the third record finds two waiting, whatever
        // the machine's load, and nothing is due by time.
        let hour = Duration::from_secs(3600);
        let batching = Batching { every: hour, batch_size: 2, export_delay: hour, export_timeout: hour, queue_size: 2 };
        let recorder =
            Recorder::start(Keep(kept.clone()), scope.clone(), batching, metrics.clone(), runtime.handle().clone())
                .expect("thread");
        let recorder = Arc::new(recorder);
        recorder.push(Box::new(record(1, "", Outcome::Http { status: 200 }, "")));
        recorder.push(Box::new(record(2, "3", Outcome::Grpc { code: 8, name: "RESOURCE_EXHAUSTED" }, "overloaded")));
        recorder.push(Box::new(record(3, "", Outcome::Http { status: 200 }, ""))); // past the bound
        assert_eq!(metrics.tracing_spans_dropped.value(&["queue_full"]), Some(1));
        recorder.flush().expect("flushed");
        {
            let batches = kept.batches.lock().expect("lock");
            assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), vec![2]); // one full batch
            let spans = &batches[0];
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
            let validation = &first.events.events[0];
            assert_eq!(validation.attributes[0].key.as_str(), "sidecar.duration_ms");
            assert_eq!(validation.attributes[0].value, opentelemetry::Value::F64(0.5));
            // Wall-clock times from the monotonic readings: the event 0.5 ms after the start.
            assert_eq!(validation.timestamp.duration_since(first.start_time).ok(), Some(Duration::from_micros(500)));
            let second = &spans[1];
            assert_eq!(attribute(second, "sidecar.model.version").as_deref(), Some("3"));
            assert_eq!(attribute(second, "sidecar.routing.reason").as_deref(), Some("pinned"));
            assert_eq!(attribute(second, "rpc.grpc.status_code").as_deref(), Some("8"));
            assert_eq!(attribute(second, "sidecar.refusal.reason").as_deref(), Some("overloaded"));
            assert_eq!(second.status, Status::error("[overloaded] no"));
        }
        // A span the SDK made joins the same queue (the provider's processor), and the last round
        // at shutdown posts it though the batch is not full, then shuts the exporter down.
        let processor = QueueProcessor(recorder.clone());
        processor.on_end(record(4, "", Outcome::Http { status: 200 }, "").span_data(&scope));
        processor.shutdown_with_timeout(hour).expect("shut down");
        {
            let batches = kept.batches.lock().expect("lock");
            assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 1]);
            assert_eq!(batches[1][0].span_context.span_id(), SpanId::from_bytes([4; 8]));
        }
        assert_eq!(kept.shut_down.load(Ordering::SeqCst), 1);
        // Stopped, nothing more is posted, and a flush says so.
        recorder.push(Box::new(record(5, "", Outcome::Http { status: 200 }, "")));
        assert!(recorder.flush().is_err());
        assert_eq!(kept.batches.lock().expect("lock").len(), 2);
    }
}
