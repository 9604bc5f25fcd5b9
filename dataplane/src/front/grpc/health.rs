//! grpc.health.v1.Health answered by the front without Python: Check and Watch, exactly as
//! sidecar/fronts/grpc_server.py's `HealthService` answers them on the grpcio front.
//!
//! Which status a service has is the control plane's rule (sidecar.fronts.http_routes'
//! `serving_status`: "" is the pod's readiness, a guarded model's name that model's): Python
//! publishes it for every service it knows with the rest of the snapshot, at once on every state
//! transition, and the front answers from it. A name not published is unknown: Check answers
//! NOT_FOUND, Watch SERVICE_UNKNOWN (and goes on, as grpcio's does, in case the name appears).
//! Watch sends the status at once, then again each time a publish changes it: it waits on the
//! publish notification (`Shared::published`), it never polls.
//!
//! Until Python's first publish, and while the control plane is stalled past
//! liveness.watchdog_stall_s (its statuses are no longer kept true), a call goes to the Python gRPC
//! server as before, as the HTTP front hands over /v2/health/* then. grpcio's HealthService neither
//! counts these calls in the request metrics nor logs them, and neither does the front: they count
//! in its `served` alone.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use prost::Message;
use tokio::sync::mpsc;

use crate::protocol::pytext::{cut, repr_str};

use super::wire::{self, GrpcBody};
use super::GrpcFront;

pub const CHECK: &str = "/grpc.health.v1.Health/Check";
pub const WATCH: &str = "/grpc.health.v1.Health/Watch";

/// grpc.health.v1's HealthCheckResponse.ServingStatus.
pub const SERVING: i32 = 1;
pub const NOT_SERVING: i32 = 2;
pub const SERVICE_UNKNOWN: i32 = 3;

#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    pub service: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// Check's NOT_FOUND message for a name that is neither "" nor a guarded model (the grpcio front's
/// HealthService says the same through the module: one wording).
pub fn unknown_service(service: &str) -> String {
    format!("unknown service {}: '' (the pod) or a guarded model's name", repr_str(&cut(service, 120)))
}

/// The status published for `service`; None when it is unknown.
fn status(front: &GrpcFront, service: &str) -> Option<i32> {
    let state = front.shared.state.load();
    let serving = state.serving.as_ref()?.get(service)?;
    Some(if *serving { SERVING } else { NOT_SERVING })
}

/// May the front answer from what is published now? Not before the first publish, nor while the
/// control plane is stalled.
fn published(front: &GrpcFront) -> bool {
    let shared = &front.shared;
    shared.state.load().serving.is_some() && shared.watchdog.control_silent_for() < shared.settings.watchdog_stall
}

/// One Check or Watch (`path` is one of them): answered here, or passed to the Python gRPC server
/// when nothing fit to answer from is published, or when the request is not one message that
/// decodes (grpcio's own refusal of it comes from grpcio).
pub async fn serve(front: Arc<GrpcFront>, request: Request<Incoming>) -> Response<GrpcBody> {
    let (parts, body) = request.into_parts();
    if !published(&front) {
        return front.pass_through(parts, body.boxed()).await;
    }
    let body = match super::infer::read_call(&front, &parts.headers, body).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let Some(request) = wire::single_message(&body).and_then(|m| HealthCheckRequest::decode(m).ok()) else {
        return front.pass_through(parts, super::collected(body)).await;
    };
    front.served.fetch_add(1, Ordering::Relaxed);
    if parts.uri.path() == WATCH {
        return watch(front, request.service);
    }
    match status(&front, &request.service) {
        Some(status) => wire::answer(wire::OK, "", false, Some(response(status)), &[]),
        None => wire::answer(wire::NOT_FOUND, &unknown_service(&request.service), false, None, &[]),
    }
}

fn response(status: i32) -> Bytes {
    wire::frame(&HealthCheckResponse { status }.encode_to_vec())
}

/// Watch: the status now, then each change, until the client leaves or the front stops (then
/// UNAVAILABLE, as grpcio's server ends its open calls at stop). Its own task: a panic ends this
/// stream alone (its body ends without a status, which the client reads as an error).
fn watch(front: Arc<GrpcFront>, service: String) -> Response<GrpcBody> {
    // Room for a few statuses the client has not read yet: each is 7 bytes, and a status changes at
    // most once a publish.
    let (frames, body) = mpsc::channel(8);
    let mut published = front.shared.published.subscribe();
    let mut stop = front.stop.clone();
    tokio::spawn(async move {
        let mut last = None;
        loop {
            // Marked seen before the state is read: a publish after this read wakes the wait below.
            published.borrow_and_update();
            let now = status(&front, &service).unwrap_or(SERVICE_UNKNOWN);
            if last != Some(now) {
                last = Some(now);
                if frames.send(Frame::data(response(now))).await.is_err() {
                    return; // the client left
                }
            }
            tokio::select! {
                changed = published.changed() => if changed.is_err() { break },
                _ = frames.closed() => return,
                _ = stop.wait_for(|stopped| *stopped) => break,
            }
        }
        let _ = frames.send(Frame::trailers(wire::trailers(wire::UNAVAILABLE, "the sidecar is shutting down"))).await;
    });
    wire::streamed(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_encoded_as_grpc_health_v1_s_and_unknown_names_quoted_as_python_quotes_them() {
        assert_eq!(&response(SERVING)[..], &[0, 0, 0, 0, 2, 0x08, 1]);
        assert_eq!(&response(NOT_SERVING)[5..], &[0x08, 2]);
        let request = HealthCheckRequest::decode(&[0x0a, 2, b'm', b'1'][..]).map(|r| r.service);
        assert_eq!(request.as_deref(), Ok("m1"));
        assert_eq!(
            unknown_service("no_such_model"),
            "unknown service 'no_such_model': '' (the pod) or a guarded model's name"
        );
        assert_eq!(unknown_service("it's"), "unknown service \"it's\": '' (the pod) or a guarded model's name");
        let long = "x".repeat(200);
        assert!(unknown_service(&long).contains(&format!("'{}...'", "x".repeat(117))));
    }
}
