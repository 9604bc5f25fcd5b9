//! The unary RPCs of `inference.GRPCInferenceService` besides ModelInfer, answered by the front
//! without Python exactly as sidecar/fronts/grpc_server.py's `GrpcFront` answers them: the same
//! status codes, messages and trailing metadata (`x-request-id`, `x-sidecar-reason`,
//! `grpc-retry-pushback-ms`), counted and logged as its request scope counts and logs them.
//!
//! - ServerLive, ServerReady: the sidecar's own verdict as Python published it (the rule of
//!   http_routes' `live_refusal` and `serving_status("")`), Triton is not asked.
//! - ModelReady: a model the sidecar guards with problems (http_routes' `model_problems`) is not
//!   ready; else Triton's own answer.
//! - ServerMetadata: Triton's, with only the extensions the sidecar exposes.
//! - ModelMetadata, ModelConfig: Triton's, without the outputs an output filter hides (judged by the
//!   rule HTTP's documents use, front/documents.rs `without_hidden`).
//! - ModelStatistics: Triton's, unless `proxy.allow_statistics` is off.
//! - The control API (every other RPC of the service: repository, shared memory, trace and log
//!   settings): refused PERMISSION_DENIED `forbidden_endpoint`, whatever the message.
//!
//! A model the sidecar does not guard is refused NOT_FOUND `unknown_model`, a version that is not a
//! number likewise. Triton is asked over the front's own channel to its gRPC port with the client's
//! bytes, the request id and the trace context; an error that is the client's to fix is passed on
//! with Triton's code and words, any other failure refused as the Python front refuses it (no
//! passive signal: a document is not the model's answer). What the Python server still decides is
//! handed to it, as before: anything before the first publish of the documents' state (or before
//! discovery), the health verdicts while the control plane is stalled, a message that is
//! compressed or does not decode, and a filtered document holding an output the spec does not
//! declare or an ensemble's steps (the filter's own patterns judge those).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use prost::Message;

use crate::front::connection::{documents_refusal, panic_message, request_id, trace_id, SERVER_LABEL, UNKNOWN_LABEL};
use crate::front::documents::{self, Documents};
use crate::front::events::{AccessRecord, Event};
use crate::front::lane::{self, InFlight};
use crate::front::tracing::{Opened, RequestSpan, Route};
use crate::front::upstream::Failure;
use crate::protocol::pytext::cut;

use super::channel;
use super::infer::read_call;
use super::messages::{ModelMetadataResponse, ModelRequest, ServerMetadataResponse, Verdict};
use super::outcome::{panic_refusal, AbortOnDrop, Outcome};
use super::wire::{self, GrpcBody};
use super::GrpcFront;

const SERVICE: &str = "inference.GRPCInferenceService";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    ServerLive,
    ServerReady,
    ModelReady,
    ServerMetadata,
    ModelMetadata,
    ModelConfig,
    ModelStatistics,
    /// ModelInfer, answered here only when admission's first step refuses it (`refused_infer`).
    ModelInfer,
    /// Triton's control API (grpc_server.py's CONTROL: every RPC of the service it does not serve).
    Control,
}

/// Every RPC answered here: its method, its span's name (as the Python front names it), its kind.
const RPCS: [(&str, &str, Kind); 18] = [
    ("ServerLive", "inference.GRPCInferenceService/ServerLive", Kind::ServerLive),
    ("ServerReady", "inference.GRPCInferenceService/ServerReady", Kind::ServerReady),
    ("ModelReady", "inference.GRPCInferenceService/ModelReady", Kind::ModelReady),
    ("ServerMetadata", "inference.GRPCInferenceService/ServerMetadata", Kind::ServerMetadata),
    ("ModelMetadata", "inference.GRPCInferenceService/ModelMetadata", Kind::ModelMetadata),
    ("ModelConfig", "inference.GRPCInferenceService/ModelConfig", Kind::ModelConfig),
    ("ModelStatistics", "inference.GRPCInferenceService/ModelStatistics", Kind::ModelStatistics),
    ("RepositoryIndex", "inference.GRPCInferenceService/RepositoryIndex", Kind::Control),
    ("RepositoryModelLoad", "inference.GRPCInferenceService/RepositoryModelLoad", Kind::Control),
    ("RepositoryModelUnload", "inference.GRPCInferenceService/RepositoryModelUnload", Kind::Control),
    ("SystemSharedMemoryStatus", "inference.GRPCInferenceService/SystemSharedMemoryStatus", Kind::Control),
    ("SystemSharedMemoryRegister", "inference.GRPCInferenceService/SystemSharedMemoryRegister", Kind::Control),
    ("SystemSharedMemoryUnregister", "inference.GRPCInferenceService/SystemSharedMemoryUnregister", Kind::Control),
    ("CudaSharedMemoryStatus", "inference.GRPCInferenceService/CudaSharedMemoryStatus", Kind::Control),
    ("CudaSharedMemoryRegister", "inference.GRPCInferenceService/CudaSharedMemoryRegister", Kind::Control),
    ("CudaSharedMemoryUnregister", "inference.GRPCInferenceService/CudaSharedMemoryUnregister", Kind::Control),
    ("TraceSetting", "inference.GRPCInferenceService/TraceSetting", Kind::Control),
    ("LogSettings", "inference.GRPCInferenceService/LogSettings", Kind::Control),
];

/// ModelInfer, as `refused_infer` answers it (not in RPCS: `infer` serves the call).
pub const MODEL_INFER: Rpc =
    Rpc { method: "ModelInfer", name: "inference.GRPCInferenceService/ModelInfer", kind: Kind::ModelInfer };

/// A ModelInfer the lane does not serve, refused here when ServingCore.resolve would refuse it: a
/// model the sidecar does not guard, a version in the message that is not a number (NOT_FOUND
/// `unknown_model`, counted and logged as the Python gRPC front does); None: the Python gRPC
/// server's to answer.
pub fn refused_infer(front: &GrpcFront, body: &Bytes) -> Option<(String, Outcome)> {
    let snapshot = front.shared.state.load();
    let docs = snapshot.documents.as_ref()?;
    let request = super::messages::ModelInferRequest::decode(wire::single_message(body)?).ok()?;
    match resolve(docs, &request.model_name, &request.model_version)? {
        Resolved::Unknown(outcome) => Some((UNKNOWN_LABEL.to_owned(), outcome)),
        Resolved::NotAVersion(outcome) => Some((request.model_name, outcome)),
        Resolved::Guarded => None,
    }
}

/// One of the RPCs this module answers.
#[derive(Debug, Clone, Copy)]
pub struct Rpc {
    method: &'static str,
    name: &'static str,
    kind: Kind,
}

/// The RPC a call's path names when this module answers it (None: ModelInfer, ModelStreamInfer,
/// another service, or a method the service does not have: the Python server's, as before).
pub fn rpc(path: &str) -> Option<Rpc> {
    let name = path.strip_prefix('/')?;
    RPCS.iter().find(|(_, n, _)| *n == name).map(|&(method, name, kind)| Rpc { method, name, kind })
}

/// A readiness verdict (ServerLive, ServerReady, ModelReady) as its answer.
fn verdict(yes: bool) -> Outcome {
    Outcome::ok(wire::frame(&Verdict { yes }.encode_to_vec()))
}

/// What the filter does to Triton's answer.
enum Filter {
    /// Passed as it came.
    None,
    /// ServerMetadata: only the extensions the sidecar exposes.
    Extensions(Arc<Documents>),
    /// ModelMetadata (`config` false) or ModelConfig of a model an output filter names: the verdict
    /// on each output its spec declares.
    Outputs { config: bool, outputs: HashMap<String, bool> },
}

/// What a call becomes once read.
enum Plan {
    /// Answered from what Python published, or refused.
    Answer(Outcome),
    /// Triton is asked, for `model` ("" for the server's documents).
    Triton { model: String, filter: Filter },
}

/// Whether the call's model is one the sidecar guards (admission's `tracked` and `check_version`).
enum Resolved {
    Guarded,
    /// Refused: a name it does not guard (metrics label `_unknown_`)...
    Unknown(Outcome),
    /// ...or a version that is not a number (labelled with the model).
    NotAVersion(Outcome),
}

/// A model and version as ServingCore.resolve judges them; None when that is Python's to say (no
/// model discovered yet: not_verified; a version only Python's str.isdigit() reads).
fn resolve(docs: &Documents, model: &str, version: &str) -> Option<Resolved> {
    if docs.models.is_empty() || !version.is_ascii() {
        return None;
    }
    if !docs.models.contains_key(model) {
        let message = documents::unknown_model_message(model, &docs.served);
        return Some(Resolved::Unknown(Outcome::rejection("unknown_model", message)));
    }
    if !version.is_empty() && !documents::is_version(version) {
        let message = documents::not_a_version_message(model, version);
        return Some(Resolved::NotAVersion(Outcome::rejection("unknown_model", message)));
    }
    Some(Resolved::Guarded)
}

/// The call's metrics label and what it becomes; None: the Python gRPC server answers it.
fn plan(front: &GrpcFront, rpc: Rpc, body: &Bytes) -> Option<(String, Plan)> {
    let shared = &front.shared;
    let server = SERVER_LABEL.to_owned();
    // The health loop's verdicts are kept true only while the control plane runs.
    let stalled = || shared.watchdog.control_silent_for() >= shared.settings.watchdog_stall;
    let snapshot = shared.state.load();
    match rpc.kind {
        Kind::ModelInfer => return None, // infer.rs serves it
        Kind::Control => {
            // grpc_server.py's _control: the method's name in http_routes.forbidden's words.
            let message = documents::forbidden_message(rpc.method);
            return Some((server, Plan::Answer(Outcome::rejection("forbidden_endpoint", message))));
        }
        Kind::ServerLive => {
            let live = snapshot.health.get("/v2/health/live")?;
            if stalled() {
                return None;
            }
            return Some((server, Plan::Answer(verdict(live.status == 200))));
        }
        Kind::ServerReady => {
            let ready = *snapshot.serving.as_ref()?.get("")?;
            if stalled() {
                return None;
            }
            return Some((server, Plan::Answer(verdict(ready))));
        }
        _ => {}
    }
    let docs = snapshot.documents.clone()?;
    if rpc.kind == Kind::ServerMetadata {
        return Some((server, Plan::Triton { model: String::new(), filter: Filter::Extensions(docs) }));
    }
    if rpc.kind == Kind::ModelStatistics && !docs.allow_statistics {
        let refused = Outcome::rejection("forbidden_endpoint", documents::STATISTICS_OFF.to_owned());
        return Some((server, Plan::Answer(refused)));
    }
    let request = ModelRequest::decode(wire::single_message(body)?).ok()?;
    let model = request.name;
    if rpc.kind == Kind::ModelStatistics && model.is_empty() {
        return Some((server, Plan::Triton { model, filter: Filter::None }));
    }
    match resolve(&docs, &model, &request.version)? {
        Resolved::Unknown(outcome) => return Some((UNKNOWN_LABEL.to_owned(), Plan::Answer(outcome))),
        Resolved::NotAVersion(outcome) => return Some((model, Plan::Answer(outcome))),
        Resolved::Guarded => {}
    }
    let guarded = docs.models.get(&model)?;
    let filter = match rpc.kind {
        Kind::ModelReady => {
            if stalled() {
                return None;
            }
            if snapshot.serving.as_ref().and_then(|serving| serving.get(&model)) == Some(&false) {
                return Some((model, Plan::Answer(verdict(false))));
            }
            Filter::None
        }
        Kind::ModelMetadata | Kind::ModelConfig if guarded.filtered => {
            // Before its spec is fetched only the filter's patterns can judge its outputs.
            let outputs = guarded.outputs.clone()?;
            Filter::Outputs { config: rpc.kind == Kind::ModelConfig, outputs }
        }
        _ => Filter::None,
    };
    Some((model.clone(), Plan::Triton { model, filter }))
}

/// One call: read, then answered here or handed to the Python gRPC server.
pub async fn serve(front: Arc<GrpcFront>, request: Request<Incoming>, rpc: Rpc) -> Response<GrpcBody> {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let body = match read_call(&front, &parts.headers, body).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let Some((label, plan)) = plan(&front, rpc, &body) else {
        return front.pass_through(parts, super::collected(body)).await;
    };
    respond(front, parts, body, rpc, label, plan, started).await
}

/// A call of `rpc` refused here with `outcome`, under the metrics label `label` (`refused_infer`'s).
pub async fn refuse(
    front: Arc<GrpcFront>,
    parts: hyper::http::request::Parts,
    body: Bytes,
    rpc: Rpc,
    (label, outcome): (String, Outcome),
    started: Instant,
) -> Response<GrpcBody> {
    respond(front, parts, body, rpc, label, Plan::Answer(outcome), started).await
}

/// The call answered as `plan` says: its span, its count and access-log line, Triton asked if needed.
async fn respond(
    front: Arc<GrpcFront>,
    parts: hyper::http::request::Parts,
    body: Bytes,
    rpc: Rpc,
    label: String,
    plan: Plan,
    started: Instant,
) -> Response<GrpcBody> {
    let shared = &front.shared;
    // In the front's in-flight count (what the drain waits for) until answered here.
    let counted = InFlight::new(shared);
    let text = |key: &str| parts.headers.get(key).and_then(|v| v.to_str().ok());
    let request_id = request_id(text("x-request-id"));
    let (traceparent, tracestate) = (text("traceparent"), text("tracestate"));
    let opened = Opened {
        traceparent,
        tracestate,
        route: Route::Grpc { service: SERVICE, method: rpc.method, name: rpc.name },
        model: &label,
        version: "",
        routed: crate::front::state::Routed::Default,
        request_id: &request_id,
        body_bytes: body.len(),
        started,
    };
    let span = RequestSpan::open(shared.tracing.as_ref(), opened);
    let (trace_id, traceparent, tracestate) = span.upstream_context(trace_id(traceparent), traceparent, tracestate);
    let client_subject = text(super::CLIENT_SUBJECT);
    let mut scope = Scope {
        front: &front,
        rpc,
        label: &label,
        request_id: &request_id,
        trace_id: &trace_id,
        span: &span,
        started,
        client_subject,
        done: false,
    };
    let outcome = match plan {
        Plan::Answer(outcome) => outcome,
        Plan::Triton { model, filter } => {
            // grpc_server.py's _call: the client's deadline bounded by proxy.upstream_timeout_s and
            // triton.timeout_s.
            let settings = &shared.settings;
            let bound = wire::timeout(&parts.headers)
                .map_or(settings.upstream_timeout, |client| client.min(settings.upstream_timeout))
                .min(settings.triton_timeout)
                .max(Duration::from_millis(1));
            let asked = Asked {
                path: parts.uri.path().to_owned(),
                body: body.clone(),
                bound,
                request_id: request_id.clone(),
                traceparent,
                tracestate,
                model,
                filter,
            };
            // Its own task, so a panic ends this call alone (INTERNAL, counted, logged); aborted
            // with this future when the client resets the stream, which drops the call to Triton.
            let task = tokio::spawn(ask(front.clone(), asked));
            let abort = AbortOnDrop(task.abort_handle());
            let joined = task.await;
            drop(abort);
            match joined {
                Ok(Some(outcome)) => outcome,
                Ok(None) => {
                    scope.done = true; // the Python server counts and logs it
                    drop(scope);
                    span.discard();
                    drop(counted);
                    return front.pass_through(parts, super::collected(body)).await;
                }
                Err(e) => {
                    let message = panic_message(e);
                    shared.metrics.internal_errors.inc(&["grpc", label.as_str()]);
                    shared.events.push(Event::GrpcPanic {
                        model: label.clone(),
                        request_id: request_id.clone(),
                        message,
                    });
                    Outcome::refusal("internal_error", panic_refusal(&request_id))
                }
            }
        }
    };
    scope.finish(&outcome);
    drop(scope);
    drop(counted);
    outcome.response(request_id)
}

/// One call answered here, from its span's opening to its count: counted and logged once, when
/// answered, or CANCELLED `client_disconnected` when `serve` is dropped unanswered (the client
/// reset the stream or its deadline passed while Triton was asked), as the Python gRPC front's
/// RequestScope counts a gone client.
struct Scope<'a> {
    front: &'a GrpcFront,
    rpc: Rpc,
    label: &'a str,
    request_id: &'a str,
    trace_id: &'a str,
    span: &'a RequestSpan,
    started: Instant,
    /// The verified client certificate's subject as the connection set it (percent-encoded).
    client_subject: Option<&'a str>,
    /// Counted already, or handed to the Python server.
    done: bool,
}

impl Scope<'_> {
    /// Count the call and send up its access-log line (every failure, a sample of the rest), as
    /// sidecar.serving.request.RequestWrapper.finish does for the Python gRPC front.
    fn finish(&mut self, outcome: &Outcome) {
        self.done = true;
        let shared = &self.front.shared;
        self.front.served.fetch_add(1, Ordering::Relaxed);
        if outcome.rejected {
            shared.metrics.rejections.inc(&["grpc", self.label, outcome.reason]);
        }
        let seconds = self.started.elapsed().as_secs_f64();
        let bytes_out = outcome.data.as_ref().map_or(0, |data| data.len() as u64);
        let message = || if outcome.encoded { wire::percent_decode(&outcome.message) } else { outcome.message.clone() };
        self.span.end_grpc((outcome.code.0, outcome.code.1), outcome.reason, message, bytes_out);
        shared.metrics.finish("grpc", self.label, outcome.code.1, seconds);
        shared.fast_requests.fetch_add(1, Ordering::Relaxed);
        if lane::logged(shared, outcome.code != wire::OK || !outcome.reason.is_empty()) {
            let record = AccessRecord {
                request_id: self.request_id.to_owned(),
                trace_id: self.trace_id.to_owned(),
                span_id: self.span.span_id(),
                model: self.label.to_owned(),
                method: "grpc".to_owned(),
                path: format!("/{}", self.rpc.name),
                status: 0,
                duration_ms: (seconds * 100_000.0).round() / 100.0,
                reason: outcome.reason.to_owned(),
                client_subject: self
                    .client_subject
                    .map_or_else(|| Arc::from(""), |s| Arc::from(wire::percent_decode(s))),
            };
            shared.events.push(Event::GrpcLog { record, code: outcome.code.1 });
        }
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        if !self.done {
            let message = "the client closed the call before its answer".to_owned();
            self.finish(&Outcome::refusal("client_disconnected", message));
        }
    }
}

/// A call Triton answers.
struct Asked {
    path: String,
    body: Bytes,
    bound: Duration,
    request_id: String,
    traceparent: Option<String>,
    tracestate: Option<String>,
    model: String,
    filter: Filter,
}

/// Triton's answer to the call, judged as grpc_server.py's _call judges it and filtered; None: the
/// Python gRPC server answers it.
async fn ask(front: Arc<GrpcFront>, asked: Asked) -> Option<Outcome> {
    let shared = &front.shared;
    let metadata = channel::forwarded(&asked.request_id, asked.traceparent.as_deref(), asked.tracestate.as_deref());
    let model = asked.model.as_str();
    let answer = match front.triton.unary(&asked.path, asked.body, asked.bound, &metadata).await {
        Ok(answer) => answer,
        Err(failure) => return Some(upstream_refusal(&front, model, failure)),
    };
    if answer.status != wire::OK {
        if answer.status.is_clients() {
            return Some(Outcome::triton(answer.status, answer.message));
        }
        let detail = cut(&wire::percent_decode(&answer.message), 300);
        let detail = if detail.is_empty() { answer.status.1.to_owned() } else { detail };
        let failure = match answer.status.0 {
            14 => Failure::Unreachable(detail),
            4 => Failure::Timeout,
            1 => Failure::Dropped(detail),
            _ => {
                // ServingCore.upstream_refusal of a SERVER_ERROR without an HTTP status.
                let message = format!("Triton answered with an error for model {model}: {detail}");
                return Some(Outcome::refusal("triton_error", message));
            }
        };
        return Some(upstream_refusal(&front, model, failure));
    }
    let filtered = match asked.filter {
        Filter::None => return Some(Outcome::ok(answer.body)),
        Filter::Extensions(docs) => {
            let message = wire::single_message(&answer.body)?;
            let mut response = ServerMetadataResponse::decode(message).ok()?;
            response.extensions.retain(|extension| docs.extensions.contains(extension));
            return Some(Outcome::ok(wire::frame(&response.encode_to_vec())));
        }
        Filter::Outputs { config, outputs } => {
            let message = wire::single_message(&answer.body)?;
            if config {
                config_without_hidden(&message, &outputs)?
            } else {
                metadata_without_hidden(&message, &outputs)?
            }
        }
    };
    let (rewritten, dropped) = filtered;
    for output in &dropped {
        shared.metrics.outputs_filtered.inc(&[model, output.as_str()]);
    }
    match rewritten {
        Some(message) => Some(Outcome::ok(wire::frame(&message))),
        None => Some(Outcome::ok(answer.body)),
    }
}

/// A call to Triton that gave no usable answer, refused as ServingCore.upstream_refusal refuses a
/// document's (HTTP's words, the gRPC code of the reason; no passive signal).
fn upstream_refusal(front: &GrpcFront, model: &str, failure: Failure) -> Outcome {
    let reply = documents_refusal(&front.shared, model, failure);
    Outcome::of_reply(reply)
}

/// A ModelMetadataResponse without its hidden outputs (hide_in_metadata's rule): the message
/// re-encoded when one is dropped (None when none is), and the names dropped; None when an output
/// cannot be judged here.
fn metadata_without_hidden(message: &[u8], outputs: &HashMap<String, bool>) -> Option<(Option<Vec<u8>>, Vec<String>)> {
    let mut response = ModelMetadataResponse::decode(message).ok()?;
    let listed = std::mem::take(&mut response.outputs);
    let (kept, dropped) = documents::without_hidden(listed, |tensor| Some(tensor.name.clone()), outputs)?;
    if dropped.is_empty() {
        return Some((None, dropped));
    }
    response.outputs = kept;
    Some((Some(response.encode_to_vec()), dropped))
}

/// ModelConfig's field numbers (model_config.proto) that filtering reads.
const CONFIG: u64 = 1; // ModelConfigResponse.config
const CONFIG_OUTPUT: u64 = 6; // ModelConfig.output
const CONFIG_ENSEMBLE: u64 = 15; // ModelConfig.ensemble_scheduling
const ENSEMBLE_STEP: u64 = 1; // ModelEnsembling.step
const OUTPUT_NAME: u64 = 1; // ModelOutput.name

/// A ModelConfigResponse without its hidden outputs (hide_in_config's rule), cut out of Triton's
/// bytes (ModelConfig is large and grows with each release: it is not decoded, so nothing it holds
/// is lost): the message rewritten when one is dropped (None when none is), and the names dropped;
/// None when an output cannot be judged here, or when one is dropped from an ensemble, whose steps'
/// output maps name it too.
fn config_without_hidden(message: &[u8], outputs: &HashMap<String, bool>) -> Option<(Option<Vec<u8>>, Vec<String>)> {
    let top = fields(message)?;
    let configs: Vec<usize> = (0..top.len()).filter(|&i| top[i].number == CONFIG).collect();
    let index = match configs.as_slice() {
        [] => return Some((None, Vec::new())),
        [index] => *index,
        _ => return None, // several, merged by a parser: not worth judging here
    };
    let inner = fields(top[index].payload?)?;
    let listed: Vec<usize> = (0..inner.len()).filter(|&i| inner[i].number == CONFIG_OUTPUT).collect();
    let name = |&i: &usize| {
        let output = fields(inner[i].payload?)?;
        let name = output.iter().rev().find(|f| f.number == OUTPUT_NAME)?;
        String::from_utf8(name.payload?.to_vec()).ok()
    };
    let (kept, dropped) = documents::without_hidden(listed.clone(), name, outputs)?;
    if dropped.is_empty() {
        return Some((None, dropped));
    }
    let ensemble = inner.iter().filter(|f| f.number == CONFIG_ENSEMBLE).any(|f| {
        f.payload.and_then(fields).is_none_or(|scheduling| scheduling.iter().any(|s| s.number == ENSEMBLE_STEP))
    });
    if ensemble {
        return None;
    }
    let kept: HashSet<usize> = kept.into_iter().collect();
    let mut config = Vec::with_capacity(top[index].whole.len());
    for (i, field) in inner.iter().enumerate() {
        if field.number != CONFIG_OUTPUT || kept.contains(&i) {
            config.extend_from_slice(field.whole);
        }
    }
    let mut out = Vec::with_capacity(message.len());
    for (i, field) in top.iter().enumerate() {
        if i == index {
            prost::encoding::encode_key(CONFIG as u32, prost::encoding::WireType::LengthDelimited, &mut out);
            prost::encoding::encode_varint(config.len() as u64, &mut out);
            out.extend_from_slice(&config);
        } else {
            out.extend_from_slice(field.whole);
        }
    }
    Some((Some(out), dropped))
}

/// One field of a protobuf message as it lies in its bytes.
struct Field<'a> {
    number: u64,
    /// The whole field: key and value.
    whole: &'a [u8],
    /// A length-delimited field's payload.
    payload: Option<&'a [u8]>,
}

/// A message's fields in order; None when it is not a well-formed message (or holds groups).
fn fields(message: &[u8]) -> Option<Vec<Field<'_>>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < message.len() {
        let start = at;
        let key = varint(message, &mut at)?;
        let payload = match key & 7 {
            0 => {
                varint(message, &mut at)?;
                None
            }
            1 => {
                at = at.checked_add(8)?;
                None
            }
            2 => {
                let length = usize::try_from(varint(message, &mut at)?).ok()?;
                let end = at.checked_add(length)?;
                let payload = message.get(at..end)?;
                at = end;
                Some(payload)
            }
            5 => {
                at = at.checked_add(4)?;
                None
            }
            _ => return None,
        };
        let whole = message.get(start..at)?;
        out.push(Field { number: key >> 3, whole, payload });
    }
    Some(out)
}

fn varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::messages::TensorMetadata;
    use super::*;

    fn judged() -> HashMap<String, bool> {
        [("scores".to_owned(), false), ("income_prob".to_owned(), true)].into()
    }

    /// A ModelOutput as model_config.proto lays it out: name (1), data_type (2), dims (3).
    fn output(name: &str) -> Vec<u8> {
        let mut out = Vec::new();
        prost::encoding::string::encode(1, &name.to_owned(), &mut out);
        prost::encoding::int32::encode(2, &11, &mut out);
        prost::encoding::int64::encode_packed(3, &[-1, 1], &mut out);
        out
    }

    fn config(extra: &[u8]) -> Vec<u8> {
        let mut config = Vec::new();
        prost::encoding::string::encode(1, &"credit_risk".to_owned(), &mut config);
        prost::encoding::int32::encode(4, &64, &mut config);
        for name in ["scores", "income_prob"] {
            prost::encoding::bytes::encode(6, &output(name), &mut config);
        }
        prost::encoding::string::encode(17, &"onnxruntime".to_owned(), &mut config);
        config.extend_from_slice(extra);
        let mut response = Vec::new();
        prost::encoding::bytes::encode(1, &config, &mut response);
        response
    }

    fn output_names(response: &[u8]) -> Vec<String> {
        let top = fields(response).expect("a message");
        let inner = fields(top[0].payload.expect("config")).expect("a config");
        inner
            .iter()
            .filter(|f| f.number == CONFIG_OUTPUT)
            .map(|f| {
                let output = fields(f.payload.expect("an output")).expect("fields");
                String::from_utf8(output[0].payload.expect("a name").to_vec()).expect("utf-8")
            })
            .collect()
    }

    #[test]
    fn every_control_rpc_is_known_and_the_served_ones_by_kind() {
        assert_eq!(rpc("/inference.GRPCInferenceService/RepositoryIndex").map(|r| r.kind), Some(Kind::Control));
        assert_eq!(rpc("/inference.GRPCInferenceService/ModelConfig").map(|r| r.kind), Some(Kind::ModelConfig));
        for path in [
            "/inference.GRPCInferenceService/ModelInfer",
            "/inference.GRPCInferenceService/ModelStreamInfer",
            "/inference.GRPCInferenceService/NoSuchMethod",
            "/grpc.health.v1.Health/Check",
        ] {
            assert!(rpc(path).is_none(), "{path}");
        }
        for (method, name, _) in RPCS {
            assert_eq!(name, format!("{SERVICE}/{method}"));
        }
        assert_eq!(
            documents::forbidden_message("RepositoryIndex"),
            "RepositoryIndex is part of Triton's control API, which stays inside the pod; only inference, metadata, \
             config, readiness and health are served here"
        );
    }

    #[test]
    fn a_config_loses_its_hidden_outputs_and_keeps_every_other_byte() {
        let response = config(&[]);
        let (rewritten, dropped) = config_without_hidden(&response, &judged()).expect("judged");
        assert_eq!(dropped, ["income_prob"]);
        let rewritten = rewritten.expect("rewritten");
        assert_eq!(output_names(&rewritten), ["scores"]);
        assert_eq!(rewritten.len(), response.len() - output("income_prob").len() - 2);
        // Nothing hidden: Triton's bytes stay.
        let only_scores: HashMap<String, bool> =
            [("scores".to_owned(), false), ("income_prob".to_owned(), false)].into();
        assert_eq!(
            config_without_hidden(&response, &only_scores).map(|(r, d)| (r.is_none(), d.len())),
            Some((true, 0))
        );
    }

    #[test]
    fn an_undeclared_output_an_ensemble_or_broken_bytes_are_left_to_python() {
        let declared: HashMap<String, bool> = [("scores".to_owned(), false)].into();
        assert!(config_without_hidden(&config(&[]), &declared).is_none());
        let mut step = Vec::new();
        prost::encoding::string::encode(1, &"inner".to_owned(), &mut step);
        let mut scheduling = Vec::new();
        prost::encoding::bytes::encode(1, &step, &mut scheduling);
        let mut ensemble = Vec::new();
        prost::encoding::bytes::encode(15, &scheduling, &mut ensemble);
        assert!(config_without_hidden(&config(&ensemble), &judged()).is_none());
        let response = config(&[]);
        assert!(config_without_hidden(&response[..response.len() - 3], &judged()).is_none());
        assert!(fields(&[0x0b]).is_none(), "a group");
    }

    #[test]
    fn metadata_loses_its_hidden_outputs() {
        let tensor = |name: &str| TensorMetadata { name: name.into(), datatype: "FP32".into(), shape: vec![-1, 1] };
        let response = ModelMetadataResponse {
            name: "credit_risk".into(),
            versions: vec!["1".into()],
            platform: "onnxruntime_onnx".into(),
            inputs: vec![tensor("features")],
            outputs: vec![tensor("scores"), tensor("income_prob")],
        };
        let (rewritten, dropped) = metadata_without_hidden(&response.encode_to_vec(), &judged()).expect("judged");
        assert_eq!(dropped, ["income_prob"]);
        let again = ModelMetadataResponse::decode(rewritten.expect("rewritten").as_slice()).expect("decodes");
        assert_eq!(again.outputs, vec![tensor("scores")]);
        assert_eq!((again.inputs.len(), again.platform.as_str()), (1, "onnxruntime_onnx"));
    }
}
