//! `POST /v2/models/{m}/generate` to a lane, served without Python: body check -> breaker -> Triton ->
//! screen -> count, the order of sidecar/fronts/generate_routes.py's GenerateExchange through
//! ServingCore.infer, with its refusals, messages and passive signals. Its stream sibling is
//! `generate_stream`.

use std::sync::Arc;

use crate::protocol::pytext::cut;
use crate::serving::filtering::contains;
use crate::serving::generation::{check_generate_request, screen_event, GenerateRefused};
use crate::serving::refusals::Reason;

use super::events::Event;
use super::lane::{self, rejected, slot, upstream_refusal, AtTriton, InFlight, Infer};
use super::reply::{json_value, refusal, Reply};
use super::upstream::Answer;
use super::Shared;

/// What Triton says when `generate` (one answer) meets a model that sent several responses.
const SEVERAL_RESPONSES: &str = "exactly 1 response";

/// The lane endpoints of a model: `POST /v2/models/{m}[/versions/{v}]/<endpoint>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Infer,
    Generate,
    GenerateStream,
}

impl Endpoint {
    /// The model and the endpoint of a path's rest after `/v2/models/`; None for any other path.
    pub fn split(rest: &str) -> Option<(&str, Endpoint)> {
        if let Some(model) = rest.strip_suffix("/infer") {
            return Some((model, Endpoint::Infer));
        }
        if let Some(model) = rest.strip_suffix("/generate_stream") {
            return Some((model, Endpoint::GenerateStream));
        }
        rest.strip_suffix("/generate").map(|model| (model, Endpoint::Generate))
    }

    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Infer => "infer",
            Endpoint::Generate => "generate",
            Endpoint::GenerateStream => "generate_stream",
        }
    }
}

/// Serve one generate request; the answer is always one the client can read (never an error).
pub async fn serve(shared: Arc<Shared>, mut request: Infer) -> Reply {
    let reply = {
        let _counted = InFlight::new(&shared);
        answer(&shared, &mut request).await
    };
    lane::finish(&shared, &request, &reply);
    reply
}

/// The headers Triton gets with a generate call (generate_routes._GenerateCall): the request's id,
/// identity (the answer must be readable to be screened), and the client's trace context.
pub(super) fn upstream_headers(request: &Infer) -> Vec<(&str, &str)> {
    let mut headers: Vec<(&str, &str)> = vec![
        ("x-request-id", request.request_id.as_str()),
        ("accept-encoding", "identity"),
        ("content-type", "application/json"),
    ];
    if let Some(v) = &request.traceparent {
        headers.push(("traceparent", v.as_str()));
    }
    if let Some(v) = &request.tracestate {
        headers.push(("tracestate", v.as_str()));
    }
    headers
}

/// A generate body refused (sidecar.serving.generation.check_generate_request): 400 naming the field
/// (and the input, when it is one); a body that is not JSON names no model, as parse_json says it.
pub(super) fn body_refusal(shared: &Shared, model: &str, refused: &GenerateRefused) -> Reply {
    let label = refused.reason.label();
    if refused.reason == Reason::Malformed {
        return rejected(shared, model, refusal(label, 400, &refused.message, "", &[]));
    }
    let mut extra = Vec::new();
    if !refused.field.is_empty() {
        extra.push(("field", json_value(&refused.field)));
        if refused.is_input {
            extra.push(("input", json_value(&refused.field)));
        }
    }
    rejected(shared, model, refusal(label, 400, &refused.message, model, &extra))
}

/// Triton's verdict that the model instance's stub process died (sidecar.protocol.triton_errors).
pub(super) fn is_stub_dead(message: &str) -> bool {
    message.contains("Stub process") && message.contains("is not healthy")
}

/// Triton's error text, from a JSON body or from a `data: {...}` event body (generate_routes).
pub(super) fn error_message(body: &[u8]) -> String {
    let mut text = body.trim_ascii();
    if let Some(rest) = text.strip_prefix(b"data:") {
        text = rest.trim_ascii();
    }
    lane::triton_error_message(text)
}

/// The message of an answer withheld for NaN/Inf (ServingCore.non_finite_answer).
pub(super) fn non_finite_message(model: &str, outputs: &[String]) -> String {
    format!(
        "model {model} answered NaN/Inf in {}; the answer was withheld and the model is being re-checked",
        outputs.join(", ")
    )
}

async fn answer(shared: &Shared, request: &mut Infer) -> Reply {
    shared.injected_panic.strike(&request.model);
    lane::routed(shared, request);
    match lane::admitted(shared, request).await {
        Err(refused) => return refused,
        Ok(Some(fresh)) => request.lane = fresh,
        Ok(None) => {}
    }
    let request = &*request;
    let model = request.model.as_str();
    let lane = &request.lane;
    let checked = check_generate_request(&lane.spec, &lane.generate, &request.body);
    request.span.phase("validation");
    if let Err(refused) = checked {
        return body_refusal(shared, model, &refused);
    }
    let permit = match slot(shared, &lane.breaker, model, "http").await {
        Ok(permit) => permit,
        Err(refused) => return refused,
    };
    request.span.phase("breaker wait");
    let _at_triton = AtTriton::new(shared, model);
    let path = lane::triton_path(model, &request.version, "generate");
    let headers = upstream_headers(request);
    // A quarantine that begins while the request is at Triton ends it at once, as for infer.
    let call = shared.upstream.post(&path, &headers, request.body.clone());
    let outcome = match lane::unless_quarantined(shared, model, &request.version, call).await {
        Ok(outcome) => outcome,
        Err(ended) => return ended,
    };
    drop(permit);
    request.span.phase("upstream call");
    match outcome {
        Ok(answer) => {
            let reply = screen(shared, request, answer);
            request.span.phase("screening");
            reply
        }
        Err(failure) => upstream_refusal(shared, model, failure),
    }
}

/// Triton's answer as it may leave the pod (GenerateExchange.send and .screen, ServingCore.screen).
fn screen(shared: &Shared, request: &Infer, answer: Answer) -> Reply {
    let model = request.model.as_str();
    let lane = &request.lane;
    let passed = |body| Reply {
        status: answer.status,
        content_type: "application/json".to_owned(),
        header_length: None,
        retry_after: None,
        body,
        reason: "",
    };
    if answer.status != 200 {
        // A dead stub is a server fault whatever the status; another 4xx is the client's to read.
        let message = error_message(&answer.body);
        if answer.status >= 500 || is_stub_dead(&message) {
            shared.events.push(Event::Failed {
                model: model.to_owned(),
                kind: "server_error",
                status: answer.status,
                detail: message.clone(),
            });
            let text = format!("Triton answered {} for model {model}: {message}", answer.status);
            return refusal("triton_error", 502, &text, model, &[("triton_status", answer.status.to_string())]);
        }
        shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
        return passed(answer.body.clone());
    }
    if contains(&answer.body, b"\"error\"") {
        // 200 with {"error": ...}: a model that sent several responses (the client must stream), or
        // Triton's own failure (a server fault). Not JSON: screening says so below.
        if let Ok(Some(error)) = screen_event(&answer.body, None, false).map(|s| s.error) {
            if error.contains(SEVERAL_RESPONSES) {
                let message = format!(
                    "model {model} streams several responses per request: call .../generate_stream (Triton said: {})",
                    cut(&error, 200)
                );
                return refusal("streaming_model", 400, &message, model, &[]);
            }
            let detail = cut(&error, 300);
            let message = format!("Triton answered with an error for model {model}: {detail}");
            shared.events.push(Event::Failed { model: model.to_owned(), kind: "error_answer", status: 0, detail });
            return refusal("triton_error", 502, &message, model, &[]);
        }
    }
    let hidden = |name: &str| lane.is_hidden(name);
    let filter: Option<&dyn Fn(&str) -> bool> = if lane.hidden.is_some() { Some(&hidden) } else { None };
    let screened = match screen_event(&answer.body, filter, lane.check_non_finite) {
        Ok(screened) => screened,
        Err(e) => {
            let message = format!("model {model}: {}", e.0);
            shared.events.push(Event::Failed { model: model.to_owned(), kind: "bad_answer", status: 0, detail: e.0 });
            return refusal("triton_bad_answer", 502, &message, model, &[]);
        }
    };
    for output in &screened.dropped {
        shared.metrics.outputs_filtered.inc(&[model, output]);
    }
    if !screened.non_finite.is_empty() {
        shared.events.push(Event::NonFinite { model: model.to_owned(), outputs: screened.non_finite.clone() });
        if shared.settings.block_non_finite_outputs {
            let outputs =
                format!("[{}]", screened.non_finite.iter().map(|o| json_value(o)).collect::<Vec<_>>().join(", "));
            let message = non_finite_message(model, &screened.non_finite);
            return refusal("non_finite_output", 502, &message, model, &[("outputs", outputs)]);
        }
    } else {
        shared.events.push(Event::Answered { model: model.to_owned(), count: 1 });
    }
    match screened.data {
        Some(data) => passed(data.into()),
        None => passed(answer.body.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_paths_name_their_endpoint() {
        assert_eq!(Endpoint::split("m/infer"), Some(("m", Endpoint::Infer)));
        assert_eq!(Endpoint::split("m/generate"), Some(("m", Endpoint::Generate)));
        assert_eq!(Endpoint::split("m/generate_stream"), Some(("m", Endpoint::GenerateStream)));
        assert_eq!(Endpoint::split("m/ready"), None);
        assert_eq!(Endpoint::split("m/generate?x=1"), None);
    }

    #[test]
    fn triton_s_error_text_is_read_from_json_or_an_event() {
        assert_eq!(
            error_message(br#"{"error":"Stub process 'm_0_0' is not healthy."}"#),
            "Stub process 'm_0_0' is not healthy."
        );
        assert_eq!(error_message(b" data: {\"error\": \"boom\"}\n\n"), "boom");
        assert!(is_stub_dead("Stub process 'm_0_0' is not healthy."));
        assert!(!is_stub_dead("model is not ready"));
    }
}
