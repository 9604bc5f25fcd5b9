//! The repository calls of the health loop's heals (load, unload), sent by the front to Triton's
//! gRPC port rather than by Python to its HTTP API. Triton's HTTP server runs a load or an unload on
//! the evhtp worker thread that received it, for as long as the load lasts, and every other
//! connection that worker holds waits meanwhile (Triton issues #8958 and #8635; the fix, #8737, is
//! not in the 2.51 we run): a heal of one model stalled the probes of healthy models and proxied
//! requests to them for the length of the load, long enough for a healthy model to fail a probe.
//! Triton's gRPC server runs repository calls apart from its inference handlers and from the HTTP
//! port. Python asks (`HttpFront.repository_call`) and hears the answer as an event, on its own loop:
//! no thread of its own waits for a load.

use std::collections::HashMap;
use std::time::Duration;

use prost::Message;

use crate::front::upstream::Failure;

use super::channel::Channel;
use super::messages::{RepositoryModelRequest, RepositoryParameter, RepositoryParameterChoice};
use super::wire::{self, Code};

const LOAD: &str = "/inference.GRPCInferenceService/RepositoryModelLoad";
const UNLOAD: &str = "/inference.GRPCInferenceService/RepositoryModelUnload";

/// What a repository call ended in, in the HTTP API's terms the health loop reads: `status` the
/// HTTP status that says what Triton's gRPC status says (0: no answer), `code` the gRPC code's name
/// or, without an answer, why (`timeout`, `unreachable`, `dropped`), `message` Triton's words.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

/// The framed request of `action` ("load" or "unload") for `model`; None for another action. An
/// unload leaves the model's dependents (an ensemble's steps) loaded, as tritonclient's does and
/// as the HTTP call sent before.
pub fn request(action: &str, model: &str) -> Option<(&'static str, bytes::Bytes)> {
    let mut message = RepositoryModelRequest {
        repository_name: String::new(),
        model_name: model.to_owned(),
        parameters: HashMap::new(),
    };
    let path = match action {
        "load" => LOAD,
        "unload" => {
            message.parameters.insert(
                "unload_dependents".to_owned(),
                RepositoryParameter { parameter_choice: Some(RepositoryParameterChoice::BoolParam(false)) },
            );
            UNLOAD
        }
        _ => return None,
    };
    Some((path, wire::frame(&message.encode_to_vec())))
}

/// Send `action` for `model` on `channel` with `metadata` (the repository header, when Triton's
/// `--grpc-restricted-protocol` asks for one), within `bound`.
pub async fn call(channel: &Channel, action: &str, model: &str, metadata: &[(&str, &str)], bound: Duration) -> Outcome {
    let Some((path, body)) = request(action, model) else {
        return Outcome { status: 0, code: "dropped", message: format!("no repository call named {action:?}") };
    };
    match channel.unary(path, body, bound, metadata).await {
        Ok(answer) => outcome_of(answer.status, &answer.message),
        Err(Failure::Timeout) => Outcome {
            status: 0,
            code: "timeout",
            message: format!("no answer from Triton's gRPC port within {:.1} s", bound.as_secs_f64()),
        },
        Err(Failure::Unreachable(detail)) => Outcome { status: 0, code: "unreachable", message: detail },
        Err(Failure::Dropped(detail)) => Outcome { status: 0, code: "dropped", message: detail },
    }
}

fn outcome_of(status: Code, message: &str) -> Outcome {
    Outcome { status: status.http_status(), code: status.1, message: wire::percent_decode(message) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unload_keeps_dependents_and_a_load_sends_no_parameter() {
        let (path, body) = request("unload", "m").unwrap();
        assert_eq!(path, UNLOAD);
        let decoded = RepositoryModelRequest::decode(&body[5..]).unwrap();
        assert_eq!(decoded.model_name, "m");
        assert_eq!(
            decoded.parameters["unload_dependents"].parameter_choice,
            Some(RepositoryParameterChoice::BoolParam(false))
        );
        let (path, body) = request("load", "m").unwrap();
        assert_eq!(path, LOAD);
        assert!(RepositoryModelRequest::decode(&body[5..]).unwrap().parameters.is_empty());
        assert!(request("delete", "m").is_none());
    }

    #[test]
    fn statuses_read_as_the_http_api_would_say_them() {
        assert_eq!(outcome_of(wire::OK, ""), Outcome { status: 200, code: "OK", message: String::new() });
        let refused = outcome_of(Code::from_number(3), "failed%20to%20load");
        assert_eq!(
            (refused.status, refused.code, refused.message.as_str()),
            (400, "INVALID_ARGUMENT", "failed to load")
        );
        assert_eq!(outcome_of(wire::UNIMPLEMENTED, "").status, 501);
        assert_eq!(outcome_of(Code::from_number(7), "").status, 403);
    }
}
