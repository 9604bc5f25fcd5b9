//! What the Python app's v2 routes (sidecar/fronts/http_routes.py) answer besides inference, served
//! by the front with the same status, body, reason label, counters and access-log line: the control
//! API refused (403 `forbidden_endpoint`, every method), a `/v2` path no route has (404
//! `unknown_path`) or a method its route does not take (405), a model the sidecar does not guard (404
//! `unknown_model`), and Triton's documents read through the front's own client: a model's readiness,
//! `GET /v2` (its extensions filtered), a model's metadata and config (its hidden outputs removed
//! when an output filter names it), its statistics and the server's (`proxy.allow_statistics`).
//!
//! The routes are aiohttp's as http_routes registers them, matched in its order: the first route
//! whose path matches and takes the method answers; a path some route matches with none taking the
//! method is 405 with the methods they take (the app's own routes too: /healthz, /readyz, /status,
//! /metrics and /drift/{model}/record stay the Python app's, but a path none of them has is the
//! front's 404). A model's `/ready` is refused as Python published it
//! (its problems from the sidecar's view), else Triton is asked. What still needs Python (a
//! filtered pinned version's or ensemble's document, the health endpoints before their first
//! publish, names to percent-decode, a query string, HEAD) goes to the Python app as before.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;

use crate::protocol::json::{self, Value};
use crate::protocol::pytext::{cut, float_repr, json_string, repr_str};

/// The state the document routes need from Python (published with each snapshot).
#[derive(Default)]
pub struct Documents {
    /// The models the sidecar guards (admission's).
    pub models: HashMap<String, Guarded>,
    /// Their names as admission lists them in unknown_model's message ("a, b").
    pub served: String,
    /// proxy.allow_statistics.
    pub allow_statistics: bool,
    /// The v2 extensions `GET /v2` shows (http_routes.exposed_extensions' set).
    pub extensions: HashSet<String>,
}

/// A model the sidecar guards, as its document routes read it.
pub struct Guarded {
    /// An output filter names it: its metadata and config are rewritten by the Python chain.
    pub filtered: bool,
    /// Its `/ready` refused from the sidecar's view (http_routes.model_ready_refusal); None: Triton
    /// is asked.
    pub not_ready: Option<super::state::Canned>,
    /// When filtered: the output filter's verdict on each output its spec declares (hidden or not),
    /// so that its metadata and config are rewritten here; None (no spec yet): the Python chain's.
    pub outputs: Option<HashMap<String, bool>>,
}

/// What a request the lane did not take becomes.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// Triton's control API: 403, whatever the method.
    Forbidden,
    /// No route has this path: 404.
    UnknownPath,
    /// Routes have this path, none this method: 405 with the methods they take.
    MethodNotAllowed(String),
    /// `GET /v2`: Triton's server metadata, its extensions filtered.
    Server,
    /// `GET /v2/models/stats`.
    ServerStats,
    /// A model's document: metadata (""), "/config", "/stats" or "/ready", of a version ("" = none).
    Model { model: String, version: String, suffix: &'static str },
    /// An infer or generate the lane did not take: the front refuses a model the sidecar does not
    /// guard; any other is the Python chain's.
    Inference { model: String, version: String, suffix: &'static str },
}

const GET: &[&str] = &["GET", "HEAD"];
const POST: &[&str] = &["POST"];
const ANY: &[&str] = &["*"];

/// A matched route: the methods it takes, and what it is (None: a route the Python app answers).
type Matched = (&'static [&'static str], Option<Route>);

/// The route of `method` on `path` (no query string, nothing to percent-decode); None when the
/// request is not the front's to answer here.
pub fn route(method: &str, path: &str) -> Option<Route> {
    // aiohttp's path is decoded and normalised (`%2F`, `/./`, `/../`, `//`): such a path is the
    // Python app's to read.
    if method == "HEAD" || path.contains(['?', '#', '%', '{', '}']) || path.contains("//") || path.contains("/.") {
        return None;
    }
    let matched = if path == "/v2" || path.starts_with("/v2/") { resources(path) } else { app_resources(path) };
    let mut allowed: Vec<&str> = Vec::new();
    for (methods, target) in matched {
        if methods.contains(&"*") || methods.contains(&method) {
            return target;
        }
        allowed.extend_from_slice(methods);
    }
    if allowed.is_empty() {
        return Some(Route::UnknownPath);
    }
    allowed.sort_unstable();
    allowed.dedup();
    Some(Route::MethodNotAllowed(allowed.join(", ")))
}

/// The app's own routes (sidecar/app/factory.py adds them before the v2 routes), which the Python
/// app answers: the front only tells their 405s and the 404 of a path no route has.
fn app_resources(path: &str) -> Vec<Matched> {
    match path {
        "/healthz" | "/readyz" | "/status" | "/metrics" => vec![(GET, None)],
        _ => {
            let drift = path
                .strip_prefix("/drift/")
                .and_then(|rest| rest.strip_suffix("/record"))
                .is_some_and(|model| !model.is_empty() && !model.contains('/'));
            if drift {
                vec![(POST, None)]
            } else {
                Vec::new()
            }
        }
    }
}

/// Every route whose path matches, in the order http_routes (then generate_routes) added them.
fn resources(path: &str) -> Vec<Matched> {
    let mut out: Vec<Matched> = Vec::new();
    match path {
        "/v2" => out.push((GET, Some(Route::Server))),
        "/v2/health/live" | "/v2/health/ready" => out.push((GET, None)),
        "/v2/models/stats" => out.push((GET, Some(Route::ServerStats))),
        _ => {}
    }
    if let Some(rest) = path.strip_prefix("/v2/models/") {
        let segments: Vec<&str> = rest.split('/').collect();
        if segments.iter().all(|s| !s.is_empty()) {
            let (model, version, tail) = match segments.as_slice() {
                [model, "versions", version, tail @ ..] if !tail.is_empty() || segments.len() == 3 => {
                    (*model, *version, tail)
                }
                [model, tail @ ..] => (*model, "", tail),
                [] => ("", "", &[][..]),
            };
            let document = |suffix: &'static str| {
                Some(Route::Model { model: model.to_owned(), version: version.to_owned(), suffix })
            };
            // Per prefix, in http_routes' order: infer, metadata, ready, config, stats, then the
            // control API; generate and generate_stream after them all.
            let inference = |suffix: &'static str| {
                Some(Route::Inference { model: model.to_owned(), version: version.to_owned(), suffix })
            };
            match tail {
                ["infer"] => out.push((POST, inference("/infer"))),
                [] => out.push((GET, document(""))),
                ["ready"] => out.push((GET, document("/ready"))),
                ["config"] => out.push((GET, document("/config"))),
                ["stats"] => out.push((GET, document("/stats"))),
                ["trace", "setting"] | ["infer_stream"] => out.push((ANY, Some(Route::Forbidden))),
                ["generate"] => out.push((POST, inference("/generate"))),
                ["generate_stream"] => out.push((POST, inference("/generate_stream"))),
                _ => {}
            }
            // `/v2/models/{m}/versions/{v}` read as a model with a 3-segment tail never matches;
            // the unversioned prefix with tail ["versions", v] matches nothing either.
        }
    }
    let control = ["/v2/repository", "/v2/systemsharedmemory", "/v2/cudasharedmemory"];
    if control.iter().any(|prefix| path.starts_with(prefix)) || matches!(path, "/v2/logging" | "/v2/trace/setting") {
        out.push((ANY, Some(Route::Forbidden)));
    }
    out
}

/// The route template of `route` on `path` (aiohttp's resource.canonical: the span's http.route);
/// "" for the router's 404 and 405, which matched no route.
pub fn template(route: &Route, path: &str) -> String {
    let model_prefix = |versioned: bool| {
        if versioned {
            "/v2/models/{model}/versions/{version}"
        } else {
            "/v2/models/{model}"
        }
    };
    match route {
        Route::UnknownPath | Route::MethodNotAllowed(_) => String::new(),
        Route::Server => "/v2".to_owned(),
        Route::ServerStats => "/v2/models/stats".to_owned(),
        Route::Model { version, suffix, .. } | Route::Inference { version, suffix, .. } => {
            format!("{}{suffix}", model_prefix(!version.is_empty()))
        }
        Route::Forbidden => {
            for prefix in ["/v2/repository", "/v2/systemsharedmemory", "/v2/cudasharedmemory"] {
                if path.starts_with(prefix) {
                    return format!("{prefix}{{tail}}");
                }
            }
            if let Some(rest) = path.strip_prefix("/v2/models/") {
                let versioned = rest.split('/').nth(1) == Some("versions");
                let tail = if path.ends_with("/infer_stream") { "/infer_stream" } else { "/trace/setting" };
                return format!("{}{tail}", model_prefix(versioned));
            }
            path.to_owned() // /v2/logging, /v2/trace/setting
        }
    }
}

/// The forbidden_endpoint message of the control API (http_routes.forbidden).
pub fn forbidden_message(path: &str) -> String {
    format!(
        "{} is part of Triton's control API, which stays inside the pod; only inference, metadata, config, \
         readiness and health are served here",
        cut(path, 120)
    )
}

pub const STATISTICS_OFF: &str = "statistics are not exposed through the sidecar (proxy.allow_statistics is off)";

pub fn unknown_path_message(path: &str) -> String {
    format!(
        "no such endpoint: {} (the sidecar serves the v2 inference, metadata, config, readiness and health endpoints)",
        cut(path, 120)
    )
}

pub fn method_not_allowed_message(method: &str, path: &str, allowed: &str) -> String {
    format!("{method} is not allowed on {}; allowed: {allowed}", cut(path, 120))
}

/// admission.tracked's refusal of a model the sidecar does not guard.
pub fn unknown_model_message(model: &str, served: &str) -> String {
    format!("unknown model {}; served: {served}", repr_str(&cut(model, 120)))
}

/// admission.check_version's refusal of a version that is not a number.
pub fn not_a_version_message(model: &str, version: &str) -> String {
    format!("model {model} has no version {} (versions are numbers)", repr_str(&cut(version, 120)))
}

/// Is `version` one Python's str.isdigit() takes (ASCII digits; other Unicode digits are forwarded)?
pub fn is_version(version: &str) -> bool {
    !version.is_empty() && version.bytes().all(|b| b.is_ascii_digit())
}

/// Triton's path of a model's document, as http_routes.model_path writes it (the name quoted as
/// urllib's quote(safe='') does).
pub fn model_path(model: &str, version: &str, suffix: &str) -> String {
    let mut out = String::from("/v2/models/");
    for b in model.bytes() {
        if b.is_ascii_alphanumeric() || b"_.-~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    if !version.is_empty() {
        out.push_str("/versions/");
        out.push_str(version);
    }
    out.push_str(suffix);
    out
}

/// Triton's server metadata with only the extensions the sidecar exposes, written as json.dumps
/// writes what rapidjson read (http_routes.server_metadata); None for a document this writer does
/// not reproduce exactly (a number, a repeated key): the Python app answers it then.
pub fn server_metadata(body: &[u8], exposed: &HashSet<String>) -> Option<String> {
    let Ok(Value::Object(mut members)) = json::parse(body) else { return None };
    let listed: Vec<Value> = match members.iter().find(|(k, _)| k == "extensions") {
        None => Vec::new(),
        Some((_, Value::Array(items))) => items.clone(),
        Some(_) => return None,
    };
    let mut kept = Vec::new();
    for item in listed {
        match &item {
            Value::Str(name) if exposed.contains(name.as_ref()) => kept.push(item),
            Value::Str(_) => {}
            _ => return None, // Python would compare a non-string with the names: let it
        }
    }
    match members.iter_mut().find(|(k, _)| k == "extensions") {
        Some((_, value)) => *value = Value::Array(kept),
        None => members.push(("extensions".into(), Value::Array(kept))),
    }
    let mut out = String::with_capacity(body.len());
    write_plain(&Value::Object(members), &mut out).then_some(out)
}

/// A filtered model's metadata (`config` false) or config without its hidden outputs, as
/// filtering.hide_in_metadata and hide_in_config remove them, written as json.dumps writes what
/// rapidjson read (http_routes._filtered_document); with the outputs dropped. None for a document
/// this cannot judge or write exactly (an output the spec does not declare, an ensemble's steps,
/// not a JSON object, NaN): the Python app answers it then.
pub fn filtered_document(body: &[u8], config: bool, outputs: &HashMap<String, bool>) -> Option<(String, Vec<String>)> {
    let Ok(Value::Object(mut members)) = json::parse(body) else { return None };
    let key = if config { "output" } else { "outputs" };
    if config {
        // Its steps' output maps name the ensemble's inner tensors, which only the filter's own
        // patterns can judge.
        if let Some((_, Value::Object(scheduling))) = members.iter().find(|(k, _)| k == "ensemble_scheduling") {
            if scheduling.iter().any(|(k, v)| k == "step" && v.is_array()) {
                return None;
            }
        }
    }
    let listed: Vec<Value> = match members.iter().find(|(k, _)| k == key) {
        None => Vec::new(),
        Some((_, value)) => value.items()?.into_owned(),
    };
    let name = |item: &Value| match item {
        Value::Object(fields) => match fields.iter().find(|(k, _)| k == "name") {
            Some((_, Value::Str(name))) => Some(name.to_string()),
            _ => None,
        },
        _ => None,
    };
    let (kept, dropped) = without_hidden(listed, name, outputs)?;
    match members.iter_mut().find(|(k, _)| k == key) {
        Some((_, value)) => *value = Value::Array(kept),
        None => members.push((key.into(), Value::Array(kept))),
    }
    let mut out = String::with_capacity(body.len());
    write_plain(&Value::Object(members), &mut out).then_some((out, dropped))
}

/// A document's outputs without the hidden ones, and the names dropped, by the output filter's
/// verdict Python published for each output the model's spec declares (`Guarded::outputs`); None
/// when an output has no name or no verdict (one the spec does not declare): only the filter's own
/// patterns can judge it, so the Python chain answers that document. The one rule for every
/// document the fronts filter: HTTP's JSON (`filtered_document`) and gRPC's messages
/// (grpc/unary.rs).
pub fn without_hidden<T>(
    items: Vec<T>,
    name: impl Fn(&T) -> Option<String>,
    outputs: &HashMap<String, bool>,
) -> Option<(Vec<T>, Vec<String>)> {
    let (mut kept, mut dropped) = (Vec::new(), Vec::new());
    for item in items {
        let name = name(&item)?;
        match outputs.get(&name)? {
            true => dropped.push(name),
            false => kept.push(item),
        }
    }
    Some((kept, dropped))
}

/// json.dumps of what rapidjson read: strings, numbers (a Python int as its digits, a float as its
/// repr), booleans, null, arrays and objects; false for NaN and the infinities.
fn write_plain(value: &Value, out: &mut String) -> bool {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Str(s) => json_string(s, out),
        Value::Number { text, .. } => match value.number() {
            Some(json::Number::Int(v)) => out.push_str(&v.to_string()),
            Some(json::Number::UInt(v)) => out.push_str(&v.to_string()),
            Some(json::Number::BigInt) => out.push_str(text),
            Some(json::Number::Float(f)) if f.is_finite() => out.push_str(&float_repr(f)),
            _ => return false,
        },
        Value::Numbers(_) => {
            let Some(items) = value.items() else { return false };
            return write_plain(&Value::Array(items.into_owned()), out);
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                if !write_plain(item, out) {
                    return false;
                }
            }
            out.push(']');
        }
        Value::Object(members) => {
            out.push('{');
            for (i, (key, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                json_string(key, out);
                out.push_str(": ");
                if !write_plain(item, out) {
                    return false;
                }
            }
            out.push('}');
        }
        _ => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(model: &str, version: &str, suffix: &'static str) -> Option<Route> {
        Some(Route::Model { model: model.to_owned(), version: version.to_owned(), suffix })
    }

    #[test]
    fn routes_are_aiohttp_s_as_http_routes_adds_them() {
        assert_eq!(route("GET", "/v2"), Some(Route::Server));
        assert_eq!(route("GET", "/v2/models/stats"), Some(Route::ServerStats));
        assert_eq!(route("GET", "/v2/models/m"), model("m", "", ""));
        assert_eq!(route("GET", "/v2/models/m/versions/2/config"), model("m", "2", "/config"));
        assert_eq!(route("GET", "/v2/models/m/versions/x"), model("m", "x", ""));
        assert_eq!(route("GET", "/v2/models/m/stats"), model("m", "", "/stats"));
        assert_eq!(route("GET", "/v2/models/m/ready"), model("m", "", "/ready"));
        assert_eq!(
            route("POST", "/v2/models/m/versions/3/infer"),
            Some(Route::Inference { model: "m".to_owned(), version: "3".to_owned(), suffix: "/infer" })
        );
        assert_eq!(route("GET", "/v2/health/ready"), None);
        for (method, path) in [
            ("POST", "/v2/repository/models/m/load"),
            ("GET", "/v2/repository/index"),
            ("DELETE", "/v2/repositoryx"),
            ("PUT", "/v2/logging"),
            ("GET", "/v2/trace/setting"),
            ("POST", "/v2/systemsharedmemory/region/r/register"),
            ("GET", "/v2/cudasharedmemory/status"),
            ("POST", "/v2/models/m/trace/setting"),
            ("GET", "/v2/models/m/versions/1/infer_stream"),
        ] {
            assert_eq!(route(method, path), Some(Route::Forbidden), "{method} {path}");
        }
        assert_eq!(route("GET", "/v2/models/m/infer"), Some(Route::MethodNotAllowed("POST".to_owned())));
        assert_eq!(route("POST", "/v2"), Some(Route::MethodNotAllowed("GET, HEAD".to_owned())));
        assert_eq!(route("DELETE", "/v2/models/stats"), Some(Route::MethodNotAllowed("GET, HEAD".to_owned())));
        for path in ["/v2/", "/v2/nothing", "/v2/models", "/v2/models/", "/v2/models/m/versions", "/v2/models/m/x"] {
            assert_eq!(route("GET", path), Some(Route::UnknownPath), "{path}");
        }
        for path in ["/healthz", "/metrics", "/v2/models/a%2Fb", "/v2?x=1", "/v2//models", "/v2/models/x/../m"] {
            assert_eq!(route("GET", path), None, "{path}");
        }
        assert_eq!(route("POST", "/drift/m/record"), None);
        assert_eq!(route("GET", "/drift/m/record"), Some(Route::MethodNotAllowed("POST".to_owned())));
        assert_eq!(route("POST", "/metrics"), Some(Route::MethodNotAllowed("GET, HEAD".to_owned())));
        for path in ["/", "/admin", "/v1/models/m:predict", "/v2x", "/drift/m/x", "/healthz/"] {
            assert_eq!(route("GET", path), Some(Route::UnknownPath), "{path}");
        }
        assert_eq!(route("HEAD", "/v2"), None);
        let templates = [
            ("/v2/repository/index", Route::Forbidden, "/v2/repository{tail}"),
            ("/v2/logging", Route::Forbidden, "/v2/logging"),
            (
                "/v2/models/m/versions/1/trace/setting",
                Route::Forbidden,
                "/v2/models/{model}/versions/{version}/trace/setting",
            ),
            ("/v2/models/m/infer_stream", Route::Forbidden, "/v2/models/{model}/infer_stream"),
            (
                "/v2/models/m/versions/2/config",
                model("m", "2", "/config").unwrap(),
                "/v2/models/{model}/versions/{version}/config",
            ),
            ("/v2/nothing", Route::UnknownPath, ""),
        ];
        for (path, route, template_of) in templates {
            assert_eq!(template(&route, path), template_of, "{path}");
        }
    }

    #[test]
    fn server_metadata_keeps_the_exposed_extensions_as_json_dumps_writes_them() {
        let exposed: HashSet<String> = ["classification", "parameters"].iter().map(|s| s.to_string()).collect();
        let body = br#"{"name":"triton","version":"2.1","extensions":["classification","logging","parameters"]}"#;
        assert_eq!(
            server_metadata(body, &exposed).unwrap(),
            r#"{"name": "triton", "version": "2.1", "extensions": ["classification", "parameters"]}"#
        );
        assert_eq!(server_metadata(br#"{"name":"t"}"#, &exposed).unwrap(), r#"{"name": "t", "extensions": []}"#);
        assert_eq!(
            server_metadata(br#"{"n":1.50,"m":[1,-0,2e3],"extensions":[]}"#, &exposed).unwrap(),
            r#"{"n": 1.5, "m": [1, 0, 2000.0], "extensions": []}"#
        );
        assert_eq!(model_path("a b/c", "3", "/config"), "/v2/models/a%20b%2Fc/versions/3/config");
        assert_eq!(unknown_model_message("x", "a, b"), "unknown model 'x'; served: a, b");
    }

    #[test]
    fn a_filtered_document_loses_its_hidden_outputs_as_hide_in_metadata_and_hide_in_config_drop_them() {
        let outputs: HashMap<String, bool> = [("scores".to_owned(), false), ("logits".to_owned(), true)].into();
        let metadata = br#"{"name":"m","outputs":[{"name":"scores","shape":[-1,1]},{"name":"logits","shape":[1]}]}"#;
        let (doc, dropped) = filtered_document(metadata, false, &outputs).unwrap();
        assert_eq!(doc, r#"{"name": "m", "outputs": [{"name": "scores", "shape": [-1, 1]}]}"#);
        assert_eq!(dropped, ["logits"]);
        let config = br#"{"name":"m","output":[{"name":"logits","dims":["1"]}],"max_batch_size":8}"#;
        let (doc, dropped) = filtered_document(config, true, &outputs).unwrap();
        assert_eq!(doc, r#"{"name": "m", "output": [], "max_batch_size": 8}"#);
        assert_eq!(dropped, ["logits"]);
        assert_eq!(filtered_document(br#"{"name":"m"}"#, true, &outputs).unwrap().0, r#"{"name": "m", "output": []}"#);
        // An output the spec does not declare, an ensemble's steps: the Python chain judges them.
        assert_eq!(filtered_document(br#"{"outputs":[{"name":"other"}]}"#, false, &outputs), None);
        let ensemble = br#"{"output":[],"ensemble_scheduling":{"step":[{"output_map":{"a":"logits"}}]}}"#;
        assert_eq!(filtered_document(ensemble, true, &outputs), None);
    }
}
