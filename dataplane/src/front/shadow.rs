//! A rollout model's answers on the lane: each served answer is evidence for the rollout's decisions
//! (Python's: `Rollout.answered`), and a share of them is sent again to the other version and the two
//! answers compared (sidecar/serving/core.py's `shadow`, sidecar/serving/shadow.py's cap).
//!
//! A shadow call starts once the client's answer is screened and never delays it: its own task,
//! no breaker slot, bounded by proxy.upstream_timeout_s (the upstream pool's bound). At most
//! proxy.max_shadow_in_flight run at once; one more is dropped and counted in shadow_dropped_total.
//! A shadow holds its place in that count until Python has *heard* its end (the event drained,
//! `HttpFront.drain_events`), not merely until the call ends: the health loop's count of shadows
//! (ShadowCalls.__len__) then never reads zero while a compared pair is still unheard.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::serving::rollouts::{compare_answers, decode_outputs, non_finite, Outputs, Route};

use super::events::{Event, ShadowOutcome};
use super::lane::{infer_headers, random_share, triton_path, Infer};
use super::state::Routed;
use super::upstream::Answer;
use super::Shared;

/// The served answer as Triton gave it, kept for the comparison (a handle on the body's bytes).
pub struct Served {
    status: u16,
    body: Bytes,
    header_length: Option<i64>,
}

impl Served {
    pub fn of(answer: &Answer) -> Served {
        Served { status: answer.status, body: answer.body.clone(), header_length: answer.header_length }
    }
}

/// The served answer's evidence up (`status` as the client gets it: 5xx is an error, as a NaN
/// withheld is), then its shadow when the rollout wants one.
pub fn after_answer(shared: &Arc<Shared>, request: &Infer, latency: Duration, status: u16, served: Served) {
    let error = status >= 500;
    answered(shared, request, latency, error);
    let Some(rollout) = &request.rollout else { return };
    if error {
        return;
    }
    let Some(target) = target(shared, request, rollout) else { return };
    if !room(shared, &request.model) {
        return;
    }
    let shadow = Shadow {
        model: request.model.clone(),
        served_version: request.version.clone(),
        target: target.to_owned(),
        stable_first: request.version == rollout.stable,
        rollout: rollout.clone(),
        check_non_finite: request.lane.check_non_finite,
        request_id: request.request_id.clone(),
        body: request.body.clone(),
        header_length: request.header_length,
        served,
    };
    // Its place is taken (room): the guard gives it back through Python whatever happens next.
    let end = ShadowEnd::new(shared.clone(), &shadow);
    tokio::spawn(shadow.run(end));
}

/// A served answer of a rollout model (Rollout.answered): its version, the upstream call's time,
/// and whether it was an error (5xx, a timeout, NaN withheld). Not urgent: Python hears it at its
/// next tick; time alone passes a step anyway.
pub fn answered(shared: &Shared, request: &Infer, latency: Duration, error: bool) {
    if request.rollout.is_none() {
        return;
    }
    shared.events.push(Event::RolloutAnswered {
        model: request.model.clone(),
        version: request.version.clone(),
        latency_s: latency.as_secs_f64(),
        error,
    });
}

/// The version this answer's shadow goes to (Router.shadow_target): the rollout's other version,
/// drawn at the published rate (0 unless progressing), never for a fallback's answer nor to a
/// version that is not trusted.
fn target<'a>(shared: &Shared, request: &Infer, rollout: &'a Route) -> Option<&'a str> {
    if request.routed == Routed::Fallback || rollout.shadow_rate <= 0.0 || random_share() >= rollout.shadow_rate {
        return None;
    }
    let other = rollout.other(&request.version);
    if other.is_empty() || !shared.state.load().trusts(&request.model, other) {
        return None;
    }
    Some(other)
}

/// Take a place among proxy.max_shadow_in_flight, or count the drop (ShadowCalls.has_room).
fn room(shared: &Shared, model: &str) -> bool {
    let limit = shared.settings.max_shadow_in_flight;
    let taken = shared.shadows.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1));
    if taken.is_err() {
        shared.metrics.shadow_dropped.inc(&[model]);
    }
    taken.is_ok()
}

struct Shadow {
    model: String,
    served_version: String,
    target: String,
    /// The served answer is stable's (the expected side of the comparison).
    stable_first: bool,
    rollout: Arc<Route>,
    check_non_finite: bool,
    request_id: String,
    body: Bytes,
    header_length: Option<i64>,
    served: Served,
}

impl Shadow {
    async fn run(self, mut end: ShadowEnd) {
        let shared = end.shared.clone();
        shared.metrics.routed.inc(&[&self.model, &self.target, "shadow"]);
        let path = triton_path(&self.model, &self.target, "infer");
        let header_length = self.header_length.map(|h| h.to_string());
        let headers = infer_headers(&self.request_id, header_length.as_deref());
        let started = Instant::now();
        let answer = shared.upstream.post(&path, &headers, self.body.clone()).await;
        end.latency = started.elapsed();
        end.outcome = match answer {
            Ok(answer) => self.compare(&answer),
            Err(_) => ShadowOutcome::Failed,
        };
    }

    /// The two answers compared (core._pair_differences): one refused and the other not is a
    /// difference; both refused (the client's request to fix) is nothing to compare.
    fn compare(&self, answer: &Answer) -> ShadowOutcome {
        let (Ok(mine), Ok(theirs)) = (
            outputs(self.served.status, &self.served.body, self.served.header_length),
            outputs(answer.status, &answer.body, answer.header_length),
        ) else {
            return ShadowOutcome::Failed; // a 200 that is not a v2 answer: nothing to judge by
        };
        if mine.is_none() && theirs.is_none() {
            return ShadowOutcome::Nothing;
        }
        let nan = self.check_non_finite && theirs.as_ref().is_some_and(non_finite);
        let differences = match (&mine, &theirs) {
            (Some(mine), Some(theirs)) => {
                let (stable, candidate) = if self.stable_first { (mine, theirs) } else { (theirs, mine) };
                compare_answers(stable, candidate, &self.rollout)
            }
            _ => {
                let refused = if mine.is_none() { &self.served_version } else { &self.target };
                vec![("(status)".to_owned(), format!("version {refused} refused a request the other version answered"))]
            }
        };
        ShadowOutcome::Compared { nan, differences }
    }
}

/// A 200 answer's outputs; None for any other status (a refusal).
fn outputs(status: u16, body: &[u8], header_length: Option<i64>) -> Result<Option<Outputs>, ()> {
    if status != 200 {
        return Ok(None);
    }
    decode_outputs(body, header_length).map(Some).map_err(|_| ())
}

/// A shadow's end, sent up when dropped: as the call set it, or `Failed` when its task ended
/// otherwise (a panic, the runtime shutting down), so its place among the shadows is always given
/// back when Python drains it.
struct ShadowEnd {
    shared: Arc<Shared>,
    model: String,
    target: String,
    latency: Duration,
    outcome: ShadowOutcome,
}

impl ShadowEnd {
    fn new(shared: Arc<Shared>, shadow: &Shadow) -> Self {
        ShadowEnd {
            shared,
            model: shadow.model.clone(),
            target: shadow.target.clone(),
            latency: Duration::ZERO,
            outcome: ShadowOutcome::Failed,
        }
    }
}

impl Drop for ShadowEnd {
    fn drop(&mut self) {
        self.shared.events.push(Event::ShadowEnded {
            model: std::mem::take(&mut self.model),
            target: std::mem::take(&mut self.target),
            latency_s: self.latency.as_secs_f64(),
            outcome: std::mem::replace(&mut self.outcome, ShadowOutcome::Failed),
        });
    }
}
