//! The front's bounds, as Python's validated configuration gives them (`listen.*`, `proxy.*`,
//! `validation.max_body_bytes`, `logging.access_log_sample_rate`): read once at start.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Settings {
    pub header_timeout: Duration,
    pub keepalive_timeout: Duration,
    pub max_url_bytes: usize,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_connections: usize,
    pub lingering_time: Duration,
    pub lingering_timeout: Duration,
    pub lingering_max_bytes: u64,
    pub max_body_bytes: usize,
    pub client_body_timeout: Duration,
    pub upstream_timeout: Duration,
    /// triton.timeout_s: the bound of a GET of one of Triton's documents (metadata, config, stats).
    pub triton_timeout: Duration,
    pub retry_after_s: u64,
    pub max_in_flight_per_model: usize,
    pub queue_size_per_model: usize,
    pub block_non_finite_outputs: bool,
    /// proxy.hold_during_heal_s: how long a request to a model that does not serve traffic waits for
    /// it to serve again before it is refused (zero: refused at once).
    pub hold_during_heal: Duration,
    /// proxy.hold_while_suspect_ms: how long a request that comes while a failed golden round is
    /// being confirmed waits for the verdict (zero: served at once, as a trusted model's).
    pub hold_while_suspect: Duration,
    pub access_log_sample_rate: f64,
    /// proxy.max_shadow_in_flight: a rollout's shadow calls at once (front/shadow.rs).
    pub max_shadow_in_flight: usize,
    /// liveness.watchdog_stall_s: the control plane silent for longer than this fails /healthz and
    /// /readyz on the front itself (`watchdog`).
    pub watchdog_stall: Duration,
}

impl Settings {
    /// Bytes of a request line and headers the front buffers before refusing them: the two limits
    /// plus room for the method, the version and the separators.
    pub fn head_limit(&self) -> usize {
        self.max_url_bytes + self.max_header_bytes + 4096
    }
}
