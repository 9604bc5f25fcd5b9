//! The state Python publishes for the front: which models the lane may serve, with what spec, output
//! filter and generate limits, and the answer owed to requests at Triton (and the event owed to
//! streams) when a model stops being trusted.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Semaphore;

use crate::serving::generation::GenerateLimits;
use crate::serving::validation::RequestSpec;

/// One model the lane serves on its own: trusted, not suspect, no rollout, rule file or drift
/// reference (those still go to the Python chain).
pub struct Lane {
    pub spec: RequestSpec,
    /// Declared outputs that never leave the pod; None when no filtering rule names the model. An
    /// output the answer holds that the model does not declare counts as hidden (the safe side).
    pub hidden: Option<HashSet<String>>,
    /// Look for NaN/Inf in float outputs (off when the model's golden files expect them).
    pub check_non_finite: bool,
    pub breaker: std::sync::Arc<Breaker>,
    /// What a generate body to the model may ask for (ServingCore.generate_limits).
    pub generate: GenerateLimits,
    /// generation.idle_timeout_s: the longest silence between two events of a stream once its
    /// first event came (before it, proxy.upstream_timeout_s).
    pub stream_idle: Duration,
    /// The loaded versions a request may pin (path `/versions/N`, header `x-model-version`) whose
    /// spec Python has fetched, each served as the model is, with its own spec and hidden outputs
    /// (the breaker and limits are the model's). A version not here goes to the Python chain,
    /// which fetches its spec or refuses it.
    pub versions: HashMap<String, std::sync::Arc<Lane>>,
}

impl Lane {
    pub fn is_hidden(&self, name: &str) -> bool {
        match &self.hidden {
            None => false,
            Some(hidden) => hidden.contains(name) || !self.spec.outputs.iter().any(|o| o == name),
        }
    }
}

/// The refusal a request at Triton ends with when its model is quarantined meanwhile.
pub struct Ended {
    pub status: u16,
    pub body: Bytes,
    pub retry_after: Option<u64>,
    /// Its reason label (quarantined, not_verified, unknown_model): how a stream it ends is counted.
    pub reason: String,
    /// The same refusal as a stream's last event (sidecar.serving.generation.error_event).
    pub event: Bytes,
    /// The versions whose requests at Triton it ends ("" = unversioned requests, which reach the
    /// version Triton picks); None = every version (the whole model is untrusted). A model
    /// quarantined for one version's failures keeps serving the others (ModelHealth.trusts).
    pub versions: Option<HashSet<String>>,
}

impl Ended {
    /// Does it end a unary request to `version` ("" = unversioned)? A stream ends on any entry, as
    /// the Python chain's stream ends as soon as its model stops serving (Admission.until_untrusted).
    pub fn ends(&self, version: &str) -> bool {
        self.versions.as_ref().is_none_or(|versions| versions.contains(version))
    }
}

/// An answer that depends only on the health loop's state (`/v2/health/live`, `/v2/health/ready`):
/// Python writes it (sidecar.fronts.http_routes' rule) and the front serves it as published.
pub struct Canned {
    pub status: u16,
    /// The refusal's JSON, empty for 200.
    pub body: Bytes,
    pub retry_after: Option<u64>,
    /// The refusal's reason label, "" for 200.
    pub reason: String,
}

#[derive(Default)]
pub struct Snapshot {
    pub lanes: HashMap<String, std::sync::Arc<Lane>>,
    pub ended: HashMap<String, std::sync::Arc<Ended>>,
    /// By path; a path not here (before Python's first publish) is forwarded to the Python app.
    pub health: HashMap<String, std::sync::Arc<Canned>>,
    /// What the v2 document routes need (front/documents.rs); None before Python's first publish
    /// of it: those that need it are forwarded.
    pub documents: Option<std::sync::Arc<super::documents::Documents>>,
}

/// The per-model breaker (as sidecar/serving/breaker.py): `capacity` requests at Triton, `queue`
/// waiting behind them, more refused at once. Kept across snapshots (its counts are live).
pub struct Breaker {
    pub slots: Semaphore,
    pub waiting: AtomicUsize,
}

impl Breaker {
    pub fn new(capacity: usize) -> Self {
        Breaker { slots: Semaphore::new(capacity), waiting: AtomicUsize::new(0) }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(versions: Option<&[&str]>) -> Ended {
        Ended {
            status: 503,
            body: Bytes::new(),
            retry_after: Some(5),
            reason: "quarantined".to_owned(),
            event: Bytes::new(),
            versions: versions.map(|v| v.iter().map(|s| s.to_string()).collect()),
        }
    }

    #[test]
    fn a_whole_model_quarantine_ends_every_version_and_a_version_s_only_its_own() {
        let whole = ended(None);
        assert!(whole.ends("") && whole.ends("1") && whole.ends("2"));
        // Version 2 broken, and Triton's choice for unversioned requests: those end, 1 goes on.
        let two = ended(Some(&["2", ""]));
        assert!(two.ends("2") && two.ends(""));
        assert!(!two.ends("1"));
        // Version 1 broken while unversioned requests reach 2: only pins to 1 end.
        let one = ended(Some(&["1"]));
        assert!(one.ends("1"));
        assert!(!one.ends("") && !one.ends("2"));
    }
}
