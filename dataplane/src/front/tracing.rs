//! Tracing on the front (issue 32, docs/tracing.md): one SERVER span per request served on a lane
//! (infer, generate, generate_stream), sampled with the OpenTelemetry SDK, kept as a record while it
//! runs and exported over OTLP/HTTP (protobuf) in batches by the SDK's exporter (span_records.rs).
//!
//! The span continues the client's W3C `traceparent`/`tracestate` (parent-based sampling when
//! tracing.parent_based), else starts a trace sampled at tracing.sample_rate. When it is sampled,
//! Triton gets a `traceparent` whose parent is this span, so Triton's own spans nest under it; when
//! it is not, the client's own context goes on to Triton as without tracing.
//!
//! Export never blocks a request: an ended span waits on a queue of tracing.queue_size spans that
//! the front's span thread drains in batches; a span that finds it full is dropped at once, and a
//! batch the collector does not take within tracing.export_timeout_s is lost. Both are counted in
//! the families Python's exporter counts into (`RequestMetrics::tracing_spans_*`). The exporter
//! posts through `FrontPoster`, a client on the front's own runtime and hyper stack (no second
//! HTTP client, no runtime of its own).
//!
//! Tracing off (no endpoint) is `Shared::tracing == None`: a request pays one branch, and neither
//! the SDK's provider nor the span thread exists.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, InstrumentationScope, KeyValue};
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SamplingDecision, SdkTracer, SdkTracerProvider, ShouldSample, Span,
    SpanData, SpanExporter,
};
use opentelemetry_sdk::Resource;

use crate::metrics::request::RequestMetrics;
use crate::protocol::pytext::cut;

use super::generate::Endpoint;
use super::span_records::{
    status_text, Batching, Clock, Noted, Outcome, QueueProcessor, Record, Recorder, HAND_ON_EVERY,
};
use super::upstream::{ClientTls, Upstream};

/// The instrumentation scope of every span (sidecar/tracing/otel.py's SCOPE).
const SCOPE: &str = "triton-sidecar";

/// Events one span records at most: a request has four phases and a stream a few more; the bound
/// keeps a span's size fixed whatever a stream does.
const MAX_EVENTS: u32 = 16;

/// The resolved `tracing` section, as Python hands it down (the OTEL_* variables already read
/// into it by sidecar/config.py: the front reads no environment of its own).
#[derive(Debug, Clone)]
pub struct TracingSettings {
    /// The collector's OTLP/HTTP traces URL (`http://host:port/path` or `https://...`).
    pub endpoint: String,
    /// For an https:// endpoint: the PEM bundle of the CAs its certificate must chain to
    /// (tracing.ca_file, or the bundle Python's exporter trusts), read by Python.
    pub ca_pem: Option<Vec<u8>>,
    /// For an https:// endpoint that asks for one: the client certificate chain and its key (PEM),
    /// tracing.client_cert_file and client_key_file as Python read them.
    pub client_identity: Option<(Vec<u8>, Vec<u8>)>,
    pub sample_rate: f64,
    pub parent_based: bool,
    pub service_name: String,
    pub service_version: String,
    pub resource_attributes: Vec<(String, String)>,
    pub queue_size: usize,
    pub batch_size: usize,
    pub export_delay: Duration,
    pub export_timeout: Duration,
}

/// Why tracing could not start: a start-up error naming the key.
#[derive(Debug, thiserror::Error)]
pub enum TracingError {
    #[error("tracing.endpoint {0}: not an http:// or https:// URL with a host")]
    NotHttp(String),
    #[error("tracing.ca_file: {0}")]
    Ca(String),
    /// The message names the key (tracing.client_cert_file or client_key_file).
    #[error("{0}")]
    ClientCert(String),
    #[error("tracing.endpoint: the OTLP exporter refused it: {0}")]
    Exporter(String),
}

/// The front's tracer: the SDK's provider (sampler, the span thread's queue) and its tracer.
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    export_timeout: Duration,
    /// A lane request's span is sampled and named here, and recorded by `recorder` (span_records.rs).
    sampler: Sampler,
    ids: RandomIdGenerator,
    recorder: Arc<Recorder>,
}

impl Tracing {
    /// Build the provider for `settings`; `runtime`: the front's runtime, which runs the exporter's
    /// posts. The span thread starts here.
    pub fn start(
        settings: &TracingSettings,
        metrics: Arc<RequestMetrics>,
        runtime: tokio::runtime::Handle,
    ) -> Result<Tracing, TracingError> {
        let (secure, rest) = match settings.endpoint.split_once("://") {
            Some(("http", rest)) => (false, rest),
            Some(("https", rest)) => (true, rest),
            _ => return Err(TracingError::NotHttp(settings.endpoint.clone())),
        };
        let authority = rest.split('/').next().unwrap_or(rest);
        if authority.is_empty() {
            return Err(TracingError::NotHttp(settings.endpoint.clone()));
        }
        let tls = if secure {
            Some(client_tls(authority, settings.ca_pem.as_deref(), settings.client_identity.as_ref())?)
        } else {
            None
        };
        // An https:// URL without a port is the collector's 443 (TcpStream needs one).
        let address = match (secure, authority.rsplit_once(':')) {
            (_, Some((_, port))) if !port.contains(']') => authority.to_owned(),
            (true, _) => format!("{authority}:443"),
            (false, _) => format!("{authority}:80"),
        };
        // The post's own bound is the export's: a collector that takes the connection and never
        // answers costs one export_timeout per batch, never a request's time.
        let upstream = Upstream::with_tls(address, settings.export_timeout, tls);
        let poster = FrontPoster { upstream: Arc::new(upstream), runtime: runtime.clone() };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(settings.endpoint.clone())
            .with_timeout(settings.export_timeout)
            .with_http_client(poster)
            .build()
            .map_err(|e| TracingError::Exporter(e.to_string()))?;
        for reason in ["queue_full", "export_failed"] {
            metrics.tracing_spans_dropped.add(&[reason], 0);
        }
        let mut counted = CountedExporter { inner: exporter, metrics: metrics.clone() };
        let ratio = Sampler::TraceIdRatioBased(settings.sample_rate);
        let sampler = if settings.parent_based { Sampler::ParentBased(Box::new(ratio)) } else { ratio };
        let mut attributes = vec![
            KeyValue::new("service.version", settings.service_version.clone()),
            KeyValue::new("telemetry.sdk.language", "rust"),
            KeyValue::new("telemetry.sdk.name", "opentelemetry"),
        ];
        attributes.extend(settings.resource_attributes.iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())));
        // builder_empty: Resource::builder() would read OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
        let resource = Resource::builder_empty()
            .with_service_name(settings.service_name.clone())
            .with_attributes(attributes)
            .build();
        // The exporter serves the provider's spans (the ones Python writes) and the lanes' records
        // alike, on the recorder's thread: its resource is set here, as the provider would set it.
        counted.set_resource(&resource);
        let scope = InstrumentationScope::builder(SCOPE).build();
        let batching = Batching {
            every: HAND_ON_EVERY,
            batch_size: settings.batch_size.clamp(1, settings.queue_size.max(1)),
            export_delay: settings.export_delay,
            export_timeout: settings.export_timeout,
            queue_size: settings.queue_size,
        };
        let recorder = Recorder::start(counted, scope, batching, metrics, runtime)
            .map_err(|e| TracingError::Exporter(format!("cannot start the span thread: {e}")))?;
        let recorder = Arc::new(recorder);
        let provider = SdkTracerProvider::builder()
            .with_sampler(sampler.clone())
            .with_resource(resource)
            .with_span_processor(QueueProcessor(recorder.clone()))
            .build();
        let tracer = provider.tracer(SCOPE);
        Ok(Tracing {
            provider,
            tracer,
            export_timeout: settings.export_timeout,
            sampler,
            ids: RandomIdGenerator::default(),
            recorder,
        })
    }

    /// The span of one request read in full: sampled, or `RequestSpan::OFF`.
    pub fn request(&self, opened: Opened<'_>) -> RequestSpan {
        // The SDK's sampler and ids, as its tracer would use them, without its span (span_records.rs
        // says why): a sampled request gets a record, the 99 % a low rate leaves out nothing.
        let remote = opened.traceparent.and_then(remote_context(opened.tracestate));
        let name = opened.route.span_name();
        let (parent, trace_id, parent_id) = match remote {
            Some(remote) => {
                let (trace_id, span_id) = (remote.trace_id(), remote.span_id());
                (Context::new().with_remote_span_context(remote), trace_id, span_id)
            }
            None => (Context::new(), self.ids.new_trace_id(), SpanId::INVALID),
        };
        let sampled = self.sampler.should_sample(Some(&parent), trace_id, name, &SpanKind::Server, &[], &[]);
        if sampled.decision != SamplingDecision::RecordAndSample {
            return RequestSpan::OFF; // the client's own context goes on to Triton, as without tracing
        }
        let context =
            SpanContext::new(trace_id, self.ids.new_span_id(), TraceFlags::SAMPLED, false, sampled.trace_state);
        let state = context.trace_state().header();
        let traceparent = traceparent_of(&context);
        let clock = Clock::now();
        let record = Box::new(Record {
            context,
            parent: parent_id,
            route: opened.route,
            start: opened.started,
            opened: clock,
            model: opened.model.to_owned(),
            version: opened.version.to_owned(),
            routed: opened.routed,
            request_id: opened.request_id.to_owned(),
            body_bytes: opened.body_bytes,
            events: Vec::with_capacity(6),
            end: clock.instant,
            outcome: Outcome::Http { status: 0 },
            reason: String::new(),
            bytes_out: 0,
            error: None,
        });
        RequestSpan(Some(Box::new(Traced {
            open: Mutex::new(Some(record)),
            recorder: self.recorder.clone(),
            traceparent,
            tracestate: (!state.is_empty()).then_some(state),
            grpc: matches!(opened.route, Route::Grpc { .. }),
        })))
    }

    /// The span of a request the Python side answers (gRPC calls on grpcio, HTTP requests the front
    /// hands over), named by Python as its front names it; None when it is not sampled. It is made
    /// here, on the front's sampler and exporter, so that Python pays a call at its start and one at
    /// its end rather than the Python SDK's span and export (issue 32's cost per sampled span).
    pub fn python_span(&self, name: String, traceparent: Option<&str>, tracestate: Option<&str>) -> Option<PythonSpan> {
        self.span_since(name, traceparent, tracestate, std::time::SystemTime::now())
    }

    /// `python_span` begun at `started`: a request the front answered itself, its span made once
    /// the answer is known to be the front's (one it hands to the Python app after all gets
    /// Python's span alone).
    pub fn span_since(
        &self,
        name: String,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
        started: std::time::SystemTime,
    ) -> Option<PythonSpan> {
        let parent = parent_context(traceparent, tracestate);
        let builder = self.tracer.span_builder(name).with_kind(SpanKind::Server).with_start_time(started);
        let span = builder.start_with_context(&self.tracer, &parent);
        let context = span.span_context().clone();
        if !context.is_sampled() {
            return None;
        }
        let state = context.trace_state().header();
        Some(PythonSpan {
            span,
            traceparent: traceparent_of(&context),
            tracestate: (!state.is_empty()).then_some(state),
            events: 0,
        })
    }

    /// Trace a request the front refused before reading it in full (a head it could not parse or
    /// that timed out, a smuggling attempt, a body too large, malformed or too slow): a span that
    /// starts and ends at once, an error with the refusal's reason and message, named for the route
    /// when the path names one, else for the method alone. (trace id, span id) for the access log
    /// when it is sampled.
    pub fn refused(&self, refused: Refused<'_>) -> Option<(String, String)> {
        let endpoint = refused.path.strip_prefix("/v2/models/").and_then(Endpoint::split).map(|(_, e)| e);
        let method = if refused.method.is_empty() { "HTTP" } else { refused.method };
        let (name, route) = match endpoint {
            Some(endpoint) if method == "POST" => (endpoint.span_name().to_owned(), Some(endpoint.route())),
            _ => (method.to_owned(), None),
        };
        let mut span = self.python_span(name, refused.traceparent, refused.tracestate)?;
        let mut attributes = vec![
            KeyValue::new("sidecar.request_id", refused.request_id.to_owned()),
            KeyValue::new("sidecar.protocol", "http"),
            KeyValue::new("http.request.method", method.to_owned()),
            KeyValue::new("http.response.status_code", i64::from(refused.status)),
            KeyValue::new("sidecar.status", status_text(refused.status)),
            KeyValue::new("sidecar.refusal.reason", refused.reason),
        ];
        if let Some(route) = route {
            attributes.push(KeyValue::new("http.route", route));
        }
        if !refused.model.is_empty() {
            attributes.push(KeyValue::new("sidecar.model", refused.model.to_owned()));
        }
        span.set(attributes);
        // The message the client read: the refusal body's "error" (the front wrote it; only a
        // sampled refusal reads it back).
        let message = crate::protocol::json::parse(refused.body)
            .ok()
            .and_then(|doc| doc.get("error").and_then(|e| e.as_str()).map(str::to_owned))
            .unwrap_or_default();
        let ids = (span.trace_id().to_owned(), span.span_id().to_owned());
        span.end(Some(&format!("[{}] {message}", refused.reason)));
        Some(ids)
    }

    /// Export what is queued (bounded by tracing.export_timeout_s) and stop the span thread. The
    /// exporter's posts run on the front's runtime: the wait is on a blocking thread, so that even a
    /// one-thread runtime goes on running them meanwhile.
    pub async fn shutdown(&self) {
        let provider = self.provider.clone();
        let recorder = self.recorder.clone();
        let bound = self.export_timeout;
        let _ = tokio::task::spawn_blocking(move || {
            recorder.stop(); // the last round: every span waiting, lanes' and Python's, posted
            provider.shutdown_with_timeout(bound)
        })
        .await;
    }
}

/// The TLS client of an https:// collector: its certificate verified against `ca_pem` (webpki's
/// rules: chain, validity, the host name of the URL), TLS 1.2 or 1.3 on ring's primitives;
/// `identity` (certificate chain, key), presented when the collector asks for a client certificate.
fn client_tls(
    authority: &str,
    ca_pem: Option<&[u8]>,
    identity: Option<&(Vec<u8>, Vec<u8>)>,
) -> Result<ClientTls, TracingError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let pem = ca_pem.ok_or_else(|| TracingError::Ca("no CA bundle for an https:// endpoint".to_owned()))?;
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(pem) {
        let certificate = certificate.map_err(|e| TracingError::Ca(format!("not a PEM CA bundle: {e}")))?;
        // A bundle may hold certificates webpki cannot use as anchors (the system's does): skip them.
        let _ = roots.add(certificate);
    }
    if roots.is_empty() {
        return Err(TracingError::Ca("the bundle holds no usable CA certificate".to_owned()));
    }
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let server_name = ServerName::try_from(host.clone())
        .map_err(|e| TracingError::NotHttp(format!("https://{authority}: {host} is not a host name: {e}")))?;
    // ring's provider, as the server side's (front/tls.rs says why not aws-lc-rs).
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TracingError::Ca(e.to_string()))?
        .with_root_certificates(roots);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((chain_pem, key_pem)) => {
            let chain = CertificateDer::pem_slice_iter(chain_pem).collect::<Result<Vec<_>, _>>().map_err(|e| {
                TracingError::ClientCert(format!("tracing.client_cert_file: not a PEM certificate chain: {e}"))
            })?;
            if chain.is_empty() {
                return Err(TracingError::ClientCert(
                    "tracing.client_cert_file: the file holds no certificate".to_owned(),
                ));
            }
            let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| {
                TracingError::ClientCert(format!("tracing.client_key_file: not a PEM private key: {e}"))
            })?;
            // rustls checks here that the key is one it can sign with (and matches the leaf's type).
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                TracingError::ClientCert(format!(
                    "tracing.client_cert_file, client_key_file: the certificate and key cannot be used together: {e}"
                ))
            })?
        }
    };
    Ok(ClientTls { connector: tokio_rustls::TlsConnector::from(Arc::new(config)), server_name })
}

/// What a span is opened with: the client's context, the route, and what the request says.
pub struct Opened<'a> {
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
    pub route: Route,
    pub model: &'a str,
    /// The version the request goes to ("" = none: Triton's default): the client's pin, or the
    /// fallback while Triton's choice is not trusted, or a rollout's pick.
    pub version: &'a str,
    /// Why the request goes to `version` (pinned, split, fallback; default for "").
    pub routed: super::state::Routed,
    pub request_id: &'a str,
    pub body_bytes: usize,
    /// When the request's head was read: the span covers the body's reading too.
    pub started: Instant,
}

/// A request the front refused before it was read in full (`Tracing::refused`).
pub struct Refused<'a> {
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
    /// "" when the head was never read.
    pub method: &'a str,
    pub path: &'a str,
    /// A lane's model, "" when none was known yet.
    pub model: &'a str,
    pub request_id: &'a str,
    pub status: u16,
    pub reason: &'static str,
    /// The refusal's JSON body, as the client got it.
    pub body: &'a [u8],
}

/// What a request is, for its span's name and attributes.
#[derive(Debug, Clone, Copy)]
pub enum Route {
    /// An HTTP endpoint the front serves (POST).
    Http(Endpoint),
    /// A gRPC method (`inference.GRPCInferenceService`, `ModelInfer`): the span is named
    /// `service/method`, as OpenTelemetry's RPC conventions (and the Python gRPC front) name it.
    Grpc { service: &'static str, method: &'static str, name: &'static str },
}

impl Route {
    pub fn span_name(self) -> &'static str {
        match self {
            Route::Http(endpoint) => endpoint.span_name(),
            Route::Grpc { name, .. } => name,
        }
    }
}

impl Endpoint {
    /// The route template (http.route).
    pub fn route(self) -> &'static str {
        &self.span_name()["POST ".len()..]
    }

    /// The span's name: the method and the route template, as OpenTelemetry's HTTP conventions say
    /// (static: nothing to format per request).
    pub fn span_name(self) -> &'static str {
        match self {
            Endpoint::Infer => "POST /v2/models/{model}/infer",
            Endpoint::Generate => "POST /v2/models/{model}/generate",
            Endpoint::GenerateStream => "POST /v2/models/{model}/generate_stream",
        }
    }
}

/// The context a request's span starts in: the client's, when its traceparent is valid; else an
/// empty one (a new trace, never an ambient one).
fn parent_context(traceparent: Option<&str>, tracestate: Option<&str>) -> Context {
    match traceparent.and_then(remote_context(tracestate)) {
        Some(remote) => Context::new().with_remote_span_context(remote),
        None => Context::new(),
    }
}

/// A sampled span the Python side writes (`Tracing::python_span`): attributes as the request goes
/// on, then its end. Dropped unended (Python's request object was collected first), the SDK ends it.
pub struct PythonSpan {
    span: Span,
    /// What Triton gets, this span as the parent; the log's trace and span ids are its slices.
    pub traceparent: String,
    pub tracestate: Option<String>,
    /// Events recorded, bounded by MAX_EVENTS as the front's own spans.
    events: u32,
}

impl PythonSpan {
    pub fn trace_id(&self) -> &str {
        &self.traceparent[TRACE_ID]
    }

    pub fn span_id(&self) -> &str {
        &self.traceparent[SPAN_ID]
    }

    pub fn set(&mut self, attributes: Vec<KeyValue>) {
        self.span.set_attributes(attributes);
    }

    /// A moment of the request (a phase that ended, a wait); past MAX_EVENTS, dropped.
    pub fn event(&mut self, name: String, attributes: Vec<KeyValue>) {
        if self.events < MAX_EVENTS {
            self.span.add_event(name, attributes);
            self.events += 1;
        }
    }

    /// End it now; `error`: the description of a failed request (its status is then an error).
    pub fn end(mut self, error: Option<&str>) {
        if let Some(description) = error {
            self.span.set_status(Status::error(cut(description, 500)));
        }
        self.span.end();
    }
}

/// A W3C traceparent (version 00's layout; a later version is read the same way, as the spec asks)
/// as a remote parent, with the client's tracestate; None when it is not valid.
fn remote_context(tracestate: Option<&str>) -> impl FnOnce(&str) -> Option<SpanContext> + '_ {
    move |traceparent| {
        let parts: Vec<&str> = traceparent.trim().split('-').collect();
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if parts.len() < 4 || !hex(parts[0], 2) || parts[0] == "ff" || (parts[0] == "00" && parts.len() != 4) {
            return None;
        }
        if !hex(parts[1], 32) || !hex(parts[2], 16) || !hex(parts[3], 2) {
            return None;
        }
        let trace_id = TraceId::from_hex(parts[1]).ok()?;
        let span_id = SpanId::from_hex(parts[2]).ok()?;
        if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
            return None;
        }
        let flags = u8::from_str_radix(parts[3], 16).ok()? & TraceFlags::SAMPLED.to_u8();
        let state = tracestate.and_then(|s| TraceState::from_str(s).ok()).unwrap_or_default();
        Some(SpanContext::new(trace_id, span_id, TraceFlags::new(flags), true, state))
    }
}

/// One request's span while it is served: None when tracing is off or the request not sampled.
/// Written through `&self` (events, the end) from the request's task; the lock is never contended.
pub struct RequestSpan(Option<Box<Traced>>);

struct Traced {
    /// The record while the request runs; None once ended (handed to the recorder). Boxed: the
    /// recorder's queue moves a pointer, not the record, into memory its thread touched last.
    open: Mutex<Option<Box<Record>>>,
    /// Where the ended record goes.
    recorder: Arc<Recorder>,
    /// What Triton gets: this span as the parent. The trace and span ids the log keeps are slices
    /// of it (`TRACE_ID`, `SPAN_ID`): one string made per request, not three.
    traceparent: String,
    tracestate: Option<String>,
    /// A gRPC call's span: ended with its status code (`end_grpc`), a dropped one CANCELLED.
    grpc: bool,
}

/// Where the ids are in a version-00 traceparent (`00-<32 hex>-<16 hex>-<2 hex>`).
const TRACE_ID: std::ops::Range<usize> = 3..35;
const SPAN_ID: std::ops::Range<usize> = 36..52;

/// The W3C traceparent naming `context` as the parent, written in one pass (no formatter: every
/// sampled request makes one).
fn traceparent_of(context: &SpanContext) -> String {
    fn hex(out: &mut String, bytes: &[u8]) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        for b in bytes {
            out.push(char::from(DIGITS[usize::from(b >> 4)]));
            out.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
    }
    let mut out = String::with_capacity(55);
    out.push_str("00-");
    hex(&mut out, &context.trace_id().to_bytes());
    out.push('-');
    hex(&mut out, &context.span_id().to_bytes());
    out.push('-');
    hex(&mut out, &[context.trace_flags().to_u8()]);
    out
}

impl RequestSpan {
    pub const OFF: RequestSpan = RequestSpan(None);

    /// The request's span when the front traces (`shared.tracing`): one branch when it does not.
    #[inline]
    pub fn open(tracing: Option<&Tracing>, opened: Opened<'_>) -> RequestSpan {
        match tracing {
            None => RequestSpan::OFF,
            Some(tracing) => tracing.request(opened),
        }
    }

    /// (trace id for the log, traceparent and tracestate for Triton): the span's when it is sampled,
    /// else the client's as it sent them. `client_trace_id`: the id the log keeps without a span.
    pub fn upstream_context(
        &self,
        client_trace_id: String,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
    ) -> (String, Option<String>, Option<String>) {
        match &self.0 {
            None => (client_trace_id, traceparent.map(str::to_owned), tracestate.map(str::to_owned)),
            Some(t) => (t.traceparent[TRACE_ID].to_owned(), Some(t.traceparent.clone()), t.tracestate.clone()),
        }
    }

    /// The span id for the access log; "" when untraced.
    #[inline]
    pub fn span_id(&self) -> String {
        self.0.as_ref().map_or_else(String::new, |t| t.traceparent[SPAN_ID].to_owned())
    }

    /// A phase of the request ended now: an event `name` with its duration in milliseconds (since
    /// the span began or the last phase ended).
    #[inline]
    pub fn phase(&self, name: &'static str) {
        self.with(|record| {
            note(record, Noted { name, at: Instant::now(), phase: true, attributes: Vec::new() });
        });
    }

    /// A moment inside the span with its attributes (made only when the span records).
    #[inline]
    pub fn event(&self, name: &'static str, attributes: impl FnOnce() -> Vec<KeyValue>) {
        self.with(|record| {
            note(record, Noted { name, at: Instant::now(), phase: false, attributes: attributes() });
        });
    }

    /// End the span with the request's outcome: HTTP status, refusal reason ("" for none), bytes
    /// sent. A refusal, or a 5xx, is an error whose description is `[reason] message`, the message
    /// the client got (`message` is called only then).
    #[inline]
    pub fn end(&self, status: u16, reason: &str, message: impl FnOnce() -> String, bytes_out: u64) {
        let failed = !reason.is_empty() || status >= 500;
        let label = if reason.is_empty() { "error" } else { reason };
        self.finish(Outcome::Http { status }, reason, || failed.then(|| describe(label, message())), bytes_out);
    }

    /// End a gRPC call's span with its status (number and name), refusal reason ("" for none) and
    /// the bytes sent: an error when the code is not OK or the call was refused, described
    /// `[reason] message` (`message` is called only then), as sidecar/tracing/otel.py ends its own.
    #[inline]
    pub fn end_grpc(&self, code: (u8, &'static str), reason: &str, message: impl FnOnce() -> String, bytes_out: u64) {
        let failed = !reason.is_empty() || code.0 != 0;
        let label = if reason.is_empty() { code.1 } else { reason };
        let outcome = Outcome::Grpc { code: code.0, name: code.1 };
        self.finish(outcome, reason, || failed.then(|| describe(label, message())), bytes_out);
    }

    /// Drop the span unrecorded: the request is handed to the Python side, whose own span covers it.
    pub fn discard(&self) {
        if let Some(traced) = &self.0 {
            if let Ok(mut open) = traced.open.lock() {
                open.take();
            }
        }
    }

    /// The record, complete, goes to the recorder; a second end finds none and does nothing, and
    /// describes no error: `error` is called only for the record still open (the drop that follows
    /// every end would otherwise format a 499's description each request, ~1 µs).
    fn finish(&self, outcome: Outcome, reason: &str, error: impl FnOnce() -> Option<String>, bytes_out: u64) {
        let Some(traced) = &self.0 else {
            return;
        };
        let record = traced.open.lock().ok().and_then(|mut open| open.take());
        if let Some(mut record) = record {
            record.end = Instant::now();
            record.outcome = outcome;
            record.reason = reason.to_owned();
            record.error = error();
            record.bytes_out = bytes_out;
            traced.recorder.push(record);
        }
    }

    /// Write to the record while it is open.
    fn with(&self, write: impl FnOnce(&mut Record)) {
        if let Some(traced) = &self.0 {
            if let Ok(mut guard) = traced.open.lock() {
                if let Some(record) = guard.as_mut() {
                    write(record);
                }
            }
        }
    }
}

/// A failed request's error description: `[label] message`, cut as every span's.
fn describe(label: &str, message: String) -> String {
    cut(&format!("[{label}] {message}"), 500)
}

/// An event of a record still open; past MAX_EVENTS, dropped.
fn note(record: &mut Record, noted: Noted) {
    if record.events.len() < MAX_EVENTS as usize {
        record.events.push(noted);
    }
}

impl Drop for RequestSpan {
    /// A span dropped before its end: the request's task was aborted because its client left (the
    /// front counts it 499), or its handling panicked (500).
    fn drop(&mut self) {
        let Some(traced) = &self.0 else {
            return; // untraced: one branch, as everywhere else
        };
        if traced.grpc {
            let (code, reason, message) = if std::thread::panicking() {
                ((13, "INTERNAL"), "internal_error", "the sidecar failed to handle this request; it was logged")
            } else {
                ((1, "CANCELLED"), "client_disconnected", "client cancelled the call while Triton was answering")
            };
            self.end_grpc(code, reason, || message.to_owned(), 0);
            return;
        }
        let (status, reason, message) = if std::thread::panicking() {
            (500, "internal_error", "the sidecar failed to handle this request; it was logged")
        } else {
            (499, "client_disconnected", "client closed the connection while Triton was answering")
        };
        self.end(status, reason, || message.to_owned(), 0);
    }
}

/// The OTLP exporter, with every span the collector took or did not take counted.
struct CountedExporter {
    inner: opentelemetry_otlp::SpanExporter,
    metrics: Arc<RequestMetrics>,
}

impl fmt::Debug for CountedExporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CountedExporter")
    }
}

impl SpanExporter for CountedExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => self.metrics.tracing_spans_exported.add(&[], n as u64),
            Err(_) => self.metrics.tracing_spans_dropped.add(&["export_failed"], n as u64),
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The exporter's HTTP client: each post runs on the front's runtime through `Upstream` (hyper,
/// keep-alive, bounded by tracing.export_timeout_s), awaited from the span thread.
struct FrontPoster {
    upstream: Arc<Upstream>,
    runtime: tokio::runtime::Handle,
}

impl fmt::Debug for FrontPoster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FrontPoster")
    }
}

#[async_trait::async_trait]
impl HttpClient for FrontPoster {
    async fn send_bytes(&self, request: hyper::Request<Bytes>) -> Result<hyper::Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
        let headers: Vec<(String, String)> = parts
            .headers
            .iter()
            .filter_map(|(name, value)| Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned())))
            .collect();
        let upstream = self.upstream.clone();
        let call = self.runtime.spawn(async move {
            let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            upstream.send(parts.method.as_str(), &path, &headers, body).await
        });
        let (status, headers, body) = match call.await {
            Ok(Ok(answer)) => answer,
            Ok(Err(failure)) => return Err(format!("the collector gave no answer: {failure:?}").into()),
            Err(e) => return Err(format!("the export's task ended: {e}").into()),
        };
        let mut response = hyper::Response::builder().status(status);
        for (name, value) in &headers {
            response = response.header(name, value);
        }
        Ok(response.body(body)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_traceparent_is_a_remote_parent_with_its_flags_and_state() {
        let read = remote_context(Some("vendor=kept"))("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        let context = read.expect("valid");
        assert_eq!(context.trace_id().to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(context.span_id().to_string(), "b7ad6b7169203331");
        assert!(context.is_sampled() && context.is_remote());
        assert_eq!(context.trace_state().header(), "vendor=kept");
        let unsampled = remote_context(None)("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00");
        assert!(!unsampled.expect("valid").is_sampled());
    }

    #[test]
    fn an_invalid_traceparent_is_no_parent() {
        for bad in [
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "garbage",
        ] {
            assert!(remote_context(None)(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_traceparent_sent_on_names_the_span_and_holds_the_ids_the_log_keeps() {
        let context = remote_context(None)("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").expect("valid");
        let written = traceparent_of(&context);
        assert_eq!(written, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        assert_eq!(&written[TRACE_ID], "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(&written[SPAN_ID], "b7ad6b7169203331");
        let unsampled = remote_context(None)("00-00f7651916cd43dd8448eb211c80319c-00ad6b7169203331-00").expect("valid");
        assert_eq!(traceparent_of(&unsampled), "00-00f7651916cd43dd8448eb211c80319c-00ad6b7169203331-00");
    }

    #[test]
    fn tracing_off_opens_no_span() {
        let opened = Opened {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            tracestate: None,
            route: Route::Http(Endpoint::Infer),
            model: "m",
            version: "",
            routed: crate::front::state::Routed::Default,
            request_id: "r",
            body_bytes: 0,
            started: Instant::now(),
        };
        let span = RequestSpan::open(None, opened);
        assert!(span.0.is_none());
        let (trace_id, parent, state) = span.upstream_context("client".into(), Some("tp"), Some("ts"));
        assert_eq!((trace_id.as_str(), parent.as_deref(), state.as_deref()), ("client", Some("tp"), Some("ts")));
        assert_eq!(span.span_id(), "");
    }
}
