//! A model's request rule file (`validation.schemas.<model>`): a Draft 2020-12 JSON Schema over the
//! request *envelope* (tensor `data` removed), and `x-tensors` rules on each named input's values.
//!
//! Python reads the file and checks it at start-up (meta-schema, draft, the shape of `x-tensors`,
//! no rule on `data`: sidecar/serving/request_rules.py, one ConfigError naming file and key); it hands
//! the schema's JSON down once, and it is compiled here once, so a request pays only for the check.
//! Both halves call this one implementation: the front's lanes, and the Python chain (gRPC, the
//! Python listener) through `RequestSpec.validate`.
//!
//! Refusals are the ones the Python chain always gave (400 `business_rule`): the schema's first error
//! in python-jsonschema's words, at `$` plus its path; a value rule naming the input, the first
//! element that breaks it and the value as numpy would print it. The order is the Python chain's:
//! the envelope first, then the JSON tensors in request order, then the binary ones; for one tensor,
//! `enum`, `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`.

use std::fmt;

use serde_json::{Map, Number as JsonNumber, Value as Json};

use crate::protocol::json::{Number, Value};
use crate::protocol::pytext::{cut, echo_str, float_repr, json_string, repr_str, MAX_ECHO_CHARS};
use crate::serving::refusals::{Reason, Refused};
use crate::serving::validation::{CheckedInput, Values};

/// A number of the rule file as Python holds it: an int stays an int (its repr has no ".0").
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bound {
    Int(i128),
    Float(f64),
}

impl Bound {
    fn of(number: &JsonNumber) -> Bound {
        if let Some(i) = number.as_i64() {
            Bound::Int(i as i128)
        } else if let Some(u) = number.as_u64() {
            Bound::Int(u as i128)
        } else {
            Bound::Float(number.as_f64().unwrap_or(f64::NAN))
        }
    }

    fn repr(self) -> String {
        match self {
            Bound::Int(i) => i.to_string(),
            Bound::Float(f) => float_repr(f),
        }
    }
}

/// One element of a tensor as numpy holds it after `np.asarray` (JSON) or `np.frombuffer` (binary).
#[derive(Debug, Clone, PartialEq)]
enum Element<'v> {
    Bool(bool),
    Int(i128),
    Float(f64),
    Text(&'v str),
}

impl Element<'_> {
    /// The value compared with a bound, numpy's way: integers exactly against an integer bound,
    /// everything else as float64; a bool is 0 or 1. None for text (never compared).
    fn compare(&self, bound: Bound) -> Option<std::cmp::Ordering> {
        let exact = match self {
            Element::Bool(b) => Some(*b as i128),
            Element::Int(i) => Some(*i),
            _ => None,
        };
        match (exact, bound) {
            (Some(i), Bound::Int(b)) => Some(i.cmp(&b)),
            (_, b) => {
                let bound = match b {
                    Bound::Int(i) => i as f64,
                    Bound::Float(f) => f,
                };
                self.as_f64()?.partial_cmp(&bound)
            }
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match self {
            Element::Bool(b) => Some(*b as u8 as f64),
            Element::Int(i) => Some(*i as f64),
            Element::Float(f) => Some(*f),
            Element::Text(_) => None,
        }
    }

    /// Is it one of the `enum` members (`np.isin`)? Numbers and bools by value; text by equality
    /// with text alone. A non-BYTES tensor against an enum that holds text: numpy makes the enum an
    /// array of strings, which no number equals.
    fn is_in(&self, allowed: &[Json], any_text: bool) -> bool {
        match self {
            Element::Text(t) => allowed.iter().any(|a| a.as_str() == Some(*t)),
            _ if any_text => false,
            number => allowed.iter().any(|a| {
                let member = match a {
                    Json::Bool(b) => Element::Bool(*b),
                    Json::Number(n) => match Bound::of(n) {
                        Bound::Int(i) => Element::Int(i),
                        Bound::Float(f) => Element::Float(f),
                    },
                    _ => return false,
                };
                match (number, &member) {
                    (Element::Int(x), Element::Int(y)) => x == y,
                    (Element::Bool(x), Element::Int(y)) | (Element::Int(y), Element::Bool(x)) => *x as i128 == *y,
                    _ => number.as_f64() == member.as_f64(),
                }
            }),
        }
    }

    /// `repr(values[i].item())`, with ints shown as floats in a float tensor (numpy's array kind).
    fn repr(&self, float_kind: bool) -> String {
        match self {
            Element::Bool(b) => (if *b { "True" } else { "False" }).into(),
            Element::Int(i) if float_kind => float_repr(*i as f64),
            Element::Int(i) => i.to_string(),
            Element::Float(f) => float_repr(*f),
            Element::Text(t) => repr_str(t),
        }
    }

    /// `messages.echo(values[i].item())`: text as it is, anything else as `json.dumps` writes it.
    fn echo(&self, float_kind: bool) -> String {
        let text = match self {
            Element::Bool(b) => (if *b { "true" } else { "false" }).into(),
            Element::Float(f) => json_float(*f),
            Element::Int(i) if float_kind => json_float(*i as f64),
            Element::Int(i) => i.to_string(),
            Element::Text(t) => (*t).to_owned(),
        };
        cut(&text, MAX_ECHO_CHARS)
    }
}

/// A float as `json.dumps` writes it (NaN and the infinities as the literals Python writes).
fn json_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        (if f > 0.0 { "Infinity" } else { "-Infinity" }).into()
    } else {
        float_repr(f)
    }
}

/// The value rules of one input tensor (one entry of `x-tensors`).
#[derive(Debug, Default)]
struct TensorRule {
    /// minimum, maximum, exclusiveMinimum, exclusiveMaximum: checked in this order.
    bounds: [Option<Bound>; 4],
    allowed: Option<Vec<Json>>,
    /// Some member of `allowed` is text.
    allowed_text: bool,
}

/// How each bound is broken, and the words a refusal says it with (the Python chain's).
type Broken = fn(std::cmp::Ordering) -> bool;

const BOUND_WORDS: [(&str, Broken); 4] = [
    ("below the minimum", std::cmp::Ordering::is_lt),
    ("above the maximum", std::cmp::Ordering::is_gt),
    ("not above the exclusive minimum", std::cmp::Ordering::is_le),
    ("not below the exclusive maximum", std::cmp::Ordering::is_ge),
];

/// Formats python-jsonschema's FormatChecker() does not check without packages the sidecar does not
/// install (rfc3339-validator, rfc3987, uri-template, jsonpointer, isoduration...): annotations only.
const PYTHON_UNCHECKED_FORMATS: [&str; 10] = [
    "date-time",
    "duration",
    "hostname",
    "iri",
    "iri-reference",
    "json-pointer",
    "relative-json-pointer",
    "uri",
    "uri-reference",
    "uri-template",
];

/// "date" as python-jsonschema checks it: YYYY-MM-DD (`date.fromisoformat`), a real day of year 1+.
fn python_date(s: &str) -> bool {
    let b = s.as_bytes();
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' || !digits(0..4) || !digits(5..7) || !digits(8..10) {
        return false;
    }
    let number = |r: std::ops::Range<usize>| b[r].iter().fold(0u32, |n, d| n * 10 + (d - b'0') as u32);
    let (year, month, day) = (number(0..4), number(5..7), number(8..10));
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    year >= 1 && (1..=days).contains(&day)
}

/// "time" as python-jsonschema's FormatChecker() checks it without rfc3339-validator:
/// `datetime.strptime(s, "%H:%M:%S")` (one or two digits each, seconds up to 61).
fn python_time(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    let field = |text: &str, max: u32| {
        (1..=2).contains(&text.len())
            && text.bytes().all(|b| b.is_ascii_digit())
            && text.parse::<u32>().is_ok_and(|v| v <= max)
    };
    parts.len() == 3 && field(parts[0], 23) && field(parts[1], 59) && field(parts[2], 61)
}

/// A model's rule file, compiled once.
pub struct RequestRules {
    /// The file's name, as refusals quote it ("request breaks credit_risk.json at $: ...").
    file_name: String,
    /// None when the file has only `x-tensors` (nothing to check on the envelope); with the schema
    /// itself, which orders the errors as python-jsonschema meets them.
    envelope: Option<(jsonschema::Validator, Json)>,
    tensors: Vec<(String, TensorRule)>,
}

impl fmt::Debug for RequestRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestRules")
            .field("file_name", &self.file_name)
            .field("envelope", &self.envelope.is_some())
            .field("tensors", &self.tensors)
            .finish()
    }
}

impl RequestRules {
    /// Compile a rule file Python has read and checked (`schema`: its JSON text). An error says what
    /// in the file cannot be compiled; Python turns it into a ConfigError naming file and key.
    pub fn new(file_name: &str, schema: &str) -> Result<RequestRules, String> {
        let raw: Json = serde_json::from_str(schema).map_err(|e| format!("not valid JSON: {e}"))?;
        let Json::Object(mut envelope) = raw else {
            return Err("a request schema is a JSON object".into());
        };
        let mut tensors = Vec::new();
        if let Some(section) = envelope.remove("x-tensors") {
            let Json::Object(section) = section else {
                return Err("at $.x-tensors: must be an object of input name -> rules".into());
            };
            for (name, rule) in section {
                tensors.push((name.clone(), tensor_rule(&name, &rule)?));
            }
        }
        let envelope = if envelope.is_empty() {
            None
        } else {
            // Formats are checked as Python's FormatChecker() checked them for the same file: the
            // ones it knows (with the packages the sidecar installs) by its own rules, the others
            // left as annotations (a "date-time" it never checked is not refused now).
            let schema = Json::Object(envelope);
            let mut options = jsonschema::draft202012::options().should_validate_formats(true);
            for name in PYTHON_UNCHECKED_FORMATS {
                options = options.with_format(name, |_: &str| true);
            }
            let compiled = options
                .with_format("email", |s: &str| s.contains('@'))
                .with_format("idn-email", |s: &str| s.contains('@'))
                .with_format("date", python_date)
                .with_format("time", python_time)
                .build(&schema)
                .map_err(|e| format!("not a valid Draft 2020-12 schema: {e}"))?;
            Some((compiled, schema))
        };
        Ok(RequestRules { file_name: file_name.to_owned(), envelope, tensors })
    }

    /// Check a request that passed every other check: `doc` its JSON (header), `binary` what follows
    /// the header, `inputs` where each input's values are.
    pub fn check(&self, doc: &Value, binary: &[u8], inputs: &[CheckedInput]) -> Result<(), Refused> {
        if let Some((envelope, schema)) = &self.envelope {
            let instance = envelope_of(doc);
            // A request that passes costs one walk; only a refused one has its errors listed.
            let first = if envelope.is_valid(&instance) { None } else { first_error(schema, envelope, &instance) };
            if let Some(error) = first {
                let mut at = String::from("$");
                for segment in error.instance_path() {
                    match segment {
                        jsonschema::paths::LocationSegment::Property(p) => {
                            at.push('.');
                            at.push_str(&p);
                        }
                        jsonschema::paths::LocationSegment::Index(i) => at.push_str(&format!("[{i}]")),
                    }
                }
                let message =
                    format!("request breaks {} at {at}: {}", self.file_name, echo_str(&python_message(&error)));
                return Err(Refused { reason: Reason::BusinessRule, message, input: String::new() });
            }
        }
        if self.tensors.is_empty() {
            return Ok(());
        }
        let items: &[Value] = match doc.get("inputs") {
            Some(Value::Array(items)) => items,
            _ => &[],
        };
        // The JSON tensors first, then the binary ones, as the Python chain took them.
        for input in inputs {
            if let (Values::Json(i), Some(rule)) = (&input.values, self.rule_of(&input.name)) {
                if let Some(data) = items.get(*i).and_then(|t| t.get("data")) {
                    let mut elements = Vec::new();
                    flatten(data, &mut elements);
                    let float_kind = elements.iter().any(|e| matches!(e, Element::Float(_)));
                    self.check_tensor(&input.name, &input.datatype, rule, elements.into_iter(), float_kind)?;
                }
            }
        }
        for input in inputs {
            if let (Values::Binary { offset, size }, Some(rule)) = (&input.values, self.rule_of(&input.name)) {
                let Some(chunk) = binary.get(*offset..offset + size) else { continue };
                let float_kind = matches!(input.datatype.as_str(), "FP16" | "FP32" | "FP64");
                match input.datatype.as_str() {
                    // numpy has no BF16; BYTES are not viewed as an array: the Python chain left both.
                    "BYTES" | "BF16" => {}
                    datatype => {
                        self.check_tensor(&input.name, datatype, rule, binary_elements(datatype, chunk), float_kind)?
                    }
                }
            }
        }
        Ok(())
    }

    fn rule_of(&self, name: &str) -> Option<&TensorRule> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, r)| r)
    }

    /// One pass over a tensor's elements: the first element breaking the first rule (in the order
    /// the Python chain checked them) is the one refused. Elements are read as they come, no copy.
    fn check_tensor<'v>(
        &self,
        name: &str,
        datatype: &str,
        rule: &TensorRule,
        elements: impl Iterator<Item = Element<'v>>,
        float_kind: bool,
    ) -> Result<(), Refused> {
        let bytes = datatype == "BYTES";
        // first[0]: enum; first[1..]: the bounds. A rule earlier in the order wins, so once one is
        // broken the later ones are no longer looked at.
        let mut first: [Option<(usize, Element<'v>)>; 5] = [None, None, None, None, None];
        let mut earliest = 5;
        for (i, element) in elements.enumerate() {
            if let Some(allowed) = &rule.allowed {
                if !element.is_in(allowed, rule.allowed_text) {
                    first[0] = Some((i, element));
                    break;
                }
            }
            if bytes {
                continue;
            }
            for (k, bound) in rule.bounds.iter().enumerate().take(earliest - 1) {
                let Some(bound) = bound else { continue };
                let broken = element.compare(*bound).is_some_and(BOUND_WORDS[k].1);
                if broken && first[k + 1].is_none() {
                    first[k + 1] = Some((i, element.clone()));
                    earliest = earliest.min(k + 1);
                }
            }
            if earliest == 1 && rule.allowed.is_none() {
                break;
            }
        }
        let Some(k) = first.iter().position(Option::is_some) else { return Ok(()) };
        let Some((i, element)) = &first[k] else { return Ok(()) };
        let at = format!("input {} breaks {}", repr_str(name), self.file_name);
        let message = if k == 0 {
            let allowed = rule.allowed.as_deref().unwrap_or(&[]);
            format!(
                "{at}: element {i} = {} is not one of {}",
                element.echo(float_kind),
                cut(&python_json(&Json::Array(allowed.to_vec())), MAX_ECHO_CHARS)
            )
        } else {
            let bound = rule.bounds[k - 1].map(Bound::repr).unwrap_or_default();
            format!("{at}: element {i} = {} is {} {bound}", element.repr(float_kind), BOUND_WORDS[k - 1].0)
        };
        Err(Refused { reason: Reason::BusinessRule, message, input: name.to_owned() })
    }
}

fn tensor_rule(name: &str, rule: &Json) -> Result<TensorRule, String> {
    let at = format!("at $.x-tensors.{name}");
    let Json::Object(keys) = rule else { return Err(format!("{at}: must be an object of rules")) };
    let mut out = TensorRule::default();
    for (key, value) in keys {
        let slot = match key.as_str() {
            "minimum" => 0,
            "maximum" => 1,
            "exclusiveMinimum" => 2,
            "exclusiveMaximum" => 3,
            "enum" => {
                let Json::Array(members) = value else { return Err(format!("{at}.enum: must be a list")) };
                out.allowed_text = members.iter().any(Json::is_string);
                out.allowed = Some(members.clone());
                continue;
            }
            other => return Err(format!("{at}: unknown rule {other:?}")),
        };
        let Json::Number(n) = value else { return Err(format!("{at}.{key}: must be a number")) };
        out.bounds[slot] = Some(Bound::of(n));
    }
    Ok(out)
}

/// The leaves of a JSON `data` value in order (`np.asarray(data).reshape(-1)`; BYTES' strings).
fn flatten<'v>(data: &'v Value, out: &mut Vec<Element<'v>>) {
    match data {
        Value::Array(items) => items.iter().for_each(|item| flatten(item, out)),
        Value::Numbers(run) => out.extend(run.iter().map(|v| number_element(&v))),
        Value::Str(s) => out.push(Element::Text(s.as_ref())),
        Value::Bool(b) => out.push(Element::Bool(*b)),
        other => out.push(number_element(other)),
    }
}

fn number_element(v: &Value) -> Element<'static> {
    match v.number() {
        Some(Number::Int(i)) => Element::Int(i as i128),
        Some(Number::UInt(u)) => Element::Int(u as i128),
        Some(Number::Float(f)) => Element::Float(f),
        // Wider than 64 bits (refused by the datatype checks before this), or not a number.
        _ => Element::Float(f64::NAN),
    }
}

/// A binary tensor's elements read in place, little-endian, as `np.frombuffer` views them (BOOL as
/// uint8, as the Python chain viewed it).
fn binary_elements<'v>(datatype: &str, chunk: &'v [u8]) -> Box<dyn Iterator<Item = Element<'v>> + 'v> {
    fn le<const N: usize>(b: &[u8]) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&b[..N]);
        out
    }
    match datatype {
        "BOOL" | "UINT8" => Box::new(chunk.iter().map(|b| Element::Int(*b as i128))),
        "INT8" => Box::new(chunk.iter().map(|b| Element::Int(*b as i8 as i128))),
        "UINT16" => Box::new(chunk.chunks_exact(2).map(|b| Element::Int(u16::from_le_bytes(le(b)) as i128))),
        "INT16" => Box::new(chunk.chunks_exact(2).map(|b| Element::Int(i16::from_le_bytes(le(b)) as i128))),
        "UINT32" => Box::new(chunk.chunks_exact(4).map(|b| Element::Int(u32::from_le_bytes(le(b)) as i128))),
        "INT32" => Box::new(chunk.chunks_exact(4).map(|b| Element::Int(i32::from_le_bytes(le(b)) as i128))),
        "UINT64" => Box::new(chunk.chunks_exact(8).map(|b| Element::Int(u64::from_le_bytes(le(b)) as i128))),
        "INT64" => Box::new(chunk.chunks_exact(8).map(|b| Element::Int(i64::from_le_bytes(le(b)) as i128))),
        "FP16" => Box::new(chunk.chunks_exact(2).map(|b| Element::Float(half_to_f64(u16::from_le_bytes(le(b)))))),
        "FP32" => Box::new(chunk.chunks_exact(4).map(|b| Element::Float(f32::from_le_bytes(le(b)) as f64))),
        "FP64" => Box::new(chunk.chunks_exact(8).map(|b| Element::Float(f64::from_le_bytes(le(b))))),
        _ => Box::new(std::iter::empty()),
    }
}

/// An IEEE 754 half-precision value, exactly.
fn half_to_f64(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exponent = ((bits >> 10) & 0x1f) as i32;
    let fraction = (bits & 0x3ff) as f64;
    sign * match exponent {
        0 => fraction * 2f64.powi(-24),
        31 if fraction == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + fraction / 1024.0) * 2f64.powi(e - 15),
    }
}

/// The error python-jsonschema reports first: it walks the schema depth first, each object's keywords
/// and `properties` in the file's order, array items in order; the crate walks the request's members
/// in the request's order. So every error is listed and the one earliest in that walk is taken.
fn first_error<'i>(
    schema: &Json,
    validator: &'i jsonschema::Validator,
    instance: &'i Json,
) -> Option<jsonschema::ValidationError<'i>> {
    use jsonschema::paths::LocationSegment;
    let order = |error: &jsonschema::ValidationError| -> Vec<usize> {
        let mut key = Vec::new();
        let mut node = Some(schema);
        for segment in error.schema_path() {
            let (at, next) = match (node, &segment) {
                (Some(Json::Object(members)), LocationSegment::Property(name)) => {
                    (members.keys().position(|k| k == name.as_ref()), members.get(name.as_ref()))
                }
                (Some(Json::Array(items)), LocationSegment::Index(i)) => (Some(*i), items.get(*i)),
                _ => (None, None),
            };
            key.push(at.unwrap_or(usize::MAX));
            node = next;
        }
        // The same keyword broken at several places: the earlier item first.
        key.push(usize::MAX);
        key.extend(error.instance_path().iter().map(|segment| match segment {
            LocationSegment::Index(i) => i,
            LocationSegment::Property(_) => 0,
        }));
        key
    };
    let mut first: Option<(Vec<usize>, jsonschema::ValidationError<'i>)> = None;
    for error in validator.iter_errors(instance) {
        let key = order(&error);
        if first.as_ref().is_none_or(|(best, _)| key < *best) {
            first = Some((key, error));
        }
    }
    first.map(|(_, error)| error)
}

/// The request as the schema sees it: every member but each input's `data`.
fn envelope_of(doc: &Value) -> Json {
    let Value::Object(members) = doc else { return to_json(doc) };
    let mut out = Map::new();
    for (key, value) in members {
        let value = match (key.as_ref(), value) {
            ("inputs", Value::Array(inputs)) => Json::Array(
                inputs
                    .iter()
                    .map(|tensor| match tensor {
                        Value::Object(fields) => Json::Object(
                            fields
                                .iter()
                                .filter(|(k, _)| k != "data")
                                .map(|(k, v)| (k.to_string(), to_json(v)))
                                .collect(),
                        ),
                        other => to_json(other),
                    })
                    .collect(),
            ),
            (_, value) => to_json(value),
        };
        out.insert(key.to_string(), value);
    }
    Json::Object(out)
}

fn to_json(v: &Value) -> Json {
    match v {
        Value::Null => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Number { text, .. } => number_json(text),
        // JSON Schema has no NaN or infinity: serde_json cannot hold them. Only a parameter can be
        // one here (tensor data is not in the envelope); it reads as null to the schema.
        Value::NonFinite(_) => Json::Null,
        Value::Str(s) => Json::String(s.to_string()),
        Value::Array(items) => Json::Array(items.iter().map(to_json).collect()),
        Value::Numbers(run) => Json::Array(
            run.iter()
                .map(|v| if let Value::Number { text, .. } = v { number_json(text) } else { Json::Null })
                .collect(),
        ),
        Value::Object(members) => Json::Object(members.iter().map(|(k, v)| (k.to_string(), to_json(v))).collect()),
    }
}

fn number_json(text: &str) -> Json {
    // The grammar was checked while parsing; a magnitude past f64's (1e400) is the one failure.
    serde_json::from_str::<JsonNumber>(text).map(Json::Number).unwrap_or(Json::Null)
}

/// Python's `repr` of a JSON value as `json.loads` gives it back (dicts, lists, True, None...).
fn python_repr(v: &Json) -> String {
    match v {
        Json::Null => "None".into(),
        Json::Bool(b) => (if *b { "True" } else { "False" }).into(),
        Json::Number(n) => match Bound::of(n) {
            Bound::Int(i) => i.to_string(),
            Bound::Float(f) => float_repr(f),
        },
        Json::String(s) => repr_str(s),
        Json::Array(items) => format!("[{}]", items.iter().map(python_repr).collect::<Vec<_>>().join(", ")),
        Json::Object(members) => format!(
            "{{{}}}",
            members.iter().map(|(k, v)| format!("{}: {}", repr_str(k), python_repr(v))).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// Python's `json.dumps` of a JSON value (", " and ": ", ASCII only).
fn python_json(v: &Json) -> String {
    match v {
        Json::Null => "null".into(),
        Json::Bool(b) => b.to_string(),
        Json::Number(n) => match Bound::of(n) {
            Bound::Int(i) => i.to_string(),
            Bound::Float(f) => json_float(f),
        },
        Json::String(s) => {
            let mut out = String::new();
            json_string(s, &mut out);
            out
        }
        Json::Array(items) => format!("[{}]", items.iter().map(python_json).collect::<Vec<_>>().join(", ")),
        Json::Object(members) => format!(
            "{{{}}}",
            members
                .iter()
                .map(|(k, v)| {
                    let mut key = String::new();
                    json_string(k, &mut key);
                    format!("{key}: {}", python_json(v))
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn reprs<'a>(items: impl Iterator<Item = &'a str>) -> String {
    items.map(repr_str).collect::<Vec<_>>().join(", ")
}

/// The schema's error in python-jsonschema's words (its `_keywords.py`), which the refusals have
/// always quoted; a kind it words no differently, or never meets here, keeps the crate's words.
fn python_message(error: &jsonschema::ValidationError) -> String {
    use jsonschema::error::{TypeKind, ValidationErrorKind as K};
    let instance = python_repr(error.instance());
    let limit = python_repr;
    match error.kind() {
        K::Required { property } => format!("{} is a required property", python_repr(property)),
        K::Type { kind } => {
            let names: Vec<String> = match kind {
                TypeKind::Single(t) => vec![t.to_string()],
                TypeKind::Multiple(set) => set.iter().map(|t| t.to_string()).collect(),
            };
            format!("{instance} is not of type {}", reprs(names.iter().map(String::as_str)))
        }
        K::Enum { options } => format!("{instance} is not one of {}", python_repr(options)),
        K::Constant { expected_value } => format!("{} was expected", python_repr(expected_value)),
        K::Pattern { pattern } => format!("{instance} does not match {}", repr_str(pattern)),
        K::Minimum { limit: l } => format!("{instance} is less than the minimum of {}", limit(l)),
        K::Maximum { limit: l } => format!("{instance} is greater than the maximum of {}", limit(l)),
        K::ExclusiveMinimum { limit: l } => format!("{instance} is less than or equal to the minimum of {}", limit(l)),
        K::ExclusiveMaximum { limit: l } => {
            format!("{instance} is greater than or equal to the maximum of {}", limit(l))
        }
        K::MinLength { limit: 1 } | K::MinItems { limit: 1 } | K::MinProperties { limit: 1 } => {
            format!("{instance} should be non-empty")
        }
        K::MaxLength { limit: 0 } | K::MaxItems { limit: 0 } | K::MaxProperties { limit: 0 } => {
            format!("{instance} is expected to be empty")
        }
        K::MinLength { .. } | K::MinItems { .. } => format!("{instance} is too short"),
        K::MaxLength { .. } | K::MaxItems { .. } => format!("{instance} is too long"),
        K::MinProperties { .. } => format!("{instance} does not have enough properties"),
        K::MaxProperties { .. } => format!("{instance} has too many properties"),
        K::AdditionalProperties { unexpected } => {
            let mut extras = unexpected.clone();
            extras.sort();
            let verb = if extras.len() == 1 { "was" } else { "were" };
            format!(
                "Additional properties are not allowed ({} {verb} unexpected)",
                reprs(extras.iter().map(String::as_str))
            )
        }
        K::UnevaluatedProperties { unexpected } => {
            let mut extras = unexpected.clone();
            extras.sort();
            let verb = if extras.len() == 1 { "was" } else { "were" };
            format!(
                "Unevaluated properties are not allowed ({} {verb} unexpected)",
                reprs(extras.iter().map(String::as_str))
            )
        }
        K::Format { format } => format!("{instance} is not a {}", repr_str(format)),
        K::FalseSchema => format!("False schema does not allow {instance}"),
        K::AnyOf { .. } | K::OneOfNotValid { .. } => format!("{instance} is not valid under any of the given schemas"),
        K::Not { schema } => format!("{instance} should not be valid under {}", python_repr(schema)),
        K::UniqueItems => format!("{instance} has non-unique elements"),
        K::Contains => format!("{instance} does not contain items matching the given schema"),
        _ => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::validation::{validate_infer_request, InputSpec, Limits, RequestSpec};
    use std::sync::Arc;

    const SCHEMA: &str = r#"{
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["id"],
        "properties": {"id": {"type": "string", "pattern": "^app-"},
                       "parameters": {"type": "object", "properties": {"when": {"format": "date"}}}},
        "x-tensors": {"features": {"minimum": -10, "maximum": 10},
                      "level": {"enum": [1, 2, 3]},
                      "tag": {"enum": ["a", "b"]}}
    }"#;

    fn ruled(rules: &str) -> RequestSpec {
        let input = |name: &str, datatype: &str| InputSpec {
            name: name.into(),
            datatype: datatype.into(),
            shape: vec![-1],
            optional: true,
        };
        RequestSpec {
            model: "credit_risk".into(),
            inputs: vec![input("features", "FP32"), input("level", "INT32"), input("tag", "BYTES")],
            outputs: vec![],
            hidden_outputs: Default::default(),
            max_batch_size: 0,
            limits: Limits { max_elements: 1_000_000, max_bytes_element: 1024, reject_non_finite: true },
            rules: Some(Arc::new(RequestRules::new("credit.json", rules).expect("compiles"))),
        }
    }

    fn check(spec: &RequestSpec, body: &[u8], header_length: Option<i64>) -> Result<(), Refused> {
        validate_infer_request(spec, body, header_length, &|_| false).map(|_| ())
    }

    fn refused(spec: &RequestSpec, body: &str) -> Refused {
        match check(spec, body.as_bytes(), None) {
            Err(refused) => refused,
            Ok(()) => panic!("passed: {body}"),
        }
    }

    fn features(data: &str) -> String {
        format!(
            r#"{{"id": "app-1", "inputs": [{{"name": "features", "shape": [3], "datatype": "FP32", "data": {data}}}]}}"#
        )
    }

    #[test]
    fn a_request_within_the_rules_passes() {
        let spec = ruled(SCHEMA);
        assert_eq!(check(&spec, features("[1, -10, 10.0]").as_bytes(), None), Ok(()));
        let body = r#"{"id": "app-2", "inputs": [{"name": "level", "shape": [2], "datatype": "INT32", "data": [1, 3]},
                       {"name": "tag", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]}"#;
        assert_eq!(check(&spec, body.as_bytes(), None), Ok(()));
    }

    #[test]
    fn the_envelope_is_refused_in_python_jsonschemas_words() {
        let spec = ruled(SCHEMA);
        let r = refused(&spec, r#"{"inputs": [{"name": "features", "shape": [1], "datatype": "FP32", "data": [1]}]}"#);
        assert_eq!(r.reason, Reason::BusinessRule);
        assert_eq!(r.message, "request breaks credit.json at $: 'id' is a required property");
        assert_eq!(r.input, "");
        let r = refused(&spec, &features("[1, 2, 3]").replace("app-1", "web-1"));
        assert_eq!(r.message, "request breaks credit.json at $.id: 'web-1' does not match '^app-'");
        // Formats are checked (Python's FormatChecker did).
        let body = features("[1, 2, 3]").replace(r#""inputs""#, r#""parameters": {"when": "yesterday"}, "inputs""#);
        assert_eq!(
            refused(&spec, &body).message,
            "request breaks credit.json at $.parameters.when: 'yesterday' is not a 'date'"
        );
        // Tensor data is not part of the envelope: a schema on the rest never sees it.
        let only_inputs = ruled(
            r#"{"properties": {"inputs": {"items": {"required": ["name", "shape", "datatype"],
                                   "additionalProperties": false, "properties": {"name": {}, "shape": {}, "datatype": {}}}}}}"#,
        );
        assert_eq!(check(&only_inputs, features("[1, 2, 3]").as_bytes(), None), Ok(()));
    }

    #[test]
    fn tensor_values_are_refused_naming_the_input_and_element() {
        let spec = ruled(SCHEMA);
        let r = refused(&spec, &features("[1, 11.0, 2]"));
        assert_eq!(r.reason, Reason::BusinessRule);
        assert_eq!(r.input, "features");
        assert_eq!(r.message, "input 'features' breaks credit.json: element 1 = 11.0 is above the maximum 10");
        // The minimum is checked before the maximum, whatever comes first in the tensor.
        let r = refused(&spec, &features("[11, -20, 0]"));
        assert_eq!(r.message, "input 'features' breaks credit.json: element 1 = -20 is below the minimum -10");
        let body =
            r#"{"id": "app-2", "inputs": [{"name": "level", "shape": [3], "datatype": "INT32", "data": [1, 4, 2]}]}"#;
        assert_eq!(
            refused(&spec, body).message,
            "input 'level' breaks credit.json: element 1 = 4 is not one of [1, 2, 3]"
        );
        let body =
            r#"{"id": "app-2", "inputs": [{"name": "tag", "shape": [2], "datatype": "BYTES", "data": ["a", "zz"]}]}"#;
        assert_eq!(
            refused(&spec, body).message,
            r#"input 'tag' breaks credit.json: element 1 = zz is not one of ["a", "b"]"#
        );
        let exclusive = ruled(r#"{"x-tensors": {"features": {"exclusiveMinimum": 0, "exclusiveMaximum": 1.5}}}"#);
        assert_eq!(
            refused(&exclusive, &features("[0.5, 1.5, 1]")).message,
            "input 'features' breaks credit.json: element 1 = 1.5 is not below the exclusive maximum 1.5"
        );
        assert_eq!(
            refused(&exclusive, &features("[0.5, 1, 0]")).message,
            "input 'features' breaks credit.json: element 2 = 0.0 is not above the exclusive minimum 0"
        );
    }

    #[test]
    fn binary_tensors_are_read_in_place() {
        let spec = ruled(SCHEMA);
        let values: Vec<u8> = [1.0f32, 2.5, 10.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let header = r#"{"id": "app-1", "inputs": [{"name": "features", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 12}}]}"#;
        let mut body = header.as_bytes().to_vec();
        body.extend_from_slice(&values);
        let r = check(&spec, &body, Some(header.len() as i64)).expect_err("10.5 is above 10");
        assert_eq!(r.message, "input 'features' breaks credit.json: element 2 = 10.5 is above the maximum 10");
        assert_eq!(r.input, "features");
        let header = r#"{"id": "app-1", "inputs": [{"name": "level", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}}]}"#;
        let mut body = header.as_bytes().to_vec();
        body.extend_from_slice(&[3i32, 7].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        let r = check(&spec, &body, Some(header.len() as i64)).expect_err("7 is not allowed");
        assert_eq!(r.message, "input 'level' breaks credit.json: element 1 = 7 is not one of [1, 2, 3]");
        assert_eq!(half_to_f64(0x3c00), 1.0);
        assert_eq!(half_to_f64(0xc000), -2.0);
    }

    #[test]
    fn the_first_error_is_the_one_python_jsonschema_meets_first() {
        // The schema names parameters before inputs; the request sends inputs first.
        let spec = ruled(
            r#"{"properties": {"parameters": {"required": ["tenant"]},
                               "inputs": {"items": {"properties": {"shape": {"items": {"maximum": 2}}}}}}}"#,
        );
        let body = features("[1, 2, 3]").replace(r#""inputs""#, r#""parameters": {}, "inputs""#);
        assert_eq!(
            refused(&spec, &body).message,
            "request breaks credit.json at $.parameters: 'tenant' is a required property"
        );
        let body = features("[1, 2, 3]");
        assert_eq!(
            refused(&spec, &body).message,
            "request breaks credit.json at $.inputs[0].shape[0]: 3 is greater than the maximum of 2"
        );
    }

    #[test]
    fn formats_are_checked_as_pythons_format_checker_checks_them() {
        let spec = ruled(
            r#"{"properties": {"parameters": {"properties": {"at": {"format": "date-time"}, "t": {"format": "time"},
                                                             "mail": {"format": "email"}}}}}"#,
        );
        let with = |params: &str| {
            features("[1, 2, 3]").replace(r#""inputs""#, &format!(r#""parameters": {params}, "inputs""#))
        };
        // Not checked by Python without rfc3339-validator: an annotation.
        assert_eq!(check(&spec, with(r#"{"at": "soon"}"#).as_bytes(), None), Ok(()));
        assert_eq!(check(&spec, with(r#"{"t": "7:05:00", "mail": "ops@"}"#).as_bytes(), None), Ok(()));
        assert_eq!(
            refused(&spec, &with(r#"{"t": "12:00:00Z"}"#)).message,
            "request breaks credit.json at $.parameters.t: '12:00:00Z' is not a 'time'"
        );
        assert_eq!(
            refused(&spec, &with(r#"{"mail": "ops"}"#)).message,
            "request breaks credit.json at $.parameters.mail: 'ops' is not a 'email'"
        );
        assert!(
            python_date("2024-02-29")
                && !python_date("2023-02-29")
                && !python_date("0000-01-01")
                && !python_date("2024-1-01")
        );
    }

    #[test]
    fn a_schema_the_crate_cannot_compile_is_an_error() {
        assert!(RequestRules::new("bad.json", r#"{"pattern": "("}"#).is_err());
        assert!(RequestRules::new("bad.json", "[1]").is_err());
        assert!(RequestRules::new("bad.json", r#"{"x-tensors": {"a": {"minimum": "low"}}}"#).is_err());
    }
}
