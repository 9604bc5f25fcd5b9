//! One HTTP/2 client connection (h2c, TCP_NODELAY) to a gRPC server: Triton's gRPC port, or the
//! Python gRPC server behind the front on loopback. Opened at the first call, shared by every call
//! (HTTP/2 multiplexes them), opened again when it closes. A call whose future is dropped (its
//! client left, its deadline passed) resets its stream: the server sees the cancel.

use std::sync::Mutex;
use std::time::Duration;

use hyper::client::conn::http2::{self, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use super::wire::GrpcBody;

/// Bound on opening the connection (loopback inside the pod: it answers at once or not at all).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

pub struct Channel {
    /// "host:port".
    authority: String,
    sender: Mutex<Option<SendRequest<GrpcBody>>>,
    /// One connect at a time: calls that arrive meanwhile wait for it rather than open their own.
    connecting: tokio::sync::Mutex<()>,
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
}
