//! One HTTP/2 client connection (h2c, TCP_NODELAY) to a gRPC server: Triton's gRPC port, or the
//! Python gRPC server behind the front on loopback. Opened at the first call, shared by every call
//! (HTTP/2 multiplexes them), opened again when it closes. A call whose future is dropped (its
//! client left, its deadline passed) resets its stream: the server sees the cancel.

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::client::conn::http2::{self, SendRequest};
use hyper::header::{HeaderName, HeaderValue};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use crate::front::upstream::Failure;

use super::wire::{self, Code, GrpcBody};

/// Bound on opening the connection (loopback inside the pod: it answers at once or not at all).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

pub struct Channel {
    /// "host:port".
    authority: String,
    sender: Mutex<Option<SendRequest<GrpcBody>>>,
    /// One connect at a time: calls that arrive meanwhile wait for it rather than open their own.
    connecting: tokio::sync::Mutex<()>,
}

/// A unary call's answer: its body (framed, as it came) and the status its trailers (or a
/// trailers-only answer) carry.
pub struct UnaryAnswer {
    pub body: Bytes,
    pub status: Code,
    /// grpc-message as it came (percent-encoded).
    pub message: String,
}

/// What a call to Triton carries besides the client's bytes: the request id, and the trace context
/// (the call's span's when it is traced, else the client's as it came), as grpc_server.py's
/// `_forwarded` sends them.
pub fn forwarded<'a>(
    request_id: &'a str,
    traceparent: Option<&'a str>,
    tracestate: Option<&'a str>,
) -> Vec<(&'static str, &'a str)> {
    let mut metadata = vec![("x-request-id", request_id)];
    for (name, value) in [("traceparent", traceparent), ("tracestate", tracestate)] {
        if let Some(value) = value {
            metadata.push((name, value));
        }
    }
    metadata
}

impl Channel {
    pub fn new(authority: String) -> Self {
        Channel { authority, sender: Mutex::new(None), connecting: tokio::sync::Mutex::new(()) }
    }

    pub fn authority(&self) -> &str {
        &self.authority
    }

    fn open(&self) -> Option<SendRequest<GrpcBody>> {
        self.sender.lock().ok()?.as_ref().filter(|s| !s.is_closed()).cloned()
    }

    /// The connection's sender, connecting first when there is none open; Err: why not (for the
    /// refusal's detail).
    pub async fn sender(&self) -> Result<SendRequest<GrpcBody>, String> {
        if let Some(sender) = self.open() {
            return Ok(sender);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(sender) = self.open() {
            return Ok(sender);
        }
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.authority))
            .await
            .map_err(|_| format!("connect to {} timed out", self.authority))?
            .map_err(|e| format!("connect to {}: {e}", self.authority))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(1 << 20)
            .initial_connection_window_size(2 << 20)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP/2 handshake with {}: {e}", self.authority))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        if let Ok(mut slot) = self.sender.lock() {
            *slot = Some(sender.clone());
        }
        Ok(sender)
    }

    /// One unary call to Triton's gRPC port (ModelInfer's and the documents', the one way both ask
    /// it; the failures' words name Triton): `body` (one framed message) to `path` with `metadata`, within `bound` (sent
    /// as grpc-timeout too; past it the call is dropped, which resets its stream). Err: no answer
    /// (unreachable, the connection dropped, no grpc-status, the bound passed); a status that is
    /// not OK is an answer.
    pub async fn unary(
        &self,
        path: &str,
        body: Bytes,
        bound: Duration,
        metadata: &[(&str, &str)],
    ) -> Result<UnaryAnswer, Failure> {
        tokio::time::timeout(bound, self.call(path, body, bound, metadata)).await.map_err(|_| Failure::Timeout)?
    }

    async fn call(
        &self,
        path: &str,
        body: Bytes,
        bound: Duration,
        metadata: &[(&str, &str)],
    ) -> Result<UnaryAnswer, Failure> {
        let uri = format!("http://{}{}", self.authority, path)
            .parse::<hyper::Uri>()
            .map_err(|e| Failure::Unreachable(format!("{}{path}: {e}", self.authority)))?;
        let mut request = hyper::Request::new(wire::full(body));
        *request.method_mut() = hyper::Method::POST;
        *request.uri_mut() = uri;
        *request.version_mut() = hyper::Version::HTTP_2;
        let headers = request.headers_mut();
        headers.insert("content-type", HeaderValue::from_static(wire::CONTENT_TYPE));
        headers.insert("te", HeaderValue::from_static("trailers"));
        if let Ok(value) = HeaderValue::from_str(&wire::timeout_value(bound)) {
            headers.insert("grpc-timeout", value);
        }
        for (name, value) in metadata {
            // A name the config gives (the repository header) is checked here, not trusted.
            if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
                headers.insert(name, value);
            }
        }
        let mut sender = self.sender().await.map_err(Failure::Unreachable)?;
        let response = sender.send_request(request).await.map_err(|e| Failure::Unreachable(e.to_string()))?;
        let (parts, body) = response.into_parts();
        if parts.status != hyper::StatusCode::OK {
            return Err(Failure::Dropped(format!("Triton's gRPC port answered HTTP {}", parts.status.as_u16())));
        }
        let collected = body.collect().await.map_err(|e| Failure::Dropped(e.to_string()))?;
        let trailers = collected.trailers().cloned();
        let body = collected.to_bytes();
        let status_from =
            if parts.headers.contains_key("grpc-status") { Some(&parts.headers) } else { trailers.as_ref() };
        let Some(status) = status_from.and_then(|h| h.get("grpc-status")) else {
            return Err(Failure::Dropped("Triton's answer ended without a grpc-status".to_owned()));
        };
        let number = status.to_str().ok().and_then(|s| s.parse::<u8>().ok()).unwrap_or(2);
        let message =
            status_from.and_then(|h| h.get("grpc-message")).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        Ok(UnaryAnswer { body, status: Code::from_number(number), message })
    }
}
