//! The per-request families: what every proxied request adds to /metrics, whichever front served it.
//! Names and help texts are sidecar/metrics.py's; label orders are the ones listed here.

use std::sync::atomic::AtomicI64;

use super::family::{CounterFamily, GaugeFamily, HistogramFamily};
use super::stream::StreamMetrics;

pub struct RequestMetrics {
    /// triton_sidecar_proxy_requests_total{protocol, model, code}
    pub requests: CounterFamily,
    /// triton_sidecar_proxy_request_duration_seconds{protocol, model}
    pub duration: HistogramFamily,
    /// triton_sidecar_proxy_rejections_total{protocol, model, reason}
    pub rejections: CounterFamily,
    /// triton_sidecar_proxy_internal_errors_total{protocol, model}
    pub internal_errors: CounterFamily,
    /// triton_sidecar_outputs_filtered_total{model, output}
    pub outputs_filtered: CounterFamily,
    /// triton_sidecar_routed_total{model, version, reason}
    pub routed: CounterFamily,
    /// triton_sidecar_shadow_dropped_total{model}: shadow calls not made, proxy.max_shadow_in_flight
    /// running (either half's: the lane's, front/shadow.rs, and the Python chain's).
    pub shadow_dropped: CounterFamily,
    /// triton_sidecar_proxy_quarantined_total{model, outcome}: requests to a model whose answers were
    /// not trusted when they came (rejected, held_*, suspect_*, ended_at_triton), counted by the
    /// admission of whichever front took them (sidecar/serving/admission.py, front/admission.rs).
    pub quarantined: CounterFamily,
    /// triton_sidecar_proxy_in_flight{model}: requests at Triton (from their breaker slot to the answer).
    pub in_flight: GaugeFamily,
    /// triton_sidecar_proxy_queued{model}: requests waiting for a breaker slot
    /// (proxy.queue_size_per_model bounds them).
    pub queued: GaugeFamily,
    /// The connections of listen.port, whichever front holds them (sidecar/fronts/http_front.py's Rust
    /// one, or the Python listener): triton_sidecar_http_connections (a gauge)...
    pub connections_open: AtomicI64,
    /// ...triton_sidecar_http_connections_refused_total{}
    pub connections_refused: CounterFamily,
    /// ...triton_sidecar_http_connection_timeouts_total{phase}
    pub connection_timeouts: CounterFamily,
    /// ...triton_sidecar_http_lingering_ends_total{how}
    pub lingering_ends: CounterFamily,
    /// triton_sidecar_tls_handshake_failures_total{reason}: handshakes failed on listen.port
    /// (whichever front terminates TLS) and on listen.grpc_port (every one with the Rust gRPC front,
    /// the SAN refusals alone with grpcio's).
    pub tls_handshake_failures: CounterFamily,
    /// The generate streams' families (triton_sidecar_stream_*, streams_in_flight).
    pub streams: StreamMetrics,
    /// triton_sidecar_tracing_spans_exported_total{}: spans the collector took, from the front's
    /// exporter and from Python's (sidecar/tracing/otel.py), one family for both.
    pub tracing_spans_exported: CounterFamily,
    /// triton_sidecar_tracing_spans_dropped_total{reason}: queue_full, export_failed.
    pub tracing_spans_dropped: CounterFamily,
}

impl RequestMetrics {
    /// `latency_bounds`: LATENCY_BUCKETS (seconds); `event_count_bounds`: EVENT_COUNT_BUCKETS.
    pub fn new(latency_bounds: Vec<f64>, event_count_bounds: Vec<f64>) -> Self {
        RequestMetrics {
            requests: CounterFamily::default(),
            streams: StreamMetrics::new(latency_bounds.clone(), event_count_bounds),
            duration: HistogramFamily::new(latency_bounds),
            rejections: CounterFamily::default(),
            internal_errors: CounterFamily::default(),
            outputs_filtered: CounterFamily::default(),
            routed: CounterFamily::default(),
            shadow_dropped: CounterFamily::default(),
            quarantined: CounterFamily::default(),
            in_flight: GaugeFamily::default(),
            queued: GaugeFamily::default(),
            connections_open: AtomicI64::new(0),
            connections_refused: CounterFamily::default(),
            connection_timeouts: CounterFamily::default(),
            lingering_ends: CounterFamily::default(),
            tls_handshake_failures: CounterFamily::default(),
            tracing_spans_exported: CounterFamily::default(),
            tracing_spans_dropped: CounterFamily::default(),
        }
    }

    /// One request answered: counted by its code, its duration (seconds) observed.
    pub fn finish(&self, protocol: &str, model: &str, code: &str, seconds: f64) {
        self.requests.inc(&[protocol, model, code]);
        self.duration.observe(&[protocol, model], seconds);
    }
}
