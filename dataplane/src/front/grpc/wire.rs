//! gRPC on HTTP/2 as the front writes and reads it: the 5-byte message framing, `grpc-timeout`,
//! status codes and messages (percent-encoded), and the unary answer (one message, then trailers).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::Response;

/// Every body the gRPC front sends or relays: the client's, the Python app's, Triton's, its own.
pub type GrpcBody = BoxBody<Bytes, hyper::Error>;

pub const CONTENT_TYPE: &str = "application/grpc";

/// A status of gRPC: its number and its name (grpc.StatusCode's, the metrics' `code` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Code(pub u8, pub &'static str);

pub const OK: Code = Code(0, "OK");
pub const CANCELLED: Code = Code(1, "CANCELLED");
pub const INVALID_ARGUMENT: Code = Code(3, "INVALID_ARGUMENT");
pub const DEADLINE_EXCEEDED: Code = Code(4, "DEADLINE_EXCEEDED");
pub const NOT_FOUND: Code = Code(5, "NOT_FOUND");
pub const RESOURCE_EXHAUSTED: Code = Code(8, "RESOURCE_EXHAUSTED");
pub const UNIMPLEMENTED: Code = Code(12, "UNIMPLEMENTED");
pub const INTERNAL: Code = Code(13, "INTERNAL");
pub const UNAVAILABLE: Code = Code(14, "UNAVAILABLE");

const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

impl Code {
    /// A status number as a peer sent it (grpc-status); UNKNOWN for one outside the table.
    pub fn from_number(n: u8) -> Code {
        NAMES.get(n as usize).map(|name| Code(n, name)).unwrap_or(Code(2, "UNKNOWN"))
    }

    /// The code of a refusal's reason label (sidecar.serving.refusals.Reason.grpc_code).
    pub fn of_reason(reason: &str) -> Code {
        match reason {
            "too_many_elements" | "body_too_large" | "overloaded" => RESOURCE_EXHAUSTED,
            "filtered_output" | "shared_memory" | "forbidden_endpoint" => Code(7, "PERMISSION_DENIED"),
            "unknown_model" => Code(5, "NOT_FOUND"),
            "unknown_path" | "method_not_allowed" => Code(12, "UNIMPLEMENTED"),
            "quarantined" | "not_verified" | "model_unavailable" | "not_ready" | "triton_unreachable" => UNAVAILABLE,
            "triton_error" | "triton_bad_answer" | "non_finite_output" | "internal_error" => INTERNAL,
            "triton_timeout" | "stream_idle" | "body_timeout" | "header_timeout" => DEADLINE_EXCEEDED,
            "client_disconnected" => CANCELLED,
            _ => INVALID_ARGUMENT,
        }
    }

    /// Triton's errors that are the client's to fix, passed on with Triton's code and words
    /// (grpc_server.py's _CLIENT_CODES).
    /// The HTTP status that says the same (google.rpc's mapping), for callers that speak Triton's
    /// HTTP API's terms (the health loop's repository calls).
    pub fn http_status(self) -> u16 {
        match self.0 {
            0 => 200,
            1 => 499,
            3 | 9 | 11 => 400,
            4 => 504,
            5 => 404,
            6 | 10 => 409,
            7 => 403,
            8 => 429,
            12 => 501,
            14 => 503,
            16 => 401,
            _ => 500,
        }
    }

    pub fn is_clients(self) -> bool {
        matches!(self.0, 3 | 5 | 9 | 11 | 12 | 6 | 7 | 16)
    }
}

/// One message in gRPC's framing (uncompressed).
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// The one uncompressed message a unary body holds, or None (compressed, several, or cut short).
pub fn single_message(body: &Bytes) -> Option<Bytes> {
    if body.len() < 5 || body[0] != 0 {
        return None;
    }
    let length = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    (body.len() == 5 + length).then(|| body.slice(5..))
}

/// A `grpc-timeout` header's duration ("<digits><unit>", unit H M S m u n); None when absent or bad.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A duration as a `grpc-timeout` value (milliseconds, at least one; 8 digits at most).
pub fn timeout_value(bound: Duration) -> String {
    format!("{}m", bound.as_millis().clamp(1, 99_999_999))
}

/// grpc-message's encoding: bytes outside printable ASCII, and '%', as %XX.
pub fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub fn percent_decode(message: &str) -> String {
    let bytes = message.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(b) = hex {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The body of a unary answer: its message (if any), then its trailers.
pub struct Unary {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Body for Unary {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

/// The trailers that end a call: grpc-status and, unless empty, grpc-message (percent-encoded).
pub fn trailers(code: Code, message: &str) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from(u16::from(code.0)));
    if !message.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&percent_encode(message)) {
            trailers.insert("grpc-message", value);
        }
    }
    trailers
}

/// A streaming answer's headers, its body what `frames` receives (messages, then the trailers);
/// dropped by hyper when the client resets the stream, which closes the sending side.
pub fn streamed(frames: tokio::sync::mpsc::Receiver<Frame<Bytes>>) -> Response<GrpcBody> {
    let mut response = Response::new(channel(frames));
    answer_headers(response.headers_mut());
    response
}

/// A body made of what `frames` receives, ended when its sender is dropped (a stream's requests
/// to Triton, an answer's messages to the client).
pub fn channel(frames: tokio::sync::mpsc::Receiver<Frame<Bytes>>) -> GrpcBody {
    Streamed(frames).boxed()
}

struct Streamed(tokio::sync::mpsc::Receiver<Frame<Bytes>>);

impl Body for Streamed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        self.0.poll_recv(cx).map(|frame| frame.map(Ok))
    }
}

/// Reads gRPC's framing from a request body as its bytes come: each whole message, in order.
#[derive(Default)]
pub struct Deframer {
    buf: BytesMut,
}

/// What the deframer found next.
#[derive(Debug, PartialEq, Eq)]
pub enum Deframed {
    Message(Bytes),
    /// Not whole yet: more bytes needed.
    Partial,
    /// The compressed flag set: the message as sent, for `encoding::inflated` (its length within
    /// the bound; its inflated size is bounded there).
    Compressed(Bytes),
    /// A message declared longer than the bound, with its length.
    TooLarge(usize),
}

impl Deframer {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Bytes received that are not a whole message yet.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    pub fn next(&mut self, limit: usize) -> Deframed {
        if self.buf.len() < 5 {
            return Deframed::Partial;
        }
        let length = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if length > limit {
            return Deframed::TooLarge(length);
        }
        if self.buf.len() < 5 + length {
            return Deframed::Partial;
        }
        let compressed = self.buf[0] != 0;
        let message = self.buf.split_to(5 + length).split_off(5).freeze();
        if compressed {
            Deframed::Compressed(message)
        } else {
            Deframed::Message(message)
        }
    }
}

/// A body of bytes already in hand (a request collected, then handed on).
pub fn full(bytes: Bytes) -> GrpcBody {
    http_body_util::Full::new(bytes).map_err(|never| match never {}).boxed()
}

/// A unary answer: `message` (already framed) when OK, and the trailers: grpc-status, grpc-message
/// (percent-encoded here unless `encoded`), and `metadata` (x-request-id, x-sidecar-reason, ...).
pub fn answer(
    code: Code,
    message: &str,
    encoded: bool,
    data: Option<Bytes>,
    metadata: &[(&'static str, String)],
) -> Response<GrpcBody> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from(u16::from(code.0)));
    if !message.is_empty() {
        let text = if encoded { message.to_owned() } else { percent_encode(message) };
        if let Ok(value) = HeaderValue::from_str(&text) {
            trailers.insert("grpc-message", value);
        }
    }
    for (key, value) in metadata {
        if let Ok(value) = HeaderValue::from_str(value) {
            trailers.append(HeaderName::from_static(key), value);
        }
    }
    let body = Unary { data, trailers: Some(trailers) };
    let mut response = Response::new(body.boxed());
    answer_headers(response.headers_mut());
    response
}

/// Every answer's headers: gRPC's content type, and the encodings the front reads (answers
/// themselves are sent uncompressed).
fn answer_headers(headers: &mut HeaderMap) {
    headers.insert("content-type", HeaderValue::from_static(CONTENT_TYPE));
    headers.insert("grpc-accept-encoding", HeaderValue::from_static(super::encoding::ACCEPTED));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_in_every_unit_and_written_in_milliseconds() {
        let mut headers = HeaderMap::new();
        for (value, want) in [
            ("1H", Duration::from_secs(3600)),
            ("2M", Duration::from_secs(120)),
            ("3S", Duration::from_secs(3)),
            ("400m", Duration::from_millis(400)),
            ("5u", Duration::from_micros(5)),
            ("6n", Duration::from_nanos(6)),
        ] {
            headers.insert("grpc-timeout", HeaderValue::from_static(value));
            assert_eq!(timeout(&headers), Some(want), "{value}");
        }
        headers.insert("grpc-timeout", HeaderValue::from_static("12x"));
        assert_eq!(timeout(&headers), None);
        assert_eq!(timeout_value(Duration::from_micros(10)), "1m");
        assert_eq!(timeout_value(Duration::from_millis(1500)), "1500m");
    }

    #[test]
    fn messages_are_framed_and_one_uncompressed_message_is_read_back() {
        let framed = frame(b"abc");
        assert_eq!(&framed[..], &[0, 0, 0, 0, 3, b'a', b'b', b'c']);
        assert_eq!(single_message(&framed).as_deref(), Some(&b"abc"[..]));
        let mut compressed = framed.to_vec();
        compressed[0] = 1;
        assert_eq!(single_message(&Bytes::from(compressed)), None);
        assert_eq!(single_message(&Bytes::from_static(&[0, 0, 0, 0, 4, b'a'])), None);
    }

    #[test]
    fn messages_are_read_back_across_frames_and_refused_when_compressed_or_too_long() {
        let mut deframer = Deframer::default();
        let two = [frame(b"ab"), frame(b"")].concat();
        deframer.push(&two[..3]);
        assert_eq!(deframer.next(100), Deframed::Partial);
        deframer.push(&two[3..]);
        assert_eq!(deframer.next(100), Deframed::Message(Bytes::from_static(b"ab")));
        assert_eq!(deframer.next(100), Deframed::Message(Bytes::new()));
        assert_eq!((deframer.next(100), deframer.pending()), (Deframed::Partial, 0));
        deframer.push(&frame(b"abc"));
        assert_eq!(deframer.next(2), Deframed::TooLarge(3));
        let mut compressed = Deframer::default();
        compressed.push(&[1, 0, 0, 0, 2, b'z']);
        assert_eq!(compressed.next(100), Deframed::Partial);
        compressed.push(b"z");
        assert_eq!(compressed.next(100), Deframed::Compressed(Bytes::from_static(b"zz")));
        compressed.push(&[1, 0, 0, 0, 3]);
        assert_eq!(compressed.next(2), Deframed::TooLarge(3));
    }

    #[test]
    fn grpc_messages_are_percent_encoded_both_ways() {
        let text = "model m: 100% é\nbad";
        let encoded = percent_encode(text);
        assert_eq!(encoded, "model m: 100%25 %C3%A9%0Abad");
        assert_eq!(percent_decode(&encoded), text);
        assert_eq!(Code::of_reason("shape"), INVALID_ARGUMENT);
        assert_eq!(Code::of_reason("quarantined"), UNAVAILABLE);
        assert_eq!(Code::from_number(7).1, "PERMISSION_DENIED");
    }
}
