//! One unary infer served without Python: validate -> breaker -> Triton -> screen -> count, the order
//! of sidecar.serving.core.ServingCore.infer, with its refusals and messages.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::SemaphorePermit;

use crate::protocol::inflate::{self, Unpacked};
use crate::protocol::pytext::cut;
use crate::serving::filtering;
use crate::serving::validation::validate_infer_request;

use super::events::{AccessRecord, Event};
use super::reply::{json_value, refusal, Reply};
use super::shadow;
use super::state::{Breaker, Lane, Routed};
use super::tracing::RequestSpan;
use super::upstream::{Answer, Failure};
use super::Shared;

/// One request the connection read in full.
pub struct Infer {
    pub model: String,
    /// The version the request goes to: the one the client pinned (path or `x-model-version`), a
    /// rollout's pick, or the fallback Python chose while the version reached is not trusted; ""
    /// for none: Triton picks.
    pub version: String,
    /// Why it goes to `version` (routing.Router.route's reason).
    pub routed: Routed,
    /// The model's rollout when it is in one: the answer is its evidence, and may be shadowed.
    pub rollout: Option<Arc<crate::serving::rollouts::Route>>,
    /// The model's lane, or the pinned version's (its spec and hidden outputs).
    pub lane: Arc<Lane>,
    pub request_id: String,
    pub trace_id: String,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    pub header_length: Option<i64>,
    /// As read off the wire; an inflated body replaces it before validation.
    pub body: Bytes,
    /// How the body is read (Content-Type and Content-Encoding).
    pub coding: Coding,
    pub path: String,
    pub started: Instant,
    /// The client certificate's subject (mutual TLS), for the access log; "" without one.
    pub client_subject: Arc<str>,
    /// The request's span (front/tracing.rs); RequestSpan::OFF when untraced.
    pub span: RequestSpan,
}

/// How an infer body is read, as http_routes.check_body_headers decides.
pub enum Coding {
    Identity,
    Gzip,
    Deflate,
    Brotli,
    Zstd,
    /// An unsupported type or encoding: 415 with this message.
    Refused(String),
}

/// Serve one request; the answer is always one the client can read (never an error).
pub async fn serve(shared: Arc<Shared>, mut request: Infer) -> Reply {
    let reply = {
        let _counted = InFlight::new(&shared);
        match unpack(&shared, &mut request).await {
            Some(refused) => refused,
            None => answer(&shared, &mut request).await,
        }
    };
    finish(&shared, &request, &reply);
    reply
}

/// Count and log one answered request (sidecar.serving.telemetry.RequestTelemetry.finish).
pub fn finish(shared: &Shared, request: &Infer, reply: &Reply) {
    let message = || triton_error_message(&reply.body);
    request.span.end(reply.status, reply.reason, message, reply.body.len() as u64);
    finish_status(shared, request, reply.status, reply.reason);
}

/// `finish` for an answer given as its status and refusal reason ("" for none): a stream's.
pub fn finish_status(shared: &Shared, request: &Infer, status: u16, reason: &str) {
    let seconds = request.started.elapsed().as_secs_f64();
    count_answered(shared, &request.model, status, reason, seconds, |duration_ms| AccessRecord {
        request_id: request.request_id.clone(),
        trace_id: request.trace_id.clone(),
        span_id: request.span.span_id(),
        model: request.model.clone(),
        method: "POST".to_owned(),
        path: cut(&request.path, 200),
        status,
        duration_ms,
        reason: reason.to_owned(),
        client_subject: request.client_subject.clone(),
    });
}

/// Count one request the front answered (sidecar.serving.telemetry.RequestTelemetry.finish) and
/// send up its access-log line when it failed or is sampled; `record` (given the duration in ms)
/// is built only for a line that is written.
pub(super) fn count_answered(
    shared: &Shared,
    model: &str,
    status: u16,
    reason: &str,
    seconds: f64,
    record: impl FnOnce(f64) -> AccessRecord,
) {
    shared.metrics.finish("http", model, &status.to_string(), seconds);
    shared.fast_requests.fetch_add(1, Ordering::Relaxed);
    if logged(shared, status >= 400 || !reason.is_empty()) {
        shared.events.push(Event::Log(record((seconds * 100_000.0).round() / 100.0)));
    }
}

/// Is a request's access-log line written: every failed one, a sample of the rest at
/// proxy.access_log_sample_rate (both ports' lanes ask here).
pub(super) fn logged(shared: &Shared, failed: bool) -> bool {
    let rate = shared.settings.access_log_sample_rate;
    failed || rate >= 1.0 || (rate > 0.0 && random_share() < rate)
}

/// Bodies past this many compressed bytes inflate on a blocking thread: up to
/// validation.max_body_bytes of inflating would hold a worker that serves other connections.
const INFLATE_INLINE_BYTES: usize = 16 * 1024;

/// The body as validation reads it: refused 415 for a type or encoding the sidecar does not take,
/// inflated when compressed (413 past validation.max_body_bytes inflated, the bomb never inflated
/// further; 400 malformed when it is not a stream of its encoding), as the Python chain refused it
/// (http_routes.check_body_headers, unreadable_body); None when it may go on.
async fn unpack(shared: &Shared, request: &mut Infer) -> Option<Reply> {
    let model = request.model.as_str();
    let encoding = match &request.coding {
        Coding::Identity => return None,
        Coding::Refused(message) => {
            return Some(rejected(shared, model, refusal("unsupported_media_type", 415, message, model, &[])));
        }
        Coding::Gzip => "gzip",
        Coding::Deflate => "deflate",
        Coding::Brotli => "br",
        Coding::Zstd => "zstd",
    };
    let limit = shared.settings.max_body_bytes;
    let unpacked = move |body: &[u8]| match encoding {
        "br" => inflate::unbrotli(body, limit),
        "zstd" => inflate::unzstd(body, limit),
        _ => inflate::inflate(body, encoding == "gzip", limit),
    };
    match inflated_off_worker(request.body.clone(), unpacked).await {
        Ok(body) => {
            request.body = Bytes::from(body);
            None
        }
        Err(Unpacked::TooLarge) => Some(rejected(shared, model, super::connection::body_too_large(limit, model))),
        Err(Unpacked::Unreadable(why)) => {
            let message = format!("request body cannot be read ({encoding}): {}", cut(&why, 120));
            Some(rejected(shared, model, refusal("malformed", 400, &message, model, &[])))
        }
    }
}

/// `unpacked(body)`, inline for a body of at most INFLATE_INLINE_BYTES, else on tokio's blocking
/// pool: the one rule for where the fronts inflate (this lane, the gRPC front's messages).
pub(crate) async fn inflated_off_worker<F>(body: Bytes, unpacked: F) -> Result<Vec<u8>, Unpacked>
where
    F: FnOnce(&[u8]) -> Result<Vec<u8>, Unpacked> + Send + 'static,
{
    if body.len() <= INFLATE_INLINE_BYTES {
        return unpacked(&body);
    }
    match tokio::task::spawn_blocking(move || unpacked(&body)).await {
        Ok(inflated) => inflated,
        // A panic while inflating ends this request as any panic in its task does.
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(Unpacked::Unreadable("the sidecar is shutting down".to_owned())),
    }
}

async fn answer(shared: &Arc<Shared>, request: &mut Infer) -> Reply {
    shared.injected_panic.strike(&request.model);
    routed(shared, request);
    match admitted(shared, request).await {
        Err(refused) => return refused,
        Ok(Some(fresh)) => request.lane = fresh,
        Ok(None) => {}
    }
    let request = &*request;
    let model = request.model.as_str();
    let lane = &request.lane;
    let hidden = |name: &str| lane.is_hidden(name);
    let checked = validate_infer_request(&lane.spec, &request.body, request.header_length, &hidden);
    request.span.phase("validation");
    if let Err(refused) = checked {
        let extra = if refused.input.is_empty() { vec![] } else { vec![("input", json_value(&refused.input))] };
        let status = match refused.reason.label() {
            "too_many_elements" => 413,
            "filtered_output" | "shared_memory" => 403,
            _ => 400,
        };
        return rejected(shared, model, refusal(refused.reason.label(), status, &refused.message, model, &extra));
    }
    let permit = match slot(shared, &lane.breaker, model, "http").await {
        Ok(permit) => permit,
        Err(refused) => return refused,
    };
    request.span.phase("breaker wait");
    let _at_triton = AtTriton::new(shared, model);
    let path = triton_path(model, &request.version, "infer");
    let header_length = request.header_length.map(|h| h.to_string());
    let mut headers = infer_headers(&request.request_id, header_length.as_deref());
    if let Some(v) = &request.traceparent {
        headers.push(("traceparent", v.as_str()));
    }
    if let Some(v) = &request.tracestate {
        headers.push(("tracestate", v.as_str()));
    }
    let call = shared.upstream.post(&path, &headers, request.body.clone());
    let sent = Instant::now();
    let outcome = match unless_quarantined(shared, model, &request.version, call).await {
        Ok(outcome) => outcome,
        Err(ended) => return ended,
    };
    drop(permit);
    request.span.phase("upstream call");
    let latency = sent.elapsed();
    match outcome {
        Ok(answer) => {
            // A rollout's served answer as Triton gave it (hidden outputs too): what a shadow's is
            // compared with. A clone of the body's handle, not of its bytes.
            let served = request.rollout.as_ref().map(|_| shadow::Served::of(&answer));
            let reply = screen(shared, request, answer);
            request.span.phase("screening");
            if let Some(served) = served {
                shadow::after_answer(shared, request, latency, reply.status, served);
            }
            if reply.status == 200 && shared.drift.wants(model, random_share) {
                // The answer as it leaves (hidden outputs removed), as the Python chain measured it.
                let answer = (&reply.body[..], reply.header_length.map(|h| h as i64));
                let batched = request.lane.spec.max_batch_size > 0;
                let asked = (&request.body[..], request.header_length);
                if shared.drift.observe_documents(model, &request.version, batched, asked, answer) {
                    shared.events.push(Event::Recorded { model: model.to_owned() });
                }
            }
            reply
        }
        Err(failure) => {
            shadow::answered(shared, request, latency, true);
            upstream_refusal(shared, model, failure)
        }
    }
}

/// The headers of an infer call to Triton: the request id, no compression back, and the body's
/// type (`header_length`: the binary extension's JSON header length, as text).
pub(super) fn infer_headers<'a>(request_id: &'a str, header_length: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let content_type = if header_length.is_some() { "application/octet-stream" } else { "application/json" };
    let mut headers =
        vec![("x-request-id", request_id), ("accept-encoding", "identity"), ("content-type", content_type)];
    if let Some(h) = header_length {
        headers.push(("inference-header-content-length", h));
    }
    headers
}

/// A uniform draw in [0, 1), for the lanes' samples (access log, drift).
pub(super) fn random_share() -> f64 {
    (super::connection::random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// The model's breaker (as sidecar/serving/breaker.py): a slot at once, or a place in the queue for
/// up to proxy.upstream_timeout_s; else the overloaded refusal, counted as a rejection of `protocol`
/// (http, grpc).
pub(super) async fn slot<'a>(
    shared: &Shared,
    breaker: &'a Breaker,
    model: &str,
    protocol: &str,
) -> Result<SemaphorePermit<'a>, Reply> {
    if let Ok(permit) = breaker.slots.try_acquire() {
        return Ok(permit);
    }
    let waiting = breaker.waiting();
    if waiting >= shared.settings.queue_size_per_model {
        let message = format!("model {model} has too many requests in flight and {waiting} waiting; retry later");
        return Err(rejected_on(shared, protocol, model, overloaded(&message, model)));
    }
    let acquired = {
        // Out of the queue however the wait ends: a slot, the time up, or the task aborted (its
        // client left while it waited).
        let _queued = Queued::new(shared, breaker, model);
        tokio::time::timeout(shared.settings.upstream_timeout, breaker.slots.acquire()).await
    };
    match acquired {
        Ok(Ok(permit)) => Ok(permit),
        _ => {
            let wait = shared.settings.upstream_timeout.as_secs_f64();
            let message = format!("model {model}: no free slot within {} s", crate::protocol::pytext::format_g(wait));
            Err(rejected_on(shared, protocol, model, overloaded(&message, model)))
        }
    }
}

/// A place in a breaker's queue and in proxy_queued{model}, held while a request waits for a slot
/// (a count kept after an abort would fill the queue for good and refuse every later request).
struct Queued<'a> {
    shared: &'a Shared,
    breaker: &'a Breaker,
    model: &'a str,
}

impl<'a> Queued<'a> {
    fn new(shared: &'a Shared, breaker: &'a Breaker, model: &'a str) -> Self {
        breaker.waiting.fetch_add(1, Ordering::Relaxed);
        shared.metrics.queued.add(&[model], 1);
        Queued { shared, breaker, model }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.breaker.waiting.fetch_sub(1, Ordering::Relaxed);
        self.shared.metrics.queued.add(&[self.model], -1);
    }
}

/// Triton's path for a call to `version` of a lane's model ("" = unversioned: Triton picks), as
/// http_routes.model_path writes it (a lane's name needs no quoting: `lane_for` takes none that would).
pub(super) fn triton_path(model: &str, version: &str, endpoint: &str) -> String {
    if version.is_empty() {
        format!("/v2/models/{model}/{endpoint}")
    } else {
        format!("/v2/models/{model}/versions/{version}/{endpoint}")
    }
}

/// A pinned, split or fallback request counted in routed_total{reason} before admission, as
/// ServingCore.infer counts its route (infer and generate; a stream is not routed). Only loaded
/// versions are published, so the version is its own label (never "other").
pub(super) fn routed(shared: &Shared, request: &Infer) {
    routed_to(shared, &request.model, &request.version, request.routed);
}

/// `routed` for a request to `version` of `model` over any wire.
pub(super) fn routed_to(shared: &Shared, model: &str, version: &str, routed: Routed) {
    if routed != Routed::Default && !version.is_empty() {
        shared.metrics.routed.inc(&[model, version, routed.label()]);
    }
}

/// Admission (front/admission.rs) for the version the request goes to: Err is its refusal, counted
/// as a rejection. A request admission held or refused gets the span's "admission" phase, as the
/// Python chain's; one served at once (a trusted model's) has none, as before. A request held for a
/// heal (or read with a stale lane) goes on with the lane published after it, its spec fetched anew
/// (Some), as the Python chain's fetches the spec after its hold; None: the lane it was read with.
pub(super) async fn admitted(shared: &Shared, request: &Infer) -> Result<Option<Arc<Lane>>, Reply> {
    let admitting = Admitting { protocol: "http", model: &request.model, version: &request.version };
    admitted_on(shared, admitting, request.lane.stale, &request.span).await
}

/// Who asks admission: a request to `version` of `model` ("" = Triton's choice) over `protocol`
/// (http, grpc: the label its refusal is counted under).
pub(super) struct Admitting<'a> {
    pub protocol: &'a str,
    pub model: &'a str,
    pub version: &'a str,
}

/// `admitted` for a request over any wire, read with a lane that was `stale` when published.
pub(super) async fn admitted_on(
    shared: &Shared,
    admitting: Admitting<'_>,
    stale: bool,
    span: &RequestSpan,
) -> Result<Option<Arc<Lane>>, Reply> {
    use super::admission::{admit, at_once, fresh_lane, Admitted};
    let Admitting { protocol, model, version } = admitting;
    let admitted = if at_once(shared, model, version) {
        Admitted::Served
    } else {
        let admitted = admit(shared, model, version).await;
        span.phase("admission");
        admitted.map_err(|reply| rejected_on(shared, protocol, model, reply))?
    };
    if admitted == Admitted::AfterHold || stale {
        return Ok(fresh_lane(shared, model, version).await);
    }
    Ok(None)
}

/// The refusal Python published for a model that stopped being trusted, for the version a request
/// reaches, while it waited at Triton (admission.py's _end_waiting), counted up as ended at Triton;
/// None while that version is trusted.
/// `call` (a request at Triton) run to its end, unless a quarantine of the model (or of this version)
/// begins meanwhile: then it is dropped at once, and its connection to Triton with it (admission.py's
/// _end_waiting), and the refusal `ended_at_triton` gives comes back instead. Infer and generate on
/// HTTP, ModelInfer on gRPC.
pub(super) async fn unless_quarantined<T>(
    shared: &Shared,
    model: &str,
    version: &str,
    call: impl std::future::Future<Output = T>,
) -> Result<T, Reply> {
    // Subscribed before the call is first polled: a quarantine published meanwhile is not missed.
    let mut published = shared.published.subscribe();
    tokio::pin!(call);
    loop {
        tokio::select! {
            outcome = &mut call => return Ok(outcome),
            changed = published.changed() => {
                if changed.is_err() {
                    return Ok(call.await); // no publisher left: nothing can end it now
                }
                if let Some(reply) = ended_at_triton(shared, model, version) {
                    return Err(reply);
                }
            }
        }
    }
}

pub(super) fn ended_at_triton(shared: &Shared, model: &str, version: &str) -> Option<Reply> {
    let snapshot = shared.state.load();
    let ended = snapshot.ended.get(model).filter(|ended| ended.ends(version))?;
    shared.events.push(Event::Ended { model: model.to_owned(), count: 1 });
    Some(Reply {
        status: ended.status,
        content_type: super::reply::JSON_REFUSAL.to_owned(),
        header_length: None,
        retry_after: ended.retry_after,
        body: ended.body.clone(),
        reason: "quarantined",
    })
}

/// In the front's in-flight count (what the drain waits for) while the request is served, however
/// it ends: answered, panicked, or its task aborted because the client left.
pub(super) struct InFlight<'a>(&'a Shared);

impl<'a> InFlight<'a> {
    pub(super) fn new(shared: &'a Shared) -> Self {
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(shared)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// In proxy_in_flight{model} while the request is at Triton, however it ends (answered, timed out,
/// its client gone and the task aborted).
pub(super) struct AtTriton<'a> {
    shared: &'a Shared,
    model: &'a str,
}

impl<'a> AtTriton<'a> {
    pub(super) fn new(shared: &'a Shared, model: &'a str) -> Self {
        shared.metrics.in_flight.add(&[model], 1);
        AtTriton { shared, model }
    }
}

impl Drop for AtTriton<'_> {
    fn drop(&mut self) {
        self.shared.metrics.in_flight.add(&[self.model], -1);
    }
}

fn overloaded(message: &str, model: &str) -> Reply {
    let mut reply = refusal("overloaded", 503, message, model, &[]);
    reply.retry_after = Some(1);
    reply
}

/// A refusal before Triton: counted in proxy_rejections_total.
pub(super) fn rejected(shared: &Shared, model: &str, reply: Reply) -> Reply {
    rejected_on(shared, "http", model, reply)
}

/// `rejected` for a request that came over `protocol` (http, grpc).
pub(super) fn rejected_on(shared: &Shared, protocol: &str, model: &str, reply: Reply) -> Reply {
    shared.metrics.rejections.inc(&[protocol, model, reply.reason]);
    reply
}

pub(super) fn upstream_refusal(shared: &Shared, model: &str, failure: Failure) -> Reply {
    match failure {
        Failure::Unreachable(detail) => {
            shared.events.push(Event::Failed { model: model.to_owned(), kind: "unreachable", status: 0, detail });
            let mut reply = refusal("triton_unreachable", 503, "Triton is unreachable from the sidecar", model, &[]);
            reply.retry_after = Some(shared.settings.retry_after_s);
            reply
        }
        Failure::Timeout => {
            let message = format!("Triton did not answer within the time limit ({model})");
            failed(shared, model, "timeout", "triton_timeout", 504, message)
        }
        Failure::Dropped(detail) => {
            let message = format!("Triton dropped the connection: {}", cut(&detail, 80));
            failed(shared, model, "dropped", "triton_bad_answer", 502, message)
        }
    }
}

/// A call that gave no answer: the passive signal up, and the refusal (its message is the signal's cause).
pub(super) fn failed(
    shared: &Shared,
    model: &str,
    kind: &'static str,
    reason: &'static str,
    status: u16,
    message: String,
) -> Reply {
    let reply = refusal(reason, status, &message, model, &[]);
    shared.events.push(Event::Failed { model: model.to_owned(), kind, status: 0, detail: message });
    reply
}

/// Triton's `{"error": ...}` text, or the start of whatever it answered (specs.triton_error_message).
pub(super) fn triton_error_message(body: &[u8]) -> String {
    let parsed = crate::protocol::json::parse(body).ok();
    let message = parsed.as_ref().and_then(|doc| match doc {
        crate::protocol::json::Value::Object(members) => {
            members.iter().find(|(k, _)| k == "error").and_then(|(_, v)| match v {
                crate::protocol::json::Value::Str(s) if !s.is_empty() => Some(s.to_string()),
                _ => None,
            })
        }
        _ => None,
    });
    let text = match message {
        Some(m) => m,
        None if body.is_empty() => "(empty answer)".to_owned(),
        None => String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
    };
    if text.chars().count() <= 300 {
        text
    } else {
        text.chars().take(297).collect::<String>() + "..."
    }
}

fn screen(shared: &Shared, request: &Infer, answer: Answer) -> Reply {
    let model = request.model.as_str();
    let content_type = answer
        .content_type
        .as_deref()
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or("application/json")
        .trim()
        .to_owned();
    if answer.status >= 500 {
        let detail = triton_error_message(&answer.body);
        shared.events.push(Event::Failed {
            model: model.to_owned(),
            kind: "server_error",
            status: answer.status,
            detail: detail.clone(),
        });
        let message = format!("Triton answered {} for model {model}: {detail}", answer.status);
        return refusal("triton_error", 502, &message, model, &[("triton_status", answer.status.to_string())]);
    }
    if answer.status != 200 {
        // An error that is the client's to fix: passed on with Triton's words.
        shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
        return Reply {
            status: answer.status,
            content_type,
            header_length: None,
            retry_after: None,
            body: answer.body,
            reason: "",
        };
    }
    let lane = &request.lane;
    let hidden = |name: &str| lane.is_hidden(name);
    let filter: Option<&dyn Fn(&str) -> bool> = if lane.hidden.is_some() { Some(&hidden) } else { None };
    let screened =
        match filtering::screen_infer_response(&answer.body, answer.header_length, filter, lane.check_non_finite) {
            Ok(screened) => screened,
            Err(e) => {
                let message = format!("model {model}: {}", e.0);
                shared.events.push(Event::Failed {
                    model: model.to_owned(),
                    kind: "bad_answer",
                    status: 0,
                    detail: e.0.clone(),
                });
                return refusal("triton_bad_answer", 502, &message, model, &[]);
            }
        };
    for output in &screened.dropped {
        shared.metrics.outputs_filtered.inc(&[model, output]);
    }
    if !screened.non_finite.is_empty() {
        shared.events.push(Event::NonFinite { model: model.to_owned(), outputs: screened.non_finite.clone() });
        if shared.settings.block_non_finite_outputs {
            let names = screened.non_finite.join(", ");
            let message = format!(
                "model {model} answered NaN/Inf in {names}; the answer was withheld and the model is being re-checked"
            );
            let outputs =
                format!("[{}]", screened.non_finite.iter().map(|o| json_value(o)).collect::<Vec<_>>().join(", "));
            return refusal("non_finite_output", 502, &message, model, &[("outputs", outputs)]);
        }
    } else {
        shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
    }
    let header_length = screened.header_length;
    let body = match screened.body {
        Some(body) => Bytes::from(body),
        None => answer.body,
    };
    Reply { status: 200, content_type, header_length, retry_after: None, body, reason: "" }
}

#[cfg(test)]
mod tests {
    use super::triton_path;

    #[test]
    fn a_pinned_request_goes_to_its_version_and_an_unpinned_one_to_triton_s_choice() {
        assert_eq!(triton_path("credit_risk", "", "infer"), "/v2/models/credit_risk/infer");
        assert_eq!(triton_path("credit_risk", "2", "infer"), "/v2/models/credit_risk/versions/2/infer");
        assert_eq!(triton_path("m", "1", "generate_stream"), "/v2/models/m/versions/1/generate_stream");
    }
}
