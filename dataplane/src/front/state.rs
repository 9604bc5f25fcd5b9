//! The state Python publishes for the front: which models the lane may serve, with what spec, output
//! filter and generate limits, and the answer owed to requests at Triton (and the event owed to
//! streams) when a model stops being trusted.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Semaphore;

use crate::serving::generation::GenerateLimits;
use crate::serving::rollouts::{cohort_bucket, Route};
use crate::serving::validation::RequestSpec;

/// Why a request goes to the version it does (sidecar.serving.routing's reasons): the
/// `routed_total{reason}` label and the span's `sidecar.routing.reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routed {
    /// Unpinned, no rollout, Triton's choice trusted: sent unversioned (not counted).
    Default,
    /// The client named the version (path, `x-model-version`, gRPC `model_version`).
    Pinned,
    /// A rollout's step sent it to stable or the candidate.
    Split,
    /// The version it would reach is not trusted: another the golden cases vouch for.
    Fallback,
}

impl Routed {
    pub fn label(self) -> &'static str {
        match self {
            Routed::Default => "default",
            Routed::Pinned => "pinned",
            Routed::Split => "split",
            Routed::Fallback => "fallback",
        }
    }
}

/// One model the lane serves on its own: its spec fetched (a model in a rollout too: its route is
/// the snapshot's `rollouts`). Whether a request to it is served now, held or refused is
/// its `Guard`'s and `Ended`'s (front/admission.rs).
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
    /// Published again from the model's last spec while it is fetched anew (a heal or a reload
    /// dropped it): admission reads it, and a request it lets through waits for the lane with the
    /// new spec (front/admission.rs `fresh_lane`), as the Python chain's waits for the fetch.
    pub stale: bool,
}

impl Lane {
    /// A lane of model `m` for the unit tests: `inputs` and `outputs` declared (FP32 inputs of
    /// shape [1]), nothing hidden, NaN screened, a breaker of one slot, no generate limits.
    #[cfg(test)]
    pub fn for_tests(inputs: &[&str], outputs: &[&str]) -> Lane {
        use crate::serving::generation::GenerateLimits;
        use crate::serving::validation::{InputSpec, Limits};
        let input = |name: &&str| InputSpec {
            name: name.to_string(),
            datatype: "FP32".into(),
            shape: vec![1],
            optional: false,
        };
        Lane {
            spec: RequestSpec {
                model: "m".into(),
                inputs: inputs.iter().map(input).collect(),
                outputs: outputs.iter().map(|o| o.to_string()).collect(),
                hidden_outputs: HashSet::new(),
                max_batch_size: 0,
                limits: Limits { max_elements: 1 << 20, max_bytes_element: 1 << 20, reject_non_finite: true },
                rules: None,
            },
            hidden: None,
            check_non_finite: true,
            breaker: std::sync::Arc::new(Breaker::new(1)),
            generate: GenerateLimits {
                max_text_bytes: 0,
                max_tokens: 0,
                token_limit_keys: HashSet::new(),
                parameters: HashSet::new(),
            },
            stream_idle: Duration::from_secs(1),
            versions: HashMap::new(),
            stale: false,
        }
    }

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

/// What admission needs of a guarded model besides `Ended` (sidecar.states.ModelHealth as the
/// Python chain reads it): published for every model the sidecar guards, lane or not.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Guard {
    /// A failed golden round is being confirmed (ModelHealth.suspect): with
    /// proxy.hold_while_suspect_ms a request waits for the verdict.
    pub suspect: bool,
    /// A request refused now may be held for the heal (proxy.hold_during_heal_s): the model is not
    /// FAILED (a failed model waits for a restart, not a heal).
    pub may_hold: bool,
    /// The trusted version an unpinned request goes to while Triton's choice is not trusted
    /// (sidecar.serving.routing.fallback_version, decided by Python), "" for none.
    pub fallback: String,
}

#[derive(Default)]
pub struct Snapshot {
    pub lanes: HashMap<String, std::sync::Arc<Lane>>,
    /// Every model the sidecar guards now; a model not here was released (or never guarded).
    pub guards: HashMap<String, Guard>,
    pub ended: HashMap<String, std::sync::Arc<Ended>>,
    /// By path; a path not here (before Python's first publish) is forwarded to the Python app.
    pub health: HashMap<String, std::sync::Arc<Canned>>,
    /// grpc.health.v1's answer for each service it knows: "" (the pod's readiness) and every guarded
    /// model's name, true for SERVING (sidecar.fronts.http_routes.serving_status, the rule grpcio's
    /// HealthService answers by). None before Python's first publish: the calls go to the Python
    /// gRPC server.
    pub serving: Option<HashMap<String, bool>>,
    /// What the v2 document routes need (front/documents.rs); None before Python's first publish
    /// of it: those that need it are forwarded.
    pub documents: Option<std::sync::Arc<super::documents::Documents>>,
    /// The models in a version rollout, as they route now (HTTP infer routes by it; a rollout
    /// model's generate and gRPC ModelInfer are still the Python chain's).
    pub rollouts: HashMap<String, std::sync::Arc<Route>>,
}

impl Snapshot {
    /// Does the model serve traffic (HEALTHY or DEGRADED: every version trusted)?
    pub fn serves(&self, model: &str) -> bool {
        self.guards.contains_key(model) && !self.ended.contains_key(model)
    }

    /// Are answers from `version` of the model ("" = the one unversioned requests reach) trusted
    /// (ModelHealth.trusts, as Python published it in `Ended::versions`)?
    pub fn trusts(&self, model: &str, version: &str) -> bool {
        self.guards.contains_key(model) && self.ended.get(model).is_none_or(|ended| !ended.ends(version))
    }

    pub fn suspect(&self, model: &str) -> bool {
        self.guards.get(model).is_some_and(|guard| guard.suspect)
    }

    /// The version a unary request to the model goes to, and why (routing.Router.route): the
    /// client's pin; else, in a rollout, stable or the candidate by the cohort's bucket (`cohort`:
    /// the value of the rollout's cohort_key header, "" for a uniform draw) and the step's share;
    /// else Triton's choice (""); either of the last two replaced by the fallback Python chose
    /// while the version it reaches is not trusted.
    pub fn route<'a>(&'a self, model: &str, pinned: &'a str, cohort: &str) -> (&'a str, Routed) {
        if !pinned.is_empty() {
            return (pinned, Routed::Pinned);
        }
        if let Some(rollout) = self.rollouts.get(model) {
            let bucket = if cohort.is_empty() { super::lane::random_share() } else { cohort_bucket(model, cohort) };
            let version = rollout.pick(bucket);
            let fallback = rollout.fallback(version);
            if !fallback.is_empty() && !self.trusts(model, version) {
                return (fallback, Routed::Fallback);
            }
            return (version, Routed::Split);
        }
        match self.guards.get(model) {
            Some(guard) if !guard.fallback.is_empty() => (guard.fallback.as_str(), Routed::Fallback),
            _ => ("", Routed::Default),
        }
    }

    /// The header whose value picks a rollout model's version ("" for none).
    pub fn cohort_key(&self, model: &str) -> &str {
        self.rollouts.get(model).map(|r| r.cohort_key.as_str()).unwrap_or("")
    }

    /// Trusted or untrusted as a whole (not quarantined for some versions alone): a stream the
    /// front admits. A stream ends when its model stops serving, so one to a version a partial
    /// quarantine spares stays the Python chain's, which watches that version's trust instead.
    pub fn whole(&self, model: &str) -> bool {
        self.guards.contains_key(model) && self.ended.get(model).is_none_or(|ended| ended.versions.is_none())
    }
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

    #[test]
    fn a_model_serves_while_nothing_ended_and_trusts_the_versions_its_quarantine_spares() {
        let mut snapshot = Snapshot::default();
        assert!(!snapshot.serves("m") && !snapshot.trusts("m", ""), "not guarded: neither");
        snapshot.guards.insert("m".into(), Guard::default());
        assert!(snapshot.serves("m") && snapshot.trusts("m", "2") && !snapshot.suspect("m"));
        snapshot.ended.insert("m".into(), std::sync::Arc::new(ended(Some(&["2", ""]))));
        assert!(!snapshot.serves("m"));
        assert!(snapshot.trusts("m", "1") && !snapshot.trusts("m", "2") && !snapshot.trusts("m", ""));
        snapshot.ended.clear();
        snapshot.guards.insert("m".into(), Guard { suspect: true, ..Guard::default() });
        assert!(snapshot.serves("m") && snapshot.suspect("m"), "suspect: still serving, through admission");
    }

    #[test]
    fn an_unpinned_request_goes_to_the_fallback_and_a_pin_stays_the_client_s() {
        let mut snapshot = Snapshot::default();
        assert_eq!(snapshot.route("m", "", ""), ("", Routed::Default), "not guarded: Triton's choice");
        snapshot.guards.insert("m".into(), Guard::default());
        assert_eq!(snapshot.route("m", "2", ""), ("2", Routed::Pinned));
        snapshot.guards.insert("m".into(), Guard { fallback: "1".into(), ..Guard::default() });
        assert_eq!(snapshot.route("m", "", ""), ("1", Routed::Fallback));
        assert_eq!(snapshot.route("m", "2", ""), ("2", Routed::Pinned), "a pin is never rerouted");
    }

    #[test]
    fn a_rollout_splits_by_the_cohort_s_bucket_and_falls_back_from_an_untrusted_pick() {
        use crate::serving::rollouts::Tolerance;
        let mut snapshot = Snapshot::default();
        snapshot.guards.insert("m".into(), Guard::default());
        let mut route = Route {
            stable: "1".into(),
            candidate: "2".into(),
            share: 0.5,
            cohort_key: "x-user".into(),
            shadow_rate: 0.0,
            fallbacks: HashMap::from([("2".to_owned(), "1".to_owned())]),
            tolerance: Tolerance { atol: 0.0, rtol: 0.0 },
            tolerances: HashMap::new(),
        };
        snapshot.rollouts.insert("m".into(), std::sync::Arc::new(route.clone()));
        // cohort_bucket("m", "user-1") is 0.337: below the share, the candidate; every time.
        for _ in 0..3 {
            assert_eq!(snapshot.route("m", "", "user-1"), ("2", Routed::Split));
        }
        assert_eq!(snapshot.route("m", "1", "user-1"), ("1", Routed::Pinned));
        route.share = 0.0;
        snapshot.rollouts.insert("m".into(), std::sync::Arc::new(route));
        assert_eq!(snapshot.route("m", "", ""), ("1", Routed::Split), "aborted or gating: stable");
        assert_eq!(snapshot.cohort_key("m"), "x-user");
        // The candidate quarantined alone: its pick goes to its fallback.
        snapshot.ended.insert("m".into(), std::sync::Arc::new(ended(Some(&["2"]))));
        let mut half = (*snapshot.rollouts["m"]).clone();
        half.share = 1.0;
        snapshot.rollouts.insert("m".into(), std::sync::Arc::new(half));
        assert_eq!(snapshot.route("m", "", "user-1"), ("1", Routed::Fallback));
    }
}
