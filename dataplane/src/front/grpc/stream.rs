//! ModelStreamInfer served without Python when its first request names a model published as a
//! lane and quarantined whole or not at all (`Snapshot::whole`): the rules of
//! sidecar/serving/streaming.py's OpenStream with grpc_server.py's GrpcStreamExchange.
//!
//! ```text
//! requests (their own task, so responses flow while one is held): decode -> admission (holds,
//! quarantine refusals) -> the one validation rule -> the model's breaker slot (held for the
//! stream's life, in streams_in_flight) -> Triton, the client's bytes unchanged | a refusal is an
//! in-stream error `[reason] message`, as Triton writes its own; an UNAVAILABLE one ends the stream
//! responses: Triton's messages -> decoded, screened (hidden outputs removed, NaN/Inf withheld as an
//! in-stream error), Triton's own error_message passed on as it came (the model's failure) ->
//! the client, through a bounded channel (QUEUE_BATCHES) | ends: Triton's end, a drop, a silence
//! longer than the bound while a request is owed (its first response: proxy.upstream_timeout_s,
//! then generation.idle_timeout_s), at once when a joined model stops being trusted
//! ```
//!
//! Messages sent compressed (gzip, deflate) are inflated before anything reads them and go to Triton
//! uncompressed (`encoding`); one the front cannot inflate is refused before the stream begins, or
//! ends it. A stream whose first request the front does not serve (not a lane, a partial quarantine,
//! a version without a lane, a message that does not decode) goes to the Python gRPC server with the
//! bytes already read (as the client sent them), so nothing changes for it. A later request on a stream the
//! front serves that names an unknown model gets admission's `[unknown_model]` in-stream error, as
//! from Python; one that names a guarded model the front does not serve whole gets
//! `[model_unavailable]` in-stream and the stream goes on (the Python chain would have served it on
//! the same stream; a stream cannot change hands once begun: docs/dataplane.md).
//!
//! The client leaving (it resets the stream) closes the answer's channel: the stream's task sees
//! it, drops its call to Triton (cancelled there) and is counted CANCELLED `client_disconnected`.
//! A panic ends that stream alone (INTERNAL, counted, logged).

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response};
use prost::Message;
use tokio::sync::mpsc;
use tokio::time::sleep_until;

use crate::front::admission;
use crate::front::connection::{panic_message, request_id, trace_id, UNKNOWN_LABEL};
use crate::front::documents;
use crate::front::events::{AccessRecord, Event};
use crate::front::generate_stream::QUEUE_BATCHES;
use crate::front::lane::{self, Admitting, InFlight};
use crate::front::reply::Reply;
use crate::front::state::{Breaker, Lane, Routed};
use crate::front::tracing::{Opened, RequestSpan, Route};
use crate::front::upstream::Failure;
use crate::front::Shared;
use crate::protocol::pytext::{cut, format_g};
use crate::serving::validation::validate_infer_request;

use super::document::infer_document;
use super::encoding::{self, Encoding};
use super::infer::{refusal_message, screen};
use super::messages::{ModelInferRequest, ModelInferResponse, ModelStreamInferResponse};
use super::outcome::{panic_refusal, trailing_metadata, AbortOnDrop};
use super::wire::{self, Code, Deframed, Deframer, GrpcBody};
use super::GrpcFront;

pub const MODEL_STREAM_INFER: &str = "/inference.GRPCInferenceService/ModelStreamInfer";

const ROUTE: Route = Route::Grpc {
    service: "inference.GRPCInferenceService",
    method: "ModelStreamInfer",
    name: "inference.GRPCInferenceService/ModelStreamInfer",
};

/// Triton's messages read ahead of the stream's task: small, so a slow client slows Triton's side.
const UPSTREAM_AHEAD: usize = 4;

/// One stream the front serves: what every part of it reads.
struct Call {
    /// The first request's model: the stream's (its metrics' and log's model).
    model: String,
    request_id: String,
    trace_id: String,
    traceparent: Option<String>,
    tracestate: Option<String>,
    span: RequestSpan,
    started: Instant,
    client_subject: Arc<str>,
    /// generation.idle_timeout_s: the bound on the silence inside a request's responses.
    idle: Duration,
}

/// Read the stream's first request, then serve the stream here or hand it to the Python gRPC server.
pub async fn serve(front: Arc<GrpcFront>, request: Request<Incoming>) -> Response<GrpcBody> {
    let started = Instant::now();
    let (parts, mut body) = request.into_parts();
    let limit = front.shared.settings.max_body_bytes;
    let mut read = BytesMut::new();
    let mut deframer = Deframer::default();
    let encoding = Encoding::of(&parts.headers);
    let first = loop {
        match deframer.next(limit) {
            Deframed::Message(message) => break Some(message),
            Deframed::Partial => {}
            Deframed::Compressed(packed) => match encoding::inflated(&encoding, packed, limit).await {
                Ok(message) => break Some(message),
                // Refused before the stream is known, as grpcio refused it: not counted as a call.
                Err(refused) => return wire::answer(refused.code, &refused.message, false, None, &[]),
            },
            Deframed::TooLarge(_) => break None, // grpcio's own answer
        }
        match body.frame().await {
            None => break None,
            Some(Err(e)) => {
                let message = format!("the client's stream broke off: {e}");
                return wire::answer(wire::CANCELLED, &message, false, None, &[]);
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                    deframer.push(&data);
                }
            }
        }
    };
    let served = first.as_ref().and_then(|message| {
        let request = ModelInferRequest::decode(message.clone()).ok()?;
        let call = stream_call(&front, &parts.headers, &request, message.len(), started)?;
        Some((call, request, message.clone()))
    });
    let Some((call, request, message)) = served else {
        let rest = Prefixed { prefix: Some(read.freeze()), rest: body };
        return front.pass_through(parts, rest.boxed()).await;
    };
    front.served.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
    let call = Arc::new(call);
    let requests = Requests { body, deframer, encoding, first: Some((request, message)) };
    tokio::spawn(supervise(front, call, requests, tx));
    wire::streamed(rx)
}

/// The stream when the front serves it: its first request names a lane's model that is trusted or
/// untrusted as a whole, at no version or a version the lane has.
fn stream_call(
    front: &GrpcFront,
    headers: &HeaderMap,
    request: &ModelInferRequest,
    body_bytes: usize,
    started: Instant,
) -> Option<Call> {
    let shared = &front.shared;
    let snapshot = shared.state.load();
    let model = request.model_name.as_str();
    let lane = snapshot.lanes.get(model)?;
    if !snapshot.whole(model)
        || !(request.model_version.is_empty() || lane.versions.contains_key(&request.model_version))
    {
        return None;
    }
    let text = |key: &str| headers.get(key).and_then(|v| v.to_str().ok());
    let request_id = request_id(text("x-request-id"));
    let (traceparent, tracestate) = (text("traceparent"), text("tracestate"));
    let opened = Opened {
        traceparent,
        tracestate,
        route: ROUTE,
        model,
        version: &request.model_version,
        routed: if request.model_version.is_empty() { Routed::Default } else { Routed::Pinned },
        request_id: &request_id,
        body_bytes,
        started,
    };
    let span = RequestSpan::open(shared.tracing.as_ref(), opened);
    let (trace_id, traceparent, tracestate) = span.upstream_context(trace_id(traceparent), traceparent, tracestate);
    Some(Call {
        model: model.to_owned(),
        request_id,
        trace_id,
        traceparent,
        tracestate,
        span,
        started,
        client_subject: text(super::CLIENT_SUBJECT)
            .map_or_else(|| Arc::from(""), |s| Arc::from(wire::percent_decode(s))),
        idle: lane.stream_idle,
    })
}

/// The client's requests: the body, what was read of it, how its compressed messages are
/// compressed, and the first request (already decoded).
struct Requests {
    body: Incoming,
    deframer: Deframer,
    encoding: Encoding,
    first: Option<(ModelInferRequest, Bytes)>,
}

/// A body already begun: the bytes read, then the rest as it comes (a stream handed over).
struct Prefixed {
    prefix: Option<Bytes>,
    rest: Incoming,
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(prefix) = self.prefix.take().filter(|p| !p.is_empty()) {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}

/// The stream's task in its own task, so a panic ends this stream alone: INTERNAL, counted, logged.
async fn supervise(front: Arc<GrpcFront>, call: Arc<Call>, requests: Requests, tx: mpsc::Sender<Frame<Bytes>>) {
    let task = tokio::spawn(run(front.clone(), call.clone(), requests, tx.clone()));
    let Err(e) = task.await else { return };
    if !e.is_panic() {
        return;
    }
    let message = panic_message(e);
    let shared = &front.shared;
    shared.metrics.internal_errors.inc(&["grpc", call.model.as_str()]);
    shared.events.push(Event::GrpcPanic { model: call.model.clone(), request_id: call.request_id.clone(), message });
    let ending = Ending::new("internal_error", panic_refusal(&call.request_id));
    finish(shared, &call, &ending.code, &ending.reason, &ending.message, 0);
    let _ = tx.send(Frame::trailers(trailers(&call, Some(&ending)))).await;
}

/// Why the sidecar ended a stream: its status, reason (x-sidecar-reason), message and pushback.
struct Ending {
    code: Code,
    reason: String,
    message: String,
    retry_after: Option<u64>,
}

impl Ending {
    fn new(reason: &str, message: String) -> Self {
        Ending { code: Code::of_reason(reason), reason: reason.to_owned(), message, retry_after: None }
    }

    /// One of the lane's refusals (admission, Triton failed), as its HTTP reply says it.
    fn refused(reply: &Reply) -> Self {
        Ending {
            code: Code::of_reason(reply.reason),
            reason: reply.reason.to_owned(),
            message: refusal_message(&reply.body),
            retry_after: reply.retry_after,
        }
    }
}

/// What the requests' task tells the stream's task, in order.
enum Note {
    /// A request was admitted for (model, version) for the first time on this stream, with the
    /// model's breaker slot when this request took it.
    Joined { model: String, slot: Option<Slot> },
    /// A request goes to Triton now: one more owed an answer.
    Sent,
    /// A request refused in-stream: the message to send (unframed).
    Refused(Bytes),
    /// A refusal that ends the stream (UNAVAILABLE, an unreadable request body).
    End(Ending),
}

/// What Triton's side of the stream sends the stream's task.
enum Upstream {
    Message(Bytes),
    /// Triton ended the stream with this status and grpc-message (percent-encoded).
    End(Code, String),
    Failed(Failure),
}

/// A model's breaker slot held for the stream's life, in streams_in_flight meanwhile.
struct Slot {
    shared: Arc<Shared>,
    breaker: Arc<Breaker>,
    model: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.breaker.slots.add_permits(1);
        self.shared.metrics.streams.in_flight.add(&[self.model.as_str()], -1);
    }
}

/// The stream: Triton's side and the requests' in tasks of their own (dropped with it, which
/// cancels Triton's side), responses screened and written to the client here.
async fn run(front: Arc<GrpcFront>, call: Arc<Call>, requests: Requests, tx: mpsc::Sender<Frame<Bytes>>) {
    let shared = &*front.shared;
    let _counted = InFlight::new(shared);
    // Subscribed before any request is admitted: a quarantine published meanwhile is not missed.
    let mut published = shared.published.subscribe();
    let (to_triton, request_body) = mpsc::channel(QUEUE_BATCHES);
    let (from_triton_tx, mut from_triton) = mpsc::channel(UPSTREAM_AHEAD);
    let upstream = AbortOnDrop(
        tokio::spawn(triton_side(front.clone(), call.clone(), request_body, from_triton_tx)).abort_handle(),
    );
    let (notes_tx, mut notes) = mpsc::unbounded_channel();
    let reader = AbortOnDrop(
        tokio::spawn(read_requests(front.clone(), call.clone(), requests, to_triton, notes_tx)).abort_handle(),
    );
    let mut record = Record { shared, call: &call, events: 0, bytes: 0, joined: false, done: false };
    let mut joined: Vec<String> = Vec::new();
    let mut slots: Vec<Slot> = Vec::new();
    let (first, idle) = (shared.settings.upstream_timeout, call.idle);
    let mut outstanding: usize = 0;
    let mut answering = false;
    let mut last = Instant::now();
    let mut last_sent: Option<Instant> = None;
    let mut reading = true;
    let ending: Option<Ending> = loop {
        let bound = (outstanding > 0).then_some(if answering { idle } else { first });
        // Biased: a request's note is queued before the request goes to Triton, so it is read
        // before any response to it and the silence bound always counts what is owed.
        let message: Bytes = tokio::select! {
            biased;
            _ = tx.closed() => {
                // The client left: Triton's side is cancelled as the tasks drop.
                drop((reader, upstream, slots));
                record.gone();
                return;
            }
            note = notes.recv(), if reading => match note {
                None => { reading = false; continue; }
                Some(Note::Joined { model, slot }) => {
                    slots.extend(slot);
                    if !joined.contains(&model) {
                        joined.push(model);
                    }
                    record.joined = true;
                    match quarantined(shared, &joined) {
                        Some(ending) => break Some(ending),
                        None => continue,
                    }
                }
                Some(Note::Sent) => {
                    if outstanding == 0 {
                        last = Instant::now(); // the stream owed nothing: the bound counts from now
                    }
                    outstanding += 1;
                    continue;
                }
                Some(Note::Refused(message)) => message,
                Some(Note::End(ending)) => break Some(ending),
            },
            up = from_triton.recv() => match up {
                Some(Upstream::Message(message)) => {
                    last = Instant::now();
                    let mut owed = Owed { outstanding: &mut outstanding, answering: &mut answering };
                    match screened(shared, &call, slots.len(), message, &mut owed) {
                        Ok(Some(message)) => message,
                        Ok(None) => continue,
                        Err(ending) => break Some(ending),
                    }
                }
                Some(Upstream::End(code, message)) => {
                    if code == wire::OK {
                        for model in &joined {
                            shared.events.push(Event::Answered { model: model.clone(), count: 1 });
                        }
                        break None;
                    }
                    break Some(ended_by_triton(shared, &call.model, code, &message));
                }
                Some(Upstream::Failed(failure)) => break Some(failed(shared, &call.model, failure)),
                None => break Some(failed(shared, &call.model, Failure::Dropped("Triton's side ended".to_owned()))),
            },
            changed = published.changed() => {
                if changed.is_ok() {
                    if let Some(ending) = quarantined(shared, &joined) {
                        break Some(ending);
                    }
                }
                continue;
            }
            _ = sleep_until((last + bound.unwrap_or(Duration::ZERO)).into()), if bound.is_some() => {
                let bound = bound.unwrap_or_default();
                let model = call.model.as_str();
                let message = format!(
                    "model {model} sent no event for {} s after {} event(s) (generation.idle_timeout_s); the stream \
                     was ended",
                    format_g(bound.as_secs_f64()),
                    record.events
                );
                shared.events.push(Event::Failed {
                    model: model.to_owned(),
                    kind: "timeout",
                    status: 0,
                    detail: message.clone(),
                });
                break Some(Ending::new("stream_idle", message));
            }
        };
        // A slow client holds the loop here (back-pressure up to Triton); a quarantine meanwhile
        // still ends the stream.
        let framed = wire::frame(&message);
        let size = framed.len() as u64;
        let reserved = loop {
            tokio::select! {
                reserved = tx.reserve() => break Some(reserved),
                changed = published.changed() => {
                    if changed.is_ok() && quarantined(shared, &joined).is_some() {
                        break None;
                    }
                }
            }
        };
        let Some(reserved) = reserved else {
            break quarantined(shared, &joined);
        };
        let Ok(reserved) = reserved else {
            drop((reader, upstream, slots));
            record.gone();
            return;
        };
        reserved.send(Frame::data(framed));
        let now = Instant::now();
        let streams = &shared.metrics.streams;
        match last_sent {
            None => {
                call.span.phase("first event sent");
                streams.first_event.observe(&[call.model.as_str()], call.started.elapsed().as_secs_f64());
            }
            Some(before) => streams.inter_event.observe(&[call.model.as_str()], (now - before).as_secs_f64()),
        }
        last_sent = Some(now);
        record.events += 1;
        record.bytes += size;
        last = last.max(now);
    };
    // Triton's side ends now (cancelled when cut short), the slots are given back, and everything is
    // counted before the client reads the stream's end.
    drop((reader, upstream, slots));
    record.ended(ending.as_ref());
    let _ = tx.send(Frame::trailers(trailers(&call, ending.as_ref()))).await;
}

/// Requests sent whose final response has not come yet, and whether the oldest has answered once
/// (its next response is then bounded by generation.idle_timeout_s).
struct Owed<'a> {
    outstanding: &'a mut usize,
    answering: &'a mut bool,
}

/// One of Triton's messages as it may leave the pod (None: withheld with nothing said, never here),
/// or the ending it brings (a message that is not a ModelStreamInferResponse).
fn screened(
    shared: &Shared,
    call: &Call,
    slotted: usize,
    message: Bytes,
    owed: &mut Owed<'_>,
) -> Result<Option<Bytes>, Ending> {
    let model = call.model.as_str();
    let mut response = match ModelStreamInferResponse::decode(message.clone()) {
        Ok(response) => response,
        Err(e) => {
            let detail = format!("not a ModelStreamInferResponse: {}", cut(&e.to_string(), 120));
            let message = format!("model {model}: {detail}");
            shared.events.push(Event::Failed { model: model.to_owned(), kind: "bad_answer", status: 0, detail });
            return Err(Ending::new("triton_bad_answer", message));
        }
    };
    let error = !response.error_message.is_empty();
    if error || response.infer_response.as_ref().is_none_or(is_final) {
        *owed.outstanding = owed.outstanding.saturating_sub(1);
        *owed.answering = false;
    } else {
        *owed.answering = true;
    }
    if error {
        // Triton's own in-stream error: passed on as it came, the stream's model's failure (when
        // the stream holds one model's slot alone, as the Python stream signals it).
        if slotted == 1 {
            let detail = cut(&format!("Triton answered: {}", response.error_message), 300);
            shared.events.push(Event::Failed { model: model.to_owned(), kind: "server_error", status: 500, detail });
        }
        return Ok(Some(message));
    }
    let Some(answer) = response.infer_response.as_mut() else { return Ok(Some(message)) };
    let Some(lane) = shared.state.load().lanes.get(&answer.model_name).cloned() else { return Ok(Some(message)) };
    let answered = answer.model_name.clone();
    let (dropped, non_finite) = screen(&lane, answer);
    for output in &dropped {
        shared.metrics.outputs_filtered.inc(&[answered.as_str(), output.as_str()]);
    }
    if !non_finite.is_empty() {
        shared.events.push(Event::NonFinite { model: answered.clone(), outputs: non_finite.clone() });
        if shared.settings.block_non_finite_outputs {
            let names = non_finite.join(", ");
            let message = format!(
                "model {answered} answered NaN/Inf in {names}; the answer was withheld and the model is being re-checked"
            );
            return Ok(Some(in_stream("non_finite_output", &message, &answer.id)));
        }
    } else {
        shared.events.push(Event::Answered { model: answered, count: 1 });
    }
    if dropped.is_empty() {
        Ok(Some(message))
    } else {
        Ok(Some(Bytes::from(response.encode_to_vec())))
    }
}

/// Triton marks the last response of a request (a decoupled model sends several).
fn is_final(response: &ModelInferResponse) -> bool {
    use super::messages::ParameterChoice;
    match response.parameters.get("triton_final_response").and_then(|p| p.parameter_choice.as_ref()) {
        Some(ParameterChoice::BoolParam(value)) => *value,
        Some(_) => false,
        None => true,
    }
}

/// A refusal said inside the stream, in Triton's in-stream form (grpc_server.py's _stream_error).
fn in_stream(reason: &str, message: &str, request_id: &str) -> Bytes {
    let response = ModelStreamInferResponse {
        error_message: format!("[{reason}] {message}"),
        infer_response: (!request_id.is_empty())
            .then(|| ModelInferResponse { id: request_id.to_owned(), ..Default::default() }),
    };
    Bytes::from(response.encode_to_vec())
}

/// A joined model stopped being trusted: the refusal Python published for it ends the stream
/// (Admission.until_untrusted; the stream's models are quarantined whole or not at all); one the
/// sidecar no longer guards (released) ends it NOT_FOUND, as a new call to it is refused.
fn quarantined(shared: &Shared, joined: &[String]) -> Option<Ending> {
    let snapshot = shared.state.load();
    if let Some(model) = joined.iter().find(|model| !snapshot.guards.contains_key(*model)) {
        return Some(Ending::new("unknown_model", admission::released_message(model)));
    }
    let ended = joined.iter().find_map(|model| snapshot.ended.get(model))?;
    let mut ending = Ending::new(&ended.reason, lane::triton_error_message(&ended.body));
    ending.retry_after = ended.retry_after;
    Some(ending)
}

/// Triton ended the stream with an error status (grpc_server.upstream_failure, then
/// ServingCore.upstream_refusal).
fn ended_by_triton(shared: &Shared, model: &str, code: Code, message: &str) -> Ending {
    let detail = cut(&wire::percent_decode(message), 300);
    let detail = if detail.is_empty() { code.1.to_owned() } else { detail };
    match code.0 {
        14 => failed(shared, model, Failure::Unreachable(detail)),
        4 => failed(shared, model, Failure::Timeout),
        1 => failed(shared, model, Failure::Dropped(detail)),
        _ => {
            shared.events.push(Event::Failed {
                model: model.to_owned(),
                kind: "server_error",
                status: 500,
                detail: detail.clone(),
            });
            Ending::new("triton_error", format!("Triton answered with an error for model {model}: {detail}"))
        }
    }
}

fn failed(shared: &Shared, model: &str, failure: Failure) -> Ending {
    Ending::refused(&lane::upstream_refusal(shared, model, failure))
}

/// The call to Triton's ModelStreamInfer: the requests as the requests' task sends them, Triton's
/// messages as they come. Dropped (the task aborted) before its end, it resets the call at Triton.
async fn triton_side(
    front: Arc<GrpcFront>,
    call: Arc<Call>,
    requests: mpsc::Receiver<Frame<Bytes>>,
    out: mpsc::Sender<Upstream>,
) {
    let ended = relay_triton(&front, &call, requests, &out).await;
    let last = match ended {
        Ok(Some((code, message))) => Upstream::End(code, message),
        Ok(None) => return, // the stream's task is gone
        Err(failure) => Upstream::Failed(failure),
    };
    let _ = out.send(last).await;
}

async fn relay_triton(
    front: &GrpcFront,
    call: &Call,
    requests: mpsc::Receiver<Frame<Bytes>>,
    out: &mpsc::Sender<Upstream>,
) -> Result<Option<(Code, String)>, Failure> {
    let uri = format!("http://{}{}", front.triton.authority(), MODEL_STREAM_INFER)
        .parse::<hyper::Uri>()
        .map_err(|e| Failure::Unreachable(format!("triton.grpc_url: {e}")))?;
    let mut request = Request::new(wire::channel(requests));
    *request.method_mut() = hyper::Method::POST;
    *request.uri_mut() = uri;
    *request.version_mut() = hyper::Version::HTTP_2;
    let headers = request.headers_mut();
    headers.insert("content-type", HeaderValue::from_static(wire::CONTENT_TYPE));
    headers.insert("te", HeaderValue::from_static("trailers"));
    if let Ok(value) = HeaderValue::from_str(&call.request_id) {
        headers.insert("x-request-id", value);
    }
    for (name, value) in [("traceparent", &call.traceparent), ("tracestate", &call.tracestate)] {
        if let Some(value) = value.as_deref().and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(name, value);
        }
    }
    let mut sender = front.triton.sender().await.map_err(Failure::Unreachable)?;
    let response = sender.send_request(request).await.map_err(|e| Failure::Unreachable(e.to_string()))?;
    let (parts, mut body) = response.into_parts();
    if parts.status != hyper::StatusCode::OK {
        return Err(Failure::Dropped(format!("Triton's gRPC port answered HTTP {}", parts.status.as_u16())));
    }
    if let Some(status) = status_of(&parts.headers) {
        return Ok(Some(status)); // trailers-only: Triton refused the stream at once
    }
    let mut deframer = Deframer::default();
    while let Some(frame) = body.frame().await {
        // The connection to Triton broke under the stream (Triton gone): grpc-core says UNAVAILABLE.
        let frame = frame.map_err(|e| Failure::Unreachable(format!("Triton's stream broke off: {e}")))?;
        let frame = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                let status = frame.trailers_ref().and_then(status_of);
                return status
                    .map(Some)
                    .ok_or_else(|| Failure::Dropped("Triton's stream ended without a grpc-status".to_owned()));
            }
        };
        deframer.push(&frame);
        loop {
            match deframer.next(usize::MAX) {
                Deframed::Message(message) => {
                    if out.send(Upstream::Message(message)).await.is_err() {
                        return Ok(None);
                    }
                }
                Deframed::Partial => break,
                // The front asks Triton for no grpc-encoding, so it sends none.
                Deframed::Compressed(_) | Deframed::TooLarge(_) => {
                    return Err(Failure::Dropped("Triton sent a compressed message".to_owned()));
                }
            }
        }
    }
    Err(Failure::Dropped("Triton's stream ended without a grpc-status".to_owned()))
}

/// grpc-status and grpc-message (as it came) from headers or trailers that carry them.
fn status_of(headers: &HeaderMap) -> Option<(Code, String)> {
    let status = headers.get("grpc-status")?;
    let number = status.to_str().ok().and_then(|s| s.parse::<u8>().ok()).unwrap_or(2);
    let message = headers.get("grpc-message").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    Some((Code::from_number(number), message))
}

/// The client's requests, each admitted, checked and sent to Triton as it comes; refusals said
/// in-stream, or the stream ended. Its end (the client closed its side) ends Triton's side of the
/// requests: Triton answers what it owes, then ends the stream.
async fn read_requests(
    front: Arc<GrpcFront>,
    call: Arc<Call>,
    mut requests: Requests,
    to_triton: mpsc::Sender<Frame<Bytes>>,
    notes: mpsc::UnboundedSender<Note>,
) {
    let shared = &front.shared;
    let limit = shared.settings.max_body_bytes;
    let mut slotted: HashSet<String> = HashSet::new();
    let mut joined: HashSet<(String, String)> = HashSet::new();
    loop {
        let (request, message) = match requests.first.take() {
            Some(first) => (Ok(first.0), first.1),
            None => {
                let message = loop {
                    match requests.deframer.next(limit) {
                        Deframed::Message(message) => break message,
                        Deframed::Partial => {}
                        Deframed::Compressed(packed) => {
                            match encoding::inflated(&requests.encoding, packed, limit).await {
                                Ok(message) => break message,
                                Err(refused) => {
                                    let ending = Ending {
                                        code: refused.code,
                                        reason: refused.reason.to_owned(),
                                        message: refused.message,
                                        retry_after: None,
                                    };
                                    let _ = notes.send(Note::End(ending));
                                    return;
                                }
                            }
                        }
                        Deframed::TooLarge(size) => {
                            // grpcio's own refusal of a message over grpc.max_receive_message_length.
                            let message = format!("Received message larger than max ({size} vs. {limit})");
                            let _ = notes.send(Note::End(Ending::new("body_too_large", message)));
                            return;
                        }
                    }
                    match requests.body.frame().await {
                        Some(Ok(frame)) => {
                            if let Ok(data) = frame.into_data() {
                                requests.deframer.push(&data);
                            }
                        }
                        // The client closed its side (or broke off: the answer's channel says so).
                        None | Some(Err(_)) => return,
                    }
                };
                (ModelInferRequest::decode(message.clone()), message)
            }
        };
        let step = match request {
            Ok(request) => admit(shared, &call, request, &mut slotted, &mut joined, &notes).await,
            Err(e) => {
                shared.metrics.rejections.inc(&["grpc", call.model.as_str(), "malformed"]);
                let detail = format!("not a ModelInferRequest: {}", cut(&e.to_string(), 200));
                Step::InStream(in_stream("malformed", &detail, ""))
            }
        };
        match step {
            Step::Forward => {
                let _ = notes.send(Note::Sent);
                if to_triton.send(Frame::data(wire::frame(&message))).await.is_err() {
                    return; // Triton's side ended: the stream's task says how
                }
            }
            Step::InStream(message) => {
                let _ = notes.send(Note::Refused(message));
            }
            Step::End(ending) => {
                let _ = notes.send(Note::End(ending));
                return;
            }
        }
    }
}

enum Step {
    Forward,
    InStream(Bytes),
    End(Ending),
}

/// One request of the stream: its model resolved, admitted, the request validated, the model's
/// breaker slot taken for the stream by its first request (OpenStream.join).
async fn admit(
    shared: &Arc<Shared>,
    call: &Call,
    request: ModelInferRequest,
    slotted: &mut HashSet<String>,
    joined: &mut HashSet<(String, String)>,
    notes: &mpsc::UnboundedSender<Note>,
) -> Step {
    let model = request.model_name.as_str();
    let version = request.model_version.as_str();
    let refused = |label: &str, reason: &str, message: String| {
        shared.metrics.rejections.inc(&["grpc", label, reason]);
        Step::InStream(in_stream(reason, &message, ""))
    };
    let lane = {
        let snapshot = shared.state.load();
        if !snapshot.guards.contains_key(model) {
            let served = match &snapshot.documents {
                Some(docs) => docs.served.clone(),
                None => {
                    let mut names: Vec<&str> = snapshot.guards.keys().map(String::as_str).collect();
                    names.sort_unstable();
                    names.join(", ")
                }
            };
            return refused(UNKNOWN_LABEL, "unknown_model", documents::unknown_model_message(model, &served));
        }
        if !version.is_empty() && !version.bytes().all(|b| b.is_ascii_digit()) {
            return refused(model, "unknown_model", documents::not_a_version_message(model, version));
        }
        let lane = snapshot.lanes.get(model).filter(|_| snapshot.whole(model)).and_then(|lane| {
            if version.is_empty() {
                Some(lane.clone())
            } else {
                lane.versions.get(version).cloned()
            }
        });
        match lane {
            Some(lane) => lane,
            None => {
                let message = format!(
                    "model {model} is not served on this stream (the sidecar's gRPC front serves a stream opened \
                     for {}; it serves no other version or partly quarantined model on it); open a new stream for \
                     model {model}",
                    call.model
                );
                return refused(model, "model_unavailable", message);
            }
        }
    };
    let admitting = Admitting { protocol: "grpc", model, version };
    let lane: Arc<Lane> = match lane::admitted_on(shared, admitting, lane.stale, &call.span).await {
        Ok(fresh) => fresh.unwrap_or(lane),
        Err(reply) => {
            let ending = Ending::refused(&reply);
            if ending.code == wire::UNAVAILABLE {
                return Step::End(ending);
            }
            return Step::InStream(in_stream(&ending.reason, &ending.message, ""));
        }
    };
    let checked = infer_document(&request).and_then(|(body, header_length)| {
        let hidden = |name: &str| lane.is_hidden(name);
        validate_infer_request(&lane.spec, &body, Some(header_length as i64), &hidden).map(|_| ())
    });
    if let Err(refused) = checked {
        let reason = refused.reason.label();
        shared.metrics.rejections.inc(&["grpc", model, reason]);
        return Step::InStream(in_stream(reason, &refused.message, ""));
    }
    let mut slot = None;
    if !slotted.contains(model) {
        match lane::slot(shared, &lane.breaker, model, "grpc").await {
            Ok(permit) => {
                // Held for the stream's life, by the stream's task: given back when its Slot drops.
                permit.forget();
                shared.metrics.streams.in_flight.add(&[model], 1);
                slot = Some(Slot { shared: shared.clone(), breaker: lane.breaker.clone(), model: model.to_owned() });
                slotted.insert(model.to_owned());
            }
            Err(reply) => {
                let ending = Ending::refused(&reply);
                return Step::InStream(in_stream(&ending.reason, &ending.message, ""));
            }
        }
    }
    let first_join = joined.insert((model.to_owned(), version.to_owned()));
    if slot.is_some() || first_join {
        let _ = notes.send(Note::Joined { model: model.to_owned(), slot });
    }
    Step::Forward
}

/// The trailers that end the stream: its status, and its x-request-id, x-sidecar-reason and
/// grpc-retry-pushback-ms as the Python gRPC front sets them.
fn trailers(call: &Call, ending: Option<&Ending>) -> HeaderMap {
    let mut trailers = match ending {
        None => wire::trailers(wire::OK, ""),
        Some(ending) => wire::trailers(ending.code, &ending.message),
    };
    let metadata = match ending {
        None => trailing_metadata(call.request_id.clone(), "", None),
        Some(ending) => trailing_metadata(call.request_id.clone(), &ending.reason, ending.retry_after),
    };
    for (key, value) in metadata {
        if let Ok(value) = HeaderValue::from_str(&value) {
            trailers.append(HeaderName::from_static(key), value);
        }
    }
    trailers
}

/// What one stream records however it ends: its stream metrics, the call's count, span and
/// access-log line (generate_stream.rs's Record for a gRPC stream).
struct Record<'a> {
    shared: &'a Shared,
    call: &'a Call,
    /// Messages sent to the client (responses and in-stream errors).
    events: u64,
    bytes: u64,
    /// A request was admitted (the stream's metrics count only such streams, as OpenStream's).
    joined: bool,
    done: bool,
}

impl Record<'_> {
    fn ended(&mut self, ending: Option<&Ending>) {
        let model = self.call.model.as_str();
        if self.joined {
            let outcome = ending.map_or("complete", |e| e.reason.as_str());
            self.shared.metrics.streams.ended(model, self.events, outcome);
        }
        if let Some(e) = ending {
            self.shared.events.push(Event::StreamEnded {
                model: model.to_owned(),
                reason: e.reason.clone(),
                events: self.events,
                cause: cut(&e.message, 300),
            });
        }
        let events = self.events as i64;
        self.call.span.event("stream ended", || vec![opentelemetry::KeyValue::new("sidecar.stream.events", events)]);
        match ending {
            None => finish(self.shared, self.call, &wire::OK, "", "", self.bytes),
            Some(e) => finish(self.shared, self.call, &e.code, &e.reason, &e.message, self.bytes),
        }
        self.done = true;
    }

    /// The client left before the stream's end: CANCELLED `client_disconnected`, as grpcio's
    /// RequestScope counts a gone client.
    fn gone(&mut self) {
        if self.joined {
            self.shared.metrics.streams.ended(&self.call.model, self.events, "client_disconnected");
        }
        let message = "the client closed the stream before its end";
        finish(self.shared, self.call, &wire::CANCELLED, "client_disconnected", message, self.bytes);
        self.done = true;
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        // A panic: the supervisor counts the call (INTERNAL); the stream is over.
        if !self.done && self.joined {
            self.shared.metrics.streams.ended(&self.call.model, self.events, "internal_error");
        }
    }
}

/// Count the stream as a call and send up its access-log line (every failure, a sample of the
/// rest), as RequestTelemetry.finish does for the Python gRPC front.
fn finish(shared: &Shared, call: &Call, code: &Code, reason: &str, message: &str, bytes_out: u64) {
    let seconds = call.started.elapsed().as_secs_f64();
    call.span.end_grpc((code.0, code.1), reason, || message.to_owned(), bytes_out);
    shared.metrics.finish("grpc", &call.model, code.1, seconds);
    shared.fast_requests.fetch_add(1, Ordering::Relaxed);
    if lane::logged(shared, *code != wire::OK || !reason.is_empty()) {
        let record = AccessRecord {
            request_id: call.request_id.clone(),
            trace_id: call.trace_id.clone(),
            span_id: call.span.span_id(),
            model: call.model.clone(),
            method: "grpc".to_owned(),
            path: MODEL_STREAM_INFER.to_owned(),
            status: 0,
            duration_ms: (seconds * 100_000.0).round() / 100.0,
            reason: reason.to_owned(),
            client_subject: call.client_subject.clone(),
        };
        shared.events.push(Event::GrpcLog { record, code: code.1 });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::messages::{InferParameter, ParameterChoice};
    use super::*;

    #[test]
    fn in_stream_errors_are_triton_s_form_with_the_request_id_when_there_is_one() {
        let said = ModelStreamInferResponse::decode(in_stream("overloaded", "model m: full", "")).unwrap_or_default();
        assert_eq!(said.error_message, "[overloaded] model m: full");
        assert!(said.infer_response.is_none());
        let said = ModelStreamInferResponse::decode(in_stream("non_finite_output", "NaN", "r7")).unwrap_or_default();
        assert_eq!(said.infer_response.map(|r| r.id).as_deref(), Some("r7"));
    }

    fn call() -> Call {
        Call {
            model: "m".into(),
            request_id: "r1".into(),
            trace_id: String::new(),
            traceparent: None,
            tracestate: None,
            span: RequestSpan::OFF,
            started: Instant::now(),
            client_subject: Arc::from(""),
            idle: Duration::from_secs(1),
        }
    }

    #[test]
    fn triton_s_error_passes_as_it_came_settles_its_request_and_is_the_model_s_failure() {
        let shared = crate::front::shared_for_tests(Duration::ZERO, Duration::ZERO);
        let (mut outstanding, mut answering) = (2, true);
        let error = ModelStreamInferResponse { error_message: "in model: boom".into(), infer_response: None };
        let message = Bytes::from(error.encode_to_vec());
        let mut owed = Owed { outstanding: &mut outstanding, answering: &mut answering };
        let passed = screened(&shared, &call(), 1, message.clone(), &mut owed).ok().flatten();
        assert_eq!(passed, Some(message));
        assert_eq!((outstanding, answering), (1, false));
        let failed = shared.events.drain().into_iter().any(|e| {
            matches!(e, Event::Failed { kind: "server_error", ref detail, .. } if detail == "Triton answered: in model: boom")
        });
        assert!(failed, "the model's failure is reported");
        // A response that is not the last of its request: the next one is bounded by the idle time.
        let partial = ModelStreamInferResponse {
            error_message: String::new(),
            infer_response: Some(ModelInferResponse {
                model_name: "not_a_lane".into(),
                parameters: HashMap::from([(
                    "triton_final_response".to_owned(),
                    InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(false)) },
                )]),
                ..Default::default()
            }),
        };
        let mut owed = Owed { outstanding: &mut outstanding, answering: &mut answering };
        assert!(screened(&shared, &call(), 1, Bytes::from(partial.encode_to_vec()), &mut owed).is_ok());
        assert_eq!((outstanding, answering), (1, true));
        let mut owed = Owed { outstanding: &mut outstanding, answering: &mut answering };
        let ending = screened(&shared, &call(), 1, Bytes::from_static(&[0xff, 0xff]), &mut owed).err();
        assert_eq!(ending.map(|e| (e.code, e.reason)), Some((wire::INTERNAL, "triton_bad_answer".to_owned())));
    }

    #[test]
    fn a_response_is_final_unless_triton_flags_it_otherwise() {
        let flagged = |value: Option<bool>| ModelInferResponse {
            parameters: value
                .map(|v| {
                    let parameter = InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(v)) };
                    HashMap::from([("triton_final_response".to_owned(), parameter)])
                })
                .unwrap_or_default(),
            ..Default::default()
        };
        assert!(is_final(&flagged(None)));
        assert!(is_final(&flagged(Some(true))));
        assert!(!is_final(&flagged(Some(false))));
    }
}
