//! ModelInfer served without Python to a model published as a lane: route -> admit -> validate ->
//! breaker -> Triton -> screen -> count, the order of lane.rs (and
//! sidecar.serving.core.ServingCore.infer), with the gRPC front's codes, messages and trailing
//! metadata (`x-request-id`, `x-sidecar-reason`, `grpc-retry-pushback-ms`).
//!
//! Admission is the HTTP front's (front/admission.rs, through `lane::admitted_on`): an unpinned call
//! goes to the model's fallback version while Triton's choice is not trusted, a call to a suspect
//! model waits for the verdict (proxy.hold_while_suspect_ms), one to a quarantined model is held for
//! the heal (proxy.hold_during_heal_s) or refused at once with the refusal Python published
//! (UNAVAILABLE, its reason and `grpc-retry-pushback-ms`), all counted as the Python gRPC front
//! counts them.
//!
//! The request is decoded (prost) only to be checked, as the same v2 document and binary chunks the
//! Python gRPC front builds (`document`), by the one validation rule; Triton gets the client's bytes
//! unchanged (re-encoded with its `model_version` set only when it goes to another version than the
//! message names: the fallback, or a pin by `x-model-version` metadata). Triton's
//! answer is decoded only when the model has hidden outputs or is screened for NaN/Inf, and
//! re-encoded only when an output is removed. Whatever the lane does not serve (a model or version
//! that is not a lane, a message and metadata pinning different versions, a malformed message)
//! goes to the Python gRPC server with the bytes already read. A message sent compressed (gzip,
//! deflate) is inflated first (`encoding`), so Triton, and the Python gRPC server, get it
//! uncompressed. With tracing on, a call is one SERVER span of
//! the front's (front/tracing.rs), named and attributed as the Python gRPC front's.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{HeaderMap, Request, Response};
use prost::Message;

use crate::front::connection::{panic_message, request_id, trace_id};
use crate::front::events::{AccessRecord, Event};
use crate::front::lane::{self, Admitting, AtTriton, InFlight};
use crate::front::state::{Lane, Routed};
use crate::front::tracing::{Opened, RequestSpan, Route};
use crate::front::upstream::Failure;
use crate::protocol::answers;
use crate::protocol::datatypes::{binary_as_f64, first_non_finite};
use crate::protocol::pytext::cut;
use crate::serving::drift;
use crate::serving::validation::validate_infer_request;

use super::channel::{self, UnaryAnswer};
use super::document::infer_document;
use super::encoding::{self, Encoding};
use super::messages::{InferTensorContents, ModelInferRequest, ModelInferResponse};
use super::outcome::{panic_refusal, AbortOnDrop, Outcome};
use super::wire::{self, GrpcBody};
use super::GrpcFront;

pub const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

/// ModelInfer's span: `inference.GRPCInferenceService/ModelInfer`, as the Python front names it.
const MODEL_INFER_ROUTE: Route = Route::Grpc {
    service: "inference.GRPCInferenceService",
    method: "ModelInfer",
    name: "inference.GRPCInferenceService/ModelInfer",
};

/// One ModelInfer the lane serves.
struct Call {
    model: String,
    /// The version the request goes to: the one it names, or the model's fallback while Triton's
    /// choice is not trusted ("" = Triton picks).
    version: String,
    /// Why it goes to `version` (pinned, fallback; default for "").
    routed: Routed,
    /// The lane as read when the call came (admission may give it a fresher one).
    lane: Arc<Lane>,
    /// What Triton gets: the client's body as it came (one framed message), or, routed to another
    /// version (the fallback, a pin by metadata), the request with that `model_version`
    /// (GrpcInferExchange._for_version).
    body: Bytes,
    request: ModelInferRequest,
    request_id: String,
    trace_id: String,
    /// What Triton gets: the call's span as the parent when it is sampled, else the client's own.
    traceparent: Option<String>,
    tracestate: Option<String>,
    /// The call's span (RequestSpan::OFF when untraced).
    span: RequestSpan,
    /// The client's deadline bounded by proxy.upstream_timeout_s.
    bound: Duration,
    started: Instant,
    /// The verified client certificate's subject ("" without mutual TLS), for the access log
    /// (`super::CLIENT_SUBJECT`, set by the connection).
    client_subject: Arc<str>,
}

/// A refusal's `error` member (its message, whole).
pub(super) fn refusal_message(body: &[u8]) -> String {
    match crate::protocol::json::parse(body) {
        Ok(crate::protocol::json::Value::Object(members)) => members
            .iter()
            .find(|(k, _)| k == "error")
            .and_then(|(_, v)| match v {
                crate::protocol::json::Value::Str(s) => Some(s.to_string()),
                _ => None,
            })
            .unwrap_or_default(),
        _ => String::from_utf8_lossy(body).into_owned(),
    }
}

/// Read the call's message, then serve it here or hand it to the Python gRPC server.
pub async fn serve(front: Arc<GrpcFront>, request: Request<Incoming>) -> Response<GrpcBody> {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let body = match read_call(&front, &parts.headers, body).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let Some(call) = lane_call(&front, &parts.headers, &body, started) else {
        if let Some(refused) = super::unary::refused_infer(&front, &body) {
            return super::unary::refuse(front, parts, body, super::unary::MODEL_INFER, refused, started).await;
        }
        return front.pass_through(parts, super::collected(body)).await;
    };
    front.served.fetch_add(1, Ordering::Relaxed);
    // Its own task, so a panic ends this call alone (INTERNAL, counted, logged); aborted with this
    // future when the client resets the stream, which drops the call to Triton (cancelled there).
    let call = Arc::new(call);
    let task = tokio::spawn(answer(front.clone(), call.clone()));
    let abort = AbortOnDrop(task.abort_handle());
    let mut unanswered = Unanswered { front: &front, call: &call, answered: false };
    let outcome = match task.await {
        Ok(outcome) => outcome,
        Err(e) => {
            let message = panic_message(e);
            let shared = &front.shared;
            shared.metrics.internal_errors.inc(&["grpc", call.model.as_str()]);
            shared.events.push(Event::GrpcPanic {
                model: call.model.clone(),
                request_id: call.request_id.clone(),
                message,
            });
            let message = panic_refusal(&call.request_id);
            Outcome::refusal("internal_error", message)
        }
    };
    drop(abort);
    unanswered.answered = true;
    finish(&front, &call, &outcome);
    outcome.response(call.request_id.clone())
}

/// A call whose client left before its answer (it reset the stream, or its deadline passed while
/// the call was held for a heal): counted and logged CANCELLED `client_disconnected` when `serve`
/// is dropped unanswered, as the Python gRPC front's RequestScope counts a gone client.
struct Unanswered<'a> {
    front: &'a GrpcFront,
    call: &'a Call,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered {
            let message = "the client closed the call before its answer".to_owned();
            finish(self.front, self.call, &Outcome::refusal("client_disconnected", message));
        }
    }
}

/// A unary call's body (validation.max_body_bytes at most), its message inflated when sent
/// compressed (`encoding`: the bound holds for the inflated message too), or the answer when it
/// cannot be read: RESOURCE_EXHAUSTED past the bound (in grpcio's words), UNIMPLEMENTED for a
/// grpc-encoding the front does not read, INVALID_ARGUMENT for a message that does not inflate,
/// CANCELLED when the client's stream broke off. Refused before the call is known, as grpcio
/// refused them, they are not counted as calls.
pub(super) async fn read_call(
    front: &GrpcFront,
    headers: &HeaderMap,
    body: Incoming,
) -> Result<Bytes, Response<GrpcBody>> {
    let limit = front.shared.settings.max_body_bytes;
    match read_message(body, limit).await {
        Ok(body) => encoding::unpack_unary(body, &Encoding::of(headers), limit)
            .await
            .map_err(|refused| wire::answer(refused.code, &refused.message, false, None, &[])),
        Err(Read::TooLarge(size)) => {
            // grpcio's own refusal of a message over grpc.max_receive_message_length.
            let message = format!("Received message larger than max ({size} vs. {limit})");
            Err(wire::answer(wire::RESOURCE_EXHAUSTED, &message, false, None, &[]))
        }
        Err(Read::Failed(e)) => Err(wire::answer(wire::CANCELLED, &e, false, None, &[])),
    }
}

enum Read {
    TooLarge(usize),
    Failed(String),
}

/// The call's body, refused as soon as its message's length (its framing says it first) or the
/// bytes sent pass validation.max_body_bytes.
async fn read_message(mut body: Incoming, limit: usize) -> Result<Bytes, Read> {
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Read::Failed(format!("the client's message was cut: {e}")))?;
        if let Ok(data) = frame.into_data() {
            out.extend_from_slice(&data);
            if out.len() >= 5 {
                let declared = u32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
                if declared > limit {
                    return Err(Read::TooLarge(declared));
                }
            }
            if out.len() > limit + 5 {
                return Err(Read::TooLarge(out.len() - 5));
            }
        }
    }
    Ok(out.freeze())
}

/// The call when the lane serves it: one message (inflated by `read_call`) that decodes, its model a
/// lane (and the version it goes to one of the lane's). Whatever the model's health, the lane's
/// admission (front/admission.rs) then serves, holds or refuses it.
fn lane_call(front: &GrpcFront, headers: &HeaderMap, body: &Bytes, started: Instant) -> Option<Call> {
    let shared = &front.shared;
    let message = wire::single_message(body)?;
    let request = ModelInferRequest::decode(message).ok()?;
    // The pin as ServingCore.pinned reads it: the message's model_version, or the `x-model-version`
    // metadata (stripped of ASCII whitespace, as the HTTP lane strips it); both naming different
    // versions is the Python chain's INVALID_ARGUMENT, and a value that is not text its too.
    let header = match headers.get("x-model-version") {
        Some(value) => value.to_str().ok()?.trim_matches(|c: char| c.is_ascii_whitespace()),
        None => "",
    };
    if !header.is_empty() && !request.model_version.is_empty() && header != request.model_version {
        return None;
    }
    let pinned = if request.model_version.is_empty() { header } else { request.model_version.as_str() };
    let snapshot = shared.state.load();
    if snapshot.rollouts.contains_key(&request.model_name) {
        return None; // a rollout's split, shadows and evidence on gRPC are still the Python chain's
    }
    let model_lane = snapshot.lanes.get(&request.model_name)?.clone();
    // A version only when it is loaded and its spec published (as on the HTTP front): any other
    // goes to the Python chain, which fetches its spec or refuses it.
    let (version, routed) = snapshot.route(&request.model_name, pinned, "");
    let lane = if version.is_empty() { model_lane } else { model_lane.versions.get(version)?.clone() };
    let version = version.to_owned();
    // Triton gets the version the call goes to in the message itself: the fallback's, or the one
    // pinned by metadata alone.
    let body = if version != request.model_version {
        let mut routed = request.clone();
        routed.model_version = version.clone();
        wire::frame(&routed.encode_to_vec())
    } else {
        body.clone()
    };
    let text = |key: &str| headers.get(key).and_then(|v| v.to_str().ok());
    let upstream = shared.settings.upstream_timeout;
    let bound = match wire::timeout(headers) {
        Some(client) => client.min(upstream).max(Duration::from_millis(1)),
        None => upstream,
    };
    let request_id = request_id(text("x-request-id"));
    let (traceparent, tracestate) = (text("traceparent"), text("tracestate"));
    let opened = Opened {
        traceparent,
        tracestate,
        route: MODEL_INFER_ROUTE,
        model: &request.model_name,
        version: &version,
        routed,
        request_id: &request_id,
        body_bytes: body.len(),
        started,
    };
    let span = RequestSpan::open(shared.tracing.as_ref(), opened);
    let (trace_id, traceparent, tracestate) = span.upstream_context(trace_id(traceparent), traceparent, tracestate);
    Some(Call {
        model: request.model_name.clone(),
        version,
        routed,
        lane,
        body,
        request_id,
        trace_id,
        traceparent,
        tracestate,
        span,
        request,
        bound,
        started,
        client_subject: text(super::CLIENT_SUBJECT)
            .map_or_else(|| Arc::from(""), |s| Arc::from(wire::percent_decode(s))),
    })
}

/// Count the call and send up its access-log line (every failure, a sample of the rest), as
/// sidecar.serving.telemetry.RequestTelemetry.finish does for the Python gRPC front.
fn finish(front: &GrpcFront, call: &Call, outcome: &Outcome) {
    let shared = &front.shared;
    let seconds = call.started.elapsed().as_secs_f64();
    let bytes_out = outcome.data.as_ref().map_or(0, |data| data.len() as u64);
    let message = || if outcome.encoded { wire::percent_decode(&outcome.message) } else { outcome.message.clone() };
    call.span.end_grpc((outcome.code.0, outcome.code.1), outcome.reason, message, bytes_out);
    shared.metrics.finish("grpc", &call.model, outcome.code.1, seconds);
    shared.fast_requests.fetch_add(1, Ordering::Relaxed);
    if lane::logged(shared, outcome.code != wire::OK || !outcome.reason.is_empty()) {
        let record = AccessRecord {
            request_id: call.request_id.clone(),
            trace_id: call.trace_id.clone(),
            span_id: call.span.span_id(),
            model: call.model.clone(),
            method: "grpc".to_owned(),
            path: MODEL_INFER.to_owned(),
            status: 0,
            duration_ms: (seconds * 100_000.0).round() / 100.0,
            reason: outcome.reason.to_owned(),
            client_subject: call.client_subject.clone(),
        };
        shared.events.push(Event::GrpcLog { record, code: outcome.code.1 });
    }
}

async fn answer(front: Arc<GrpcFront>, call: Arc<Call>) -> Outcome {
    let shared = &front.shared;
    let _counted = InFlight::new(shared);
    let model = call.model.as_str();
    shared.injected_panic.strike(model);
    lane::routed_to(shared, model, &call.version, call.routed);
    // Admission first (ServingCore.infer: route, admit, then the spec it validates against): a call
    // held for a heal goes on with the lane published after it, its spec fetched anew.
    let admitting = Admitting { protocol: "grpc", model, version: &call.version };
    let lane = match lane::admitted_on(shared, admitting, call.lane.stale, &call.span).await {
        Ok(fresh) => fresh.unwrap_or_else(|| call.lane.clone()),
        Err(refused) => return Outcome::of_reply(refused),
    };
    let lane = &lane;
    let checked = infer_document(&call.request).and_then(|(body, header_length)| {
        let hidden = |name: &str| lane.is_hidden(name);
        validate_infer_request(&lane.spec, &body, Some(header_length as i64), &hidden).map(|_| ())
    });
    call.span.phase("validation");
    if let Err(refused) = checked {
        let reason = refused.reason.label();
        shared.metrics.rejections.inc(&["grpc", model, reason]);
        return Outcome::refusal(reason, refused.message);
    }
    let permit = match lane::slot(shared, &lane.breaker, model, "grpc").await {
        Ok(permit) => permit,
        Err(refused) => return Outcome::of_reply(refused),
    };
    call.span.phase("breaker wait");
    let _at_triton = AtTriton::new(shared, model);
    // A quarantine that begins while the call is at Triton ends it at once; dropping the call
    // resets its stream at Triton.
    let upstream = tokio::time::timeout(call.bound, to_triton(&front, &call));
    let outcome = match lane::unless_quarantined(shared, model, &call.version, upstream).await {
        Ok(outcome) => outcome,
        Err(ended) => return Outcome::of_reply(ended),
    };
    drop(permit);
    call.span.phase("upstream call");
    match outcome {
        Err(_) => Outcome::of_reply(lane::upstream_refusal(shared, model, Failure::Timeout)),
        Ok(Err(failure)) => Outcome::of_reply(lane::upstream_refusal(shared, model, failure)),
        Ok(Ok(answer)) => {
            let judged = judge(&front, &call, lane, answer);
            call.span.phase("screening");
            judged
        }
    }
}

/// The call to Triton's gRPC port (the client's bytes, the request id, the trace context).
async fn to_triton(front: &GrpcFront, call: &Call) -> Result<UnaryAnswer, Failure> {
    let metadata = channel::forwarded(&call.request_id, call.traceparent.as_deref(), call.tracestate.as_deref());
    front.triton.unary(MODEL_INFER, call.body.clone(), call.bound, &metadata).await
}

/// Triton's verdict as the Python gRPC front gives it: an error that is the client's to fix passed
/// on, a failure refused (and signalled), an answer screened.
fn judge(front: &GrpcFront, call: &Call, lane: &Lane, answer: UnaryAnswer) -> Outcome {
    let shared = &front.shared;
    let model = call.model.as_str();
    if answer.status != wire::OK {
        let detail = cut(&wire::percent_decode(&answer.message), 300);
        let detail = if detail.is_empty() { answer.status.1.to_owned() } else { detail };
        if answer.status.is_clients() {
            return Outcome::triton(answer.status, answer.message);
        }
        let failure = match answer.status.0 {
            14 => Failure::Unreachable(detail),
            4 => Failure::Timeout,
            1 => Failure::Dropped(detail),
            _ => {
                // Triton's verdict on the model (a dead stub is recognised from its words: status 500
                // as the Python front reads a gRPC error).
                shared.events.push(Event::Failed {
                    model: model.to_owned(),
                    kind: "server_error",
                    status: 500,
                    detail: detail.clone(),
                });
                let message = format!("Triton answered with an error for model {model}: {detail}");
                return Outcome::refusal("triton_error", message);
            }
        };
        return Outcome::of_reply(lane::upstream_refusal(shared, model, failure));
    }
    let measured = shared.drift.wants(model, lane::random_share);
    if lane.hidden.is_none() && !lane.check_non_finite && !measured {
        shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
        return Outcome::ok(answer.body);
    }
    let decoded = wire::single_message(&answer.body)
        .ok_or_else(|| "not one uncompressed message".to_owned())
        .and_then(|message| ModelInferResponse::decode(message).map_err(|e| e.to_string()));
    let mut response = match decoded {
        Ok(response) => response,
        Err(e) => {
            let message = format!("model {model}: not a ModelInferResponse: {}", cut(&e, 120));
            return Outcome::of_reply(lane::failed(shared, model, "bad_answer", "triton_bad_answer", 502, message));
        }
    };
    let (dropped, non_finite) = screen(lane, &mut response);
    for output in &dropped {
        shared.metrics.outputs_filtered.inc(&[model, output.as_str()]);
    }
    if !non_finite.is_empty() {
        shared.events.push(Event::NonFinite { model: model.to_owned(), outputs: non_finite.clone() });
        if shared.settings.block_non_finite_outputs {
            let names = non_finite.join(", ");
            let message = format!(
                "model {model} answered NaN/Inf in {names}; the answer was withheld and the model is being re-checked"
            );
            return Outcome::refusal("non_finite_output", message);
        }
    } else {
        shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
    }
    if measured {
        measure_drift(shared, call, lane, &response);
    }
    if dropped.is_empty() {
        Outcome::ok(answer.body)
    } else {
        Outcome::ok(wire::frame(&response.encode_to_vec()))
    }
}

/// Count a measured call in the drift windows (serving::drift): its inputs as validation read them
/// (the document `infer_document` writes), the outputs of the answer as it leaves (hidden ones
/// removed), of the version that answered.
fn measure_drift(shared: &crate::front::Shared, call: &Call, lane: &Lane, response: &ModelInferResponse) {
    let Ok((body, header_length)) = infer_document(&call.request) else { return };
    let Ok(asked) = answers::decode_inputs(&body, Some(header_length as i64)) else { return };
    let inputs = drift::numeric_tensors(&asked, &body);
    let outputs: Vec<drift::Numeric> = response
        .outputs
        .iter()
        .enumerate()
        .filter(|(_, output)| drift::binnable(&output.datatype))
        .filter_map(|(i, output)| {
            let values = match response.raw_output_contents.get(i) {
                Some(raw) => binary_as_f64(&output.datatype, raw)?,
                None => typed_f64(&output.datatype, output.contents.as_ref()?),
            };
            Some(drift::Numeric { name: &output.name, datatype: &output.datatype, shape: &output.shape, values })
        })
        .collect();
    let version = if response.model_version.is_empty() { call.version.as_str() } else { &response.model_version };
    let batched = lane.spec.max_batch_size > 0;
    if shared.drift.observe_decoded(&call.model, version, batched, &inputs, &outputs) {
        shared.events.push(Event::Recorded { model: call.model.clone() });
    }
}

/// A typed `contents` field's values as float64 (the field the datatype is carried in).
fn typed_f64(datatype: &str, contents: &InferTensorContents) -> Vec<f64> {
    fn widened<T: Copy + Into<f64>>(values: &[T]) -> Vec<f64> {
        values.iter().map(|v| (*v).into()).collect()
    }
    match datatype {
        "INT8" | "INT16" | "INT32" => widened(&contents.int_contents),
        "INT64" => contents.int64_contents.iter().map(|v| *v as f64).collect(),
        "UINT8" | "UINT16" | "UINT32" => widened(&contents.uint_contents),
        "UINT64" => contents.uint64_contents.iter().map(|v| *v as f64).collect(),
        "FP32" | "FP16" => widened(&contents.fp32_contents),
        "FP64" => contents.fp64_contents.clone(),
        _ => Vec::new(),
    }
}

/// Hidden outputs removed from the response (with their raw contents), and the kept float outputs
/// holding NaN or ±Inf (grpc_server.py's screen_infer_response).
pub(super) fn screen(lane: &Lane, response: &mut ModelInferResponse) -> (Vec<String>, Vec<String>) {
    let mut dropped = Vec::new();
    let mut non_finite = Vec::new();
    let mut keep = Vec::with_capacity(response.outputs.len());
    for (i, output) in response.outputs.iter().enumerate() {
        if lane.hidden.is_some() && lane.is_hidden(&output.name) {
            dropped.push(output.name.clone());
            keep.push(false);
            continue;
        }
        keep.push(true);
        if !lane.check_non_finite || !matches!(output.datatype.as_str(), "FP16" | "FP32" | "FP64") {
            continue;
        }
        let finite = match response.raw_output_contents.get(i) {
            Some(raw) => first_non_finite(&output.datatype, raw).is_none(),
            None => output.contents.as_ref().is_none_or(|c| {
                if output.datatype == "FP64" {
                    c.fp64_contents.iter().all(|v| v.is_finite())
                } else {
                    c.fp32_contents.iter().all(|v| v.is_finite())
                }
            }),
        };
        if !finite {
            non_finite.push(output.name.clone());
        }
    }
    if !dropped.is_empty() {
        let raw_count = response.raw_output_contents.len();
        let mut index = 0;
        response.outputs.retain(|_| {
            index += 1;
            keep[index - 1]
        });
        let mut index = 0;
        response.raw_output_contents.retain(|_| {
            index += 1;
            index > keep.len() || keep[index - 1]
        });
        debug_assert!(response.raw_output_contents.len() <= raw_count);
    }
    (dropped, non_finite)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use bytes::Bytes;
    use prost::Message;

    use super::super::messages::{InferOutputTensor, InferTensorContents, ModelInferResponse};
    use super::screen;
    use crate::front::state::Lane;

    fn lane(hidden: Option<&[&str]>, check_non_finite: bool) -> Lane {
        Lane {
            hidden: hidden.map(|h| h.iter().map(|s| s.to_string()).collect()),
            check_non_finite,
            ..Lane::for_tests(&[], &["scores", "secret", "half"])
        }
    }

    fn output(name: &str, datatype: &str, contents: Option<InferTensorContents>) -> InferOutputTensor {
        InferOutputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: vec![2],
            parameters: HashMap::new(),
            contents,
        }
    }

    fn response() -> ModelInferResponse {
        ModelInferResponse {
            model_name: "m".into(),
            id: "r1".into(),
            outputs: vec![output("scores", "FP32", None), output("secret", "FP32", None), output("half", "FP16", None)],
            raw_output_contents: vec![
                Bytes::from([1.0f32.to_le_bytes(), f32::NAN.to_le_bytes()].concat()),
                Bytes::from([2.0f32.to_le_bytes(), 3.0f32.to_le_bytes()].concat()),
                Bytes::from_static(&[0x00, 0x3c, 0x00, 0x7c]), // 1.0, +Inf in FP16
            ],
            ..Default::default()
        }
    }

    #[test]
    fn a_hidden_output_leaves_with_its_raw_contents_and_nan_is_found_in_what_is_kept() {
        let mut answer = response();
        let (dropped, non_finite) = screen(&lane(Some(&["secret"]), true), &mut answer);
        assert_eq!(dropped, vec!["secret".to_owned()]);
        assert_eq!(non_finite, vec!["scores".to_owned(), "half".to_owned()]);
        assert_eq!(answer.outputs.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), vec!["scores", "half"]);
        assert_eq!(answer.raw_output_contents.len(), 2);
        assert_eq!(&answer.raw_output_contents[1][..], &[0x00, 0x3c, 0x00, 0x7c]);
        // Re-encoded, the rest of the message is Triton's.
        let again = ModelInferResponse::decode(answer.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!((again.model_name.as_str(), again.id.as_str()), ("m", "r1"));
    }

    #[test]
    fn typed_float_contents_are_screened_and_nothing_is_touched_without_rules() {
        let mut typed = ModelInferResponse {
            outputs: vec![output(
                "scores",
                "FP64",
                Some(InferTensorContents { fp64_contents: vec![1.0, f64::INFINITY], ..Default::default() }),
            )],
            ..Default::default()
        };
        let (dropped, non_finite) = screen(&lane(None, true), &mut typed);
        assert!(dropped.is_empty());
        assert_eq!(non_finite, vec!["scores".to_owned()]);
        let mut untouched = response();
        let (dropped, non_finite) = screen(&lane(None, false), &mut untouched);
        assert!(dropped.is_empty() && non_finite.is_empty());
        assert_eq!(untouched, response());
    }
}
