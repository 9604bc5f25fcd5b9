//! `POST /v2/models/{m}/generate_stream` to a lane, relayed without Python, event by event: the
//! rules of sidecar/serving/streaming.py's OpenStream with generate_routes.py's SseStreamExchange.
//!
//! ```text
//! body check -> breaker slot (held for the whole stream) -> streams_in_flight -> Triton (its head
//! within proxy.upstream_timeout_s) -> each event, as its blank line arrives: screened (hidden
//! outputs cut, NaN/Inf, Triton's error events) -> passive signals -> written to the client at once
//! | ends: Triton's end, a drop, a silence longer than the bound (the first event:
//! proxy.upstream_timeout_s; then generation.idle_timeout_s), or at once when the model is
//! quarantined (the error event Python published)
//! ```
//!
//! Two halves: the stream's task (`run`, spawned by `spawn`) does the work and sends what the
//! client must get (`Out`) through a bounded channel; the connection (`relay`) writes it as it
//! comes, in chunked transfer-encoding, and meanwhile reads the client so that a client that leaves
//! aborts the task: its call to Triton is dropped (the connection closed, so Triton stops) and its
//! slot freed. A channel of QUEUE_BATCHES writes bounds what a slow client holds: past it the task
//! stops reading Triton (back-pressure), as the Python stream's queue does. A panic in the task
//! ends that stream only (500 before the head was sent; the connection dropped after).

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::sleep_until;

use crate::protocol::pytext::{cut, format_g, rapidjson_string};
use crate::protocol::sse::{write_event, EventSplitter};
use crate::serving::generation::{check_generate_request, needs_screening, screen_event};

use super::admission;
use super::events::{AccessRecord, Event};
use super::generate::{body_refusal, error_message, is_stub_dead, non_finite_message, upstream_headers};
use super::lane::{self, slot, upstream_refusal, InFlight, Infer};
use super::reply::{encode, error_event, http_date, json_value, refusal, Reply, JSON_REFUSAL};
use super::state::Lane;
use super::upstream::Failure;
use super::Shared;

/// Writes queued for a slow client before the task stops reading Triton (streaming.QUEUE_BATCHES).
pub const QUEUE_BATCHES: usize = 64;

/// Largest error answer read from Triton before a stream begins (its error bodies are one line).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// What the stream's task tells the connection, in order.
pub enum Out {
    /// The whole answer instead of a stream: a refusal, or Triton's refusal before it began.
    Whole(Reply),
    /// The stream began (200); its head leaves with the first write, as the Python front's does.
    Begin,
    /// Events as the client reads them (server-sent events), for one write.
    Events(Vec<u8>),
}

/// Start the stream's task; the connection relays what it sends (`relay`).
pub fn spawn(shared: Arc<Shared>, request: Infer) -> (JoinHandle<()>, mpsc::Receiver<Out>) {
    let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
    (tokio::spawn(run(shared, request, tx)), rx)
}

/// Why a stream that began was ended by the sidecar: said in its last event.
struct Ending {
    reason: &'static str,
    /// The event to send, when Python wrote it (a quarantine); else made of reason and message.
    event: Option<Bytes>,
    message: String,
    /// Members after "model", encoded as python-rapidjson writes them.
    extra: Vec<(&'static str, String)>,
    /// The reason label as counted (a published refusal's own label).
    outcome: String,
}

impl Ending {
    fn new(reason: &'static str, message: String) -> Self {
        Ending { reason, event: None, message, extra: Vec::new(), outcome: reason.to_owned() }
    }

    fn event(&self, model: &str) -> Vec<u8> {
        match &self.event {
            Some(event) => event.to_vec(),
            None => error_event(self.reason, &self.message, model, &self.extra),
        }
    }
}

/// What one stream records, whatever ends it: counted when it is done (before the client reads its
/// end), or, when its task is dropped (the client left) or panics, as such.
struct Record<'a> {
    shared: &'a Shared,
    request: &'a Infer,
    /// The answer has begun (200 and the stream).
    began: bool,
    /// Events sent to the client.
    events: u64,
    /// Bytes of events sent to the client (the span's http.response.body.size).
    bytes: u64,
    done: bool,
}

impl Record<'_> {
    /// The whole answer instead of a stream: counted and logged now, before the client reads it.
    fn whole(&mut self, reply: &Reply) {
        lane::finish(self.shared, self.request, reply);
        self.done = true;
    }

    /// The stream is over: its events and ending counted, then the request.
    fn ended(&mut self, ending: Option<&Ending>) {
        let model = self.request.model.as_str();
        let outcome = ending.map_or("complete", |e| e.outcome.as_str());
        self.shared.metrics.streams.ended(model, self.events, outcome);
        if let Some(e) = ending {
            self.shared.events.push(Event::StreamEnded {
                model: model.to_owned(),
                reason: e.outcome.clone(),
                events: self.events,
                cause: cut(&e.message, 300),
            });
        }
        let span = &self.request.span;
        let events = self.events as i64;
        span.event("stream ended", || vec![opentelemetry::KeyValue::new("sidecar.stream.events", events)]);
        match ending {
            // Ended by the sidecar with an error event: an error span saying why, as a refusal's.
            Some(e) => span.end(200, &e.outcome, || e.message.clone(), self.bytes),
            None => span.end(200, "", String::new, self.bytes),
        }
        lane::finish_status(self.shared, self.request, 200, "");
        self.done = true;
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let model = self.request.model.as_str();
        if std::thread::panicking() {
            // The connection counts the panic itself (it sees the task's end); the stream is over.
            if self.began {
                self.shared.metrics.streams.ended(model, self.events, "internal_error");
            }
            return;
        }
        // Dropped before its end: the client left and the connection aborted the task.
        if self.began {
            self.shared.metrics.streams.ended(model, self.events, "client_disconnected");
        }
        let seconds = self.request.started.elapsed().as_secs_f64();
        self.shared.metrics.finish("http", model, "499", seconds);
        self.shared.events.push(Event::Log(AccessRecord {
            request_id: self.request.request_id.clone(),
            trace_id: self.request.trace_id.clone(),
            span_id: self.request.span.span_id(),
            model: model.to_owned(),
            method: "POST".to_owned(),
            path: cut(&self.request.path, 200),
            status: 499,
            duration_ms: (seconds * 100_000.0).round() / 100.0,
            reason: "client_disconnected".to_owned(),
            client_subject: self.request.client_subject.clone(),
        }));
    }
}

/// In triton_sidecar_streams_in_flight{model} while the stream holds its breaker slot.
struct Open<'a> {
    shared: &'a Shared,
    model: &'a str,
}

impl<'a> Open<'a> {
    fn new(shared: &'a Shared, model: &'a str) -> Self {
        shared.metrics.streams.in_flight.add(&[model], 1);
        Open { shared, model }
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.shared.metrics.streams.in_flight.add(&[self.model], -1);
    }
}

/// The stream's task: everything but the client's socket.
async fn run(shared: Arc<Shared>, request: Infer, tx: mpsc::Sender<Out>) {
    let shared = &*shared;
    let _counted = InFlight::new(shared);
    let mut record = Record { shared, request: &request, began: false, events: 0, bytes: 0, done: false };
    let model = request.model.as_str();
    let whole = |record: &mut Record, reply: Reply| {
        record.whole(&reply);
        // The connection reads until the channel closes: a full channel is not possible here.
        let _ = tx.try_send(Out::Whole(reply));
    };
    // Admission first (OpenStream.join: admitted_spec, then the check), while the record is kept:
    // a client that leaves while its stream is held is counted 499 as any other.
    let fresh = match lane::admitted(shared, &request).await {
        Ok(fresh) => fresh,
        Err(refused) => return whole(&mut record, refused),
    };
    let lane = fresh.as_ref().unwrap_or(&request.lane);
    let checked = check_generate_request(&lane.spec, &lane.generate, &request.body);
    request.span.phase("validation");
    if let Err(refused) = checked {
        return whole(&mut record, body_refusal(shared, model, &refused));
    }
    let permit = match slot(shared, &lane.breaker, model, "http").await {
        Ok(permit) => permit,
        Err(refused) => return whole(&mut record, refused),
    };
    request.span.phase("breaker wait");
    let open = Open::new(shared, model);
    // Subscribed before Triton is called: a quarantine published meanwhile is not missed.
    let mut published = shared.published.subscribe();
    // A pinned stream is not routed (no routed_total), as the Python chain's streams are not.
    let path = lane::triton_path(model, &request.version, "generate_stream");
    let headers = upstream_headers(&request);
    let mut upstream = match shared.upstream.stream(&path, &headers, request.body.clone()).await {
        Ok(upstream) => upstream,
        Err(failure) => return whole(&mut record, upstream_refusal(shared, model, failure)),
    };
    request.span.phase("upstream call");
    if upstream.status != 200 {
        let timeout = shared.settings.upstream_timeout;
        let answer = match tokio::time::timeout(timeout, upstream.read_all(MAX_ERROR_BODY)).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(failure)) => return whole(&mut record, upstream_refusal(shared, model, failure)),
            Err(_) => return whole(&mut record, upstream_refusal(shared, model, Failure::Timeout)),
        };
        return whole(&mut record, refused_before_stream(shared, model, upstream.status, &answer));
    }
    record.began = true;
    if tx.send(Out::Begin).await.is_err() {
        return; // the connection is gone (it aborts this task)
    }
    let idle = lane.stream_idle;
    let first = shared.settings.upstream_timeout;
    let mut splitter = EventSplitter::default();
    // The silence bound counts from the last events read (from the head, for the first event).
    let mut last = Instant::now();
    let mut received: u64 = 0;
    let mut last_sent: Option<Instant> = None;
    let mut ending = quarantined(shared, model);
    while ending.is_none() {
        let bound = if received > 0 { idle } else { first };
        let next = tokio::select! {
            next = upstream.next() => next,
            changed = published.changed() => {
                if changed.is_ok() {
                    ending = quarantined(shared, model);
                }
                continue;
            }
            _ = sleep_until((last + bound).into()) => {
                let message = format!(
                    "model {model} sent no event for {} s after {} event(s) (generation.idle_timeout_s); the stream \
                     was ended",
                    format_g(bound.as_secs_f64()),
                    record.events
                );
                signal_failed(shared, model, "timeout", 0, message.clone());
                ending = Some(Ending::new("stream_idle", message));
                continue;
            }
        };
        let chunk = match next {
            Ok(Some(chunk)) => chunk,
            Ok(None) if splitter.pending() => {
                ending = Some(dropped(shared, model, "stream ended inside an event".to_owned()));
                continue;
            }
            Ok(None) => {
                shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
                break;
            }
            Err(failure) => {
                ending = Some(failed_mid_stream(shared, model, failure));
                continue;
            }
        };
        let events = splitter.feed(&chunk);
        if events.is_empty() {
            continue;
        }
        last = Instant::now();
        received += events.len() as u64;
        let (out, ended) = screened(shared, &request, lane, events);
        ending = ended;
        if out.is_empty() {
            continue;
        }
        // Every event this read completed goes out in one write, now: nothing waits for more.
        let mut bytes = Vec::with_capacity(out.iter().map(|e| e.len() + 8).sum());
        for event in &out {
            write_event(event, &mut bytes);
        }
        let reserved = loop {
            tokio::select! {
                reserved = tx.reserve() => break reserved,
                changed = published.changed() => {
                    if changed.is_ok() && ending.is_none() {
                        if let Some(quarantine) = quarantined(shared, model) {
                            ending = Some(quarantine);
                        }
                    }
                }
            }
        };
        let Ok(reserved) = reserved else { return };
        record.bytes += bytes.len() as u64;
        reserved.send(Out::Events(bytes));
        let now = Instant::now();
        let streams = &shared.metrics.streams;
        match last_sent {
            None => {
                // One event per stream for its first write, whatever its length: a span stays small.
                request.span.phase("first event sent");
                streams.first_event.observe(&[model], request.started.elapsed().as_secs_f64());
            }
            Some(before) => streams.inter_event.observe(&[model], (now - before).as_secs_f64()),
        }
        last_sent = Some(now);
        record.events += out.len() as u64;
        // A client slower than the model stopped this loop; the silence counts from now.
        last = last.max(now);
    }
    // Triton's side ends now (a stream cut short closes its connection), the slot is given back, and
    // everything is counted before the client reads the stream's end.
    drop(upstream);
    drop(permit);
    drop(open);
    record.ended(ending.as_ref());
    if let Some(ending) = ending {
        let _ = tx.send(Out::Events(ending.event(model))).await;
    }
}

/// Triton refused the stream before it began: a server fault (5xx, or a dead stub whatever the
/// status) is the sidecar's 502 and a passive signal; another refusal reaches the client as
/// `{"error": Triton's words}` with Triton's status.
fn refused_before_stream(shared: &Shared, model: &str, status: u16, answer: &[u8]) -> Reply {
    let message = error_message(answer);
    if status >= 500 || is_stub_dead(&message) {
        signal_failed(shared, model, "server_error", status, message.clone());
        let text = format!("Triton answered {status} for model {model}: {message}");
        return refusal("triton_error", 502, &text, model, &[("triton_status", status.to_string())]);
    }
    let mut body = String::from("{\"error\": ");
    body.push_str(&json_value(&message));
    body.push('}');
    Reply {
        status,
        content_type: JSON_REFUSAL.to_owned(),
        header_length: None,
        retry_after: None,
        body: Bytes::from(body),
        reason: "",
    }
}

fn signal_failed(shared: &Shared, model: &str, kind: &'static str, status: u16, detail: String) {
    shared.events.push(Event::Failed { model: model.to_owned(), kind, status, detail });
}

/// The model stopped being trusted: the stream ends with the refusal Python published for it,
/// whatever version it reaches (the Python chain's stream ends as soon as its model stops serving).
fn quarantined(shared: &Shared, model: &str) -> Option<Ending> {
    let snapshot = shared.state.load();
    if !snapshot.guards.contains_key(model) {
        // Released (no longer guarded): the 404 a new request to it gets, as its last event.
        return Some(Ending::new("unknown_model", admission::released_message(model)));
    }
    let ended = snapshot.ended.get(model)?;
    let mut ending = Ending::new("quarantined", lane::triton_error_message(&ended.body));
    ending.event = Some(ended.event.clone());
    ending.outcome = ended.reason.clone();
    Some(ending)
}

/// The stream broke off (ServingCore.upstream_refusal of a drop): its signal, and its ending.
fn dropped(shared: &Shared, model: &str, detail: String) -> Ending {
    let message = format!("Triton dropped the connection: {}", cut(&detail, 120));
    signal_failed(shared, model, "dropped", 0, message.clone());
    Ending::new("triton_bad_answer", message)
}

fn failed_mid_stream(shared: &Shared, model: &str, failure: Failure) -> Ending {
    match failure {
        Failure::Dropped(detail) => dropped(shared, model, detail),
        Failure::Timeout => {
            let message = format!("Triton did not answer within the time limit ({model})");
            signal_failed(shared, model, "timeout", 0, message.clone());
            Ending::new("triton_timeout", message)
        }
        Failure::Unreachable(detail) => {
            signal_failed(shared, model, "unreachable", 0, detail);
            Ending::new("triton_unreachable", "Triton is unreachable from the sidecar".to_owned())
        }
    }
}

/// The events of one read as they may leave the pod, and the ending one of them brought
/// (OpenStream._screened and _judge): the events before it still go out.
fn screened(shared: &Shared, request: &Infer, lane: &Lane, events: Vec<Bytes>) -> (Vec<Bytes>, Option<Ending>) {
    let model = request.model.as_str();
    let hidden = |name: &str| lane.is_hidden(name);
    let filter: Option<&dyn Fn(&str) -> bool> = if lane.hidden.is_some() { Some(&hidden) } else { None };
    let mut out = Vec::with_capacity(events.len());
    for event in events {
        if !needs_screening(&event, filter.is_some(), lane.check_non_finite) {
            out.push(event);
            continue;
        }
        let verdict = match screen_event(&event, filter, lane.check_non_finite) {
            Ok(verdict) => verdict,
            Err(e) => {
                let message = format!("model {model}: {}", e.0);
                signal_failed(shared, model, "bad_answer", 0, e.0);
                return (out, Some(Ending::new("triton_bad_answer", message)));
            }
        };
        for output in &verdict.dropped {
            shared.metrics.outputs_filtered.inc(&[model, output]);
        }
        if let Some(error) = verdict.error {
            let detail = cut(&error, 300);
            let message = format!("Triton answered with an error for model {model}: {detail}");
            signal_failed(shared, model, "error_event", 0, detail);
            return (out, Some(Ending::new("triton_error", message)));
        }
        if !verdict.non_finite.is_empty() {
            shared.events.push(Event::NonFinite { model: model.to_owned(), outputs: verdict.non_finite.clone() });
            if shared.settings.block_non_finite_outputs {
                let mut ending = Ending::new("non_finite_output", non_finite_message(model, &verdict.non_finite));
                let mut outputs = String::from("[");
                for (i, output) in verdict.non_finite.iter().enumerate() {
                    if i > 0 {
                        outputs.push(',');
                    }
                    rapidjson_string(output, &mut outputs);
                }
                outputs.push(']');
                ending.extra.push(("outputs", outputs));
                return (out, Some(ending));
            }
        } else {
            shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
        }
        out.push(verdict.data.map(Bytes::from).unwrap_or(event));
    }
    (out, None)
}

/// The head of a stream's answer (generate_routes.generate_stream's headers), chunked.
fn stream_head(request_id: &str, keep_alive: bool) -> Vec<u8> {
    let mut head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nCache-Control: no-cache\r\n\
         X-Request-ID: {request_id}\r\nTransfer-Encoding: chunked\r\nDate: {}\r\nServer: triton-sidecar\r\n",
        http_date()
    );
    if !keep_alive {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    head.into_bytes()
}

/// One chunk of chunked transfer-encoding (RFC 9112 §7.1) holding `data`.
fn write_chunk(data: &[u8], out: &mut Vec<u8>) {
    if data.is_empty() {
        return; // an empty chunk would end the body
    }
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The last chunk: the body ends (no trailers).
const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// What the connection needs of the request to answer for a task that panicked.
pub struct Relayed<'a> {
    pub shared: &'a Shared,
    pub request_id: &'a str,
    pub model: &'a str,
    pub started: Instant,
    pub keep_alive: bool,
    /// Bytes the client may pipeline meanwhile before the front stops reading (a client that left
    /// is still seen: its end of file comes after them).
    pub room: usize,
}

/// Write what the stream's task sends as it comes (each write flushed), reading the client
/// meanwhile: a client that leaves aborts the task. False when the connection is done.
pub async fn relay<S>(
    stream: &mut S,
    buf: &mut BytesMut,
    at: Relayed<'_>,
    mut task: JoinHandle<()>,
    mut rx: mpsc::Receiver<Out>,
) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut head: Option<Vec<u8>> = None;
    let mut began = false;
    loop {
        tokio::select! {
            out = rx.recv() => match out {
                Some(Out::Whole(reply)) => {
                    let bytes = encode(&reply, at.request_id, at.keep_alive);
                    return write(stream, &bytes, at.keep_alive).await;
                }
                Some(Out::Begin) => {
                    began = true;
                    head = Some(stream_head(at.request_id, at.keep_alive));
                }
                Some(Out::Events(events)) => {
                    let mut bytes = head.take().unwrap_or_default();
                    write_chunk(&events, &mut bytes);
                    if !write(stream, &bytes, true).await {
                        task.abort(); // the client is gone: Triton's side ends with the task
                        return false;
                    }
                }
                None => break,
            },
            read = stream.read_buf(buf), if buf.len() < at.room => {
                if matches!(read, Ok(0) | Err(_)) {
                    task.abort();
                    return false;
                }
            }
        }
    }
    match (&mut task).await {
        Ok(()) if began => {
            let mut bytes = head.take().unwrap_or_default();
            bytes.extend_from_slice(LAST_CHUNK);
            write(stream, &bytes, at.keep_alive).await
        }
        Ok(()) => false, // ended without an answer: only when the connection went away
        Err(e) => {
            let shared = at.shared;
            super::connection::count_panic(shared, at.model, e);
            let seconds = at.started.elapsed().as_secs_f64();
            if began {
                // The status is sent: the stream can only be cut (the client sees no last chunk).
                shared.metrics.finish("http", at.model, "200", seconds);
                return false;
            }
            let reply = refusal(
                "internal_error",
                500,
                "the sidecar failed to handle this request; it was logged",
                at.model,
                &[],
            );
            shared.metrics.finish("http", at.model, "500", seconds);
            write(stream, &encode(&reply, at.request_id, at.keep_alive), at.keep_alive).await
        }
    }
}

/// Write and flush (a TLS stream holds bytes until flushed); false when the connection is done.
async fn write<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8], keep_alive: bool) -> bool {
    if stream.write_all(bytes).await.is_err() || stream.flush().await.is_err() {
        return false;
    }
    if !keep_alive {
        let _ = stream.shutdown().await;
        return false;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn shared() -> Arc<Shared> {
        crate::front::shared_for_tests(Duration::ZERO, Duration::ZERO)
    }

    /// Relay `task`'s output to a client that stays connected: (connection kept, what it read).
    async fn relayed(shared: &Shared, task: JoinHandle<()>, rx: mpsc::Receiver<Out>) -> (bool, String) {
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        let mut buf = BytesMut::new();
        let at =
            Relayed { shared, request_id: "r1", model: "m", started: Instant::now(), keep_alive: true, room: 1024 };
        let kept = relay(&mut server, &mut buf, at, task, rx).await;
        drop(server);
        let mut read = Vec::new();
        let _ = client.read_to_end(&mut read).await;
        (kept, String::from_utf8_lossy(&read).into_owned())
    }

    #[tokio::test]
    async fn each_write_of_the_task_is_a_chunk_and_the_connection_is_kept_after_the_last() {
        let shared = shared();
        let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
        let task = tokio::spawn(async move {
            for out in [Out::Begin, Out::Events(b"data: 1\n\n".to_vec()), Out::Events(b"data: 22\n\n".to_vec())] {
                let _ = tx.send(out).await;
            }
        });
        let (kept, read) = relayed(&shared, task, rx).await;
        assert!(kept);
        assert!(read.starts_with("HTTP/1.1 200 OK\r\n"), "{read}");
        assert!(read.ends_with("\r\n\r\n9\r\ndata: 1\n\n\r\na\r\ndata: 22\n\n\r\n0\r\n\r\n"), "{read}");
    }

    #[tokio::test]
    async fn a_panic_before_the_stream_began_is_a_500_for_that_request_only() {
        let shared = shared();
        let (tx, rx) = mpsc::channel::<Out>(QUEUE_BATCHES);
        let task = tokio::spawn(async move {
            let _tx = tx;
            panic!("boom");
        });
        let (kept, read) = relayed(&shared, task, rx).await;
        assert!(kept, "the connection goes on");
        assert!(read.starts_with("HTTP/1.1 500 Internal Server Error\r\n"), "{read}");
        assert!(read.contains(r#""reason": "internal_error""#), "{read}");
        assert_eq!(shared.metrics.internal_errors.value(&["http", "m"]), Some(1));
        assert!(shared.events.drain().contains(&Event::Panic { model: "m".into(), message: "boom".into() }));
    }

    #[tokio::test]
    async fn a_panic_mid_stream_cuts_it_without_its_last_chunk() {
        let shared = shared();
        let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
        let task = tokio::spawn(async move {
            let _ = tx.send(Out::Begin).await;
            let _ = tx.send(Out::Events(b"data: 1\n\n".to_vec())).await;
            panic!("boom");
        });
        let (kept, read) = relayed(&shared, task, rx).await;
        assert!(!kept, "a stream that cannot end properly closes its connection");
        assert!(read.ends_with("9\r\ndata: 1\n\n\r\n"), "{read}");
        assert_eq!(shared.metrics.internal_errors.value(&["http", "m"]), Some(1));
    }

    #[tokio::test]
    async fn a_client_that_leaves_aborts_the_stream_s_task() {
        let shared = shared();
        let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
        let (alive, dropped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _alive = alive; // dropped when the task is
            let _ = tx.send(Out::Begin).await;
            let _ = tx.send(Out::Events(b"data: 1\n\n".to_vec())).await;
            std::future::pending::<()>().await;
        });
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        let reader = tokio::spawn(async move {
            let mut first = [0u8; 64];
            let _ = client.read(&mut first).await; // the head and the first event, then it leaves
        });
        let mut buf = BytesMut::new();
        let at = Relayed {
            shared: &shared,
            request_id: "r1",
            model: "m",
            started: Instant::now(),
            keep_alive: true,
            room: 1024,
        };
        assert!(!relay(&mut server, &mut buf, at, task, rx).await);
        let _ = reader.await;
        assert!(dropped.await.is_err(), "the task (and its call to Triton) was dropped");
    }

    #[test]
    fn chunks_frame_events_and_the_last_chunk_ends_the_body() {
        let mut out = Vec::new();
        write_chunk(b"data: {\"a\":1}\n\n", &mut out);
        write_chunk(b"", &mut out);
        out.extend_from_slice(LAST_CHUNK);
        assert_eq!(out, b"f\r\ndata: {\"a\":1}\n\n\r\n0\r\n\r\n");
    }

    #[test]
    fn the_head_is_a_chunked_event_stream() {
        let head = String::from_utf8(stream_head("r1", false)).unwrap_or_default();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"), "{head}");
        assert!(head.contains("\r\nX-Request-ID: r1\r\nTransfer-Encoding: chunked\r\n"), "{head}");
        assert!(head.ends_with("Connection: close\r\n\r\n"), "{head}");
    }
}
