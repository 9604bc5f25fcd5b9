//! The generate-stream families: what every stream adds to /metrics, whichever front relayed it (the
//! Rust front's generate_stream, the Python chain's generate_stream and gRPC ModelStreamInfer).
//! Names and help texts are sidecar/metrics.py's; label orders are the ones listed here.

use super::family::{CounterFamily, GaugeFamily, HistogramFamily};

pub struct StreamMetrics {
    /// triton_sidecar_stream_first_event_seconds{model}: from the request to the first event sent.
    pub first_event: HistogramFamily,
    /// triton_sidecar_stream_inter_event_seconds{model}: between two writes of one stream.
    pub inter_event: HistogramFamily,
    /// triton_sidecar_stream_events{model}: events sent in one stream (EVENT_COUNT_BUCKETS).
    pub events: HistogramFamily,
    /// triton_sidecar_streams_in_flight{model}: streams holding a breaker slot now.
    pub in_flight: GaugeFamily,
    /// triton_sidecar_stream_endings_total{model, outcome}: complete, or the reason of the ending.
    pub endings: CounterFamily,
}

impl StreamMetrics {
    pub fn new(latency_bounds: Vec<f64>, event_count_bounds: Vec<f64>) -> Self {
        StreamMetrics {
            first_event: HistogramFamily::new(latency_bounds.clone()),
            inter_event: HistogramFamily::new(latency_bounds),
            events: HistogramFamily::new(event_count_bounds),
            in_flight: GaugeFamily::default(),
            endings: CounterFamily::default(),
        }
    }

    /// A stream that began ended after sending `events` events; `outcome` is "complete" or the
    /// reason label of what ended it.
    pub fn ended(&self, model: &str, events: u64, outcome: &str) {
        self.events.observe(&[model], events as f64);
        self.endings.inc(&[model, outcome]);
    }
}
