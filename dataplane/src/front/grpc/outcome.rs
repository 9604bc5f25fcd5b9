//! How a call the gRPC front answers itself ends (ModelInfer, the unary documents, a stream's
//! trailers): its status, message and the trailing metadata the Python gRPC front sets with them
//! (`x-request-id`, the reason key `x-sidecar-reason`, `grpc-retry-pushback-ms` for a refusal with
//! Retry-After), and the pieces every such call shares (the panic's message, a task aborted with
//! its owner). One place, so the modules cannot drift apart in what a client reads.

use bytes::Bytes;
use hyper::Response;

use crate::front::reply::Reply;

use super::infer::refusal_message;
use super::wire::{self, Code, GrpcBody};

/// How a unary call ends.
pub struct Outcome {
    pub code: Code,
    pub message: String,
    /// `message` is Triton's grpc-message as it came (already percent-encoded).
    pub encoded: bool,
    /// The answer, framed (OK only).
    pub data: Option<Bytes>,
    pub reason: &'static str,
    pub retry_after: Option<u64>,
    /// A refusal before Triton was asked: counted in the rejections as well.
    pub rejected: bool,
}

impl Outcome {
    pub fn ok(data: Bytes) -> Self {
        Outcome {
            code: wire::OK,
            message: String::new(),
            encoded: false,
            data: Some(data),
            reason: "",
            retry_after: None,
            rejected: false,
        }
    }

    /// The sidecar's refusal with the reason's gRPC code (after Triton was asked, or not counted
    /// as a rejection: a panic, a client gone).
    pub fn refusal(reason: &'static str, message: String) -> Self {
        Outcome {
            code: Code::of_reason(reason),
            message,
            encoded: false,
            data: None,
            reason,
            retry_after: None,
            rejected: false,
        }
    }

    /// A refusal of the sidecar's own before Triton is asked: counted in the rejections too.
    pub fn rejection(reason: &'static str, message: String) -> Self {
        Outcome { rejected: true, ..Outcome::refusal(reason, message) }
    }

    /// One of the lane's refusals (breaker, quarantine at Triton, Triton failed) as its HTTP reply
    /// gives it: the same reason, message and Retry-After, with the reason's gRPC code.
    pub fn of_reply(reply: Reply) -> Self {
        Outcome { retry_after: reply.retry_after, ..Outcome::refusal(reply.reason, refusal_message(&reply.body)) }
    }

    /// Triton's own client error (INVALID_ARGUMENT, NOT_FOUND...), passed on with its code and words.
    pub fn triton(code: Code, encoded_message: String) -> Self {
        Outcome {
            code,
            message: encoded_message,
            encoded: true,
            data: None,
            reason: "",
            retry_after: None,
            rejected: false,
        }
    }

    /// The call's answer: the message (OK) and the trailers.
    pub fn response(self, request_id: String) -> Response<GrpcBody> {
        let metadata = trailing_metadata(request_id, self.reason, self.retry_after);
        wire::answer(self.code, &self.message, self.encoded, self.data, &metadata)
    }
}

/// The trailing metadata of a call's end, as the Python gRPC front sets it.
pub fn trailing_metadata(request_id: String, reason: &str, retry_after: Option<u64>) -> Vec<(&'static str, String)> {
    let mut metadata: Vec<(&'static str, String)> = vec![("x-request-id", request_id)];
    if !reason.is_empty() {
        metadata.push(("x-sidecar-reason", reason.to_owned()));
    }
    if let Some(seconds) = retry_after {
        metadata.push(("grpc-retry-pushback-ms", (seconds * 1000).to_string()));
    }
    metadata
}

/// What a client reads when its call panicked (sidecar.serving.request's words for the same bug on
/// the Python side); the panic's own message goes to the log under the request id.
pub fn panic_refusal(request_id: &str) -> String {
    format!(
        "the sidecar failed while answering this request (panic); this is a bug in the sidecar: its log has the \
         panic's message under request id {request_id}"
    )
}

/// A task aborted when its owner drops it (the call's end, or its own task dropped).
pub struct AbortOnDrop(pub tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
