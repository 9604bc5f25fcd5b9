//! Triton's HTTP port: hyper's HTTP/1.1 client connections (TCP_NODELAY), kept alive in a pool of
//! our own, one call per request, bounded by proxy.upstream_timeout_s.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::HeaderMap;
use hyper_util::rt::TokioIo;
use std::sync::Mutex;
use tokio::net::TcpStream;

pub struct Upstream {
    /// Idle keep-alive connections, most recently used last. A connection goes back here as soon
    /// as its answer is read, before the next request can ask for one: a client sending back to
    /// back reuses one connection instead of racing a second one open.
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
    /// "host:port" of Triton's HTTP endpoint.
    authority: String,
    timeout: Duration,
}

/// Idle connections kept at most (more are closed when they come back).
const MAX_IDLE: usize = 256;

/// Why a call gave no answer (sidecar.serving.refusals.FailureKind).
#[derive(Debug)]
pub enum Failure {
    Timeout,
    Unreachable(String),
    Dropped(String),
}

pub struct Answer {
    pub status: u16,
    pub content_type: Option<String>,
    pub header_length: Option<i64>,
    pub body: Bytes,
}

impl Upstream {
    pub fn new(authority: String, timeout: Duration) -> Self {
        Upstream { idle: Mutex::new(Vec::new()), authority, timeout }
    }

    fn take_idle(&self) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.idle.lock().ok()?;
        while let Some(sender) = idle.pop() {
            if !sender.is_closed() {
                return Some(sender);
            }
        }
        None
    }

    fn put_idle(&self, sender: SendRequest<Full<Bytes>>) {
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < MAX_IDLE {
                idle.push(sender);
            }
        }
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, Failure> {
        let stream = TcpStream::connect(&self.authority).await.map_err(|e| Failure::Unreachable(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) =
            http1::handshake(TokioIo::new(stream)).await.map_err(|e| Failure::Unreachable(e.to_string()))?;
        // The connection's own task: it ends when the connection closes or its sender is dropped.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    /// POST `body` to `path`; `headers` are sent as given.
    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: Bytes) -> Result<Answer, Failure> {
        let (status, headers, body) = self.send("POST", path, headers, body).await?;
        let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let header_length = headers
            .get("inference-header-content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<i64>().ok());
        Ok(Answer { status, content_type, header_length, body })
    }

    /// One call: (status, the answer's headers, its whole body).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<(u16, HeaderMap, Bytes), Failure> {
        let mut request = hyper::Request::builder().method(method).uri(path);
        if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("host")) {
            request = request.header("host", self.authority.as_str());
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body)).map_err(|e| Failure::Dropped(e.to_string()))?;
        let call = async {
            // An idle connection becomes ready once its task has seen the last answer end (at once
            // in practice); one that closed meanwhile is replaced by a new one.
            let mut sender = match self.take_idle() {
                Some(mut sender) => match sender.ready().await {
                    Ok(()) => sender,
                    Err(_) => self.connect().await?,
                },
                None => self.connect().await?,
            };
            let response = sender.send_request(request).await.map_err(|e| Failure::Dropped(e.to_string()))?;
            let status = response.status().as_u16();
            let (parts, body) = response.into_parts();
            let keep = !parts.headers.get("connection").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            let body = body.collect().await.map_err(|e| Failure::Dropped(e.to_string()))?.to_bytes();
            if keep {
                self.put_idle(sender);
            }
            Ok((status, parts.headers, body))
        };
        // On a timeout (or the caller dropping this future) the connection is dropped with it,
        // never put back: the other side sees the call end.
        match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(Failure::Timeout),
        }
    }
}
