//! Triton's HTTP port: hyper's HTTP/1.1 client connections (TCP_NODELAY), kept alive in a pool of
//! our own, one call per request, bounded by proxy.upstream_timeout_s. A stream (generate_stream) is
//! read frame by frame (`Upstream::stream`); its connection goes back to the pool only when the
//! stream was read to its end, and is closed at once when the stream is dropped before.
//!
//! The same pool posts the front's spans to an OTLP collector (front/tracing.rs), inside TLS when
//! the collector's URL is https:// (`Upstream::with_tls`).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::HeaderMap;
use hyper_util::rt::TokioIo;
use std::sync::Mutex;
use tokio::net::TcpStream;
use tokio::task::{AbortHandle, JoinHandle};
use tokio_rustls::TlsConnector;

/// A TLS client's side of a pool: the verifier's roots and the name the certificate must carry.
pub struct ClientTls {
    pub connector: TlsConnector,
    pub server_name: rustls::pki_types::ServerName<'static>,
}

pub struct Upstream {
    /// Some: each connection is TLS first (an https:// collector); Triton's pool is plain (loopback).
    tls: Option<ClientTls>,
    /// Idle keep-alive connections, most recently used last. A connection goes back here as soon
    /// as its answer is read, before the next request can ask for one: a client sending back to
    /// back reuses one connection instead of racing a second one open.
    idle: Mutex<Vec<Pooled>>,
    /// "host:port" of Triton's HTTP endpoint.
    authority: String,
    timeout: Duration,
    /// Connections opened and calls that reused an idle one, since the start.
    opened: AtomicU64,
    reused: AtomicU64,
    /// Connections open now: counted up at connect, down when a connection's task ends (closed by
    /// either side, aborted, or dropped with the runtime).
    open: Arc<AtomicI64>,
}

/// What the pool did, as sidecar.upstream.UpstreamPool counts it (the tests read both the same way).
pub struct PoolStats {
    pub opened: u64,
    pub reused: u64,
    pub idle: usize,
    pub open: i64,
}

/// Counts a connection open for as long as its task lives.
struct OpenConnection(Arc<AtomicI64>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Idle connections kept at most (more are closed when they come back), and how long one is kept
/// idle before it is closed: sidecar.upstream's bounds, so a burst's connections do not stay open
/// for ever once traffic stops (Triton's descriptors, and the soak's count of the sidecar's).
const MAX_IDLE: usize = 64;
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// Why a call gave no answer (sidecar.serving.refusals.FailureKind).
#[derive(Debug)]
pub enum Failure {
    Timeout,
    Unreachable(String),
    Dropped(String),
}

/// One keep-alive connection: its request side, and its connection task (aborted to close the
/// socket at once when a stream is given up midway).
struct Pooled {
    sender: SendRequest<Full<Bytes>>,
    task: AbortHandle,
    /// When it last went back to the pool.
    idle_since: Instant,
}

pub struct Answer {
    pub status: u16,
    pub content_type: Option<String>,
    pub header_length: Option<i64>,
    pub body: Bytes,
}

impl Upstream {
    pub fn new(authority: String, timeout: Duration) -> Self {
        Self::with_tls(authority, timeout, None)
    }

    pub fn with_tls(authority: String, timeout: Duration, tls: Option<ClientTls>) -> Self {
        Upstream {
            tls,
            idle: Mutex::new(Vec::new()),
            authority,
            timeout,
            opened: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            open: Arc::new(AtomicI64::new(0)),
        }
    }

    pub fn stats(&self) -> PoolStats {
        let idle = self.idle.lock().map(|idle| idle.iter().filter(|p| !p.sender.is_closed()).count()).unwrap_or(0);
        PoolStats {
            opened: self.opened.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            idle,
            open: self.open.load(Ordering::Relaxed),
        }
    }

    fn take_idle(&self) -> Option<Pooled> {
        let mut idle = self.idle.lock().ok()?;
        while let Some(pooled) = idle.pop() {
            if !pooled.sender.is_closed() && pooled.idle_since.elapsed() < IDLE_TIMEOUT {
                return Some(pooled);
            }
            pooled.task.abort();
        }
        None
    }

    fn put_idle(&self, mut pooled: Pooled) {
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < MAX_IDLE {
                pooled.idle_since = Instant::now();
                idle.push(pooled);
                return;
            }
        }
        pooled.task.abort();
    }

    /// Close the connections idle for longer than IDLE_TIMEOUT (or closed by the other side); the
    /// front calls it every second, so they close when traffic stops, not at the next request.
    pub fn sweep_idle(&self) {
        let Ok(mut idle) = self.idle.lock() else { return };
        // Oldest first: connections go back at the end.
        let stale = idle.iter().take_while(|p| p.sender.is_closed() || p.idle_since.elapsed() >= IDLE_TIMEOUT).count();
        for pooled in idle.drain(..stale) {
            pooled.task.abort();
        }
        idle.retain(|p| !p.sender.is_closed());
    }

    async fn connect(&self) -> Result<Pooled, Failure> {
        let stream = TcpStream::connect(&self.authority).await.map_err(|e| Failure::Unreachable(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        // Counted open from here (a handshake that fails drops it, and the count with it).
        self.open.fetch_add(1, Ordering::Relaxed);
        let counted = OpenConnection(self.open.clone());
        let (sender, task) = match &self.tls {
            None => handshake(stream, counted).await?,
            Some(tls) => {
                let stream = tls
                    .connector
                    .connect(tls.server_name.clone(), stream)
                    .await
                    .map_err(|e| Failure::Unreachable(format!("TLS handshake: {e}")))?;
                handshake(stream, counted).await?
            }
        };
        self.opened.fetch_add(1, Ordering::Relaxed);
        Ok(Pooled { sender, task: task.abort_handle(), idle_since: Instant::now() })
    }

    /// A connection ready for a request: an idle one (ready once its task has seen the last answer
    /// end, at once in practice), or a new one when none is, or the one taken closed meanwhile.
    async fn ready(&self) -> Result<Pooled, Failure> {
        match self.take_idle() {
            Some(mut pooled) => match pooled.sender.ready().await {
                Ok(()) => {
                    self.reused.fetch_add(1, Ordering::Relaxed);
                    Ok(pooled)
                }
                Err(_) => self.connect().await,
            },
            None => self.connect().await,
        }
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<hyper::Request<Full<Bytes>>, Failure> {
        let mut request = hyper::Request::builder().method(method).uri(path);
        if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("host")) {
            request = request.header("host", self.authority.as_str());
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(Full::new(body)).map_err(|e| Failure::Dropped(e.to_string()))
    }

    /// POST `body` to `path` and return once the answer's head is here (within the pool's timeout);
    /// its body is then read frame by frame, without a total bound (the caller bounds the silences).
    pub async fn stream(&self, path: &str, headers: &[(&str, &str)], body: Bytes) -> Result<Streaming<'_>, Failure> {
        let request = self.request("POST", path, headers, body)?;
        let call = async {
            let mut pooled = self.ready().await?;
            let response = pooled.sender.send_request(request).await.map_err(|e| Failure::Dropped(e.to_string()))?;
            Ok::<_, Failure>((pooled, response))
        };
        let (pooled, response) = match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result?,
            Err(_) => return Err(Failure::Timeout),
        };
        let status = response.status().as_u16();
        let (parts, body) = response.into_parts();
        let keep = !parts.headers.get("connection").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        Ok(Streaming { status, body, pooled: Some(pooled), keep, pool: self })
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
        let request = self.request(method, path, headers, body)?;
        let call = async {
            let mut pooled = self.ready().await?;
            let response = pooled.sender.send_request(request).await.map_err(|e| Failure::Dropped(e.to_string()))?;
            let status = response.status().as_u16();
            let (parts, body) = response.into_parts();
            let keep = !parts.headers.get("connection").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            let body = body.collect().await.map_err(|e| Failure::Dropped(e.to_string()))?.to_bytes();
            if keep {
                self.put_idle(pooled);
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

/// HTTP/1.1 over `stream` (plain TCP or TLS): the request sender, and the connection's own task,
/// which runs it until it closes or its sender is dropped, counted open meanwhile.
async fn handshake<S>(stream: S, counted: OpenConnection) -> Result<(SendRequest<Full<Bytes>>, JoinHandle<()>), Failure>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) =
        http1::handshake(TokioIo::new(stream)).await.map_err(|e| Failure::Unreachable(e.to_string()))?;
    let task = tokio::spawn(async move {
        let _counted = counted;
        let _ = connection.await;
    });
    Ok((sender, task))
}

/// An answer being read as it arrives (`Upstream::stream`).
pub struct Streaming<'a> {
    pub status: u16,
    body: Incoming,
    /// The connection, until the body ends (then pooled) or the stream is dropped (then closed).
    pooled: Option<Pooled>,
    keep: bool,
    pool: &'a Upstream,
}

impl Streaming<'_> {
    /// The next piece of the body as it arrived; None at its end (the connection goes back to the
    /// pool); an error when the connection broke.
    pub async fn next(&mut self) -> Result<Option<Bytes>, Failure> {
        loop {
            match self.body.frame().await {
                None => {
                    if let Some(pooled) = self.pooled.take() {
                        if self.keep {
                            self.pool.put_idle(pooled);
                        }
                    }
                    return Ok(None);
                }
                Some(Err(e)) => return Err(Failure::Dropped(e.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        if !data.is_empty() {
                            return Ok(Some(data));
                        }
                    }
                }
            }
        }
    }

    /// The whole body, at most `limit` bytes of it (an error answer; more is not read).
    pub async fn read_all(&mut self, limit: usize) -> Result<Bytes, Failure> {
        let mut out = Vec::new();
        while out.len() < limit {
            match self.next().await? {
                Some(data) => out.extend_from_slice(&data[..data.len().min(limit - out.len())]),
                None => break,
            }
        }
        Ok(Bytes::from(out))
    }
}

impl Drop for Streaming<'_> {
    /// A stream given up before its end (the client left, a quarantine, a silence): its connection is
    /// closed now, so Triton sees the request cancelled and stops generating.
    fn drop(&mut self) {
        if let Some(pooled) = self.pooled.take() {
            pooled.task.abort();
        }
    }
}
