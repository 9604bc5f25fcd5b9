//! One client connection of the HTTP front, served request after request (pipelined requests wait
//! in the buffer, answered in order). Its bounds and refusals are the Python listener's
//! (docs/reliability.md): header and keep-alive timeouts, URL and header sizes, smuggling refused,
//! 413 before the body is read with lingering close, 408 for a body that trickles, 100-continue.
//! A request the lane does not serve hands the connection, from that request's first byte on, to the
//! Python app behind the front.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::sleep_until;

use crate::protocol::pytext::{cut, format_g, repr_str};
use crate::serving::rollouts;

use super::documents::{self, Route};
use super::events::{AccessRecord, Event};
use super::generate::{self, Endpoint};
use super::generate_stream::{self, Relayed};
use super::lane::{self, Coding, Infer};
use super::reply::{encode, refusal, Reply, JSON_REFUSAL};
use super::state::{Canned, Routed};
use super::tracing::{self as spans, Opened, Refused, RequestSpan};
use super::upstream::Failure;
use super::Shared;

/// The metrics label of a request to the pod rather than a model (sidecar.serving.admission).
pub(super) const SERVER_LABEL: &str = "_server_";
/// The metrics label of a model name the sidecar does not guard (sidecar.serving.admission).
pub(super) const UNKNOWN_LABEL: &str = "_unknown_";

/// A request head as the front read it.
struct Head {
    length: usize,
    method: String,
    path: String,
    /// 1 for HTTP/1.1, 0 for HTTP/1.0.
    version: u8,
    /// Names lower-cased, values as sent (latin-1).
    headers: Vec<(String, String)>,
}

impl Head {
    fn get(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn keep_alive(&self) -> bool {
        let connection = self.get("connection").unwrap_or("").to_ascii_lowercase();
        if self.version == 1 {
            !connection.split(',').any(|t| t.trim() == "close")
        } else {
            connection.split(',').any(|t| t.trim() == "keep-alive")
        }
    }
}

/// A request the lane serves, as `lane_for` found it in the head.
struct LaneRequest {
    model: String,
    /// The version it goes to (pinned, a rollout's pick, or the fallback), "" for none.
    version: String,
    /// Why it goes to `version`.
    routed: Routed,
    /// The model's rollout, when it is in one (infer only): its evidence and shadows (lane.rs).
    rollout: Option<Arc<rollouts::Route>>,
    /// The model's lane, or the pinned version's.
    lane: Arc<super::state::Lane>,
    header_length: Option<i64>,
    endpoint: Endpoint,
    /// The body's encoding, or the 415 it gets (infer only).
    coding: Coding,
}

/// How the front answers one of the Python app's v2 routes (`document_for`), and the route's
/// template (its span's http.route; "" for the router's 404 and 405).
struct Plan {
    how: How,
    route: String,
}

enum How {
    /// A refusal before Triton, under this metrics label.
    Refuse { label: String, reply: Reply },
    /// One of Triton's documents, GET `upstream`; `model`: the model it is about, "" for the server's.
    Fetch { label: String, model: String, upstream: String, kind: Fetched },
}

/// What becomes of a document Triton gave.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fetched {
    /// Passed on as Triton wrote it (a 5xx refused as triton_error).
    Passthrough,
    /// GET /v2: its extensions filtered.
    Server,
    /// A model's /ready: 200 empty, else not_ready with Triton's words.
    Ready,
    /// A filtered model's metadata or (`config`) config: its hidden outputs removed.
    Filtered { config: bool },
}

/// What follows a refusal given before the whole request was read.
enum Drain {
    /// The rest cannot be framed any more: bytes are only counted until the client is done.
    Count,
    /// This many bytes of a declared body remain.
    Length(u64),
    /// A chunked body, read to its last chunk.
    Chunked(Chunked),
}

/// A client connection over `S`: a TcpStream, or a TLS stream over one (the handshake is done
/// before the connection is made: front/tls.rs).
pub struct Connection<S> {
    stream: S,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    buf: BytesMut,
    answered_any: bool,
    /// The client certificate's subject (mutual TLS), for the access log; "" without one.
    client_subject: Arc<str>,
    /// The method of the request being served, for the access log of a refusal ("" before one).
    method: String,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> Connection<S> {
    pub fn new(stream: S, shared: Arc<Shared>, stop: watch::Receiver<bool>) -> Self {
        Connection {
            stream,
            shared,
            stop,
            buf: BytesMut::with_capacity(16 * 1024),
            answered_any: false,
            client_subject: Arc::from(""),
            method: String::new(),
        }
    }

    /// The subject of the certificate the client presented in its TLS handshake.
    pub fn with_client_subject(mut self, client_subject: Arc<str>) -> Self {
        self.client_subject = client_subject;
        self
    }

    pub async fn run(mut self) {
        loop {
            let Some(head) = self.read_head().await else { return };
            if !self.serve(head).await {
                return;
            }
        }
    }

    /// The next request head, or None when the connection is done (closed, timed out, refused).
    async fn read_head(&mut self) -> Option<Head> {
        self.method.clear();
        let settings = &self.shared.settings;
        let idle_since = Instant::now();
        let mut begun: Option<Instant> = None;
        loop {
            if !self.buf.is_empty() {
                let now = Instant::now();
                begun.get_or_insert(now);
                match parse_head(&self.buf, settings) {
                    Ok(Some(head)) => return Some(head),
                    Ok(None) => {}
                    Err(reply) => {
                        self.refuse(reply, None, "", Drain::Count).await;
                        return None;
                    }
                }
            }
            let deadline = match begun {
                Some(b) => b + settings.header_timeout,
                None if self.answered_any => idle_since + settings.keepalive_timeout,
                None => idle_since + settings.header_timeout,
            };
            let timed_out = tokio::select! {
                read = self.stream.read_buf(&mut self.buf) => match read {
                    Ok(0) | Err(_) => return None,
                    Ok(_) => false,
                },
                _ = sleep_until(deadline.into()) => true,
                _ = self.stop.wait_for(|stopped| *stopped) => return None,
            };
            if !timed_out {
                continue;
            }
            if begun.is_some() {
                self.shared.metrics.connection_timeouts.inc(&["header"]);
                let message = format!(
                    "request headers not received within {} s (listen.header_timeout_s)",
                    format_g(settings.header_timeout.as_secs_f64())
                );
                let reply = refusal("header_timeout", 408, &message, "", &[]);
                // 408 and close at once: a client that trickles its headers is not one that reads
                // answers (lingering would hold its descriptor longer still).
                let request_id = self.count_refusal(&reply, None, "");
                let _ = send(&mut self.stream, &encode(&reply, &request_id, false)).await;
            } else {
                let phase = if self.answered_any { "keepalive" } else { "header" };
                self.shared.metrics.connection_timeouts.inc(&[phase]);
            }
            return None;
        }
    }

    /// Serve one request; false when the connection is done.
    async fn serve(&mut self, head: Head) -> bool {
        let started = Instant::now();
        self.method.clone_from(&head.method);
        if let Some(why) = smuggling(&head) {
            let reply = refusal("malformed", 400, &why, "", &[]);
            self.refuse(reply, Some(&head), "", Drain::Count).await;
            return false;
        }
        if let Some(reply) =
            self.shared.watchdog.stalled_answer(&head.method, &head.path, self.shared.settings.watchdog_stall)
        {
            // No body to frame on a kubelet GET: the connection goes on after the answer.
            let keep_alive =
                head.keep_alive() && head.get("content-length").is_none() && head.get("transfer-encoding").is_none();
            self.buf.advance(head.length);
            let request_id = request_id(head.get("x-request-id"));
            return self.write_answer(&encode(&reply, &request_id, keep_alive), keep_alive).await;
        }
        if let Some(canned) = self.canned(&head) {
            return self.answer_canned(head, &canned, started).await;
        }
        let Some(infer) = self.lane_for(&head) else {
            if forwardable(&head, self.shared.settings.max_body_bytes) {
                if let Some(plan) = self.document_for(&head) {
                    return self.answer_document(head, plan, started).await;
                }
                return self.forward(head).await;
            }
            self.hand_over().await;
            return false;
        };
        let LaneRequest { model, version, routed, rollout, lane, header_length, endpoint, coding } = infer;
        let settings = &self.shared.settings;
        let limit = settings.max_body_bytes;
        let chunked = head.get("transfer-encoding").is_some();
        let declared = match head.get("content-length") {
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) => n,
                Err(_) => {
                    let reply = refusal("malformed", 400, "not valid HTTP: invalid Content-Length", "", &[]);
                    self.refuse(reply, Some(&head), &model, Drain::Count).await;
                    return false;
                }
            },
            None => 0,
        };
        if !chunked && declared > limit as u64 {
            let reply = body_too_large(limit, &model);
            let buffered = (self.buf.len() - head.length) as u64;
            self.buf.clear();
            self.refuse(reply, Some(&head), &model, Drain::Length(declared.saturating_sub(buffered))).await;
            return false;
        }
        let expects = head.get("expect").is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"));
        if expects && send(&mut self.stream, b"HTTP/1.1 100 Continue\r\n\r\n").await.is_err() {
            return false;
        }
        // The body, within proxy.client_body_timeout_s.
        let deadline = Instant::now() + settings.client_body_timeout;
        let body = if chunked {
            let mut decoder = Chunked::default();
            loop {
                match decoder.feed(&self.buf[head.length..], limit) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(ChunkError::TooLarge) => {
                        // Refused once the limit is passed; the rest is read to its last chunk and
                        // thrown away, so the connection closes where the body ends.
                        decoder.discard = true;
                        decoder.body = Vec::new();
                        let input = self.buf.split_off(head.length);
                        self.buf.clear();
                        let done = decoder.feed(&input, usize::MAX).unwrap_or(true);
                        decoder.pending = input[decoder.consumed..].to_vec();
                        decoder.consumed = 0;
                        let drain = if done { Drain::Length(0) } else { Drain::Chunked(decoder) };
                        self.refuse(body_too_large(limit, &model), Some(&head), &model, drain).await;
                        return false;
                    }
                    Err(ChunkError::Malformed(why)) => {
                        let reply = refusal("malformed", 400, &format!("not valid HTTP: {why}"), "", &[]);
                        self.refuse(reply, Some(&head), &model, Drain::Count).await;
                        return false;
                    }
                }
                if !self.read_body_bytes(deadline).await {
                    return self.body_timed_out(&head, &model, None).await;
                }
            }
            let consumed = head.length + decoder.consumed;
            self.buf.advance(consumed);
            Bytes::from(decoder.body)
        } else {
            let total = head.length + declared as usize;
            while self.buf.len() < total {
                if !self.read_body_bytes(deadline).await {
                    let missing = (total - self.buf.len()) as u64;
                    return self.body_timed_out(&head, &model, Some(missing)).await;
                }
            }
            let mut request = self.buf.split_to(total).freeze();
            request.advance(head.length);
            request
        };
        let request_id = request_id(head.get("x-request-id"));
        let (traceparent, tracestate) = (head.get("traceparent"), head.get("tracestate"));
        let opened = Opened {
            traceparent,
            tracestate,
            route: spans::Route::Http(endpoint),
            model: &model,
            version: &version,
            routed,
            request_id: &request_id,
            body_bytes: body.len(),
            started,
        };
        let span = RequestSpan::open(self.shared.tracing.as_ref(), opened);
        let (trace_id, traceparent, tracestate) = span.upstream_context(trace_id(traceparent), traceparent, tracestate);
        let infer = Infer {
            model,
            version,
            routed,
            rollout,
            lane,
            trace_id,
            traceparent,
            tracestate,
            span,
            header_length,
            body,
            coding,
            path: route_path(&head.path).to_owned(),
            started,
            request_id,
            client_subject: self.client_subject.clone(),
        };
        let keep_alive = head.keep_alive();
        if endpoint == Endpoint::GenerateStream {
            return self.relay_stream(infer, keep_alive).await;
        }
        let Some(reply_bytes) = self.answer(infer, keep_alive, endpoint).await else { return false };
        self.write_answer(&reply_bytes, keep_alive).await
    }

    /// A generate_stream served by the front: its events written as they come (generate_stream).
    async fn relay_stream(&mut self, infer: Infer, keep_alive: bool) -> bool {
        let shared = self.shared.clone();
        let (request_id, model, started) = (infer.request_id.clone(), infer.model.clone(), infer.started);
        let (task, events) = generate_stream::spawn(shared.clone(), infer);
        let room = shared.settings.head_limit() + shared.settings.max_body_bytes;
        let at = Relayed { shared: &shared, request_id: &request_id, model: &model, started, keep_alive, room };
        let kept = generate_stream::relay(&mut self.stream, &mut self.buf, at, task, events).await;
        self.answered_any = true;
        kept
    }

    /// Write a whole answer; false when the connection is done (the client gone, or not kept alive).
    async fn write_answer(&mut self, bytes: &[u8], keep_alive: bool) -> bool {
        if send(&mut self.stream, bytes).await.is_err() {
            return false;
        }
        self.answered_any = true;
        if !keep_alive {
            let _ = self.stream.shutdown().await;
            return false;
        }
        true
    }

    /// Run the lane in its own task (a panic ends that request with 500, never the connection's
    /// task); meanwhile read what the client pipelines, and cancel the call if the client leaves.
    async fn answer(&mut self, infer: Infer, keep_alive: bool, endpoint: Endpoint) -> Option<Vec<u8>> {
        let shared = self.shared.clone();
        let request_id = infer.request_id.clone();
        let model = infer.model.clone();
        let path = infer.path.clone();
        let started = infer.started;
        let (trace, span_id) = (infer.trace_id.clone(), infer.span.span_id());
        let mut task = match endpoint {
            Endpoint::Generate => tokio::spawn(generate::serve(shared.clone(), infer)),
            _ => tokio::spawn(lane::serve(shared.clone(), infer)),
        };
        let room = shared.settings.head_limit() + shared.settings.max_body_bytes;
        loop {
            tokio::select! {
                joined = &mut task => {
                    let reply = match joined {
                        Ok(reply) => reply,
                        Err(e) => {
                            count_panic(&shared, &model, e);
                            let reply = refusal("internal_error", 500, "the sidecar failed to handle this request; \
                                                 it was logged", &model, &[]);
                            shared.metrics.finish("http", &model, "500", started.elapsed().as_secs_f64());
                            reply
                        }
                    };
                    return Some(encode(&reply, &request_id, keep_alive));
                }
                read = self.stream.read_buf(&mut self.buf), if self.buf.len() < room => {
                    if matches!(read, Ok(0) | Err(_)) {
                        // The client left: its call to Triton is cancelled (the connection to Triton
                        // dropped with it) and the request counted as 499.
                        task.abort();
                        let seconds = started.elapsed().as_secs_f64();
                        shared.metrics.finish("http", &model, "499", seconds);
                        shared.events.push(Event::Log(AccessRecord {
                            request_id, trace_id: trace, span_id, model, method: "POST".to_owned(), path: cut(&path, 200), status: 499,
                            duration_ms: (seconds * 100_000.0).round() / 100.0,
                            reason: "client_disconnected".to_owned(),
                            client_subject: self.client_subject.clone(),
                        }));
                        return None;
                    }
                }
            }
        }
    }

    /// Read more of a body before `deadline`; false when the time is up or the client left.
    async fn read_body_bytes(&mut self, deadline: Instant) -> bool {
        tokio::select! {
            read = self.stream.read_buf(&mut self.buf) => matches!(read, Ok(n) if n > 0),
            _ = sleep_until(deadline.into()) => false,
        }
    }

    async fn body_timed_out(&mut self, head: &Head, model: &str, missing: Option<u64>) -> bool {
        let timeout = self.shared.settings.client_body_timeout.as_secs_f64();
        let message = format!("request body not received within {} s (proxy.client_body_timeout_s)", format_g(timeout));
        let reply = refusal("body_timeout", 408, &message, model, &[]);
        self.buf.clear();
        let drain = match missing {
            Some(n) => Drain::Length(n),
            None => Drain::Count,
        };
        self.refuse(reply, Some(head), model, drain).await;
        false
    }

    /// What the lane needs of this request when it serves it (infer, generate, generate_stream, to
    /// the model or to a version of it the client pinned); None sends it to the Python chain.
    fn lane_for(&self, head: &Head) -> Option<LaneRequest> {
        if head.method != "POST" || head.version != 1 || head.get("upgrade").is_some() {
            return None;
        }
        // The query string is no part of the route (aiohttp's router matched the path alone, and
        // no infer route reads a parameter): Triton's path is the lane's own.
        let (named, endpoint) = Endpoint::split(route_path(&head.path).strip_prefix("/v2/models/")?)?;
        let (model, path_version) = match named.split_once("/versions/") {
            Some((_, "")) => return None, // `/versions//`: no route has it (the Python chain's 404)
            Some(split) => split,
            None => (named, ""),
        };
        if model.is_empty() || model.contains(['/', '#']) || path_version.contains(['/', '#']) {
            return None; // a path no route has: the Python chain's
        }
        // Percent-encoded names are decoded as aiohttp's match_info decodes them; one that decodes
        // to a name Triton's path would need quoted stays the Python chain's (a lane's never does).
        let (model, path_version) = (plain_name(model)?, plain_name(path_version)?);
        let (model, path_version) = (model.as_ref(), path_version.as_ref());
        // The pin as http_routes.infer reads it (routing.pinned_version): the path's version or the
        // header's, stripped (of ASCII whitespace only: what else Python strips is not a digit, so
        // such a pin matches no version and goes to Python); generate reads no header. Both naming
        // different versions is the Python chain's 400.
        let header = match endpoint {
            Endpoint::Infer => {
                head.get("x-model-version").map(|v| v.trim_matches(|c: char| c.is_ascii_whitespace())).unwrap_or("")
            }
            _ => "",
        };
        if !header.is_empty() && !path_version.is_empty() && header != path_version {
            return None;
        }
        let version = if path_version.is_empty() { header } else { path_version };
        let coding = match endpoint {
            Endpoint::Infer => body_coding(head)?,
            // Generate bodies are forwarded when compressed or of another type (the lane has none
            // of generate_routes' rules for them yet).
            _ => {
                let encoding = head.get("content-encoding").unwrap_or("").trim().to_ascii_lowercase();
                if !(encoding.is_empty() || encoding == "identity") {
                    return None;
                }
                let ctype = media_type(head);
                if !matches!(ctype.as_str(), "" | "application/json" | "application/octet-stream") {
                    return None;
                }
                Coding::Identity
            }
        };
        // Generate bodies are JSON whatever the header says (generate_routes reads none of it).
        let header_length = match head.get("inference-header-content-length") {
            Some(v) if endpoint == Endpoint::Infer => Some(v.trim().parse::<i64>().ok()?),
            _ => None,
        };
        let snapshot = self.shared.state.load();
        let lane = snapshot.lanes.get(model)?.clone();
        if endpoint == Endpoint::GenerateStream && !snapshot.whole(model) {
            return None; // a stream to a version a partial quarantine spares: the Python chain's
        }
        // A rollout's generate is still the Python chain's: its shadows compare texts.
        let rollout = snapshot.rollouts.get(model).cloned();
        if rollout.is_some() && endpoint == Endpoint::Generate {
            return None;
        }
        // The route of infer and generate (routing.Router.route): the pin, else a rollout's pick
        // (by the cohort_key header's value, or at random), else Triton's choice; the fallback
        // Python chose while the version reached is not trusted. A stream is not routed
        // (OpenStream.join admits the version it names, "" for Triton's).
        let (version, routed) = match endpoint {
            Endpoint::GenerateStream if version.is_empty() => (version, Routed::Default),
            Endpoint::GenerateStream => (version, Routed::Pinned),
            _ => {
                let key = snapshot.cohort_key(model);
                let cohort = if key.is_empty() { "" } else { head.get(key).unwrap_or("") };
                snapshot.route(model, version, cohort)
            }
        };
        // A version only when it is loaded and its spec published (admission then judges it as the
        // Python chain would); any other goes to the Python chain, which fetches its spec
        // (published for the next request) or refuses it.
        let lane = if version.is_empty() { lane } else { lane.versions.get(version)?.clone() };
        let version = version.to_owned();
        Some(LaneRequest { model: model.to_owned(), version, routed, rollout, lane, header_length, endpoint, coding })
    }

    /// The published answer to this request when it is a GET of a health endpoint with no body, and
    /// the health loop is turning (a stalled one's answers are stale: they go to the Python app,
    /// as before, and its watchdog speaks for it on /healthz and /readyz).
    fn canned(&self, head: &Head) -> Option<Arc<Canned>> {
        if head.method != "GET" || head.get("transfer-encoding").is_some() {
            return None;
        }
        if head.get("content-length").is_some_and(|v| v.trim() != "0") {
            return None;
        }
        if self.shared.watchdog.control_silent_for() >= self.shared.settings.watchdog_stall {
            return None;
        }
        let path = head.path.split('?').next().unwrap_or("");
        self.shared.state.load().health.get(path).cloned()
    }

    /// Answer a health endpoint as published, counted and logged as the Python chain does (the
    /// pod's own label, every refusal logged, a sample of the rest).
    async fn answer_canned(&mut self, head: Head, canned: &Canned, started: Instant) -> bool {
        self.buf.advance(head.length);
        let shared = self.shared.clone();
        let request_id = request_id(head.get("x-request-id"));
        let keep_alive = head.keep_alive();
        let reply = Reply {
            status: canned.status,
            content_type: if canned.body.is_empty() { String::new() } else { JSON_REFUSAL.to_owned() },
            header_length: None,
            retry_after: canned.retry_after,
            body: canned.body.clone(),
            reason: "",
        };
        if !canned.reason.is_empty() {
            shared.metrics.rejections.inc(&["http", SERVER_LABEL, &canned.reason]);
        }
        let seconds = started.elapsed().as_secs_f64();
        super::lane::count_answered(&shared, SERVER_LABEL, canned.status, &canned.reason, seconds, |duration_ms| {
            AccessRecord {
                request_id: request_id.clone(),
                trace_id: trace_id(head.get("traceparent")),
                span_id: String::new(),
                model: SERVER_LABEL.to_owned(),
                method: head.method.clone(),
                path: cut(&head.path, 200),
                status: canned.status,
                duration_ms,
                reason: canned.reason.clone(),
                client_subject: self.client_subject.clone(),
            }
        });
        self.write_answer(&encode(&reply, &request_id, keep_alive), keep_alive).await
    }

    /// How the front answers a request the lane did not take when it is one of the Python app's v2
    /// routes it serves too (front/documents.rs); None: the Python app answers it.
    fn document_for(&self, head: &Head) -> Option<Plan> {
        let path = head.path.as_str();
        let route = documents::route(&head.method, path)?;
        let template = documents::template(&route, path);
        let refuse = |label: &str, reason: &'static str, status: u16, message: &str, model: &str| How::Refuse {
            label: label.to_owned(),
            reply: refusal(reason, status, message, model, &[]),
        };
        let snapshot = self.shared.state.load();
        let fetch = |label: &str, model: &str, upstream: String, kind: Fetched| How::Fetch {
            label: label.to_owned(),
            model: model.to_owned(),
            upstream,
            kind,
        };
        let has_body = head.get("content-length").is_some_and(|v| v.trim() != "0");
        let how = match route {
            Route::Forbidden => {
                refuse(SERVER_LABEL, "forbidden_endpoint", 403, &documents::forbidden_message(path), "")
            }
            Route::UnknownPath => {
                refuse(UNKNOWN_LABEL, "unknown_path", 404, &documents::unknown_path_message(path), "")
            }
            Route::MethodNotAllowed(allowed) => {
                let message = documents::method_not_allowed_message(&head.method, path, &allowed);
                refuse(UNKNOWN_LABEL, "method_not_allowed", 405, &message, "")
            }
            Route::Inference { model, .. } => {
                // A model the sidecar guards that is not a lane (on hold, quarantined, in a rollout,
                // a version not published...) is the Python chain's; one it does not guard is
                // refused here (admission.tracked), its body read and thrown away as the Python
                // listener read it.
                let docs = snapshot.documents.as_ref()?;
                if docs.models.is_empty() || docs.models.contains_key(&model) {
                    return None;
                }
                let message = documents::unknown_model_message(&model, &docs.served);
                refuse(UNKNOWN_LABEL, "unknown_model", 404, &message, "")
            }
            // Triton's documents are fetched for requests without a body (a GET's is never read),
            // so that the Python app can still answer one the front cannot write exactly.
            _ if has_body => return None,
            Route::Server => {
                snapshot.documents.as_ref()?;
                fetch(SERVER_LABEL, "", "/v2".to_owned(), Fetched::Server)
            }
            Route::ServerStats => {
                if !snapshot.documents.as_ref()?.allow_statistics {
                    refuse(SERVER_LABEL, "forbidden_endpoint", 403, documents::STATISTICS_OFF, "")
                } else {
                    fetch(SERVER_LABEL, "", "/v2/models/stats".to_owned(), Fetched::Passthrough)
                }
            }
            Route::Model { model, version, suffix } => {
                let docs = snapshot.documents.as_ref()?;
                if suffix == "/stats" && !docs.allow_statistics {
                    refuse(SERVER_LABEL, "forbidden_endpoint", 403, documents::STATISTICS_OFF, "")
                } else if !version.is_ascii() || docs.models.is_empty() {
                    // A digit Python's isdigit() knows beyond ASCII; no model discovered yet (503).
                    return None;
                } else {
                    match docs.models.get(&model) {
                        None => refuse(
                            UNKNOWN_LABEL,
                            "unknown_model",
                            404,
                            &documents::unknown_model_message(&model, &docs.served),
                            "",
                        ),
                        Some(_) if !version.is_empty() && !documents::is_version(&version) => refuse(
                            &model,
                            "unknown_model",
                            404,
                            &documents::not_a_version_message(&model, &version),
                            &model,
                        ),
                        Some(guarded) if suffix == "/ready" => {
                            // A stalled health loop's view is stale: the Python app answers (as the
                            // health endpoints' canned answers are forwarded then).
                            if self.shared.watchdog.control_silent_for() >= self.shared.settings.watchdog_stall {
                                return None;
                            }
                            match &guarded.not_ready {
                                Some(canned) => How::Refuse {
                                    label: model.clone(),
                                    reply: Reply {
                                        status: canned.status,
                                        content_type: JSON_REFUSAL.to_owned(),
                                        header_length: None,
                                        retry_after: canned.retry_after,
                                        body: canned.body.clone(),
                                        reason: "not_ready",
                                    },
                                },
                                None => {
                                    let upstream = documents::model_path(&model, &version, suffix);
                                    fetch(&model, &model, upstream, Fetched::Ready)
                                }
                            }
                        }
                        // An output filter names the model: its documents lose their hidden outputs,
                        // judged by what Python published of its spec (a pinned version's, or
                        // before the spec is fetched: the Python chain's).
                        Some(guarded) if guarded.filtered && suffix != "/stats" => {
                            if !version.is_empty() || guarded.outputs.is_none() {
                                return None;
                            }
                            let upstream = documents::model_path(&model, &version, suffix);
                            fetch(&model, &model, upstream, Fetched::Filtered { config: suffix == "/config" })
                        }
                        Some(_) => {
                            let upstream = documents::model_path(&model, &version, suffix);
                            fetch(&model, &model, upstream, Fetched::Passthrough)
                        }
                    }
                }
            }
        };
        Some(Plan { how, route: template })
    }

    /// Answer one of the Python app's v2 routes as it answers it, counted and logged as it counts
    /// and logs it.
    async fn answer_document(&mut self, head: Head, plan: Plan, started: Instant) -> bool {
        let shared = self.shared.clone();
        let keep_alive = head.keep_alive();
        let path = head.path.clone();
        let Plan { how, route } = plan;
        // The router's 404 and 405 name no request id (aiohttp's middleware answered them before
        // any request scope, without the client's traceparent): a new one is logged, none is sent.
        let routed = !route.is_empty();
        let opened = std::time::SystemTime::now();
        let (label, reply, sent_id) = match how {
            How::Refuse { label, reply } => {
                // A body the route never reads is read and thrown away, as the Python app's was.
                let declared = head.get("content-length").and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0);
                let total = head.length + declared;
                let deadline = Instant::now() + shared.settings.client_body_timeout;
                while self.buf.len() < total {
                    if !self.read_body_bytes(deadline).await {
                        let missing = (total - self.buf.len()) as u64;
                        return self.body_timed_out(&head, "", Some(missing)).await;
                    }
                }
                self.buf.advance(total);
                shared.metrics.rejections.inc(&["http", &label, reply.reason]);
                (label, reply, routed)
            }
            How::Fetch { label, model, upstream, kind } => {
                let fetched = {
                    let _counted = lane::InFlight::new(&shared);
                    let headers = [("accept-encoding", "identity")];
                    let call = shared.upstream.send("GET", &upstream, &headers, Bytes::new());
                    tokio::pin!(call);
                    let timeout = sleep_until((Instant::now() + shared.settings.triton_timeout).into());
                    tokio::pin!(timeout);
                    let room = shared.settings.head_limit() + shared.settings.max_body_bytes;
                    loop {
                        tokio::select! {
                            answered = &mut call => break answered,
                            _ = &mut timeout => break Err(Failure::Timeout),
                            read = self.stream.read_buf(&mut self.buf), if self.buf.len() < room => {
                                if matches!(read, Ok(0) | Err(_)) {
                                    // The client left: its call is dropped with it, counted and
                                    // logged 499 as a gone client's request is.
                                    let seconds = started.elapsed().as_secs_f64();
                                    shared.metrics.finish("http", &label, "499", seconds);
                                    shared.events.push(Event::Log(AccessRecord {
                                        request_id: request_id(head.get("x-request-id")),
                                        trace_id: trace_id(head.get("traceparent")),
                                        span_id: String::new(),
                                        model: label,
                                        method: head.method.clone(),
                                        path: cut(&path, 200),
                                        status: 499,
                                        duration_ms: (seconds * 100_000.0).round() / 100.0,
                                        reason: "client_disconnected".to_owned(),
                                        client_subject: self.client_subject.clone(),
                                    }));
                                    return false;
                                }
                            }
                        }
                    }
                };
                let reply = match fetched {
                    Err(failure) => documents_refusal(&shared, &model, failure),
                    Ok((200, _, _)) if kind == Fetched::Ready => Reply {
                        status: 200,
                        content_type: String::new(), // an empty 200, as aiohttp's web.Response() writes it
                        header_length: None,
                        retry_after: None,
                        body: Bytes::new(),
                        reason: "",
                    },
                    Ok((_, _, body)) if kind == Fetched::Ready => {
                        let words = lane::triton_error_message(&body);
                        let message = format!("Triton says model {model} is not ready ({words})");
                        refusal("not_ready", 503, &message, &model, &[])
                    }
                    Ok((200, _, body)) if matches!(kind, Fetched::Filtered { .. }) => {
                        let config = kind == Fetched::Filtered { config: true };
                        let snapshot = shared.state.load();
                        let outputs = snapshot.documents.as_ref().and_then(|d| d.models.get(&model)?.outputs.as_ref());
                        let Some((doc, dropped)) = outputs.and_then(|o| documents::filtered_document(&body, config, o))
                        else {
                            return self.forward(head).await;
                        };
                        for output in &dropped {
                            shared.metrics.outputs_filtered.inc(&[model.as_str(), output.as_str()]);
                        }
                        Reply {
                            status: 200,
                            content_type: JSON_REFUSAL.to_owned(),
                            header_length: None,
                            retry_after: None,
                            body: Bytes::from(doc),
                            reason: "",
                        }
                    }
                    Ok((status, _, body)) if status >= 500 => {
                        let message = format!("Triton answered {status}: {}", lane::triton_error_message(&body));
                        refusal("triton_error", 502, &message, "", &[("triton_status", status.to_string())])
                    }
                    Ok((200, _, body)) if kind == Fetched::Server => {
                        let Some(doc) = documents::server_metadata(&body, &snapshot_extensions(&shared)) else {
                            return self.forward(head).await;
                        };
                        Reply {
                            status: 200,
                            content_type: JSON_REFUSAL.to_owned(),
                            header_length: None,
                            retry_after: None,
                            body: Bytes::from(doc),
                            reason: "",
                        }
                    }
                    Ok((status, headers, body)) => {
                        let sent = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
                        let media = sent.split(';').next().unwrap_or("").trim();
                        Reply {
                            status,
                            content_type: if media.is_empty() {
                                "application/json".to_owned()
                            } else {
                                media.to_owned()
                            },
                            header_length: None,
                            retry_after: None,
                            body,
                            reason: "",
                        }
                    }
                };
                self.buf.advance(head.length);
                (label, reply, true)
            }
        };
        let span = shared.tracing.as_ref().and_then(|tracing| {
            let method = head.method.as_str();
            let name = if routed { format!("{method} {route}") } else { method.to_owned() };
            let (traceparent, tracestate) =
                if routed { (head.get("traceparent"), head.get("tracestate")) } else { (None, None) };
            tracing.span_since(name, traceparent, tracestate, opened)
        });
        let client_id = request_id(head.get("x-request-id"));
        let logged_id = if sent_id { client_id } else { request_id(None) };
        let (trace, span_id) = match &span {
            Some(span) => (span.trace_id().to_owned(), span.span_id().to_owned()),
            None if sent_id => (trace_id(head.get("traceparent")), String::new()),
            None => (String::new(), String::new()),
        };
        if let Some(mut span) = span {
            end_document_span(&mut span, &head.method, &route, &logged_id, &label, &reply);
            span.end(document_failure(&reply).as_deref());
        }
        let seconds = started.elapsed().as_secs_f64();
        lane::count_answered(&shared, &label, reply.status, reply.reason, seconds, |duration_ms| AccessRecord {
            request_id: logged_id.clone(),
            trace_id: trace,
            span_id,
            model: label.clone(),
            method: head.method.clone(),
            path: cut(&path, 200),
            status: reply.status,
            duration_ms,
            reason: reply.reason.to_owned(),
            client_subject: self.client_subject.clone(),
        });
        let sent = if sent_id { logged_id.as_str() } else { "" };
        self.write_answer(&encode(&reply, sent, keep_alive), keep_alive).await
    }

    /// Send one request the lane does not serve to the Python app and relay its answer; the
    /// connection stays the front's, so the client's next infer is the lane's again.
    async fn forward(&mut self, head: Head) -> bool {
        self.shared.handovers.fetch_add(1, Ordering::Relaxed);
        let declared = head.get("content-length").and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0);
        let total = head.length + declared;
        let deadline = Instant::now() + self.shared.settings.client_body_timeout;
        while self.buf.len() < total {
            if !self.read_body_bytes(deadline).await {
                let missing = (total - self.buf.len()) as u64;
                return self.body_timed_out(&head, "", Some(missing)).await;
            }
        }
        let request = self.buf.split_to(total).freeze();
        let body = request.slice(head.length..);
        let headers: Vec<(&str, &str)> = head
            .headers
            .iter()
            .filter(|(name, _)| !HOP_BY_HOP.contains(&name.as_str()) && name != "content-length")
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        let keep_alive = head.keep_alive();
        let shared = self.shared.clone();
        let call = shared.back_pool.send(&head.method, &head.path, &headers, body);
        tokio::pin!(call);
        let room = shared.settings.head_limit() + shared.settings.max_body_bytes;
        let answered = loop {
            tokio::select! {
                answered = &mut call => break answered,
                read = self.stream.read_buf(&mut self.buf), if self.buf.len() < room => {
                    if matches!(read, Ok(0) | Err(_)) {
                        return false; // the client left: the call to the app is dropped with it
                    }
                }
            }
        };
        let out = match answered {
            Ok((status, headers, body)) => relayed(status, &headers, &body, keep_alive),
            Err(_) => {
                let reply = refusal("internal_error", 500, "the sidecar's own app did not answer", "", &[]);
                encode(&reply, &request_id(head.get("x-request-id")), false)
            }
        };
        self.write_answer(&out, keep_alive).await
    }

    /// Hand the rest of the connection, from the current request's first byte, to the Python app.
    async fn hand_over(&mut self) {
        self.shared.handovers.fetch_add(1, Ordering::Relaxed);
        let Ok(mut back) = TcpStream::connect(self.shared.back).await else {
            let reply = refusal("internal_error", 500, "the sidecar's own app is not reachable", "", &[]);
            let _ = send(&mut self.stream, &encode(&reply, &request_id(None), false)).await;
            return;
        };
        let _ = back.set_nodelay(true);
        if back.write_all(&self.buf).await.is_err() {
            return;
        }
        self.buf.clear();
        let _ = tokio::io::copy_bidirectional(&mut self.stream, &mut back).await;
    }

    /// Count an early refusal as a request and a rejection, log it, and trace it (a span with its
    /// reason, sampled as any request's); its request id. `head`: the request's, when it was read;
    /// `model`: a model of a lane (tracked), "" when the refusal came before one was known.
    fn count_refusal(&self, reply: &Reply, head: Option<&Head>, model: &str) -> String {
        let label = if model.is_empty() { "_unknown_" } else { model };
        let id = request_id(None);
        let path = head.map_or("", |head| head.path.as_str());
        self.shared.metrics.rejections.inc(&["http", label, reply.reason]);
        self.shared.metrics.finish("http", label, &reply.status.to_string(), 0.0);
        let (trace_id, span_id) = match &self.shared.tracing {
            None => (String::new(), String::new()),
            Some(tracing) => {
                let header = |name: &str| head.and_then(|head| head.get(name));
                let refused = Refused {
                    traceparent: header("traceparent"),
                    tracestate: header("tracestate"),
                    method: &self.method,
                    path,
                    model,
                    request_id: &id,
                    status: reply.status,
                    reason: reply.reason,
                    body: &reply.body,
                };
                tracing.refused(refused).unwrap_or_default()
            }
        };
        self.shared.events.push(Event::Log(AccessRecord {
            request_id: id.clone(),
            trace_id,
            span_id,
            model: label.to_owned(),
            method: self.method.clone(),
            path: cut(path, 200),
            status: reply.status,
            duration_ms: 0.0,
            reason: reply.reason.to_owned(),
            client_subject: self.client_subject.clone(),
        }));
        id
    }

    /// Answer before the request is read, half-close, and linger until the client is done (bounded):
    /// a client that writes its whole body before reading still reads the answer.
    async fn refuse(&mut self, reply: Reply, head: Option<&Head>, model: &str, drain: Drain) {
        let request_id = self.count_refusal(&reply, head, model);
        let settings = self.shared.settings.clone();
        let metrics = self.shared.metrics.clone();
        let ends = |how: &str| metrics.lingering_ends.inc(&[how]);
        if send(&mut self.stream, &encode(&reply, &request_id, false)).await.is_err() {
            ends("client_closed"); // gone before the answer could be written
            return;
        }
        let mut drain = drain;
        if matches!(drain, Drain::Length(0)) {
            ends("drained");
            return;
        }
        let _ = self.stream.shutdown().await;
        let started = Instant::now();
        let mut last = started;
        let mut total: u64 = 0;
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let by_time = started + settings.lingering_time;
            let by_idle = last + settings.lingering_timeout;
            tokio::select! {
                read = self.stream.read(&mut chunk) => {
                    let n = match read {
                        Ok(0) | Err(_) => { ends("client_closed"); return; }
                        Ok(n) => n,
                    };
                    total += n as u64;
                    last = Instant::now();
                    if total > settings.lingering_max_bytes {
                        ends("bytes");
                        return;
                    }
                    match &mut drain {
                        Drain::Count => {}
                        Drain::Length(left) => {
                            *left = left.saturating_sub(n as u64);
                            if *left == 0 {
                                ends("drained");
                                return;
                            }
                        }
                        Drain::Chunked(decoder) => {
                            decoder.pending.extend_from_slice(&chunk[..n]);
                            let pending = std::mem::take(&mut decoder.pending);
                            match decoder.feed(&pending, usize::MAX) {
                                Ok(true) | Err(_) => { ends("drained"); return; }
                                Ok(false) => {
                                    decoder.pending = pending[decoder.consumed..].to_vec();
                                    decoder.consumed = 0;
                                }
                            }
                        }
                    }
                }
                _ = sleep_until(by_time.min(by_idle).into()) => {
                    ends(if by_time <= by_idle { "time" } else { "idle" });
                    return;
                }
            }
        }
    }
}

/// Write `bytes` whole and out of any buffer: a TLS stream keeps what the socket would not take yet
/// until it is flushed (a TcpStream's flush does nothing).
async fn send<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

/// Headers of one hop, never relayed (RFC 9110 §7.6.1), plus the framing each hop writes itself.
const HOP_BY_HOP: [&str; 8] =
    ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"];

/// A request the Python app can answer through the front, one request at a time: HTTP/1.1, a whole
/// body of a known length within validation.max_body_bytes, and an answer that is not a stream.
/// Anything else (HEAD, chunked or oversized bodies, 100-continue, generate_stream's events, an
/// upgrade) is handed over with the connection.
fn forwardable(head: &Head, max_body_bytes: usize) -> bool {
    if head.version != 1 || head.get("upgrade").is_some() || head.get("expect").is_some() {
        return false;
    }
    if !matches!(head.method.as_str(), "GET" | "POST" | "PUT" | "DELETE" | "OPTIONS" | "PATCH") {
        return false;
    }
    if head.get("transfer-encoding").is_some() || head.path.split('?').next().unwrap_or("").ends_with("_stream") {
        return false;
    }
    match head.get("content-length") {
        None => true,
        Some(v) => v.trim().parse::<usize>().is_ok_and(|n| n <= max_body_bytes),
    }
}

/// The Python app's answer, as the client reads it: its status and headers, our framing.
fn relayed(status: u16, headers: &hyper::HeaderMap, body: &[u8], keep_alive: bool) -> Vec<u8> {
    let reason = hyper::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("Unknown");
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(format!("HTTP/1.1 {status} {reason}\r\n").as_bytes());
    for (name, value) in headers {
        let name = name.as_str();
        if HOP_BY_HOP.contains(&name) || name == "content-length" {
            continue;
        }
        write_name(name, &mut out);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    if !keep_alive {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// A header name as the Python app wrote it (hyper hands names over lower-cased): each word
/// capitalised, and the sidecar's own `X-Request-ID` as it spells it, so a forwarded answer reads
/// byte for byte as it did without the front (names are case-insensitive, some clients' lookups not).
fn write_name(name: &str, out: &mut Vec<u8>) {
    if name == "x-request-id" {
        out.extend_from_slice(b"X-Request-ID");
        return;
    }
    let mut upper = true;
    for b in name.bytes() {
        out.push(if upper { b.to_ascii_uppercase() } else { b });
        upper = b == b'-';
    }
}

/// A request whose task panicked: counted as an internal error and as a request the front served
/// (its 500 or its cut stream is the front's answer), its message sent up for the log.
pub(super) fn count_panic(shared: &super::Shared, model: &str, e: tokio::task::JoinError) {
    let message = panic_message(e);
    shared.metrics.internal_errors.inc(&["http", model]);
    shared.fast_requests.fetch_add(1, Ordering::Relaxed);
    shared.events.push(Event::Panic { model: model.to_owned(), message });
}

pub(super) fn panic_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(payload) => {
            if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_owned()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "a panic without a message".to_owned()
            }
        }
        Err(_) => "the request's task was cancelled".to_owned(),
    }
}

/// A document request's span attributes, as sidecar.tracing.spans' request_attributes and
/// outcome_attributes give them for the Python chain's request.
fn end_document_span(span: &mut spans::PythonSpan, method: &str, route: &str, id: &str, label: &str, reply: &Reply) {
    use opentelemetry::KeyValue;
    let mut attributes = vec![
        KeyValue::new("sidecar.request_id", id.to_owned()),
        KeyValue::new("sidecar.protocol", "http"),
        KeyValue::new("http.request.method", method.to_owned()),
        KeyValue::new("sidecar.status", reply.status.to_string()),
        KeyValue::new("http.response.status_code", i64::from(reply.status)),
    ];
    if !route.is_empty() {
        attributes.push(KeyValue::new("http.route", route.to_owned()));
    }
    if !label.starts_with('_') {
        attributes.push(KeyValue::new("sidecar.model", label.to_owned()));
    }
    if !reply.reason.is_empty() {
        attributes.push(KeyValue::new("sidecar.refusal.reason", reply.reason));
    }
    span.set(attributes);
}

/// The description a failed request's span ends with (RequestWrapper.finish's): the refusal's
/// reason and message, else the status; None when it did not fail.
fn document_failure(reply: &Reply) -> Option<String> {
    if reply.reason.is_empty() {
        return (reply.status >= 400).then(|| reply.status.to_string());
    }
    let message = crate::protocol::json::parse(&reply.body)
        .ok()
        .and_then(|doc| doc.get("error").and_then(|e| e.as_str()).map(str::to_owned))
        .unwrap_or_default();
    Some(format!("[{}] {message}", reply.reason))
}

/// The exposed extensions as last published (GET /v2 is only planned once they are).
fn snapshot_extensions(shared: &super::Shared) -> std::collections::HashSet<String> {
    shared.state.load().documents.as_ref().map(|docs| docs.extensions.clone()).unwrap_or_default()
}

/// A document Triton gave no answer for, refused as ServingCore.upstream_refusal(signal=False)
/// refuses it: no passive signal for the model, but Triton unreachable still told to the health loop.
pub(super) fn documents_refusal(shared: &super::Shared, model: &str, failure: Failure) -> Reply {
    match failure {
        Failure::Unreachable(detail) => {
            shared.events.push(Event::Failed { model: model.to_owned(), kind: "unreachable", status: 0, detail });
            let mut reply = refusal("triton_unreachable", 503, "Triton is unreachable from the sidecar", model, &[]);
            reply.retry_after = Some(shared.settings.retry_after_s);
            reply
        }
        Failure::Timeout => {
            let named = if model.is_empty() { "server" } else { model };
            let message = format!("Triton did not answer within the time limit ({named})");
            refusal("triton_timeout", 504, &message, model, &[])
        }
        Failure::Dropped(detail) => {
            let message = format!("Triton dropped the connection: {}", cut(&detail, 120));
            refusal("triton_bad_answer", 502, &message, model, &[])
        }
    }
}

pub(super) fn body_too_large(limit: usize, model: &str) -> Reply {
    let message = format!("request body larger than {limit} bytes (validation.max_body_bytes)");
    refusal("body_too_large", 413, &message, model, &[])
}

/// The Content-Type of a request, as http_routes.check_body_headers reads it: its media type, stripped
/// and lower-cased.
fn media_type(head: &Head) -> String {
    head.get("content-type").unwrap_or("").split(';').next().unwrap_or("").trim().to_lowercase()
}

/// How the lane reads an infer body (http_routes.check_body_headers, in its order: the type first,
/// then the encoding): as sent, inflated, or refused 415.
fn body_coding(head: &Head) -> Option<Coding> {
    let ctype = media_type(head);
    if !matches!(ctype.as_str(), "" | "application/json" | "application/octet-stream") {
        return Some(Coding::Refused(format!(
            "Content-Type {} is not accepted; send application/json (or application/octet-stream with \
             Inference-Header-Content-Length)",
            repr_str(&cut(&ctype, 120))
        )));
    }
    let encoding = head.get("content-encoding").unwrap_or("identity").trim().to_lowercase();
    Some(match encoding.as_str() {
        "" | "identity" => Coding::Identity,
        "gzip" => Coding::Gzip,
        "deflate" => Coding::Deflate,
        "br" => Coding::Brotli,
        "zstd" => Coding::Zstd,
        _ => Coding::Refused(format!(
            "Content-Encoding {} is not accepted; send the body uncompressed, gzip, deflate, br or zstd",
            repr_str(&cut(&encoding, 120))
        )),
    })
}

/// A request target's path without its query string (what routes and the access log read).
fn route_path(target: &str) -> &str {
    target.split_once('?').map_or(target, |(path, _)| path)
}

/// A path segment percent-decoded, when it is a plain name ([A-Za-z0-9_.-], what a lane's model is
/// named and Triton's path carries unquoted); None for one that is not, or does not decode.
fn plain_name(segment: &str) -> Option<std::borrow::Cow<'_, str>> {
    let plain = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-');
    if !segment.contains('%') {
        return segment.bytes().all(plain).then_some(std::borrow::Cow::Borrowed(segment));
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    if !out.iter().all(|c| plain(*c)) {
        return None;
    }
    String::from_utf8(out).ok().map(std::borrow::Cow::Owned)
}

/// Why a request's framing is ambiguous: Content-Length with Transfer-Encoding, a coding other than
/// chunked, or two Content-Lengths (request smuggling; refused as nginx does, never handed on).
fn smuggling(head: &Head) -> Option<String> {
    let lengths: Vec<&str> =
        head.headers.iter().filter(|(n, _)| n == "content-length").map(|(_, v)| v.as_str()).collect();
    let codings: Vec<&str> =
        head.headers.iter().filter(|(n, _)| n == "transfer-encoding").map(|(_, v)| v.as_str()).collect();
    if lengths.len() > 1 {
        return Some("not valid HTTP: more than one Content-Length".to_owned());
    }
    let coding = codings.last()?;
    if !lengths.is_empty() {
        return Some("both Content-Length and Transfer-Encoding: the body's framing is ambiguous".to_owned());
    }
    if codings.len() > 1 || !coding.trim().eq_ignore_ascii_case("chunked") {
        return Some(format!("Transfer-Encoding {}: only chunked is accepted", repr_str(&cut(coding, 80))));
    }
    None
}

/// A complete head, None while more bytes are needed, or the refusal a head over a limit gets.
fn parse_head(buf: &[u8], settings: &super::settings::Settings) -> Result<Option<Head>, Reply> {
    let mut headers = vec![httparse::EMPTY_HEADER; settings.max_headers];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(buf) {
        Ok(httparse::Status::Complete(length)) => {
            let path = request.path.unwrap_or("");
            if path.len() > settings.max_url_bytes {
                return Err(url_too_long(settings));
            }
            let size: usize = request.headers.iter().map(|h| h.name.len() + h.value.len()).sum();
            if size > settings.max_header_bytes {
                return Err(headers_too_large(settings));
            }
            Ok(Some(Head {
                length,
                method: request.method.unwrap_or("").to_owned(),
                path: path.to_owned(),
                version: request.version.unwrap_or(1),
                headers: request
                    .headers
                    .iter()
                    .map(|h| (h.name.to_ascii_lowercase(), h.value.iter().map(|&b| b as char).collect()))
                    .collect(),
            }))
        }
        Ok(httparse::Status::Partial) => {
            let line_ends = buf.iter().position(|&b| b == b'\n');
            if line_ends.is_none() && buf.len() > settings.max_url_bytes + 32 {
                return Err(url_too_long(settings));
            }
            if buf.len() > settings.head_limit() {
                return Err(headers_too_large(settings));
            }
            Ok(None)
        }
        Err(httparse::Error::TooManyHeaders) => Err(headers_too_large(settings)),
        Err(e) => Err(refusal("malformed", 400, &format!("not valid HTTP: {e}"), "", &[])),
    }
}

fn url_too_long(settings: &super::settings::Settings) -> Reply {
    let message = format!("request target longer than {} bytes (listen.max_url_bytes)", settings.max_url_bytes);
    refusal("url_too_long", 414, &message, "", &[])
}

fn headers_too_large(settings: &super::settings::Settings) -> Reply {
    let message = format!(
        "request headers over {} bytes or {} fields (listen.max_header_bytes, listen.max_headers)",
        settings.max_header_bytes, settings.max_headers
    );
    refusal("headers_too_large", 431, &message, "", &[])
}

/// A per-thread xorshift, seeded at random per process: request ids and log sampling, not secrets
/// (Python's side used random.getrandbits for both).
pub fn random_u64() -> u64 {
    use std::cell::Cell;
    use std::hash::{BuildHasher, Hasher};
    thread_local!(static STATE: Cell<u64> = Cell::new({
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x5eed);
        h.finish() | 1
    }));
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

/// The client's X-Request-ID when it is sane (1-128 of `[A-Za-z0-9._:/+=@-]`), else a new one.
pub fn request_id(sent: Option<&str>) -> String {
    if let Some(id) = sent {
        let sane = !id.is_empty()
            && id.len() <= 128
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:/+=@-".contains(&b));
        if sane {
            return id.to_owned();
        }
    }
    format!("{:016x}{:016x}", random_u64(), random_u64())
}

/// The trace id of a W3C traceparent header, or "" (all-zero ids are invalid).
pub fn trace_id(traceparent: Option<&str>) -> String {
    let Some(value) = traceparent else { return String::new() };
    let parts: Vec<&str> = value.trim().split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if parts.len() == 4 && hex(parts[0], 2) && hex(parts[1], 32) && hex(parts[2], 16) && hex(parts[3], 2) {
        if parts[1].bytes().all(|b| b == b'0') {
            return String::new();
        }
        return parts[1].to_owned();
    }
    String::new()
}

#[derive(Debug)]
enum ChunkError {
    TooLarge,
    Malformed(&'static str),
}

/// An incremental reader of a chunked body (RFC 9112 §7.1): fed the bytes after the head each time
/// more arrive, it resumes where it stopped.
#[derive(Default)]
pub struct Chunked {
    /// Bytes of the input consumed so far.
    consumed: usize,
    /// Data bytes still to come in the current chunk, and its CRLF after it.
    left: usize,
    in_data: bool,
    trailers: bool,
    body: Vec<u8>,
    /// Only find the end (a refused body is thrown away).
    discard: bool,
    /// Bytes carried over between feeds while draining.
    pending: Vec<u8>,
}

impl Chunked {
    /// Read on from `input` (everything after the head); Ok(true) once the last chunk and the
    /// trailers are read.
    fn feed(&mut self, input: &[u8], limit: usize) -> Result<bool, ChunkError> {
        loop {
            let rest = &input[self.consumed..];
            if self.in_data {
                if self.left > 0 {
                    let n = self.left.min(rest.len());
                    if n == 0 {
                        return Ok(false);
                    }
                    if !self.discard {
                        self.body.extend_from_slice(&rest[..n]);
                    }
                    self.left -= n;
                    self.consumed += n;
                    continue;
                }
                if rest.len() < 2 {
                    return Ok(false);
                }
                if &rest[..2] != b"\r\n" {
                    return Err(ChunkError::Malformed("a chunk does not end with CRLF"));
                }
                self.consumed += 2;
                self.in_data = false;
                continue;
            }
            let Some(end) = rest.windows(2).position(|w| w == b"\r\n") else {
                if rest.len() > 4096 {
                    return Err(ChunkError::Malformed("a chunk-size line over 4096 bytes"));
                }
                return Ok(false);
            };
            let line = &rest[..end];
            self.consumed += end + 2;
            if self.trailers {
                if line.is_empty() {
                    return Ok(true);
                }
                continue;
            }
            let size_text = line.split(|&b| b == b';').next().unwrap_or(b"");
            let size_text = std::str::from_utf8(size_text).map_err(|_| ChunkError::Malformed("a bad chunk size"))?;
            let size =
                usize::from_str_radix(size_text.trim(), 16).map_err(|_| ChunkError::Malformed("a bad chunk size"))?;
            if size == 0 {
                self.trailers = true;
                continue;
            }
            self.left = size;
            self.in_data = true;
            if !self.discard && self.body.len().saturating_add(size) > limit {
                return Err(ChunkError::TooLarge);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_is_the_path_without_its_query_and_names_decode_only_to_plain_names() {
        assert_eq!(route_path("/v2/models/m/infer?debug=1&x=%2F"), "/v2/models/m/infer");
        assert_eq!(route_path("/v2/models/m/infer"), "/v2/models/m/infer");
        assert_eq!(plain_name("credit_risk").as_deref(), Some("credit_risk"));
        assert_eq!(plain_name("credit%5Frisk").as_deref(), Some("credit_risk"));
        assert_eq!(plain_name("%31").as_deref(), Some("1"));
        // Decoding to a name Triton's path would need quoted, or not decoding at all: not a lane's.
        for segment in ["a%2Fb", "a%20b", "a b", "caf\u{e9}", "bad%zz", "cut%4", "%ff"] {
            assert_eq!(plain_name(segment), None, "{segment}");
        }
    }

    #[test]
    fn a_chunked_body_is_read_across_feeds() {
        let whole = b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: v\r\n\r\n";
        for split in 0..whole.len() {
            let mut decoder = Chunked::default();
            let first = decoder.feed(&whole[..split], 100).unwrap();
            assert!(!first || split == whole.len());
            assert!(decoder.feed(whole, 100).unwrap(), "split at {split}");
            assert_eq!(decoder.body, b"abcde");
            assert_eq!(decoder.consumed, whole.len());
        }
    }

    #[test]
    fn a_chunked_body_over_the_limit_is_refused() {
        let mut decoder = Chunked::default();
        assert!(matches!(decoder.feed(b"5\r\nabcde\r\n5\r\nfghij\r\n0\r\n\r\n", 8), Err(ChunkError::TooLarge)));
    }

    #[test]
    fn relayed_header_names_are_written_as_the_python_app_wrote_them() {
        for (name, written) in [
            ("x-request-id", "X-Request-ID"),
            ("content-type", "Content-Type"),
            ("inference-header-content-length", "Inference-Header-Content-Length"),
            ("retry-after", "Retry-After"),
        ] {
            let mut out = Vec::new();
            write_name(name, &mut out);
            assert_eq!(out, written.as_bytes());
        }
    }

    #[test]
    fn ids_are_kept_when_sane_and_made_otherwise() {
        assert_eq!(request_id(Some("abc-1")), "abc-1");
        assert_eq!(request_id(Some("bad id")).len(), 32);
        assert_eq!(
            trace_id(Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(trace_id(Some("00-00000000000000000000000000000000-b7ad6b7169203331-01")), "");
    }
}
