//! The HTTP front: `listen.port` served by this crate (issue 30).
//!
//! One tokio runtime on its own threads (`listen.workers`) accepts the client connections, reads
//! every request head itself (`connection`), enforces the listener's bounds with the sidecar's JSON
//! refusals, and serves a unary infer to a model the control plane marked as fit for it (`lane`:
//! validation, breaker, Triton, screening, counters) without entering Python, to it or to a version
//! of it a client pinned. The rest of the v2 routes (Triton's documents, statistics, readiness, the
//! control API refused, the router's 404s and 405s) are answered by `documents` as the Python app
//! answers them. Whatever the front does not serve yet (a filtered model's pinned version's documents, the
//! app's own endpoints, a version whose spec is not fetched yet, a rollout, a model on hold...) is handed, with
//! the very bytes the client sent, to the Python app listening on a loopback port behind it, which
//! answers it exactly as before.
//!
//! State comes down as snapshots (`state`, swapped atomically, read without a lock); what the health
//! loop must hear goes up as events (`events`, drained by Python in batches). With tls.cert_file set,
//! each connection's TLS handshake comes first (`tls`); the connection then serves HTTP inside it.
//!
//! With `listen.grpc_front: rust` the same runtime and state serve `listen.grpc_port` too (`grpc`):
//! ModelInfer to a lane without Python, every other call passed through to the Python gRPC server
//! behind it on loopback.

pub mod admission;
pub mod connection;
pub mod documents;
pub mod events;
pub mod generate;
pub mod generate_stream;
pub mod grpc;
pub mod lane;
pub mod reply;
pub mod settings;
pub mod shadow;
pub mod span_records;
pub mod state;
pub mod tls;
pub mod tracing;
pub mod upstream;
pub mod watchdog;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::metrics::family::GaugeFamily;
use crate::metrics::request::RequestMetrics;

use self::events::Events;
use self::settings::Settings;
use self::state::Snapshot;
use self::upstream::Upstream;
use self::watchdog::Watchdog;

/// What every connection and request of one front shares.
pub struct Shared {
    pub settings: Settings,
    /// The Python app behind the front (loopback), for what the lane does not serve.
    pub back: SocketAddr,
    pub upstream: Upstream,
    /// Keep-alive connections to the Python app behind the front, for the requests it answers.
    pub back_pool: Upstream,
    pub state: ArcSwap<Snapshot>,
    /// Bumped at every publish: a request at Triton looks again whether its model is still trusted.
    pub published: watch::Sender<u64>,
    /// Shared with the TLS client verifier, which reports the clients it refuses for their SANs.
    pub events: Arc<Events>,
    /// TLS on listen.port (tls.cert_file set): every connection's handshake, then HTTP inside it.
    pub tls: Option<tls::Terminator>,
    /// One span per lane request (tracing.endpoint set); None: tracing off, one branch per request.
    pub tracing: Option<tracing::Tracing>,
    pub metrics: Arc<RequestMetrics>,
    pub open_connections: AtomicUsize,
    pub handovers: AtomicU64,
    pub fast_requests: AtomicU64,
    pub in_flight: AtomicUsize,
    /// Shadow calls started and not yet heard by Python (front/shadow.rs): the cap's count.
    pub shadows: AtomicUsize,
    /// Requests held for a heal now, per model (front/admission.rs): Python's `Admission.holding`
    /// adds these to its own. Not a /metrics family (the Python chain has none).
    pub holding: GaugeFamily,
    /// Liveness of the runtime and of the control plane, each read by the other half.
    pub watchdog: Watchdog,
    /// Fault injection: a panic armed for a model's next lane request.
    pub injected_panic: InjectedPanic,
    /// The drift windows the lanes count their measured answers in (the same the Python chain
    /// feeds and the scrape reads: sidecar.serving.drift.DriftMonitor's).
    pub drift: Arc<crate::serving::drift::DriftWindows>,
}

/// Fault injection for tests and drills (`HttpFront.panic_next`): the next lane request to one
/// model panics inside its task, so the per-request catch (500 `internal_error`, counted, logged
/// with the message, the process and the connection unharmed) is proven on the real path. Unarmed,
/// a request pays one relaxed load.
#[derive(Default)]
pub struct InjectedPanic {
    armed: AtomicBool,
    model: Mutex<Option<String>>,
}

impl InjectedPanic {
    pub fn arm(&self, model: String) {
        if let Ok(mut armed) = self.model.lock() {
            *armed = Some(model);
            self.armed.store(true, Ordering::Release);
        }
    }

    /// Panic here when armed for `model` (once).
    pub fn strike(&self, model: &str) {
        if !self.armed.load(Ordering::Acquire) {
            return;
        }
        let hit = match self.model.lock() {
            Ok(mut armed) if armed.as_deref() == Some(model) => {
                *armed = None;
                self.armed.store(false, Ordering::Release);
                true
            }
            _ => false,
        };
        if hit {
            panic!("fault injected by HttpFront.panic_next({model:?})");
        }
    }
}

impl Shared {
    pub fn new(
        settings: Settings,
        back: SocketAddr,
        upstream: Upstream,
        metrics: Arc<RequestMetrics>,
        events: Arc<Events>,
    ) -> Self {
        // The Python app applies its own bounds (holds, Triton's timeout); this one only ends a
        // call it never answers.
        let back_pool = Upstream::new(back.to_string(), settings.upstream_timeout * 2 + Duration::from_secs(3600));
        Shared {
            settings,
            back,
            upstream,
            back_pool,
            state: ArcSwap::from_pointee(Snapshot::default()),
            published: watch::channel(0).0,
            events,
            tls: None,
            tracing: None,
            metrics,
            open_connections: AtomicUsize::new(0),
            handovers: AtomicU64::new(0),
            fast_requests: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            shadows: AtomicUsize::new(0),
            holding: GaugeFamily::default(),
            watchdog: Watchdog::default(),
            injected_panic: InjectedPanic::default(),
            drift: Arc::default(),
        }
    }

    pub fn publish(&self, snapshot: Snapshot) {
        self.state.store(Arc::new(snapshot));
        self.published.send_modify(|n| *n += 1);
    }
}

/// The next connection `listener` accepts; None once `stop` turns true. Both ports' accept loops
/// (HTTP here, gRPC in grpc/mod.rs) take their connections from it; each keeps its own handling of
/// a connection over listen.max_connections.
pub(crate) async fn accept_next(listener: &TcpListener, stop: &mut watch::Receiver<bool>) -> Option<TcpStream> {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopped| *stopped) => return None,
        };
        match accepted {
            Ok((stream, _)) => return Some(stream),
            // Out of descriptors (EMFILE) or a connection reset before accept: wait a moment rather
            // than spin; the backlog keeps the others.
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
        }
    }
}

/// Accept connections until `stop` turns true; each connection is its own task.
pub async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let beating = shared.clone();
    let beat_stop = stop.clone();
    tokio::spawn(async move {
        // Each second, idle pooled connections (to Triton, to the Python app) past their bound close.
        let mut beats = 0u32;
        let pools = beating.clone();
        let chores = move || {
            beats = beats.wrapping_add(1);
            if beats % 4 == 0 {
                pools.upstream.sweep_idle();
                pools.back_pool.sweep_idle();
            }
        };
        beating.watchdog.beat(beat_stop, chores).await
    });
    while let Some(stream) = accept_next(&listener, &mut stop).await {
        if shared.open_connections.load(Ordering::Relaxed) >= shared.settings.max_connections {
            shared.metrics.connections_refused.inc(&[]);
            // Accepted and closed at once: listen.max_connections are open. A FIN first, and what
            // the client already sent read away (at most a second, 64 KiB), so the kernel does not
            // answer it with a reset the client would read as an error instead of the close.
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut stream = stream;
                let _ = stream.shutdown().await;
                let mut sink = [0u8; 4096];
                let mut left = 64 * 1024usize;
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
                while left > 0 {
                    match tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
                        Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n),
                        _ => break,
                    }
                }
            });
            continue;
        }
        shared.open_connections.fetch_add(1, Ordering::Relaxed);
        shared.metrics.connections_open.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let counted = Counted(shared.clone());
            serve_connection(stream, shared, stop).await;
            drop(counted);
        });
    }
    drop(listener);
    drain(&shared).await;
    if let Some(tracing) = &shared.tracing {
        // The last spans, while the runtime that posts them still runs (bounded by the export's).
        tracing.shutdown().await;
    }
}

/// One accepted connection to its end: over TLS when tls.cert_file is set (the handshake first,
/// bounded, its failure counted by reason and never served), else in plaintext.
async fn serve_connection(stream: TcpStream, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let Some(terminator) = &shared.tls else {
        connection::Connection::new(stream, shared, stop).run().await;
        return;
    };
    let accepted = tokio::select! {
        accepted = terminator.accept(stream) => accepted,
        _ = stop.wait_for(|stopped| *stopped) => return,
    };
    match accepted {
        Ok(tls::Accepted { stream, client_subject }) => {
            connection::Connection::new(stream, shared, stop).with_client_subject(client_subject).run().await;
        }
        Err(reason) => shared.metrics.tls_handshake_failures.inc(&[reason]),
    }
}

/// Wait for the requests in flight (bounded by proxy.upstream_timeout_s) before the runtime ends.
async fn drain(shared: &Shared) {
    let deadline = tokio::time::Instant::now() + shared.settings.upstream_timeout;
    while shared.in_flight.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Releases a connection's place in listen.max_connections however its task ends.
struct Counted(Arc<Shared>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.open_connections.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A `Shared` for unit tests: small bounds, nothing listening behind it (Triton "at" port 9), the
/// holds as given; one place for the fields a new setting adds.
#[cfg(test)]
pub(crate) fn shared_for_tests(
    hold_during_heal: std::time::Duration,
    hold_while_suspect: std::time::Duration,
) -> Arc<Shared> {
    use std::time::Duration;
    let second = Duration::from_secs(1);
    let settings = settings::Settings {
        header_timeout: second,
        keepalive_timeout: second,
        max_url_bytes: 1024,
        max_header_bytes: 8192,
        max_headers: 64,
        max_connections: 8,
        lingering_time: second,
        lingering_timeout: second,
        lingering_max_bytes: 1024,
        max_body_bytes: 1 << 20,
        client_body_timeout: second,
        upstream_timeout: second,
        triton_timeout: second,
        retry_after_s: 5,
        max_in_flight_per_model: 4,
        queue_size_per_model: 4,
        block_non_finite_outputs: true,
        hold_during_heal,
        hold_while_suspect,
        access_log_sample_rate: 0.0,
        max_shadow_in_flight: 2,
        watchdog_stall: Duration::from_secs(60),
    };
    let metrics = Arc::new(crate::metrics::request::RequestMetrics::new(vec![0.1, 1.0], vec![1.0, 10.0]));
    let nowhere = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
    let upstream = upstream::Upstream::new(nowhere.to_string(), second);
    Arc::new(Shared::new(settings, nowhere, upstream, metrics, Arc::new(events::Events::default())))
}
