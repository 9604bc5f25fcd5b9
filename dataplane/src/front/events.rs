//! What the health loop must hear from the front, queued in order and drained by Python in batches
//! (sidecar/fronts/http_front.py): passive signals, the sampled access log, panics.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use crate::front::grpc::repository::Outcome;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A repository call Python asked for (`HttpFront.repository_call`, numbered `call`) has ended.
    Repository {
        call: u64,
        outcome: Outcome,
    },
    /// `count` answers in a row from the model that were usable (a passive signal's reset).
    Answered {
        model: String,
        count: u64,
    },
    /// A call to Triton that gave no usable answer: kind is timeout, unreachable, dropped,
    /// server_error or bad_answer; `status` Triton's HTTP status (0 when none), `detail` its words.
    /// Two kinds say Triton's own error inside an answer of 200: error_answer (a generate answer
    /// `{"error": ...}`) and error_event (an error event of a stream, which may be a dead stub's).
    /// A stream's silence is a timeout whose detail is the whole message.
    Failed {
        model: String,
        kind: &'static str,
        status: u16,
        detail: String,
    },
    NonFinite {
        model: String,
        outputs: Vec<String>,
    },
    /// Requests at Triton ended because their model was quarantined while they waited.
    Ended {
        model: String,
        count: u64,
    },
    Log(AccessRecord),
    /// A gRPC call the front answered: its access-log line, `status` 0 and the gRPC code's name.
    GrpcLog {
        record: AccessRecord,
        code: &'static str,
    },
    /// A request whose handling panicked (answered 500 internal_error): the message, for the log.
    Panic {
        model: String,
        message: String,
    },
    /// A gRPC call whose handling panicked (answered INTERNAL internal_error): for the log.
    GrpcPanic {
        model: String,
        request_id: String,
        message: String,
    },
    /// A verified client certificate refused in the handshake (tls.client_allowed_sans), for the
    /// log's tls_client_refused (the counter is counted where the handshake fails).
    TlsRefused {
        reason: &'static str,
        client_subject: String,
        /// The port's protocol: "http" (listen.port) or "grpc" (listen.grpc_port).
        protocol: &'static str,
    },
    /// A live recording of the model's answers has its rows (record-reference --live waits for it).
    Recorded {
        model: String,
    },
    /// A rollout model's answer served by the lane (Rollout.answered): the version that answered, the
    /// upstream call's time, and whether it was an error (5xx, timeout, NaN withheld).
    RolloutAnswered {
        model: String,
        version: String,
        latency_s: f64,
        error: bool,
    },
    /// A shadow call of a rollout model ended (front/shadow.rs): the version it went to, its time,
    /// and what it found. Draining it gives back its place among proxy.max_shadow_in_flight.
    ShadowEnded {
        model: String,
        target: String,
        latency_s: f64,
        outcome: ShadowOutcome,
    },
    /// A generate stream that began and was ended by the sidecar (its error event sent): the
    /// reason label, the events sent before it, and why (streaming.py's stream_ended log line).
    StreamEnded {
        model: String,
        reason: String,
        events: u64,
        cause: String,
    },
}

/// What a shadow call found (core.ServingCore.shadow's cases).
#[derive(Debug, Clone, PartialEq)]
pub enum ShadowOutcome {
    /// No answer (a timeout, Triton unreachable, a broken answer): the shadow version's error.
    Failed,
    /// Both versions refused the request (the client's to fix): nothing to compare.
    Nothing,
    /// Compared: NaN/Inf in the shadow's answer, and every difference as (output, message).
    Compared { nan: bool, differences: Vec<(String, String)> },
}

/// One access-log line (every failure, a sample of the rest), with sidecar.serving.telemetry's fields.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessRecord {
    pub request_id: String,
    pub trace_id: String,
    /// The front's span when the request was traced (front/tracing.rs), "" when not.
    pub span_id: String,
    pub model: String,
    /// As the client sent it ("" when the refusal came before a request line could be read).
    pub method: String,
    pub path: String,
    pub status: u16,
    pub duration_ms: f64,
    pub reason: String,
    /// The client certificate's RFC 4514 subject (mutual TLS), "" without one.
    pub client_subject: Arc<str>,
}

#[derive(Default)]
pub struct Events {
    queue: Mutex<Vec<Event>>,
    /// The front's end of a socket pair whose other end Python's event loop watches: one byte wakes
    /// it at once for an event the health loop must not wait for (a failure, NaN/Inf, a panic).
    /// Usable answers wait for Python's next tick, so traffic alone never wakes Python.
    wake: Option<UnixStream>,
}

/// Events kept while Python does not drain (a wedged loop): past this the oldest are dropped, the
/// health loop's own probes still see the model.
const MAX_QUEUED: usize = 65536;

impl Events {
    /// Events whose other end is `wake` (non-blocking).
    pub fn waking(wake: UnixStream) -> Self {
        Events { queue: Mutex::new(Vec::new()), wake: Some(wake) }
    }

    pub fn push(&self, event: Event) {
        let urgent = match &event {
            Event::Failed { .. }
            | Event::NonFinite { .. }
            | Event::Panic { .. }
            | Event::GrpcPanic { .. }
            | Event::StreamEnded { .. }
            | Event::Recorded { .. }
            | Event::ShadowEnded { .. }
            | Event::Repository { .. } => true,
            // An access-log line (every failure, a sample of the rest: Python writes each one anyway)
            // is written as the request ends, not a tick later.
            Event::Log(_) | Event::GrpcLog { .. } => true,
            _ => false,
        };
        self.queue_event(event);
        if urgent {
            if let Some(mut wake) = self.wake.as_ref() {
                // A full socket already holds a wake-up Python has not read: nothing is lost.
                let _ = wake.write(b"!");
            }
        }
    }

    fn queue_event(&self, event: Event) {
        let Ok(mut queue) = self.queue.lock() else { return };
        if let (Event::Answered { model, count }, Some(Event::Answered { model: last, count: n })) =
            (&event, queue.last_mut())
        {
            if last == model {
                *n += count;
                return;
            }
        }
        if queue.len() >= MAX_QUEUED {
            // The oldest event goes, but never a repository call's end (a heal waits for it) nor a
            // shadow's (its place among the shadows is given back when it is drained).
            let kept = |e: &Event| matches!(e, Event::Repository { .. } | Event::ShadowEnded { .. });
            if let Some(oldest) = queue.iter().position(|e| !kept(e)) {
                queue.remove(oldest);
            }
        }
        queue.push(event);
    }

    pub fn drain(&self) -> Vec<Event> {
        match self.queue.lock() {
            Ok(mut queue) => std::mem::take(&mut *queue),
            Err(_) => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_in_a_row_from_one_model_are_one_event() {
        let events = Events::default();
        for model in ["a", "a", "b", "a"] {
            events.push(Event::Answered { model: model.into(), count: 1 });
        }
        assert_eq!(
            events.drain(),
            vec![
                Event::Answered { model: "a".into(), count: 2 },
                Event::Answered { model: "b".into(), count: 1 },
                Event::Answered { model: "a".into(), count: 1 },
            ]
        );
        assert!(events.drain().is_empty());
    }

    #[test]
    fn a_full_queue_drops_its_oldest_events_but_never_a_repository_calls_end() {
        let events = Events::default();
        let ended = Event::Repository { call: 7, outcome: Outcome { status: 200, code: "OK", message: String::new() } };
        events.push(ended.clone());
        for n in 0..MAX_QUEUED + 10 {
            events.push(Event::Panic { model: format!("m{n}"), message: String::new() });
        }
        let drained = events.drain();
        assert_eq!(drained.len(), MAX_QUEUED);
        assert_eq!(drained[0], ended);
        assert_eq!(drained[1], Event::Panic { model: "m11".into(), message: String::new() });
    }
}
