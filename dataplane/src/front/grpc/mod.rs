//! The gRPC front: `listen.grpc_port` served by this crate (issue 31, `listen.grpc_front: rust`), on
//! the HTTP front's runtime and state.
//!
//! hyper's HTTP/2 server (h2c) takes the connections. `ModelInfer` to a model published as a lane
//! (unversioned, or a version in `lane.versions`) is served here (`infer`), whatever the model's
//! health: decoded with prost, admitted by the HTTP front's admission (the fallback version, holds
//! while suspect or during a heal, quarantine refusals), checked by the one validation rule, the
//! client's bytes forwarded to Triton's gRPC port over one HTTP/2 connection, the answer screened,
//! counted as the Python gRPC front counts it. The service's other unary RPCs are answered here too
//! (`unary`): ServerLive, ServerReady and ModelReady from the sidecar's own verdict, ServerMetadata,
//! ModelMetadata, ModelConfig (hidden outputs removed) and ModelStatistics from Triton's gRPC port,
//! the control API refused PERMISSION_DENIED; so are grpc.health.v1 (`health`) and server
//! reflection (`reflection`). `ModelStreamInfer` whose first request names a lane's model
//! quarantined whole or not at all is served here too (`stream`): each request admitted and
//! validated as it comes, the model's breaker slot held for the stream, each response screened, an
//! in-stream error for a refused request, UNAVAILABLE when a quarantine begins. Every other call (an
//! unknown method, and what those modules leave to Python) is passed through as it is, streaming
//! both ways with its headers and trailers, to the Python gRPC server listening on a loopback port
//! behind the front (`pass_through`), which answers it exactly as before; a client that cancels
//! drops the forwarded call, which cancels it there.
//!
//! With tls.cert_file set this port is grpcs: each connection's handshake comes first, on the HTTP
//! port's rules (`super::tls`: the same material, client CA and allowed SANs, ALPN `h2`, the same
//! bound and failure reasons), then HTTP/2 inside it. The Python gRPC server behind stays plaintext
//! on loopback; what it needs of the handshake, the verified client certificate's subject for its
//! access log, travels as the `x-sidecar-client-subject` header, set here on every call (a client's
//! own is always removed, so no client can name itself).

pub mod channel;
pub mod document;
pub mod encoding;
pub mod health;
pub mod infer;
pub mod keepalive;
pub mod messages;
pub mod outcome;
pub mod reflection;
pub mod repository;
pub mod stream;
pub mod unary;
pub mod wire;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::HeaderValue;
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::tls::{self, Terminator};
use super::Shared;

use self::channel::Channel;
use self::keepalive::{PingPolicy, Policed};
use self::wire::GrpcBody;

/// What every gRPC connection and call shares.
pub struct GrpcFront {
    pub shared: Arc<Shared>,
    /// The Python gRPC server behind the front (127.0.0.1), for every call the lane does not serve.
    pub back: Channel,
    /// Triton's gRPC port (triton.grpc_url).
    pub triton: Channel,
    pub settings: GrpcSettings,
    /// TLS on listen.grpc_port (tls.cert_file set): every connection's handshake, then HTTP/2 inside.
    pub tls: Option<Terminator>,
    /// Calls handed to the Python gRPC server, and calls answered here without it.
    pub handovers: AtomicU64,
    pub served: AtomicU64,
    pub open_connections: AtomicUsize,
    /// Turns true when the front stops: the streams the front answers itself (health Watch) end.
    pub stop: watch::Receiver<bool>,
}

#[derive(Debug, Clone)]
pub struct GrpcSettings {
    /// listen.grpc_max_concurrent_streams.
    pub max_concurrent_streams: u32,
    /// listen.max_connections, counted apart for this port (as gRPC core's
    /// grpc.max_allowed_incoming_connections).
    pub max_connections: usize,
    /// listen.grpc_max_connection_idle_s: a connection with no call open for this long is sent
    /// GOAWAY (None: never).
    pub max_idle: Option<Duration>,
    /// listen.grpc_max_connection_age_s: a connection older than this is sent GOAWAY, its open calls
    /// finish within proxy.upstream_timeout_s (grpcio's grpc.max_connection_age_grace_ms), then it
    /// closes (None: never).
    pub max_age: Option<Duration>,
    /// listen.grpc_min_ping_interval_s: keepalive enforcement, gRPC core's ping policy (`keepalive`).
    pub pings: PingPolicy,
}

impl GrpcFront {
    pub fn new(
        shared: Arc<Shared>,
        back: String,
        triton: String,
        settings: GrpcSettings,
        tls: Option<Terminator>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        GrpcFront {
            shared,
            back: Channel::new(back),
            triton: Channel::new(triton),
            settings,
            tls,
            handovers: AtomicU64::new(0),
            served: AtomicU64::new(0),
            open_connections: AtomicUsize::new(0),
            stop,
        }
    }

    /// One call: the ModelInfer lane when it may serve it, the service's other unary RPCs,
    /// grpc.health.v1 and server reflection here, else the Python gRPC server.
    async fn route(self: Arc<Self>, request: Request<Incoming>) -> Response<GrpcBody> {
        match request.uri().path() {
            infer::MODEL_INFER => infer::serve(self, request).await,
            stream::MODEL_STREAM_INFER => stream::serve(self, request).await,
            health::CHECK | health::WATCH => health::serve(self, request).await,
            reflection::V1 | reflection::V1ALPHA => reflection::serve(&self, request),
            path => match unary::rpc(path) {
                Some(rpc) => unary::serve(self, request, rpc).await,
                None => {
                    let (parts, body) = request.into_parts();
                    self.pass_through(parts, body.boxed()).await
                }
            },
        }
    }

    /// The call to the Python gRPC server as it came (method, path, metadata, body streamed), its
    /// answer relayed as it comes (headers, messages, trailers). Dropping the returned response's
    /// body (the client reset the stream) drops the forwarded call, which resets it there.
    pub async fn pass_through(&self, parts: hyper::http::request::Parts, body: GrpcBody) -> Response<GrpcBody> {
        self.handovers.fetch_add(1, Ordering::Relaxed);
        let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let uri = match format!("http://{}{}", self.back.authority(), path).parse::<hyper::Uri>() {
            Ok(uri) => uri,
            Err(e) => return unavailable(format!("the sidecar's gRPC service: bad path: {e}")),
        };
        let mut forwarded = Request::new(body);
        *forwarded.method_mut() = parts.method;
        *forwarded.uri_mut() = uri;
        *forwarded.version_mut() = hyper::Version::HTTP_2;
        *forwarded.headers_mut() = parts.headers;
        let mut sender = match self.back.sender().await {
            Ok(sender) => sender,
            Err(e) => return unavailable(format!("the sidecar's gRPC service is unavailable: {e}")),
        };
        match sender.send_request(forwarded).await {
            Ok(response) => response.map(|body| body.boxed()),
            Err(e) => unavailable(format!("the sidecar's gRPC service did not answer: {e}")),
        }
    }
}

fn unavailable(message: String) -> Response<GrpcBody> {
    wire::answer(wire::UNAVAILABLE, &message, false, None, &[])
}

/// The header that carries the verified client certificate's subject (RFC 4514, percent-encoded as
/// grpc-message is) to the Python gRPC server behind the front and to the lane's access record.
pub const CLIENT_SUBJECT: &str = "x-sidecar-client-subject";

/// Accept connections until `stop` turns true; each connection is its own task.
pub async fn accept_loop(listener: TcpListener, front: Arc<GrpcFront>, mut stop: watch::Receiver<bool>) {
    while let Some(stream) = super::accept_next(&listener, &mut stop).await {
        if front.open_connections.load(Ordering::Relaxed) >= front.settings.max_connections {
            drop(stream); // closed at once, as gRPC core closes one past its bound
            continue;
        }
        let _ = stream.set_nodelay(true);
        front.open_connections.fetch_add(1, Ordering::Relaxed);
        let front = front.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let counted = Counted(front.clone());
            match &front.tls {
                None => serve_connection(stream, None, front.clone(), stop).await,
                Some(terminator) => {
                    // The handshake first, bounded, its failure counted by reason and never served.
                    let accepted = tokio::select! {
                        accepted = terminator.accept(stream) => Some(accepted),
                        _ = stop.wait_for(|stopped| *stopped) => None,
                    };
                    match accepted {
                        Some(Ok(tls::Accepted { stream, client_subject })) => {
                            let subject = subject_header(&client_subject);
                            serve_connection(stream, subject, front.clone(), stop).await;
                        }
                        Some(Err(reason)) => front.shared.metrics.tls_handshake_failures.inc(&[reason]),
                        None => {}
                    }
                }
            }
            drop(counted);
        });
    }
}

/// The `x-sidecar-client-subject` value of a connection's client certificate (None without one).
fn subject_header(subject: &str) -> Option<HeaderValue> {
    if subject.is_empty() {
        return None;
    }
    HeaderValue::from_str(&wire::percent_encode(subject)).ok()
}

/// One connection's calls until it closes; at stop, when idle past listen.grpc_max_connection_idle_s
/// or older than listen.grpc_max_connection_age_s: GOAWAY, and the calls open finish (those still
/// open after proxy.upstream_timeout_s end with the connection). A client that pings too often
/// (listen.grpc_min_ping_interval_s) is sent GOAWAY too_many_pings by the connection's bytes'
/// watcher (`keepalive`, between TLS and hyper), which then ends it. `subject`: the
/// verified client certificate's, set on every call in place of whatever the client sent.
async fn serve_connection<S>(
    stream: S,
    subject: Option<HeaderValue>,
    front: Arc<GrpcFront>,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let calls = Arc::new(Calls { open: AtomicUsize::new(0), last: Mutex::new(Instant::now()) });
    let opened = Instant::now();
    let service = {
        let front = front.clone();
        let calls = calls.clone();
        service_fn(move |mut request: Request<Incoming>| {
            let front = front.clone();
            let open = OpenCall::new(calls.clone());
            let headers = request.headers_mut();
            headers.remove(CLIENT_SUBJECT);
            if let Some(subject) = &subject {
                headers.insert(CLIENT_SUBJECT, subject.clone());
            }
            async move { Ok::<_, Infallible>(front.route(request).await.map(|body| Tracked { body, _open: open }.boxed())) }
        })
    };
    let connection = http2::Builder::new(TokioExecutor::new())
        .max_concurrent_streams(front.settings.max_concurrent_streams)
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(2 << 20)
        .serve_connection(TokioIo::new(Policed::new(stream, front.settings.pings)), service);
    tokio::pin!(connection);
    let (idle, age) = (front.settings.max_idle, front.settings.max_age);
    let beat = [idle, age]
        .into_iter()
        .flatten()
        .min()
        .map(|d| (d / 4).clamp(Duration::from_millis(20), Duration::from_secs(1)));
    loop {
        let ending = tokio::select! {
            _ = connection.as_mut() => return,
            stopped = stop.wait_for(|stopped| *stopped) => stopped.is_ok(),
            _ = tokio::time::sleep(beat.unwrap_or(Duration::from_secs(3600))), if beat.is_some() => {
                let quiet = calls.open.load(Ordering::Relaxed) == 0
                    && calls.last.lock().map(|last| last.elapsed()).unwrap_or_default() >= idle.unwrap_or(Duration::MAX);
                quiet || age.is_some_and(|age| opened.elapsed() >= age)
            }
        };
        if ending {
            connection.as_mut().graceful_shutdown();
            // Calls still open after the grace (a health Watch, a stream that never ends) do not
            // hold the connection: it closes under them, as grpcio's does after
            // grpc.max_connection_age_grace_ms (proxy.upstream_timeout_s), and the client reconnects.
            let _ = tokio::time::timeout(front.shared.settings.upstream_timeout, connection).await;
            return;
        }
    }
}

/// A connection's calls open now, and when the last one ended (or the connection began).
struct Calls {
    open: AtomicUsize,
    last: Mutex<Instant>,
}

/// One call open on its connection until its answer's body is done or dropped.
struct OpenCall(Arc<Calls>);

impl OpenCall {
    fn new(calls: Arc<Calls>) -> Self {
        calls.open.fetch_add(1, Ordering::Relaxed);
        OpenCall(calls)
    }
}

impl Drop for OpenCall {
    fn drop(&mut self) {
        if let Ok(mut last) = self.0.last.lock() {
            *last = Instant::now();
        }
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An answer's body that keeps its call counted open while it is sent.
struct Tracked {
    body: GrpcBody,
    _open: OpenCall,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Releases a connection's place in the port's bound however its task ends.
struct Counted(Arc<GrpcFront>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.open_connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A body already read, handed on (a ModelInfer the lane does not serve).
pub fn collected(bytes: Bytes) -> GrpcBody {
    wire::full(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_subject_travels_percent_encoded_and_reads_back_whole() {
        assert!(subject_header("").is_none());
        let subject = "CN=scorer é,O=bank 100%";
        let header = subject_header(subject).map(|v| v.to_str().map(str::to_owned).unwrap_or_default());
        assert_eq!(header.as_deref(), Some("CN=scorer %C3%A9,O=bank 100%25"));
        assert_eq!(wire::percent_decode(header.as_deref().unwrap_or_default()), subject);
    }
}
