//! `HttpFront`: the HTTP front of `front`, started, fed and stopped by sidecar/fronts/http_front.py.
//! Its runtime threads never enter Python: the state is pushed down (`publish`), events pulled up
//! (`drain_events`), counters read (`open_connections`, ...).

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use tokio::sync::watch;

use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixStream;

use crate::front::documents::{Documents, Guarded};
use crate::front::events::{Event, Events, ShadowOutcome};
use crate::front::grpc::channel::Channel;
use crate::front::grpc::keepalive::PingPolicy;
use crate::front::grpc::{self, repository, GrpcFront, GrpcSettings};
use crate::front::settings::Settings;
use crate::front::state::{Breaker, Canned, Ended, Guard, Lane, Snapshot};
use crate::front::tls::{server_config, Terminator, TlsMaterial, ALPN_H2, ALPN_HTTP1};
use crate::front::tracing::{Tracing, TracingSettings};
use crate::front::upstream::Upstream;
use crate::front::{accept_loop, Shared};
use crate::serving::rollouts::{Route, Tolerance};

use super::drift::DriftWindows;
use super::generation::GenerateLimits;
use super::metrics::RequestMetrics;
use super::spans::RequestSpan;
use super::validation::RequestSpec;

/// (model, its spec, hidden outputs or None, look for NaN/Inf, its generate limits,
/// generation.idle_timeout_s, its pinnable versions, stale: its last spec while a new one is
/// fetched) as Python publishes a lane.
type LaneTuple<'py> = (
    String,
    PyRef<'py, RequestSpec>,
    Option<Vec<String>>,
    bool,
    PyRef<'py, GenerateLimits>,
    f64,
    Vec<VersionTuple<'py>>,
    bool,
);

/// (version, its spec, its hidden outputs or None): a loaded version whose spec Python fetched.
type VersionTuple<'py> = (String, PyRef<'py, RequestSpec>, Option<Vec<String>>);

/// (model, status, JSON body, Retry-After or None, reason label, the same refusal as a stream's last
/// event, the versions whose requests it ends or None for every version).
type EndedTuple = (String, u16, Vec<u8>, Option<u64>, String, Vec<u8>, Option<Vec<String>>);
/// (model, suspect, may be held for a heal, fallback version or ""): every model the sidecar guards.
type GuardTuple = (String, bool, bool, String);
/// (model, stable, candidate, the candidate's share now, cohort_key lower-cased or "", shadow rate
/// now, [(version, its fallback while not trusted)], atol, rtol, [(output, atol, rtol)]).
type RouteTuple = (String, String, String, f64, String, f64, Vec<(String, String)>, f64, f64, Vec<(String, f64, f64)>);
/// (path, status, JSON body or empty, Retry-After or None, reason label or "").
type CannedTuple = (String, u16, Vec<u8>, Option<u64>, String);
/// ([(model, named by an output filter, its /ready refusal (status, JSON body, Retry-After) or
/// None, the filter's verdict on its declared outputs or None)] in admission's order,
/// proxy.allow_statistics, the v2 extensions GET /v2 shows).
type DocumentsTuple = (Vec<GuardedTuple>, bool, Vec<String>);
type GuardedTuple = (String, bool, Option<(u16, Vec<u8>, Option<u64>)>, Option<Vec<(String, bool)>>);

/// (certificate chain PEM, key PEM, client CA bundle PEM or None, allowed client SANs, min version)
/// as sidecar/fronts/tls.py loaded and checked them.
type TlsTuple = (Vec<u8>, Vec<u8>, Option<Vec<u8>>, Vec<String>, String);

/// The resolved `tracing` section (sidecar/fronts/http_front.py's `_tracing`): (endpoint, the CA
/// bundle of an https:// endpoint, its client certificate chain and key or None, sample_rate,
/// parent_based, service_name, service.version, resource attributes, queue_size, batch_size,
/// export_delay_s, export_timeout_s).
type TracingTuple = (
    String,
    Option<Vec<u8>>,
    Option<(Vec<u8>, Vec<u8>)>,
    f64,
    bool,
    String,
    String,
    Vec<(String, String)>,
    usize,
    usize,
    f64,
    f64,
);

fn tracing_settings(
    (
        endpoint,
        ca_pem,
        client_identity,
        sample_rate,
        parent_based,
        service_name,
        service_version,
        resource_attributes,
        queue_size,
        batch_size,
        delay_s,
        timeout_s,
    ): TracingTuple,
) -> PyResult<TracingSettings> {
    Ok(TracingSettings {
        endpoint,
        ca_pem,
        client_identity,
        sample_rate,
        parent_based,
        service_name,
        service_version,
        resource_attributes,
        queue_size,
        batch_size,
        export_delay: secs(delay_s, "tracing.export_delay_s")?,
        export_timeout: secs(timeout_s, "tracing.export_timeout_s")?,
    })
}

fn material((cert_chain_pem, key_pem, client_ca_pem, allowed_sans, min_version): TlsTuple) -> TlsMaterial {
    TlsMaterial { cert_chain_pem, key_pem, client_ca_pem, allowed_sans, min_version }
}

#[pyclass(module = "sidecar._dataplane")]
pub struct HttpFront {
    shared: Arc<Shared>,
    port: u16,
    stop: watch::Sender<bool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Python's end of the wake-up socket pair, until `wake_fd` hands it over.
    wake: Mutex<Option<UnixStream>>,
    /// Breakers by model, kept across snapshots (their counts are live).
    breakers: Mutex<HashMap<String, Arc<Breaker>>>,
    runtime: tokio::runtime::Handle,
    workers: usize,
    /// The gRPC front on the same runtime (`serve_grpc`), once started.
    grpc: Mutex<Option<Arc<GrpcFront>>>,
    /// The connection to Triton's gRPC port the health loop's repository calls go on
    /// (`repository_call`), opened at the first.
    repository: Mutex<Option<Arc<Channel>>>,
}

fn secs(value: f64, key: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| PyValueError::new_err(format!("{key}: {value} is not a duration")))
}

#[pymethods]
impl HttpFront {
    /// Bind `host:port` (0: any free port) with an accept queue of `backlog`, and serve on
    /// `workers` runtime threads. `back_port`: the Python app on 127.0.0.1; `upstream`: Triton's
    /// HTTP "host:port". `limits` holds the settings by their configuration keys. `tls`: the
    /// material to serve TLS with (None: plaintext); `tls.handshake_timeout_s` in `limits` bounds
    /// a handshake. `tracing`: the resolved tracing section when tracing.endpoint is set (None:
    /// no span, no exporter). `drift`: the drift windows the lanes count measured answers in
    /// (DriftMonitor's; None: a set of its own, measuring nothing until something is set in it).
    #[new]
    #[pyo3(signature = (host, port, backlog, workers, back_port, upstream, limits, metrics, tls = None, tracing = None, drift = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        host: &str,
        port: u16,
        backlog: i32,
        workers: usize,
        back_port: u16,
        upstream: String,
        limits: HashMap<String, f64>,
        metrics: PyRef<'_, RequestMetrics>,
        tls: Option<TlsTuple>,
        tracing: Option<TracingTuple>,
        drift: Option<PyRef<'_, DriftWindows>>,
    ) -> PyResult<Self> {
        let drift = drift.map(|d| d.inner.clone()).unwrap_or_default();
        let get = |key: &str| -> PyResult<f64> {
            limits.get(key).copied().ok_or_else(|| PyValueError::new_err(format!("HttpFront: missing limit {key}")))
        };
        let settings = Settings {
            header_timeout: secs(get("listen.header_timeout_s")?, "listen.header_timeout_s")?,
            keepalive_timeout: secs(get("listen.keepalive_timeout_s")?, "listen.keepalive_timeout_s")?,
            max_url_bytes: get("listen.max_url_bytes")? as usize,
            max_header_bytes: get("listen.max_header_bytes")? as usize,
            max_headers: get("listen.max_headers")? as usize,
            max_connections: get("listen.max_connections")? as usize,
            lingering_time: secs(get("listen.lingering_time_s")?, "listen.lingering_time_s")?,
            lingering_timeout: secs(get("listen.lingering_timeout_s")?, "listen.lingering_timeout_s")?,
            lingering_max_bytes: get("listen.lingering_max_bytes")? as u64,
            max_body_bytes: get("validation.max_body_bytes")? as usize,
            client_body_timeout: secs(get("proxy.client_body_timeout_s")?, "proxy.client_body_timeout_s")?,
            upstream_timeout: secs(get("proxy.upstream_timeout_s")?, "proxy.upstream_timeout_s")?,
            triton_timeout: secs(get("triton.timeout_s")?, "triton.timeout_s")?,
            retry_after_s: get("proxy.retry_after_s")? as u64,
            max_in_flight_per_model: get("proxy.max_in_flight_per_model")? as usize,
            queue_size_per_model: get("proxy.queue_size_per_model")? as usize,
            block_non_finite_outputs: get("proxy.block_non_finite_outputs")? != 0.0,
            hold_during_heal: secs(get("proxy.hold_during_heal_s")?, "proxy.hold_during_heal_s")?,
            hold_while_suspect: secs(get("proxy.hold_while_suspect_ms")? / 1000.0, "proxy.hold_while_suspect_ms")?,
            access_log_sample_rate: get("logging.access_log_sample_rate")?,
            max_shadow_in_flight: get("proxy.max_shadow_in_flight")? as usize,
            watchdog_stall: secs(get("liveness.watchdog_stall_s")?, "liveness.watchdog_stall_s")?,
        };
        let address = (host, port)
            .to_socket_addrs()
            .map_err(|e| PyOSError::new_err(format!("listen.host {host}: {e}")))?
            .next()
            .ok_or_else(|| PyOSError::new_err(format!("listen.host {host}: no address")))?;
        let listener = bind(address, backlog).map_err(|e| PyOSError::new_err(format!("listen.port {port}: {e}")))?;
        let port = listener.local_addr().map_err(|e| PyOSError::new_err(e.to_string()))?.port();
        let back = SocketAddr::from(([127, 0, 0, 1], back_port));
        let timeout = settings.upstream_timeout;
        let (stop, stopped) = watch::channel(false);
        let (front_end, python_end) = UnixStream::pair().map_err(|e| PyOSError::new_err(e.to_string()))?;
        front_end.set_nonblocking(true).map_err(|e| PyOSError::new_err(e.to_string()))?;
        let events = Arc::new(Events::waking(front_end));
        let terminator = match tls {
            None => None,
            Some(tls) => {
                let timeout = secs(get("tls.handshake_timeout_s")?, "tls.handshake_timeout_s")?;
                let config = server_config(&material(tls), ALPN_HTTP1, events.clone())
                    .map_err(|e| PyValueError::new_err(e.to_string()))?;
                Some(Terminator::new(config, timeout))
            }
        };
        let metrics = metrics.inner.clone();
        let tracing = tracing.map(tracing_settings).transpose()?;
        // The runtime is built on its own thread: the upstream client must be made inside it.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(Arc<Shared>, tokio::runtime::Handle), String>>();
        let thread = std::thread::Builder::new()
            .name("sidecar-front".into())
            .spawn(move || {
                let runtime = if workers <= 1 {
                    tokio::runtime::Builder::new_current_thread().enable_all().build()
                } else {
                    tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build()
                };
                let runtime = match runtime {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let mut shared = Shared::new(settings, back, Upstream::new(upstream, timeout), metrics, events);
                    shared.tls = terminator;
                    shared.drift = drift;
                    if let Some(settings) = &tracing {
                        let started =
                            Tracing::start(settings, shared.metrics.clone(), tokio::runtime::Handle::current());
                        match started {
                            Ok(tracing) => shared.tracing = Some(tracing),
                            Err(e) => {
                                let _ = ready_tx.send(Err(e.to_string()));
                                return;
                            }
                        }
                    }
                    let shared = Arc::new(shared);
                    let _ = ready_tx.send(Ok((shared.clone(), tokio::runtime::Handle::current())));
                    accept_loop(listener, shared, stopped).await;
                });
            })
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let (shared, runtime) =
            ready_rx.recv().map_err(|e| PyRuntimeError::new_err(e.to_string()))?.map_err(PyRuntimeError::new_err)?;
        Ok(HttpFront {
            shared,
            port,
            stop,
            thread: Mutex::new(Some(thread)),
            wake: Mutex::new(Some(python_end)),
            breakers: Mutex::new(HashMap::new()),
            runtime,
            workers: workers.max(1),
            grpc: Mutex::new(None),
            repository: Mutex::new(None),
        })
    }

    /// Serve new TLS handshakes with this material from now on (a rotation), on listen.port and on
    /// the gRPC port when this front serves it; connections already open keep theirs. ValueError
    /// when rustls refuses it (the material in force stays, on both ports: both configurations are
    /// built before either is swapped).
    fn reload_tls(&self, tls: TlsTuple) -> PyResult<()> {
        let Some(terminator) = &self.shared.tls else {
            return Err(PyRuntimeError::new_err("this front serves plaintext: it was started without tls"));
        };
        let material = material(tls);
        let refused = |e: crate::front::tls::MaterialError| PyValueError::new_err(e.to_string());
        let config = server_config(&material, ALPN_HTTP1, self.shared.events.clone()).map_err(refused)?;
        let grpc = self.grpc.lock().ok().and_then(|g| g.clone());
        let grpc = match grpc.as_ref().and_then(|front| front.tls.as_ref()) {
            Some(grpc_terminator) => {
                Some((grpc_terminator, server_config(&material, ALPN_H2, self.shared.events.clone()).map_err(refused)?))
            }
            None => None,
        };
        terminator.swap(config);
        if let Some((grpc_terminator, grpc_config)) = grpc {
            grpc_terminator.swap(grpc_config);
        }
        Ok(())
    }

    /// Serve `listen.grpc_port` on this front's runtime (listen.grpc_front: rust): bind `host:port`
    /// (0: any free port) and return the port. ModelInfer to a lane is served here; every other
    /// call goes to the Python gRPC server on 127.0.0.1:`back_port`. `triton`: Triton's gRPC
    /// "host:port" (triton.grpc_url). `min_ping_interval_s`: listen.grpc_min_ping_interval_s, the
    /// keepalive enforcement of every connection (grpc::keepalive). `tls`: the material this front was started with (the same
    /// files; None when it serves plaintext), served as grpcs with ALPN h2 and the HTTP port's
    /// handshake bound; ValueError when rustls refuses it.
    #[pyo3(signature = (host, port, backlog, back_port, triton, max_concurrent_streams, max_connections, max_idle_s, max_age_s, min_ping_interval_s, tls = None))]
    #[allow(clippy::too_many_arguments)]
    fn serve_grpc(
        &self,
        host: &str,
        port: u16,
        backlog: i32,
        back_port: u16,
        triton: String,
        max_concurrent_streams: u32,
        max_connections: usize,
        max_idle_s: f64,
        max_age_s: f64,
        min_ping_interval_s: f64,
        tls: Option<TlsTuple>,
    ) -> PyResult<u16> {
        let terminator = match (tls, &self.shared.tls) {
            (None, None) => None,
            (Some(tls), Some(http)) => {
                let config = server_config(&material(tls), ALPN_H2, self.shared.events.clone())
                    .map_err(|e| PyValueError::new_err(e.to_string()))?;
                Some(Terminator::new(config, http.timeout()))
            }
            (Some(_), None) => {
                return Err(PyRuntimeError::new_err("serve_grpc: tls given to a front started without tls"))
            }
            (None, Some(_)) => {
                return Err(PyRuntimeError::new_err("serve_grpc: this front serves TLS: the gRPC port needs it too"))
            }
        };
        let bound = |s: f64, key: &str| -> PyResult<Option<Duration>> {
            if s > 0.0 {
                secs(s, key).map(Some)
            } else {
                Ok(None)
            }
        };
        let max_idle = bound(max_idle_s, "listen.grpc_max_connection_idle_s")?;
        let max_age = bound(max_age_s, "listen.grpc_max_connection_age_s")?;
        // 0 is allowed (as gRPC core's 0: any interval while a call is open).
        let min_ping_interval = bound(min_ping_interval_s, "listen.grpc_min_ping_interval_s")?.unwrap_or_default();
        let address = (host, port)
            .to_socket_addrs()
            .map_err(|e| PyOSError::new_err(format!("listen.host {host}: {e}")))?
            .next()
            .ok_or_else(|| PyOSError::new_err(format!("listen.host {host}: no address")))?;
        let listener =
            bind(address, backlog).map_err(|e| PyOSError::new_err(format!("listen.grpc_port {port}: {e}")))?;
        let bound = listener.local_addr().map_err(|e| PyOSError::new_err(e.to_string()))?.port();
        let settings = GrpcSettings {
            max_concurrent_streams,
            max_connections,
            max_idle,
            max_age,
            pings: PingPolicy::new(min_ping_interval),
        };
        let back = format!("127.0.0.1:{back_port}");
        let stopped = self.stop.subscribe();
        let front = Arc::new(GrpcFront::new(self.shared.clone(), back, triton, settings, terminator, stopped.clone()));
        let serving = front.clone();
        self.runtime.spawn(async move {
            if let Ok(listener) = tokio::net::TcpListener::from_std(listener) {
                grpc::accept_loop(listener, serving, stopped).await;
            }
        });
        if let Ok(mut slot) = self.grpc.lock() {
            *slot = Some(front);
        }
        Ok(bound)
    }

    /// gRPC calls handed to the Python gRPC server, and calls answered without it (ModelInfer to a
    /// lane, grpc.health.v1, server reflection; 0, 0 before serve_grpc).
    #[getter]
    fn grpc_counts(&self) -> (u64, u64) {
        let front = self.grpc.lock().ok().and_then(|g| g.clone());
        front.map(|f| (f.handovers.load(Ordering::Relaxed), f.served.load(Ordering::Relaxed))).unwrap_or((0, 0))
    }

    /// Send a repository call, `action` ("load" or "unload") of `model`, to Triton's gRPC port
    /// `authority` ("host:port") with `metadata`, bounded by `timeout_s`
    /// (front/grpc/repository.rs says why not over HTTP). Returns at once; its end comes as the
    /// event ("repository", call, status, code, message).
    fn repository_call(
        &self,
        call: u64,
        authority: String,
        action: String,
        model: String,
        metadata: Vec<(String, String)>,
        timeout_s: f64,
    ) -> PyResult<()> {
        let bound = secs(timeout_s, "a repository call's timeout")?;
        let channel = {
            let mut slot =
                self.repository.lock().map_err(|_| PyRuntimeError::new_err("repository channel poisoned"))?;
            match slot.as_ref() {
                Some(channel) if channel.authority() == authority => channel.clone(),
                _ => {
                    let channel = Arc::new(Channel::new(authority));
                    *slot = Some(channel.clone());
                    channel
                }
            }
        };
        let events = self.shared.events.clone();
        self.runtime.spawn(async move {
            let metadata: Vec<(&str, &str)> = metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let outcome = repository::call(&channel, &action, &model, &metadata, bound).await;
            events.push(Event::Repository { call, outcome });
        });
        Ok(())
    }

    /// The descriptor Python's loop watches for urgent events (its owner from now on: call once).
    fn wake_fd(&self) -> PyResult<i32> {
        let taken = self.wake.lock().ok().and_then(|mut w| w.take());
        taken.map(|s| s.into_raw_fd()).ok_or_else(|| PyRuntimeError::new_err("wake_fd was already taken"))
    }

    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    #[getter]
    fn open_connections(&self) -> usize {
        self.shared.open_connections.load(Ordering::Relaxed)
    }

    /// The lanes' shadow calls not yet heard (started, their end not drained): ShadowCalls adds them.
    #[getter]
    fn shadows_in_flight(&self) -> usize {
        self.shared.shadows.load(Ordering::Acquire)
    }

    #[getter]
    fn handovers(&self) -> u64 {
        self.shared.handovers.load(Ordering::Relaxed)
    }

    /// The pool of connections to Triton: (opened, calls that reused one, idle now, open now), as
    /// sidecar.upstream.UpstreamPool counts them.
    #[getter]
    fn upstream_pool(&self) -> (u64, u64, usize, i64) {
        let stats = self.shared.upstream.stats();
        (stats.opened, stats.reused, stats.idle, stats.open)
    }

    /// Requests the front holds for a heal now, per model: [(model, count)] (Admission.holding adds
    /// them to the Python chain's).
    #[getter]
    fn holding(&self) -> Vec<(String, i64)> {
        self.shared
            .holding
            .samples()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .filter_map(|(labels, n)| labels.into_iter().next().map(|model| (model, n)))
            .collect()
    }

    #[getter]
    fn fast_requests(&self) -> u64 {
        self.shared.fast_requests.load(Ordering::Relaxed)
    }

    #[getter]
    fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// Seconds since the front's runtime last beat (watchdog::BEAT): /healthz fails past
    /// liveness.watchdog_stall_s.
    #[getter]
    fn runtime_silent_for(&self) -> f64 {
        self.shared.watchdog.runtime_silent_for().as_secs_f64()
    }

    /// Seconds since the control plane last touched the front (drained its events or published).
    #[getter]
    fn control_silent_for(&self) -> f64 {
        self.shared.watchdog.control_silent_for().as_secs_f64()
    }

    /// Fault injection for the watchdog's test and for drills: block every thread of the front's
    /// runtime for `seconds`, as a deadlock or a blocking call on a worker would.
    fn stall_runtime(&self, seconds: f64) -> PyResult<()> {
        let pause = secs(seconds, "seconds")?;
        for _ in 0..self.workers {
            self.runtime.spawn(async move { std::thread::sleep(pause) });
        }
        Ok(())
    }

    /// Fault injection for tests and drills: the next request the front serves to `model` panics
    /// inside its task (answered 500 internal_error, counted and logged; nothing else harmed).
    fn panic_next(&self, model: String) {
        self.shared.injected_panic.arm(model);
    }

    /// Swap in the state requests read. `lanes`: (model, spec, hidden outputs or None, check
    /// non-finite, generate limits, generation.idle_timeout_s, [(version, spec, hidden outputs or
    /// None)]); `ended`: (model, status, JSON body, Retry-After or None, reason label, the streams'
    /// error event, the versions it ends or None for all) for models whose requests at Triton must
    /// end now; `health`: the answers of /v2/health/live and /ready as Python would give them now;
    /// `serving`: grpc.health.v1's status of each service it knows ("" the pod, each guarded model;
    /// True for SERVING), None while the gRPC front is not this crate's.
    /// `guards`: (model, suspect, may be held for a heal, fallback version or "") for every model
    /// the sidecar guards (a lane's model not among them is not served: released).
    /// `documents`: what the v2 document routes need (None: they are forwarded).
    /// `rollouts`: each model in a version rollout, as its requests route now.
    #[pyo3(signature = (lanes, ended, health = Vec::new(), serving = None, guards = None, documents = None, rollouts = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        lanes: Vec<LaneTuple<'_>>,
        ended: Vec<EndedTuple>,
        health: Vec<CannedTuple>,
        serving: Option<Vec<(String, bool)>>,
        guards: Option<Vec<GuardTuple>>,
        documents: Option<DocumentsTuple>,
        rollouts: Vec<RouteTuple>,
    ) -> PyResult<()> {
        let mut breakers = self.breakers.lock().map_err(|_| PyRuntimeError::new_err("breakers poisoned"))?;
        let capacity = self.shared.settings.max_in_flight_per_model;
        let mut snapshot = Snapshot::default();
        for (model, spec, hidden, check_non_finite, generate, idle_s, versions, stale) in lanes {
            let breaker = breakers.entry(model.clone()).or_insert_with(|| Arc::new(Breaker::new(capacity))).clone();
            let stream_idle = secs(idle_s, "generation.idle_timeout_s")?;
            // A pinned version is the model served with that version's spec and hidden outputs: the
            // breaker, limits and screening are the model's (ServingCore keys them by model alone).
            let lane_of = |spec: &RequestSpec, hidden: Option<Vec<String>>, versions| Lane {
                spec: spec.spec.clone(),
                hidden: hidden.map(|h| h.into_iter().collect::<HashSet<_>>()),
                check_non_finite,
                breaker: breaker.clone(),
                generate: generate.limits.clone(),
                stream_idle,
                versions,
                stale,
            };
            let versions = versions
                .into_iter()
                .map(|(version, spec, hidden)| (version, Arc::new(lane_of(&spec, hidden, HashMap::new()))))
                .collect();
            snapshot.lanes.insert(model, Arc::new(lane_of(&spec, hidden, versions)));
        }
        for (model, status, body, retry_after, reason, event, versions) in ended {
            let ended = Ended {
                status,
                body: Bytes::from(body),
                retry_after,
                reason,
                event: Bytes::from(event),
                versions: versions.map(|v| v.into_iter().collect()),
            };
            snapshot.ended.insert(model, Arc::new(ended));
        }
        match guards {
            Some(guards) => {
                for (model, suspect, may_hold, fallback) in guards {
                    snapshot.guards.insert(model, Guard { suspect, may_hold, fallback });
                }
            }
            // Published without them (a caller that knows only lanes): every lane's model guarded.
            None => {
                for model in snapshot.lanes.keys().chain(snapshot.ended.keys()) {
                    snapshot.guards.insert(model.clone(), Guard::default());
                }
            }
        }
        for (path, status, body, retry_after, reason) in health {
            snapshot.health.insert(path, Arc::new(Canned { status, body: Bytes::from(body), retry_after, reason }));
        }
        snapshot.serving = serving.map(|statuses| statuses.into_iter().collect());
        if let Some((models, allow_statistics, extensions)) = documents {
            let served = models.iter().map(|(name, ..)| name.as_str()).collect::<Vec<_>>().join(", ");
            let models = models.into_iter().map(|(name, filtered, ready, outputs)| {
                let not_ready = ready.map(|(status, body, retry_after)| Canned {
                    status,
                    body: Bytes::from(body),
                    retry_after,
                    reason: "not_ready".to_owned(),
                });
                let outputs = outputs.map(|judged| judged.into_iter().collect());
                (name, Guarded { filtered, not_ready, outputs })
            });
            snapshot.documents = Some(Arc::new(Documents {
                models: models.collect(),
                served,
                allow_statistics,
                extensions: extensions.into_iter().collect(),
            }));
        }
        for (model, stable, candidate, share, cohort_key, shadow_rate, fallbacks, atol, rtol, tolerances) in rollouts {
            let route = Route {
                stable,
                candidate,
                share,
                cohort_key,
                shadow_rate,
                fallbacks: fallbacks.into_iter().collect(),
                tolerance: Tolerance { atol, rtol },
                tolerances: tolerances.into_iter().map(|(o, atol, rtol)| (o, Tolerance { atol, rtol })).collect(),
            };
            snapshot.rollouts.insert(model, Arc::new(route));
        }
        self.shared.publish(snapshot);
        self.shared.watchdog.control_seen();
        Ok(())
    }

    /// Everything the front queued since the last call, oldest first, as tuples:
    /// ("answered", model, count), ("failed", model, kind, status, detail), ("non_finite", model,
    /// outputs), ("ended", model, count), ("log", request_id, trace_id, model, method, path, status,
    /// duration_ms, reason, client_subject, span_id), ("panic", model, message), ("tls_refused", reason,
    /// client_subject, protocol), ("stream_ended", model, reason, events, cause), ("grpc_log", request_id,
    /// trace_id, model, path, code, duration_ms, reason, client_subject, span_id), ("grpc_panic", model,
    /// request_id, message), ("repository", call, status, code, message), ("recorded", model),
    /// ("rollout_answered", model, version, latency_s, error), ("shadow_ended", model, target,
    /// latency_s, "failed" | "nothing" | "compared", NaN in the shadow's answer, [(output, message)]).
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.shared.watchdog.control_seen();
        let out = PyList::empty(py);
        for event in self.shared.events.drain() {
            let item: Bound<'py, PyTuple> = match event {
                Event::Answered { model, count } => ("answered", model, count).into_pyobject(py)?,
                Event::Failed { model, kind, status, detail } => {
                    ("failed", model, kind, status, detail).into_pyobject(py)?
                }
                Event::NonFinite { model, outputs } => ("non_finite", model, outputs).into_pyobject(py)?,
                Event::Ended { model, count } => ("ended", model, count).into_pyobject(py)?,
                Event::Log(r) => (
                    "log",
                    r.request_id,
                    r.trace_id,
                    r.model,
                    r.method,
                    r.path,
                    r.status,
                    r.duration_ms,
                    r.reason,
                    r.client_subject.as_ref(),
                    r.span_id,
                )
                    .into_pyobject(py)?,
                Event::GrpcLog { record: r, code } => (
                    "grpc_log",
                    r.request_id,
                    r.trace_id,
                    r.model,
                    r.path,
                    code,
                    r.duration_ms,
                    r.reason,
                    r.client_subject.as_ref(),
                    r.span_id,
                )
                    .into_pyobject(py)?,
                Event::Panic { model, message } => ("panic", model, message).into_pyobject(py)?,
                Event::GrpcPanic { model, request_id, message } => {
                    ("grpc_panic", model, request_id, message).into_pyobject(py)?
                }
                Event::TlsRefused { reason, client_subject, protocol } => {
                    ("tls_refused", reason, client_subject, protocol).into_pyobject(py)?
                }
                Event::StreamEnded { model, reason, events, cause } => {
                    ("stream_ended", model, reason, events, cause).into_pyobject(py)?
                }
                Event::Recorded { model } => ("recorded", model).into_pyobject(py)?,
                Event::RolloutAnswered { model, version, latency_s, error } => {
                    ("rollout_answered", model, version, latency_s, error).into_pyobject(py)?
                }
                Event::ShadowEnded { model, target, latency_s, outcome } => {
                    // Heard: its place among the shadows is free from now on.
                    let _ = self.shared.shadows.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
                    let (kind, nan, differences) = match outcome {
                        ShadowOutcome::Failed => ("failed", false, Vec::new()),
                        ShadowOutcome::Nothing => ("nothing", false, Vec::new()),
                        ShadowOutcome::Compared { nan, differences } => ("compared", nan, differences),
                    };
                    ("shadow_ended", model, target, latency_s, kind, nan, differences).into_pyobject(py)?
                }
                Event::Repository { call, outcome } => {
                    ("repository", call, outcome.status, outcome.code, outcome.message).into_pyobject(py)?
                }
            };
            out.append(item)?;
        }
        Ok(out)
    }

    /// The span of a request the Python side answers, named `name`, continuing the client's
    /// `traceparent`/`tracestate`, on this front's sampler and exporter; None when tracing is off or
    /// the span is not sampled (then the client's context goes on to Triton as without tracing).
    #[pyo3(signature = (name, traceparent = None, tracestate = None))]
    fn open_span(&self, name: String, traceparent: Option<&str>, tracestate: Option<&str>) -> Option<RequestSpan> {
        let tracing = self.shared.tracing.as_ref()?;
        tracing.python_span(name, traceparent, tracestate).map(RequestSpan::new)
    }

    /// Stop accepting, end idle connections, let in-flight requests finish (bounded by
    /// proxy.upstream_timeout_s), and wait without the GIL for the runtime to end.
    fn close(&self, py: Python<'_>) {
        let _ = self.stop.send(true);
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        py.detach(move || {
            if let Some(handle) = handle {
                let _ = handle.join();
            }
        });
    }
}

/// The listening socket: address reuse (a restart does not wait out TIME_WAIT) and an accept queue of
/// `backlog` (listen.max_connections; the kernel caps it at net.core.somaxconn).
fn bind(address: SocketAddr, backlog: i32) -> std::io::Result<std::net::TcpListener> {
    let domain = socket2::Domain::for_address(address);
    let socket = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&address.into())?;
    socket.listen(backlog)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// grpc.health.v1 Check's NOT_FOUND message for `service` (the grpcio front's HealthService says
/// what the data plane's gRPC front says).
#[pyfunction]
fn unknown_health_service(service: &str) -> String {
    grpc::health::unknown_service(service)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<HttpFront>()?;
    m.add_function(wrap_pyfunction!(unknown_health_service, m)?)
}
