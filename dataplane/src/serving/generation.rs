//! Triton's generate extension, wire-free: the body check of `POST .../generate` and
//! `.../generate_stream`, and the screening of each answer or server-sent event.
//!
//! A generate body is one flat JSON object: each top-level key is one of the model's inputs (a scalar
//! or a flat list) or a request parameter, and `parameters` may hold more parameters. Triton turns
//! what it does not recognise into parameters without a word, and answers 500 to a value of the wrong
//! type, so the body is checked first: unknown keys, wrong types, oversized text, a max_tokens-like
//! value above the model's ceiling. The first problem in document order is the one reported, in the
//! words clients have always read (sidecar/serving/generation.py before issue 30).

use std::collections::HashSet;

use crate::protocol::datatypes::int_range;
use crate::protocol::json::{self, Number, Value};
use crate::protocol::pytext::{cut, float_repr, repr_str};
use crate::serving::filtering::contains;
use crate::serving::refusals::Reason;
use crate::serving::validation::{malformed_message, InputSpec, RequestSpec};

/// Characters of a value quoted in a token-limit message (messages.cut's default).
const QUOTED_CHARS: usize = 120;
/// Characters of an unknown key echoed back (and named as the refusal's field).
const UNKNOWN_KEY_CHARS: usize = 80;

/// What a generate request to one model may ask for, from the configuration's `generation` section
/// (built once per model and configuration, not per request).
#[derive(Debug, Clone)]
pub struct GenerateLimits {
    /// Longest text input, in UTF-8 bytes (validation.max_bytes_element).
    pub max_text_bytes: u64,
    /// Ceiling on every `token_limit_keys` value for this model (generation.max_tokens[_per_model]).
    pub max_tokens: u64,
    pub token_limit_keys: HashSet<String>,
    /// Keys accepted besides the model's inputs (generation.parameters and token_limit_keys).
    pub parameters: HashSet<String>,
}

/// A generate body refused: the reason, a message a person can act on, the field it concerns ("" for
/// the body as a whole) and whether that field is one of the model's inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerateRefused {
    pub reason: Reason,
    pub message: String,
    pub field: String,
    pub is_input: bool,
}

type Outcome = Result<(), GenerateRefused>;

fn refuse(reason: Reason, message: String, field: &str, is_input: bool) -> GenerateRefused {
    GenerateRefused { reason, message, field: field.to_owned(), is_input }
}

/// Check one generate body against the model's inputs and the generation limits.
pub fn check_generate_request(spec: &RequestSpec, limits: &GenerateLimits, body: &[u8]) -> Outcome {
    let doc =
        json::parse(body).map_err(|e| refuse(Reason::Malformed, malformed_message("request body", &e), "", false))?;
    // Python's reader (RapidJSON) refuses a number too large for a double; ours reads it as infinity.
    if let Some(offset) = first_overflowing_number(&doc, body) {
        let e = json::ParseError { offset, what: "Number too big to be stored in double.".into() };
        return Err(refuse(Reason::Malformed, malformed_message("request body", &e), "", false));
    }
    let Value::Object(members) = &doc else {
        return Err(refuse(
            Reason::Schema,
            "a generate request is one JSON object: each key an input of the model or a parameter".into(),
            "",
            false,
        ));
    };
    let check = Check { spec, limits };
    for (name, value) in members {
        let name = name.as_ref();
        if let Some(input) = spec.inputs.iter().find(|i| i.name == name) {
            check.input(input, value)?;
        } else if name == "id" {
            if !matches!(value, Value::Str(_)) {
                return Err(refuse(Reason::Schema, "'id' must be a string".into(), name, false));
            }
        } else if name == "parameters" {
            let Value::Object(parameters) = value else {
                return Err(refuse(
                    Reason::Parameter,
                    "'parameters' must be an object of parameters".into(),
                    name,
                    false,
                ));
            };
            for (key, item) in parameters {
                check.parameter(key, item, &format!("parameters.{key}"))?;
            }
        } else {
            check.parameter(name, value, name)?;
        }
    }
    let missing = spec
        .inputs
        .iter()
        .filter(|i| !i.optional && !members.iter().any(|(k, _)| k == &i.name))
        .map(|i| i.name.as_str())
        .min();
    if let Some(name) = missing {
        return Err(refuse(
            Reason::MissingInput,
            format!("model {} requires input {}", spec.model, repr_str(name)),
            name,
            true,
        ));
    }
    Ok(())
}

/// The byte offset of the first number (in document order) too large for a double. Values borrow
/// the body's text, so a number's offset is where its text starts.
fn first_overflowing_number(value: &Value, body: &[u8]) -> Option<usize> {
    match value {
        Value::Number { text, below_exp10, .. } if *below_exp10 > 308 => py_float(value)
            .is_some_and(f64::is_infinite)
            .then(|| (text.as_ptr() as usize).saturating_sub(body.as_ptr() as usize)),
        Value::Array(items) => items.iter().find_map(|v| first_overflowing_number(v, body)),
        Value::Numbers(run) if run.below_exp10 > 308 => run.iter().find_map(|v| first_overflowing_number(&v, body)),
        Value::Object(members) => members.iter().find_map(|(_, v)| first_overflowing_number(v, body)),
        _ => None,
    }
}

/// The items of a value that may be a scalar or a flat list.
fn items_of<'v, 'a>(value: &'v Value<'a>) -> std::borrow::Cow<'v, [Value<'a>]> {
    value.items().unwrap_or_else(|| std::borrow::Cow::Borrowed(std::slice::from_ref(value)))
}

/// A JSON number as Python's reader (RapidJSON, native numbers) holds it: an int when written without
/// fraction or exponent and it fits i64 or u64; a float otherwise (wider integers too).
fn is_int(value: &Value) -> bool {
    matches!(value.number(), Some(Number::Int(_) | Number::UInt(_)))
}

/// The float Python's reader makes of a number that is not an int; None for an int or a non-number.
fn py_float(value: &Value) -> Option<f64> {
    match (value, value.number()) {
        (_, Some(Number::Float(f))) => Some(f),
        // Digits checked while parsing; too many for a double read as infinity (refused above).
        (Value::Number { text, .. }, Some(Number::BigInt)) => Some(text.parse::<f64>().unwrap_or(f64::INFINITY)),
        _ => None,
    }
}

fn is_finite(value: &Value) -> bool {
    py_float(value).is_none_or(f64::is_finite)
}

/// Python's `str(int)` of an int JSON number (JSON writes no leading zeros, and "-0" is 0).
fn int_text(value: &Value) -> String {
    match value.number() {
        Some(Number::Int(i)) => i.to_string(),
        Some(Number::UInt(u)) => u.to_string(),
        _ => String::new(),
    }
}

/// Python's `repr` of a scalar JSON value.
fn scalar_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Str(s) => repr_str(s),
        v if is_int(v) => int_text(v),
        v => py_float(v).map(float_repr).unwrap_or_default(),
    }
}

/// What the Python half called a value of the wrong type.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Bool(_) => "a boolean",
        Value::Str(_) => "a string",
        v if is_int(v) => "an integer",
        v if py_float(v).is_some() => "a number",
        _ => "a value",
    }
}

struct Check<'s> {
    spec: &'s RequestSpec,
    limits: &'s GenerateLimits,
}

impl Check<'_> {
    fn parameter(&self, key: &str, value: &Value, place: &str) -> Outcome {
        if !self.limits.parameters.contains(key) {
            let mut known: Vec<&str> = self.spec.inputs.iter().map(|i| i.name.as_str()).collect();
            known.sort_unstable();
            let shown = cut(place, UNKNOWN_KEY_CHARS);
            return Err(refuse(
                Reason::UnknownField,
                format!(
                    "{} is neither an input of model {} ({}) nor a parameter the sidecar knows (generation.parameters)",
                    repr_str(&shown),
                    self.spec.model,
                    known.join(", ")
                ),
                &shown,
                false,
            ));
        }
        for item in items_of(value).iter() {
            if matches!(item, Value::Null | Value::Array(_) | Value::Numbers(_) | Value::Object(_)) {
                return Err(refuse(
                    Reason::Parameter,
                    format!("parameter {} must be a string, number or boolean (or a list of them)", repr_str(place)),
                    place,
                    false,
                ));
            }
            if !is_finite(item) {
                return Err(refuse(
                    Reason::NonFinite,
                    format!("parameter {} is NaN or infinite", repr_str(place)),
                    place,
                    false,
                ));
            }
        }
        if self.limits.token_limit_keys.contains(key) {
            self.token_limit(place, value, false)?;
        }
        Ok(())
    }

    fn token_limit(&self, place: &str, value: &Value, is_input: bool) -> Outcome {
        for item in items_of(value).iter() {
            let negative = matches!(item.number(), Some(Number::Int(i)) if i < 0);
            if !is_int(item) || negative {
                return Err(refuse(
                    Reason::Datatype,
                    format!(
                        "{} must be a whole number of tokens, got {}",
                        repr_str(place),
                        cut(&scalar_repr(item), QUOTED_CHARS)
                    ),
                    place,
                    is_input,
                ));
            }
            let tokens = match item.number() {
                Some(Number::Int(i)) => i as u64, // not negative: refused above
                Some(Number::UInt(u)) => u,
                _ => 0,
            };
            if tokens > self.limits.max_tokens {
                return Err(refuse(
                    Reason::TooManyTokens,
                    format!(
                        "{} is {}, above the ceiling of {} tokens for model {} (generation.max_tokens)",
                        repr_str(place),
                        int_text(item),
                        self.limits.max_tokens,
                        self.spec.model
                    ),
                    place,
                    is_input,
                ));
            }
        }
        Ok(())
    }

    fn input(&self, input: &InputSpec, value: &Value) -> Outcome {
        let name = input.name.as_str();
        let datatype = input.datatype.as_str();
        let items = items_of(value);
        let refused = |reason: Reason, message: String| refuse(reason, message, name, true);
        for item in items.iter() {
            if matches!(item, Value::Null | Value::Array(_) | Value::Numbers(_) | Value::Object(_)) {
                return Err(refused(
                    Reason::Shape,
                    format!("input {} takes a value or a flat list of values", repr_str(name)),
                ));
            }
            let ok = match datatype {
                "BYTES" => match item {
                    Value::Str(text) => {
                        if text.len() as u64 > self.limits.max_text_bytes {
                            return Err(refused(
                                Reason::BytesTooLong,
                                format!(
                                    "input {} is longer than {} bytes (validation.max_bytes_element)",
                                    repr_str(name),
                                    self.limits.max_text_bytes
                                ),
                            ));
                        }
                        true
                    }
                    _ => false,
                },
                "BOOL" => matches!(item, Value::Bool(_)),
                "FP16" | "FP32" | "FP64" | "BF16" => {
                    let number = is_int(item) || py_float(item).is_some();
                    if number && !is_finite(item) {
                        return Err(refused(Reason::NonFinite, format!("input {} is NaN or infinite", repr_str(name))));
                    }
                    number
                }
                _ => match int_range(datatype) {
                    Some((low, high)) => {
                        let number = is_int(item);
                        let fits = match item.number() {
                            Some(Number::Int(i)) => (low..=high).contains(&i128::from(i)),
                            Some(Number::UInt(u)) => (low..=high).contains(&i128::from(u)),
                            _ => false,
                        };
                        if number && !fits {
                            return Err(refused(
                                Reason::OutOfRange,
                                format!("input {}: {} does not fit {datatype}", repr_str(name), int_text(item)),
                            ));
                        }
                        number
                    }
                    // A datatype the generate extension has no JSON for: Triton's to judge.
                    None => true,
                },
            };
            if !ok {
                return Err(refused(
                    Reason::Datatype,
                    format!("input {} is {datatype}; got {}", repr_str(name), kind(item)),
                ));
            }
        }
        let fixed = !input.shape.is_empty() && input.shape.iter().all(|d| *d > 0);
        if fixed {
            // u128: a product of i64 dims that overflows it is no count a body could match anyway.
            let count = input.shape.iter().fold(1u128, |acc, d| acc.saturating_mul(*d as u128));
            if count != items.len() as u128 {
                let shape: Vec<String> = input.shape.iter().map(i64::to_string).collect();
                return Err(refused(
                    Reason::Shape,
                    format!(
                        "input {} holds {count} value(s) (shape [{}]), got {}",
                        repr_str(name),
                        shape.join(", "),
                        items.len()
                    ),
                ));
            }
        }
        if self.limits.token_limit_keys.contains(name) {
            self.token_limit(name, value, true)?;
        }
        Ok(())
    }
}

/// Keys of every generate answer that are not outputs: never hidden.
const ENVELOPE_KEYS: [&str; 3] = ["model_name", "model_version", "id"];

/// Words Triton writes for non-finite floats in JSON; absent from an event = nothing to look for.
const NON_FINITE_WORDS: [&[u8]; 2] = [b"NaN", b"Infinity"];

/// False when an event can be passed on unparsed: no filtering rule for the model, no error key, and
/// no NaN/Infinity word anywhere in its text (the common case: most events are one token).
pub fn needs_screening(data: &[u8], has_filter: bool, check_non_finite: bool) -> bool {
    if has_filter || contains(data, b"\"error\"") {
        return true;
    }
    check_non_finite && NON_FINITE_WORDS.iter().any(|w| contains(data, w))
}

/// One generate answer (or one event of a stream) as it may leave the pod.
#[derive(Debug, PartialEq, Eq)]
pub struct ScreenedEvent {
    /// The event without its hidden outputs; None when it passes untouched.
    pub data: Option<Vec<u8>>,
    pub dropped: Vec<String>,
    /// Fields holding NaN or ±Inf (only looked for when asked).
    pub non_finite: Vec<String>,
    /// Triton's own error, when the event is `{"error": ...}` (as Python's `str` writes it).
    pub error: Option<String>,
}

/// An event that is not a JSON object; the message says how.
#[derive(Debug, PartialEq, Eq)]
pub struct EventFormatError(pub String);

/// Hidden outputs cut out of the event's text (the members kept byte for byte), NaN/Inf fields found,
/// Triton's error events named.
pub fn screen_event(
    data: &[u8],
    is_hidden: Option<&dyn Fn(&str) -> bool>,
    check_non_finite: bool,
) -> Result<ScreenedEvent, EventFormatError> {
    let not_json = |what: String| EventFormatError(format!("an event that is not JSON: {}", cut(&what, QUOTED_CHARS)));
    if let Err(e) = std::str::from_utf8(data) {
        return Err(not_json(utf8_error_text(data, &e)));
    }
    let doc = json::parse(data).map_err(|e| not_json(e.to_string()))?;
    if let Some(offset) = first_overflowing_number(&doc, data) {
        return Err(not_json(format!("Parse error at offset {offset}: Number too big to be stored in double.")));
    }
    let Value::Object(members) = &doc else {
        return Err(EventFormatError("an event that is not a JSON object".into()));
    };
    if let Some(error) = doc.get("error") {
        let error = match error {
            Value::Str(s) => s.to_string(),
            other => py_repr(other),
        };
        return Ok(ScreenedEvent { data: None, dropped: Vec::new(), non_finite: Vec::new(), error: Some(error) });
    }
    let drop: Vec<bool> =
        members.iter().map(|(k, _)| !ENVELOPE_KEYS.contains(&k.as_ref()) && is_hidden.is_some_and(|f| f(k))).collect();
    let kept = members.iter().zip(&drop).filter(|(_, d)| !**d).map(|(m, _)| m);
    let non_finite: Vec<String> = if check_non_finite {
        kept.filter(|(_, v)| has_non_finite(v)).map(|(k, _)| k.to_string()).collect()
    } else {
        Vec::new()
    };
    let dropped: Vec<String> =
        members.iter().zip(&drop).filter(|(_, d)| **d).map(|((k, _), _)| k.to_string()).collect();
    let data = if dropped.is_empty() { None } else { Some(drop_members(data, &drop)) };
    Ok(ScreenedEvent { data, dropped, non_finite, error: None })
}

fn has_non_finite(value: &Value) -> bool {
    match value {
        Value::NonFinite(_) => true,
        Value::Array(items) => items.iter().any(has_non_finite),
        // A run holds no NaN or Infinity literal; only an exponent past a double's range reads as one.
        Value::Numbers(run) => {
            run.below_exp10 > 308 && run.iter().any(|v| py_float(&v).is_some_and(|f| !f.is_finite()))
        }
        _ => false,
    }
}

/// Python's `repr` of a JSON value (what `str()` wrote for an error that is not a string).
fn py_repr(value: &Value) -> String {
    match value {
        Value::Array(items) => format!("[{}]", items.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Numbers(run) => format!("[{}]", run.iter().map(|v| py_repr(&v)).collect::<Vec<_>>().join(", ")),
        Value::Object(members) => format!(
            "{{{}}}",
            members.iter().map(|(k, v)| format!("{}: {}", repr_str(k), py_repr(v))).collect::<Vec<_>>().join(", ")
        ),
        scalar => scalar_repr(scalar),
    }
}

/// What Python's UTF-8 decoder says of bytes that are not UTF-8 (the event reader decoded first).
fn utf8_error_text(data: &[u8], e: &std::str::Utf8Error) -> String {
    let at = e.valid_up_to();
    let byte = data.get(at).copied().unwrap_or(0);
    let why = match e.error_len() {
        None => {
            let last = data.len().saturating_sub(1);
            return if last > at {
                format!("'utf-8' codec can't decode bytes in position {at}-{last}: unexpected end of data")
            } else {
                format!("'utf-8' codec can't decode byte 0x{byte:02x} in position {at}: unexpected end of data")
            };
        }
        Some(_) if (0x80..=0xc1).contains(&byte) || byte >= 0xf5 => "invalid start byte",
        Some(_) => "invalid continuation byte",
    };
    format!("'utf-8' codec can't decode byte 0x{byte:02x} in position {at}: {why}")
}

/// The object's text without the members marked in `drop` (its text is valid JSON: it was parsed).
fn drop_members(text: &[u8], drop: &[bool]) -> Vec<u8> {
    let spans = member_spans(text);
    let Some(last) = spans.last() else {
        return text.to_vec();
    };
    if last.1 > text.len() || spans.len() != drop.len() {
        return text.to_vec(); // not the text that was parsed: keep it whole rather than guess
    }
    let keep: Vec<bool> = drop.iter().map(|d| !d).collect();
    json::splice(text, &spans, &keep)
}

/// The byte spans (key's opening quote to the value's end) of the members of the top-level object in
/// a text known to be valid JSON: only strings and nesting need tracking.
fn member_spans(text: &[u8]) -> Vec<(usize, usize)> {
    let ws = |pos: &mut usize| {
        while matches!(text.get(*pos), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            *pos += 1;
        }
    };
    let string_end = |mut pos: usize| -> usize {
        pos += 1; // the opening quote
        while let Some(b) = text.get(pos) {
            match b {
                b'\\' => pos += 2,
                b'"' => return pos + 1,
                _ => pos += 1,
            }
        }
        text.len()
    };
    let value_end = |mut pos: usize| -> usize {
        match text.get(pos) {
            Some(b'"') => string_end(pos),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                while let Some(b) = text.get(pos) {
                    match b {
                        b'"' => {
                            pos = string_end(pos);
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth = depth.saturating_sub(1);
                            if depth == 0 {
                                return pos + 1;
                            }
                        }
                        _ => {}
                    }
                    pos += 1;
                }
                text.len()
            }
            _ => {
                while !matches!(text.get(pos), None | Some(b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')) {
                    pos += 1;
                }
                pos
            }
        }
    };
    let mut spans = Vec::new();
    let mut pos = 0;
    ws(&mut pos);
    pos += 1; // '{'
    loop {
        ws(&mut pos);
        if text.get(pos) != Some(&b'"') {
            return spans;
        }
        let start = pos;
        pos = string_end(pos);
        ws(&mut pos);
        pos += 1; // ':'
        ws(&mut pos);
        pos = value_end(pos);
        spans.push((start, pos));
        ws(&mut pos);
        if text.get(pos) == Some(&b',') {
            pos += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::validation::Limits;

    /// tests/test_generation.py's model: a text prompt, an optional max_tokens input, a free list.
    fn llm() -> RequestSpec {
        let input = |name: &str, datatype: &str, shape: Vec<i64>, optional: bool| InputSpec {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            optional,
        };
        RequestSpec {
            model: "llm".into(),
            inputs: vec![
                input("text_input", "BYTES", vec![1], false),
                input("max_tokens", "INT32", vec![1], true),
                input("temperature_in", "FP32", vec![-1], true),
            ],
            outputs: vec!["text_output".into()],
            hidden_outputs: HashSet::new(),
            max_batch_size: 0,
            limits: Limits { max_elements: 1000, max_bytes_element: 1000, reject_non_finite: true },
            rules: None,
        }
    }

    /// generation.max_tokens 100, 50 for model llm, text up to 32 bytes; the default key lists.
    fn limits() -> GenerateLimits {
        let token_limit_keys: HashSet<String> =
            ["max_tokens", "max_new_tokens", "max_output_tokens"].map(String::from).into_iter().collect();
        let mut parameters: HashSet<String> =
            ["temperature", "top_p", "top_k", "seed", "stop"].map(String::from).into_iter().collect();
        parameters.extend(token_limit_keys.iter().cloned());
        GenerateLimits { max_text_bytes: 32, max_tokens: 50, token_limit_keys, parameters }
    }

    fn refused(body: &str) -> GenerateRefused {
        match check_generate_request(&llm(), &limits(), body.as_bytes()) {
            Ok(()) => panic!("{body} passed"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_body_of_inputs_and_known_parameters_passes() {
        let body = r#"{"text_input": "hi", "max_tokens": 50, "temperature": 0, "seed": 7, "id": "r1",
                      "parameters": {"top_k": 1, "stop": ["\n", "."]}, "temperature_in": [0.5, 1]}"#;
        assert_eq!(check_generate_request(&llm(), &limits(), body.as_bytes()), Ok(()));
    }

    #[test]
    fn bad_bodies_are_refused_naming_the_field() {
        let e = "é".repeat(17); // 34 bytes > 32
        let long_text = format!(r#"{{"text_input": "{e}"}}"#);
        for (body, reason, field, is_input) in [
            (r#"{"text_input": "hi", "max_tokens": 51}"#, Reason::TooManyTokens, "max_tokens", true),
            (r#"{"text_input": "hi", "max_new_tokens": 51}"#, Reason::TooManyTokens, "max_new_tokens", false),
            (r#"{"text_input": "hi", "max_tokens": true}"#, Reason::Datatype, "max_tokens", true),
            (r#"{"text_input": "hi", "max_tokens": 1099511627776}"#, Reason::OutOfRange, "max_tokens", true),
            (r#"{"text_input": "hi", "top_p": NaN}"#, Reason::NonFinite, "top_p", false),
            (r#"{"text_input": "hi", "parameters": {"tmp": 1}}"#, Reason::UnknownField, "parameters.tmp", false),
            (r#"{"text_input": "hi", "parameters": [1]}"#, Reason::Parameter, "parameters", false),
            (&long_text, Reason::BytesTooLong, "text_input", true),
            (r#"{"text_input": "hi", "temperature_in": "warm"}"#, Reason::Datatype, "temperature_in", true),
            (r#"{"text_input": [["nested"]]}"#, Reason::Shape, "text_input", true),
            (r#"{"text_input": "hi", "id": 3}"#, Reason::Schema, "id", false),
            (r#"{"max_tokens": 1}"#, Reason::MissingInput, "text_input", true),
        ] {
            let r = refused(body);
            assert_eq!((r.reason, r.field.as_str(), r.is_input), (reason, field, is_input), "{body}: {r:?}");
        }
    }

    #[test]
    fn messages_are_the_python_half_s_words() {
        for (body, message) in [
            (
                r#"{"text_input": "hi", "max_new_tokens": 51}"#,
                "'max_new_tokens' is 51, above the ceiling of 50 tokens for model llm (generation.max_tokens)",
            ),
            (
                r#"{"text_input": "hi", "max_new_tokens": 99999999999999999999999}"#,
                "'max_new_tokens' must be a whole number of tokens, got 1e+23",
            ),
            (
                r#"{"text_input": "hi", "max_new_tokens": -3}"#,
                "'max_new_tokens' must be a whole number of tokens, got -3",
            ),
            (
                r#"{"text_input": "hi", "max_new_tokens": 2.0}"#,
                "'max_new_tokens' must be a whole number of tokens, got 2.0",
            ),
            (
                r#"{"text_input": "hi", "max_new_tokens": "it's"}"#,
                r#"'max_new_tokens' must be a whole number of tokens, got "it's""#,
            ),
            (
                r#"{"text_input": "hi", "temprature": 1}"#,
                "'temprature' is neither an input of model llm (max_tokens, temperature_in, text_input) nor a \
                 parameter the sidecar knows (generation.parameters)",
            ),
            (
                r#"{"text_input": "hi", "stop": [null]}"#,
                "parameter 'stop' must be a string, number or boolean (or a list of them)",
            ),
            (
                r#"{"text_input": "hi", "parameters": {"top_p": -Infinity}}"#,
                "parameter 'parameters.top_p' is NaN or infinite",
            ),
            (r#"{"text_input": "hi", "temperature_in": [1, NaN]}"#, "input 'temperature_in' is NaN or infinite"),
            (r#"{"text_input": "hi", "temperature_in": [true]}"#, "input 'temperature_in' is FP32; got a boolean"),
            (r#"{"text_input": 3}"#, "input 'text_input' is BYTES; got an integer"),
            (r#"{"text_input": "hi", "max_tokens": 1.5}"#, "input 'max_tokens' is INT32; got a number"),
            (
                r#"{"text_input": "hi", "max_tokens": -2147483649}"#,
                "input 'max_tokens': -2147483649 does not fit INT32",
            ),
            (r#"{"text_input": ["a", "b"]}"#, "input 'text_input' holds 1 value(s) (shape [1]), got 2"),
            (
                r#"{"text_input": "hi", "text_input": "ho"}"#,
                "request body is not valid JSON: duplicate key text_input in a JSON object",
            ),
            ("{", "request body is not valid JSON: Parse error at offset 1: Missing a name for object member."),
            (
                r#"{"text_input": "hi", "top_p": 1e400}"#,
                "request body is not valid JSON: Parse error at offset 30: Number too big to be stored in double.",
            ),
            ("[1]", "a generate request is one JSON object: each key an input of the model or a parameter"),
            (r#"{"text_input": "hi", "parameters": 1}"#, "'parameters' must be an object of parameters"),
            (r#"{"max_tokens": 1}"#, "model llm requires input 'text_input'"),
        ] {
            assert_eq!(refused(body).message, message, "{body}");
        }
    }

    #[test]
    fn the_first_problem_in_document_order_is_reported() {
        let r = refused(r#"{"temprature": 1, "text_input": 5, "max_tokens": 99}"#);
        assert_eq!((r.reason, r.field.as_str()), (Reason::UnknownField, "temprature"));
        let r = refused(r#"{"max_tokens": 99, "text_input": 5}"#);
        assert_eq!(r.reason, Reason::TooManyTokens);
        let long_key = format!(r#"{{"text_input": "hi", "{}": 1}}"#, "k".repeat(100));
        assert_eq!(refused(&long_key).field, format!("{}...", "k".repeat(77)));
    }

    fn secret(name: &str) -> bool {
        name.starts_with("secret")
    }

    fn screened(event: &[u8]) -> ScreenedEvent {
        match screen_event(event, Some(&secret), true) {
            Ok(s) => s,
            Err(e) => panic!("{}: {}", String::from_utf8_lossy(event), e.0),
        }
    }

    #[test]
    fn screening_drops_hidden_outputs_and_finds_non_finite_fields() {
        let s = screened(br#"{"model_name":"llm","text_output":"hi","logprob":NaN,"secret":"x"}"#);
        assert_eq!((s.dropped, s.non_finite), (vec!["secret".to_string()], vec!["logprob".to_string()]));
        assert_eq!(s.data.unwrap(), br#"{"model_name":"llm","text_output":"hi","logprob":NaN}"#);
        let untouched = screened(br#"{"model_name":"llm","text_output":"hi"}"#);
        assert_eq!(untouched, ScreenedEvent { data: None, dropped: vec![], non_finite: vec![], error: None });
        let error = screen_event(br#"{"error":"Stub process is not healthy."}"#, None, true).unwrap();
        assert_eq!(error.error.as_deref(), Some("Stub process is not healthy."));
    }

    #[test]
    fn kept_members_pass_byte_for_byte_and_the_envelope_is_never_hidden() {
        let s = screened(br#" { "secret" : [1, {"x": "}"}] , "text_output" : "a\"b\u00e9" , "secret2": {} } "#);
        assert_eq!(s.dropped, vec!["secret".to_string(), "secret2".to_string()]);
        assert_eq!(s.data.unwrap(), br#" { "text_output" : "a\"b\u00e9" } "#);
        let s = screen_event(br#"{"id":"x","secret":1,"model_name":"m"}"#, Some(&|_: &str| true), true).unwrap();
        assert_eq!(s.data.unwrap(), br#"{"id":"x","model_name":"m"}"#);
        assert_eq!(screened(br#"{"secret": 1}"#).data.unwrap(), b"{}");
    }

    #[test]
    fn non_finite_values_are_looked_for_in_lists_not_objects() {
        let s = screen_event(br#"{"a": [1, [2, -Infinity]], "b": {"c": NaN}, "secret_x": [NaN]}"#, None, true).unwrap();
        assert_eq!(s.non_finite, vec!["a".to_string(), "secret_x".to_string()]);
        let s = screen_event(br#"{"a": [NaN]}"#, None, false).unwrap();
        assert!(s.non_finite.is_empty());
    }

    #[test]
    fn an_error_that_is_not_a_string_is_written_as_python_writes_it() {
        for (event, error) in [
            (&br#"{"error": {"a": [1, 2.5, null, true, "x", NaN]}}"#[..], "{'a': [1, 2.5, None, True, 'x', nan]}"),
            (br#"{"error": 5}"#, "5"),
            (br#"{"error": null, "secret": 1}"#, "None"),
        ] {
            let s = screened(event);
            assert_eq!((s.error.as_deref(), s.data), (Some(error), None));
        }
    }

    #[test]
    fn events_that_are_not_json_objects_say_how() {
        for (event, message) in [
            (&b"{\"a\": 1e400}"[..], "an event that is not JSON: Parse error at offset 6: Number too big to be stored in double."),
            (b"{\"a\": \"\xff\"}", "an event that is not JSON: 'utf-8' codec can't decode byte 0xff in position 7: invalid start byte"),
            (b"{\"a\": \"\xe2\x82", "an event that is not JSON: 'utf-8' codec can't decode bytes in position 7-8: unexpected end of data"),
            (
                b"{\"a\": \"\xe0\x80\"}",
                "an event that is not JSON: 'utf-8' codec can't decode byte 0xe0 in position 7: invalid continuation byte",
            ),
            (b"[1]", "an event that is not a JSON object"),
            (b"{", "an event that is not JSON: Parse error at offset 1: Missing a name for object member."),
        ] {
            assert_eq!(screen_event(event, None, true).unwrap_err().0, message);
        }
    }

    #[test]
    fn only_events_with_a_filter_an_error_or_a_non_finite_word_are_parsed() {
        let token = br#"{"model_name":"llm","text_output":"hi"}"#;
        assert!(!needs_screening(token, false, true));
        assert!(needs_screening(token, true, false));
        assert!(needs_screening(br#"{"error":"x"}"#, false, false));
        assert!(needs_screening(br#"{"a":NaN}"#, false, true));
        assert!(!needs_screening(br#"{"a":NaN}"#, false, false));
    }
}
