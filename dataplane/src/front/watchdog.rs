//! Liveness of both halves (issue 30, boundary 6), each watched by the other.
//!
//! - **The runtime**: a task beats every `BEAT` on the front's runtime; Python's /healthz reads how
//!   long it has been silent (`HttpFront.runtime_silent_for`). Threads that stop turning (a blocked
//!   worker, a deadlock) stop the beat, and /healthz on the probe port fails naming the front.
//! - **The control plane**: Python touches the front at every tick (events drained, state
//!   published). When it has been silent longer than liveness.watchdog_stall_s, its loop no longer
//!   turns (or its tick died) and the state requests read is no longer kept true: the front answers
//!   /healthz and /readyz 503 itself instead of forwarding them to a loop that will not answer, so
//!   the kubelet takes the pod out of traffic and restarts it within its own bounds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::watch;

use crate::protocol::pytext::{format_g, json_string};

use super::reply::{Reply, JSON_REFUSAL};

/// How often the runtime beats: far below any sensible watchdog_stall_s, and 4 wake-ups a second
/// cost nothing measurable when idle.
pub const BEAT: Duration = Duration::from_millis(250);

/// Two moments, as milliseconds since the front started: when the runtime last beat, and when the
/// control plane last touched the front.
pub struct Watchdog {
    epoch: Instant,
    runtime_beat: AtomicU64,
    control_seen: AtomicU64,
}

impl Default for Watchdog {
    fn default() -> Self {
        Watchdog { epoch: Instant::now(), runtime_beat: AtomicU64::new(0), control_seen: AtomicU64::new(0) }
    }
}

impl Watchdog {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn silent_for(&self, stamp: &AtomicU64) -> Duration {
        Duration::from_millis(self.now_ms().saturating_sub(stamp.load(Ordering::Relaxed)))
    }

    pub fn control_seen(&self) {
        self.control_seen.store(self.now_ms(), Ordering::Relaxed);
    }

    pub fn control_silent_for(&self) -> Duration {
        self.silent_for(&self.control_seen)
    }

    pub fn runtime_silent_for(&self) -> Duration {
        self.silent_for(&self.runtime_beat)
    }

    /// Beat on the runtime until the front stops.
    /// Beat until `stop`; `chores` runs at each beat too (the front's housekeeping, so an idle
    /// front wakes for one timer only).
    pub async fn beat(&self, mut stop: watch::Receiver<bool>, mut chores: impl FnMut()) {
        let mut every = tokio::time::interval(BEAT);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {
                    self.runtime_beat.store(self.now_ms(), Ordering::Relaxed);
                    chores();
                }
                _ = stop.wait_for(|stopped| *stopped) => return,
            }
        }
    }

    /// The front's own answer to a kubelet endpoint while the control plane is silent past `bound`;
    /// None while it turns (the Python app answers, with every model's state).
    pub fn stalled_answer(&self, method: &str, path: &str, bound: Duration) -> Option<Reply> {
        let path = path.split('?').next().unwrap_or("");
        if !matches!(method, "GET" | "HEAD") || !matches!(path, "/healthz" | "/readyz") {
            return None;
        }
        let silent = self.control_silent_for();
        if silent <= bound {
            return None;
        }
        Some(stalled_reply(silent, bound))
    }
}

/// 503 in /healthz's shape (status, problems, models): the health loop's state is unknown, so no
/// model is listed.
fn stalled_reply(silent: Duration, bound: Duration) -> Reply {
    let problem = format!(
        "control plane stalled: the health loop has not turned for {} s (bound {} s, \
         liveness.watchdog_stall_s); model states are no longer kept true",
        silent.as_secs(),
        format_g(bound.as_secs_f64())
    );
    let mut body = String::from("{\"status\": \"fail\", \"problems\": [");
    json_string(&problem, &mut body);
    body.push_str("], \"models\": {}}");
    Reply {
        status: 503,
        content_type: JSON_REFUSAL.to_owned(),
        header_length: None,
        retry_after: None,
        body: Bytes::from(body),
        reason: "control_plane_stalled",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_kubelet_endpoints_are_answered_and_only_when_silent() {
        let dog = Watchdog::default();
        dog.control_seen();
        assert!(dog.stalled_answer("GET", "/healthz", Duration::from_secs(60)).is_none());
        let zero = Duration::ZERO;
        std::thread::sleep(Duration::from_millis(5));
        assert!(dog.stalled_answer("POST", "/healthz", zero).is_none());
        assert!(dog.stalled_answer("GET", "/v2/health/ready", zero).is_none());
        let reply = dog.stalled_answer("GET", "/readyz?verbose=1", zero).expect("answered");
        assert_eq!(reply.status, 503);
        let body = String::from_utf8_lossy(&reply.body).into_owned();
        assert!(body.starts_with("{\"status\": \"fail\", \"problems\": [\"control plane stalled"), "{body}");
        assert!(body.ends_with("\"models\": {}}"), "{body}");
    }
}
