//! Admission on the front: whether a lane request is served now, held, or refused, decided from the
//! state Python published, as sidecar/serving/admission.py's `Admission.admit` decides it (the
//! Python chain keeps that one for what still reaches it: grpcio's calls, handed-over requests).
//!
//! A request to a version the model trusts goes on at once, unless the model is suspect (a failed
//! golden round is being confirmed) and proxy.hold_while_suspect_ms is set: then it waits for the
//! verdict, up to that bound. A request to a version not trusted is held, with
//! proxy.hold_during_heal_s and a model that is not FAILED, until the model serves traffic again
//! or the hold ends; otherwise it is refused at once with the refusal Python published for it.
//!
//! A held request waits on `Shared::published` (bumped at every publish: Python publishes at once on
//! a transition, a suspect change and a release) and reads the snapshot again after each; it holds
//! no lock and costs nothing while it waits. Its task is aborted when its client leaves (the
//! connection watches it), which drops its place in the holding count with it.

use std::sync::Arc;

use super::reply::{refusal, Reply, JSON_REFUSAL};
use super::state::{Lane, Snapshot};
use super::Shared;

/// How a request was let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// Without a heal in between: the lane it was read with still holds.
    Served,
    /// Held until the model served again: its spec was dropped on the way (a heal reloads the
    /// model: SpecCache forgets it), so the request waits for the one fetched anew (`fresh_lane`).
    AfterHold,
}

/// Is a request to `version` of `model` served without waiting (the version trusted, no verdict to
/// wait for)? `admit` returns Ok at once for these.
pub fn at_once(shared: &Shared, model: &str, version: &str) -> bool {
    let now = shared.state.load();
    now.trusts(model, version) && (shared.settings.hold_while_suspect.is_zero() || !now.suspect(model))
}

/// Serve the request to `version` of `model` ("" = unversioned: Triton's choice) once this returns
/// Ok; Err is the refusal it gets (counted in proxy_quarantined_total, as the Python chain counts
/// it; the caller counts the rejection).
pub async fn admit(shared: &Shared, model: &str, version: &str) -> Result<Admitted, Reply> {
    let mut now = shared.state.load();
    if now.trusts(model, version) {
        if shared.settings.hold_while_suspect.is_zero() || !now.suspect(model) {
            return Ok(Admitted::Served);
        }
        if verdict_came(shared, model, version).await {
            return Ok(Admitted::Served);
        }
        now = shared.state.load();
    }
    let hold = shared.settings.hold_during_heal;
    if hold.is_zero() || !now.guards.get(model).is_some_and(|guard| guard.may_hold) {
        shared.metrics.quarantined.inc(&[model, "rejected"]);
        return Err(quarantine_refusal(&now, model));
    }
    let waited = {
        let _held = Held::new(shared, model);
        tokio::time::timeout(hold, until(shared, |now| now.serves(model) || !now.guards.contains_key(model))).await
    };
    let now = shared.state.load();
    if waited.is_err() {
        shared.metrics.quarantined.inc(&[model, "held_timeout"]);
        return Err(quarantine_refusal(&now, model));
    }
    if !now.guards.contains_key(model) {
        return Err(released(model)); // released while held: 404, no series revived
    }
    shared.metrics.quarantined.inc(&[model, "held_released"]);
    Ok(Admitted::AfterHold)
}

/// The model's lane (or `version`'s) as published once it serves again with its spec fetched anew
/// after a hold (the Python chain's request fetches it then too: ServingCore.admitted_spec), within
/// proxy.upstream_timeout_s; None keeps the lane the request was read with (the fetch failed or is
/// slow, or the version's spec is not fetched again until a request pins it through Python).
/// While a model's spec is fetched anew, Python publishes its last lane marked stale.
pub async fn fresh_lane(shared: &Shared, model: &str, version: &str) -> Option<Arc<Lane>> {
    let bound = shared.settings.upstream_timeout;
    let ready = |now: &Snapshot| now.serves(model) && now.lanes.get(model).is_some_and(|lane| !lane.stale);
    tokio::time::timeout(bound, until(shared, ready)).await.ok()?;
    let now = shared.state.load();
    let lane = now.lanes.get(model)?;
    if version.is_empty() {
        Some(lane.clone())
    } else {
        lane.versions.get(version).cloned()
    }
}

/// Hold a request while the model's failed round is confirmed (Admission._verdict_came): true to
/// serve it (the model passed, or the hold ended with the model still trusted), false when it was
/// quarantined meanwhile.
async fn verdict_came(shared: &Shared, model: &str, version: &str) -> bool {
    let bound = shared.settings.hold_while_suspect;
    let decided = tokio::time::timeout(bound, until(shared, |now| !now.suspect(model))).await.is_ok();
    let outcome = if !shared.state.load().trusts(model, version) {
        "suspect_refused"
    } else if decided {
        "suspect_released"
    } else {
        "suspect_timeout"
    };
    shared.metrics.quarantined.inc(&[model, outcome]);
    outcome != "suspect_refused"
}

/// Return once `ready` holds for the snapshot in force: looked at now, then after each publish.
async fn until(shared: &Shared, ready: impl Fn(&Snapshot) -> bool) {
    // Subscribed before the first look, so a publish between the look and the wait is not missed.
    let mut published = shared.published.subscribe();
    while !ready(&shared.state.load()) {
        if published.changed().await.is_err() {
            // The front is going away (its Shared dropped): nothing will be published again; the
            // caller's bound ends the wait.
            std::future::pending::<()>().await;
        }
    }
}

/// Why the model's answers are not trusted now, as Python published it (Admission.quarantine_refusal);
/// for a model no longer guarded, the 404 a new request gets. (A model that serves again in the
/// instant between a held request's bound and this look has no refusal published: it gets that
/// 404 where the Python chain would answer 503 naming its state, a race of one publish.)
fn quarantine_refusal(now: &Snapshot, model: &str) -> Reply {
    let Some(ended) = now.ended.get(model) else {
        return released(model);
    };
    let reason = match ended.reason.as_str() {
        "not_verified" => "not_verified",
        "unknown_model" => "unknown_model",
        _ => "quarantined",
    };
    Reply {
        status: ended.status,
        content_type: JSON_REFUSAL.to_owned(),
        header_length: None,
        retry_after: ended.retry_after,
        body: ended.body.clone(),
        reason,
    }
}

fn released(model: &str) -> Reply {
    refusal("unknown_model", 404, &released_message(model), model, &[])
}

/// What a request or a stream to a model the sidecar stopped guarding is told
/// (Admission.quarantine_refusal's words).
pub fn released_message(model: &str) -> String {
    format!("model {model} is no longer guarded by the sidecar (released)")
}

/// A request held for a heal, in the front's holding count (what `Admission.holding` adds up)
/// however its wait ends: served, refused, or its task aborted because the client left.
struct Held<'a> {
    shared: &'a Shared,
    model: &'a str,
}

impl<'a> Held<'a> {
    fn new(shared: &'a Shared, model: &'a str) -> Self {
        shared.holding.add(&[model], 1);
        Held { shared, model }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.shared.holding.add(&[self.model], -1);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;
    use crate::front::state::{Ended, Guard};

    fn shared(hold_during_heal: Duration, hold_while_suspect: Duration) -> Arc<Shared> {
        crate::front::shared_for_tests(hold_during_heal, hold_while_suspect)
    }

    /// A lane of `m` whose spec names its one input `input`; `stale` as published.
    fn lane(input: &str, stale: bool) -> Arc<Lane> {
        Arc::new(Lane { stale, ..Lane::for_tests(&[input], &[]) })
    }

    #[tokio::test]
    async fn a_request_read_with_a_stale_lane_goes_on_with_the_one_published_with_the_new_spec() {
        let shared = shared(Duration::ZERO, Duration::ZERO);
        let mut snapshot = Snapshot::default();
        snapshot.guards.insert("m".into(), Guard::default());
        snapshot.lanes.insert("m".into(), lane("old", true));
        shared.publish(snapshot);
        let waiting = tokio::spawn({
            let shared = shared.clone();
            async move { fresh_lane(&shared, "m", "").await.map(|lane| lane.spec.inputs[0].name.clone()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "a stale lane is not the fresh one");
        let mut snapshot = Snapshot::default();
        snapshot.guards.insert("m".into(), Guard::default());
        snapshot.lanes.insert("m".into(), lane("new", false));
        shared.publish(snapshot);
        assert_eq!(waiting.await.expect("no panic").as_deref(), Some("new"));
    }

    /// `m` guarded; `quarantined`: its whole-model refusal published; `suspect` as given.
    fn publish(shared: &Shared, guarded: bool, quarantined: bool, suspect: bool) {
        let mut snapshot = Snapshot::default();
        if guarded {
            snapshot.guards.insert("m".into(), Guard { suspect, may_hold: true, fallback: String::new() });
        }
        if quarantined {
            let ended = Ended {
                status: 503,
                body: Bytes::from_static(b"{\"error\": \"model m is UNHEALTHY\", \"reason\": \"quarantined\"}"),
                retry_after: Some(5),
                reason: "quarantined".into(),
                event: Bytes::new(),
                versions: None,
            };
            snapshot.ended.insert("m".into(), Arc::new(ended));
        }
        snapshot.lanes = HashMap::new();
        shared.publish(snapshot);
    }

    fn count(shared: &Shared, outcome: &str) -> u64 {
        shared.metrics.quarantined.value(&["m", outcome]).unwrap_or(0)
    }

    fn holding(shared: &Shared) -> i64 {
        shared.holding.samples().into_iter().map(|(_, n)| n).sum()
    }

    #[tokio::test]
    async fn without_a_hold_a_quarantined_model_s_request_is_refused_at_once_with_python_s_refusal() {
        let shared = shared(Duration::ZERO, Duration::ZERO);
        publish(&shared, true, true, false);
        let refused = admit(&shared, "m", "").await.expect_err("quarantined");
        assert_eq!((refused.status, refused.retry_after, refused.reason), (503, Some(5), "quarantined"));
        assert!(refused.body.starts_with(b"{\"error\": \"model m is UNHEALTHY\""));
        assert_eq!(count(&shared, "rejected"), 1);
    }

    #[tokio::test]
    async fn a_held_request_goes_on_at_the_publish_that_makes_its_model_serve() {
        let shared = shared(Duration::from_secs(5), Duration::ZERO);
        publish(&shared, true, true, false);
        let held = tokio::spawn({
            let shared = shared.clone();
            async move { admit(&shared, "m", "").await.map_err(|r| r.status) }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while holding(&shared) != 1 {
            assert!(tokio::time::Instant::now() < deadline, "the request was never held");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let healed = std::time::Instant::now();
        publish(&shared, true, false, false);
        assert_eq!(held.await.expect("no panic"), Ok(Admitted::AfterHold));
        assert!(healed.elapsed() < Duration::from_secs(1), "released {:?} after the heal", healed.elapsed());
        assert_eq!((count(&shared, "held_released"), holding(&shared)), (1, 0));
    }

    #[tokio::test]
    async fn a_hold_ends_with_the_refusal_when_its_bound_passes_and_with_404_when_the_model_is_released() {
        let shared = shared(Duration::from_millis(30), Duration::ZERO);
        publish(&shared, true, true, false);
        let refused = admit(&shared, "m", "").await.expect_err("still quarantined");
        assert_eq!((refused.status, count(&shared, "held_timeout"), holding(&shared)), (503, 1, 0));

        let shared = self::shared(Duration::from_secs(5), Duration::ZERO);
        publish(&shared, true, true, false);
        let held = tokio::spawn({
            let shared = shared.clone();
            async move { admit(&shared, "m", "").await.map_err(|r| (r.status, r.reason)) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        publish(&shared, false, false, false);
        assert_eq!(held.await.expect("no panic"), Err((404, "unknown_model")));
        assert_eq!((count(&shared, "held_released"), count(&shared, "held_timeout")), (0, 0));
    }

    #[tokio::test]
    async fn a_request_to_a_suspect_model_waits_for_the_verdict_and_is_served_or_refused_by_it() {
        let shared = shared(Duration::ZERO, Duration::from_secs(5));
        publish(&shared, true, false, true);
        assert!(!at_once(&shared, "m", ""));
        let waiting = tokio::spawn({
            let shared = shared.clone();
            async move { admit(&shared, "m", "").await.map_err(|r| r.status) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        publish(&shared, true, false, false); // the confirmation passed
        assert_eq!(waiting.await.expect("no panic"), Ok(Admitted::Served));
        assert_eq!(count(&shared, "suspect_released"), 1);

        publish(&shared, true, false, true);
        let waiting = tokio::spawn({
            let shared = shared.clone();
            async move { admit(&shared, "m", "").await.map_err(|r| r.status) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        publish(&shared, true, true, false); // quarantined by the confirmation
        assert_eq!(waiting.await.expect("no panic"), Err(503));
        // As the Python chain counts it: refused by the verdict, then rejected (no heal hold).
        assert_eq!((count(&shared, "suspect_refused"), count(&shared, "rejected")), (1, 1));
    }
}
