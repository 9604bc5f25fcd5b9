//! Answers as bytes on the wire: the status line and headers the Python listener wrote, and the
//! sidecar's JSON refusals (`{"error", "reason", "model", ...}`, json.dumps's spacing).

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::protocol::pytext::{json_string, rapidjson_string};

/// One answer of the front.
pub struct Reply {
    pub status: u16,
    pub content_type: String,
    pub header_length: Option<usize>,
    pub retry_after: Option<u64>,
    pub body: Bytes,
    /// The refusal's reason label ("" for Triton's answer passed on).
    pub reason: &'static str,
}

pub const JSON_REFUSAL: &str = "application/json; charset=utf-8";

/// A refusal's parts: reason label and HTTP status (sidecar.serving.refusals.Reason), message, the
/// model, extra members already encoded as JSON values.
pub fn refusal(reason: &'static str, status: u16, message: &str, model: &str, extra: &[(&str, String)]) -> Reply {
    Reply {
        status,
        content_type: JSON_REFUSAL.to_owned(),
        header_length: None,
        retry_after: None,
        body: Bytes::from(refusal_body(reason, message, model, extra)),
        reason,
    }
}

pub fn refusal_body(reason: &str, message: &str, model: &str, extra: &[(&str, String)]) -> String {
    let mut out = String::with_capacity(64 + message.len());
    out.push_str("{\"error\": ");
    json_string(message, &mut out);
    out.push_str(", \"reason\": ");
    json_string(reason, &mut out);
    if !model.is_empty() {
        out.push_str(", \"model\": ");
        json_string(model, &mut out);
    }
    for (key, value) in extra {
        out.push_str(", ");
        json_string(key, &mut out);
        out.push_str(": ");
        out.push_str(value);
    }
    out.push('}');
    out
}

/// How a stream that already began says it failed: a server-sent event holding the refusal's body
/// as python-rapidjson writes it (sidecar.serving.generation.error_event); `extra` values already
/// encoded that way.
pub fn error_event(reason: &str, message: &str, model: &str, extra: &[(&str, String)]) -> Vec<u8> {
    let mut out = String::with_capacity(64 + message.len());
    out.push_str("{\"error\":");
    rapidjson_string(message, &mut out);
    out.push_str(",\"reason\":");
    rapidjson_string(reason, &mut out);
    if !model.is_empty() {
        out.push_str(",\"model\":");
        rapidjson_string(model, &mut out);
    }
    for (key, value) in extra {
        out.push(',');
        rapidjson_string(key, &mut out);
        out.push(':');
        out.push_str(value);
    }
    out.push('}');
    let mut event = Vec::with_capacity(out.len() + 8);
    crate::protocol::sse::write_event(out.as_bytes(), &mut event);
    event
}

/// A string as a JSON value (for `extra`).
pub fn json_value(text: &str) -> String {
    let mut out = String::new();
    json_string(text, &mut out);
    out
}

pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

/// The whole answer: head and body in one buffer (one write).
pub fn encode(reply: &Reply, request_id: &str, keep_alive: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + reply.body.len());
    out.extend_from_slice(format!("HTTP/1.1 {} {}\r\n", reply.status, reason_phrase(reply.status)).as_bytes());
    // An empty 200 has no type, as aiohttp's web.Response() writes it.
    if !reply.content_type.is_empty() {
        out.extend_from_slice(format!("Content-Type: {}\r\n", reply.content_type).as_bytes());
    }
    out.extend_from_slice(format!("Content-Length: {}\r\n", reply.body.len()).as_bytes());
    // "" for an answer that names none (the router's 404 and 405, as aiohttp's middleware wrote them).
    if !request_id.is_empty() {
        out.extend_from_slice(format!("X-Request-ID: {request_id}\r\n").as_bytes());
    }
    if let Some(length) = reply.header_length {
        out.extend_from_slice(format!("Inference-Header-Content-Length: {length}\r\n").as_bytes());
    }
    if let Some(seconds) = reply.retry_after {
        out.extend_from_slice(format!("Retry-After: {seconds}\r\n").as_bytes());
    }
    out.extend_from_slice(b"Date: ");
    out.extend_from_slice(http_date().as_bytes());
    out.extend_from_slice(b"\r\nServer: triton-sidecar\r\n");
    if !keep_alive {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&reply.body);
    out
}

/// Now as an HTTP date (RFC 9110 IMF-fixdate).
pub fn http_date() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let days = secs / 86400;
    let (h, m, s) = ((secs % 86400) / 3600, (secs % 3600) / 60, secs % 60);
    const WEEKDAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let weekday = WEEKDAYS[(days % 7) as usize];
    // Civil from days (Howard Hinnant's algorithm).
    let z = days as i64 + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    format!("{weekday}, {day:02} {} {year} {h:02}:{m:02}:{s:02} GMT", MONTHS[(month - 1) as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_as_json_dumps_writes_it() {
        let body = refusal_body("shape", "input \"x\": bad", "m", &[("input", json_value("x"))]);
        assert_eq!(body, r#"{"error": "input \"x\": bad", "reason": "shape", "model": "m", "input": "x"}"#);
        assert_eq!(refusal_body("header_timeout", "slow", "", &[]), r#"{"error": "slow", "reason": "header_timeout"}"#);
    }

    #[test]
    fn an_error_event_reads_as_rapidjson_writes_it() {
        let event = error_event("non_finite_output", "NaN in \u{e9}", "m", &[("outputs", r#"["a","b"]"#.to_owned())]);
        assert_eq!(
            event,
            br#"data: {"error":"NaN in \u00E9","reason":"non_finite_output","model":"m","outputs":["a","b"]}"#
                .iter()
                .chain(b"\n\n")
                .copied()
                .collect::<Vec<u8>>()
        );
    }

    #[test]
    fn the_date_is_an_imf_fixdate() {
        let date = http_date();
        assert_eq!(date.len(), 29, "{date}");
        assert!(date.ends_with(" GMT"));
    }
}
