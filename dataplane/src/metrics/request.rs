//! The per-request families: what every proxied request adds to /metrics, whichever front served it.
//! Names and help texts are sidecar/metrics.py's; label orders are the ones listed here.

use super::family::{CounterFamily, HistogramFamily};

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
}

impl RequestMetrics {
    pub fn new(latency_bounds: Vec<f64>) -> Self {
        RequestMetrics {
            requests: CounterFamily::default(),
            duration: HistogramFamily::new(latency_bounds),
            rejections: CounterFamily::default(),
            internal_errors: CounterFamily::default(),
            outputs_filtered: CounterFamily::default(),
            routed: CounterFamily::default(),
        }
    }

    /// One request answered: counted by its code, its duration (seconds) observed.
    pub fn finish(&self, protocol: &str, model: &str, code: &str, seconds: f64) {
        self.requests.inc(&[protocol, model, code]);
        self.duration.observe(&[protocol, model], seconds);
    }
}
