//! Values written into messages exactly as the Python side writes them (`repr`, `json.dumps`,
//! `format(x, "g")`, `messages.echo`): clients and tests that match on the words keep working,
//! whichever half refused the request.

use super::json::{Number, Value};

/// Characters of a client's value echoed back in an error (sidecar/messages.py MAX_ECHO_CHARS).
pub const MAX_ECHO_CHARS: usize = 80;

/// `text`, or its first `limit` characters ending in "..." (messages.cut).
pub fn cut(text: &str, limit: usize) -> String {
    if text.chars().count() <= limit {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(limit.saturating_sub(3)).collect();
    out.push_str("...");
    out
}

/// A client's value as it is quoted in an error: its text, or its JSON, cut short (messages.echo).
pub fn echo(value: &Value) -> String {
    match value {
        Value::Str(s) => cut(s, MAX_ECHO_CHARS),
        other => cut(&dumps(other), MAX_ECHO_CHARS),
    }
}

pub fn echo_str(text: &str) -> String {
    cut(text, MAX_ECHO_CHARS)
}

/// Python's `json.dumps(value)`: ", " and ": " separators, ASCII only, floats as `repr`.
pub fn dumps(value: &Value) -> String {
    let mut out = String::new();
    dump_into(value, &mut out);
    out
}

fn dump_into(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number { text, .. } => match value.number() {
            Some(Number::Int(v)) => out.push_str(&v.to_string()),
            Some(Number::Float(f)) => out.push_str(&json_float(f)),
            // Python's int prints its digits as written ("-0" aside, which fits i64).
            _ => out.push_str(text),
        },
        Value::NonFinite(f) => out.push_str(&json_float(*f)),
        Value::Str(s) => json_string(s, out),
        Value::Numbers(_) => dump_into(&Value::Array(value.items().map(|i| i.into_owned()).unwrap_or_default()), out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump_into(item, out);
                if out.len() > 4 * MAX_ECHO_CHARS {
                    // Only the start is ever shown (echo cuts at 80 characters).
                    out.push_str(", ...");
                    break;
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
                dump_into(item, out);
                if out.len() > 4 * MAX_ECHO_CHARS {
                    out.push_str(", ...");
                    break;
                }
            }
            out.push('}');
        }
    }
}

fn json_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        }
    } else {
        float_repr(f)
    }
}

pub fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A string as python-rapidjson's `dumps` writes it (the in-stream error events of
/// sidecar.serving.generation.error_event): control characters and everything past ASCII escaped,
/// with upper-case hex digits; DEL kept as it is.
pub fn rapidjson_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7f => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(text)`: single quotes unless the text holds one and no double quote.
pub fn repr_str(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `repr(bytes)`: b'...' (b"..." when the bytes hold a ' and no "), printable ASCII as is,
/// \t \n \r \\ and the quote escaped, anything else as \xNN.
pub fn repr_bytes(bytes: &[u8]) -> String {
    let quote = if bytes.contains(&b'\'') && !bytes.contains(&b'"') { '"' } else { '\'' };
    let mut out = String::with_capacity(bytes.len() + 3);
    out.push('b');
    out.push(quote);
    for &b in bytes {
        match b {
            b'\t' => out.push_str("\\t"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\\' => out.push_str("\\\\"),
            _ if b as char == quote => {
                out.push('\\');
                out.push(quote);
            }
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out.push(quote);
    out
}

/// The shortest digits of `f` (no sign) and its decimal point position: f = 0.DIGITS × 10^point.
fn shortest_digits(f: f64) -> (String, i32) {
    let sci = format!("{:e}", f.abs()); // e.g. "1.2345e-5": Rust prints the shortest round-trip digits
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let exp: i32 = exp.parse().unwrap_or(0);
    (digits, exp + 1)
}

fn exponent_suffix(exp: i32) -> String {
    format!("e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
}

/// Python's `repr(float)`.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if f == 0.0 {
        return format!("{sign}0.0");
    }
    let (digits, point) = shortest_digits(f);
    if !(-4 < point && point <= 16) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() { String::new() } else { format!(".{tail}") };
        return format!("{sign}{head}{frac}{}", exponent_suffix(point - 1));
    }
    format!("{sign}{}", place_point(&digits, point, true))
}

/// DIGITS with the decimal point placed `point` digits in; `dot_zero` keeps "1.0" rather than "1".
fn place_point(digits: &str, point: i32, dot_zero: bool) -> String {
    if point <= 0 {
        return format!("0.{}{}", "0".repeat((-point) as usize), digits);
    }
    let point = point as usize;
    if point >= digits.len() {
        let whole = format!("{digits}{}", "0".repeat(point - digits.len()));
        return if dot_zero { format!("{whole}.0") } else { whole };
    }
    format!("{}.{}", &digits[..point], &digits[point..])
}

/// Python's `format(f, "g")`: six significant digits, trailing zeros dropped.
pub fn format_g(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0".into() } else { "0".into() };
    }
    let sign = if f < 0.0 { "-" } else { "" };
    let sci = format!("{:.5e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let digits = digits.trim_end_matches('0');
    let digits = if digits.is_empty() { "0" } else { digits };
    if !(-4..6).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() { String::new() } else { format!(".{tail}") };
        return format!("{sign}{head}{frac}{}", exponent_suffix(exp));
    }
    format!("{sign}{}", place_point(digits, exp + 1, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::json::parse;

    #[test]
    fn floats_print_as_python_prints_them() {
        for (f, repr) in [
            (1.0, "1.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (100.0, "100.0"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e39, "1e+39"),
            (-2.5e-7, "-2.5e-07"),
            (3.4028234663852886e38, "3.4028234663852886e+38"),
        ] {
            assert_eq!(float_repr(f), repr, "{f}");
        }
        for (f, g) in [(70000.0, "70000"), (1e39, "1e+39"), (123456789.0, "1.23457e+08"), (0.5, "0.5"), (1e-5, "1e-05")]
        {
            assert_eq!(format_g(f), g, "{f}");
        }
    }

    #[test]
    fn values_echo_as_json_dumps_does() {
        let v = parse(br#"{"a": [1, 2.5, true, null, "\u00e9"], "b": 1e39}"#).unwrap();
        assert_eq!(dumps(&v), r#"{"a": [1, 2.5, true, null, "\u00e9"], "b": 1e+39}"#);
        assert_eq!(echo(&Value::Str("x".repeat(100).into())), format!("{}...", "x".repeat(77)));
    }

    #[test]
    fn strings_repr_as_python_does() {
        assert_eq!(repr_str("INPUT0"), "'INPUT0'");
        assert_eq!(repr_str("it's"), "\"it's\"");
        assert_eq!(repr_str("a\nb\\"), "'a\\nb\\\\'");
    }

    #[test]
    fn rapidjson_escapes_with_upper_case_hex_and_keeps_del() {
        let mut out = String::new();
        rapidjson_string("\u{e9} \u{1f} \u{2028} / \" \\ \t \u{1f600} \u{7f}\u{8}\u{c}", &mut out);
        let expected = r#""\u00E9 \u001F \u2028 / \" \\ \t \uD83D\uDE00 "#.to_owned() + "\u{7f}" + r#"\b\f""#;
        assert_eq!(out, expected);
    }
}
