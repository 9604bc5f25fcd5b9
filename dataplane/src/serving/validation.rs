//! Request validation before anything reaches Triton: one v2 infer request (JSON, or JSON header plus
//! binary tensors) against the model's `RequestSpec`, built once from Triton's metadata and config.
//!
//! Why the checks look the way they do (sidecar/serving/validation.py has the Python half's story):
//! - Triton answers **500**, not 400, to a request it cannot parse: malformed JSON, a bool or string
//!   where a number belongs, a non-string `id`, a shape that is not a list of unsigned integers, a
//!   `binary_data_output` that is not a bool, a `data` length that does not match the shape. Everything
//!   Triton would choke on is refused here with a 4xx that names the field.
//! - The order of the checks, and every message, is the one clients have always read: the first
//!   problem found is the one reported.
//! - Tensor values are walked once, without copies; binary tensors are read in place.

use std::collections::HashSet;
use std::sync::Arc;

use crate::protocol::datatypes::{element_size, first_non_finite, float_max, int_range, ALL_SORTED};
use crate::protocol::json::{self, Number, Numbers, Value};
use crate::protocol::pytext::{echo, echo_str, format_g, repr_str};
use crate::serving::refusals::{Reason, Refused};
use crate::serving::request_rules::RequestRules;

/// The request keys Triton reads; any other is refused (a typo would otherwise pass silently).
const REQUEST_KEYS: [&str; 4] = ["id", "inputs", "outputs", "parameters"];
const INPUT_KEYS: [&str; 5] = ["data", "datatype", "name", "parameters", "shape"];
const OUTPUT_KEYS: [&str; 2] = ["name", "parameters"];
const SHARED_MEMORY_PARAMETERS: [&str; 3] = ["shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"];
/// BYTES data nested deeper than this is refused (a bound on the walk, as the Python half had).
const MAX_BYTES_NESTING: usize = 64;

/// How Triton reads a parameter: with a fixed type it answers 500 for any other.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ParamKind {
    UInt,
    Bool,
    UIntOrString,
    Any,
}

fn request_parameter(key: &str) -> ParamKind {
    match key {
        "binary_data_output" | "sequence_start" | "sequence_end" => ParamKind::Bool,
        "priority" | "timeout" => ParamKind::UInt,
        "sequence_id" => ParamKind::UIntOrString,
        _ => ParamKind::Any,
    }
}

fn input_parameter(key: &str) -> ParamKind {
    match key {
        "binary_data_size" => ParamKind::UInt,
        "binary_data" => ParamKind::Bool,
        _ => ParamKind::Any,
    }
}

fn output_parameter(key: &str) -> ParamKind {
    match key {
        "binary_data" => ParamKind::Bool,
        "classification" => ParamKind::UInt,
        _ => ParamKind::Any,
    }
}

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_elements: u64,
    pub max_bytes_element: u64,
    pub reject_non_finite: bool,
}

#[derive(Debug, Clone)]
pub struct InputSpec {
    pub name: String,
    pub datatype: String,
    /// Full shape as clients send it, batch dim first when the model batches; -1 = any size.
    pub shape: Vec<i64>,
    pub optional: bool,
}

/// What a valid request to one model (version) looks like.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub model: String,
    /// Declared inputs; empty for a server whose metadata declares none (MLServer's custom runtimes).
    pub inputs: Vec<InputSpec>,
    /// Every output the model declares (hidden ones included), by name.
    pub outputs: Vec<String>,
    /// Outputs that never leave the pod: asking for one by name is a 403.
    pub hidden_outputs: HashSet<String>,
    /// 0 = the model does not batch; else the first dim of every input is the batch, 1..max.
    pub max_batch_size: u64,
    pub limits: Limits,
    /// The model's rule file (`validation.schemas`), compiled once; None for most models, which
    /// then pay nothing for it.
    pub rules: Option<Arc<RequestRules>>,
}

/// Where an input's values are in the request.
#[derive(Debug, Clone)]
pub enum Values {
    /// `inputs[i].data` of the JSON document.
    Json(usize),
    /// `size` bytes at `offset` of the binary part (after the JSON header).
    Binary { offset: usize, size: usize },
}

#[derive(Debug, Clone)]
pub struct CheckedInput {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<u64>,
    pub values: Values,
}

/// What the proxy needs to know about a request that passed.
#[derive(Debug)]
pub struct Checked {
    pub elements: u64,
    /// Outputs asked for by name; empty = all (minus hidden ones, removed from the answer).
    pub requested_outputs: Vec<String>,
    /// The body had a binary part.
    pub binary: bool,
    /// Where the JSON header ends (the whole body for plain JSON).
    pub header_length: usize,
    pub inputs: Vec<CheckedInput>,
}

/// Check one infer request body; `header_length` is the Inference-Header-Content-Length (binary
/// tensor extension) or None for a plain JSON body. `is_hidden` decides outputs by name for a server
/// whose metadata declares none.
pub fn validate_infer_request(
    spec: &RequestSpec,
    body: &[u8],
    header_length: Option<i64>,
    is_hidden: &dyn Fn(&str) -> bool,
) -> Result<Checked, Refused> {
    let check = Check { spec, is_hidden };
    let split = match header_length {
        Some(h) if h <= 0 || h as u64 > body.len() as u64 => {
            return Err(check.refuse(
                Reason::Malformed,
                format!("Inference-Header-Content-Length {h} is outside the body (1..{} bytes)", body.len()),
                "",
            ))
        }
        Some(h) => h as usize,
        None => body.len(),
    };
    let what = if header_length.is_some() { "inference header" } else { "request body" };
    let doc =
        json::parse(&body[..split]).map_err(|e| check.refuse(Reason::Malformed, malformed_message(what, &e), ""))?;
    let (elements, requested_outputs, inputs) = check.document(&doc, &body[split..])?;
    // The rule file is checked last, on a request every other check passed (as it always was).
    if let Some(rules) = &spec.rules {
        rules.check(&doc, &body[split..], &inputs)?;
    }
    Ok(Checked { elements, requested_outputs, binary: split < body.len(), header_length: split, inputs })
}

/// Why a client's JSON could not be read, in the words every request check uses (`what`: "request
/// body", "inference header").
pub(crate) fn malformed_message(what: &str, e: &json::ParseError) -> String {
    if e.what.contains("nested too deeply") {
        format!("{what} is nested too deeply")
    } else if e.what.starts_with("duplicate key") {
        format!("{what} is not valid JSON: {}", echo_str(&e.what))
    } else {
        format!("{what} is not valid JSON: {}", echo_str(&e.to_string()))
    }
}

struct Check<'a> {
    spec: &'a RequestSpec,
    is_hidden: &'a dyn Fn(&str) -> bool,
}

type Outcome<T> = Result<T, Refused>;

/// What numpy made of a JSON list, the Python half's model of a tensor: the checks keep its verdicts.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Kind {
    Bool,
    Int,
    UInt,
    Float,
    Text,
    Object,
}

fn is_uint(v: &Value) -> bool {
    matches!(v.number(), Some(Number::Int(0..) | Number::UInt(_)))
}

/// An integer as Python holds it that fits i64 (a bool is not one).
fn int64_of(v: &Value) -> Option<i64> {
    match v.number() {
        Some(Number::Int(i)) => Some(i),
        _ => None,
    }
}

fn keys<'v>(v: &'v Value) -> impl Iterator<Item = &'v str> {
    let members: &[(std::borrow::Cow<'_, str>, Value)] = match v {
        Value::Object(m) => m,
        _ => &[],
    };
    members.iter().map(|(k, _)| k.as_ref())
}

/// The first key (sorted) that is not one of `known`.
fn first_unknown_key<'v>(v: &'v Value, known: &[&str]) -> Option<&'v str> {
    keys(v).filter(|k| !known.contains(k)).min()
}

fn shape_text(shape: &[i64]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

fn ushape_text(shape: &[u64]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

impl Check<'_> {
    fn refuse(&self, reason: Reason, message: String, input: &str) -> Refused {
        Refused { reason, message, input: input.to_owned() }
    }

    fn document(&self, doc: &Value, binary: &[u8]) -> Outcome<(u64, Vec<String>, Vec<CheckedInput>)> {
        let spec = self.spec;
        if !matches!(doc, Value::Object(_)) {
            return Err(self.refuse(Reason::Schema, "the request must be a JSON object with 'inputs'".into(), ""));
        }
        if let Some(key) = first_unknown_key(doc, &REQUEST_KEYS) {
            return Err(self.refuse(
                Reason::Schema,
                format!("unknown request field {} (known: {})", repr_str(&echo_str(key)), REQUEST_KEYS.join(", ")),
                "",
            ));
        }
        if let Some(id) = doc.get("id") {
            if !matches!(id, Value::Str(_)) {
                return Err(self.refuse(Reason::Schema, "'id' must be a string".into(), ""));
            }
        }
        self.parameters(doc.get("parameters"), request_parameter, "request", "")?;
        let inputs = match doc.get("inputs") {
            Some(Value::Array(items)) if !items.is_empty() => items,
            // A list of numbers: its first element is not a tensor.
            Some(Value::Numbers(_)) => {
                return Err(self.refuse(
                    Reason::Schema,
                    "inputs[0] must be an object with name, shape, datatype, data".into(),
                    "",
                ))
            }
            _ => return Err(self.refuse(Reason::Schema, "'inputs' must be a non-empty list of tensors".into(), "")),
        };
        let requested = self.requested_outputs(doc.get("outputs"))?;

        let mut seen: Vec<&str> = Vec::with_capacity(inputs.len());
        let mut batch: Option<u64> = None;
        let mut elements: u64 = 0;
        let mut offset: usize = 0;
        let mut checked: Vec<CheckedInput> = Vec::with_capacity(inputs.len());
        // A bool among numbers: numpy would have read it as 1 or 0, Triton answers 500. Reported after
        // the checks on the whole request's structure, as the Python half did.
        let mut bool_in_numbers: Option<Refused> = None;
        for (i, tensor) in inputs.iter().enumerate() {
            let (tspec, shape) = self.tensor_header(tensor, i, &seen)?;
            let name = tspec.name.as_str();
            seen.push(tensor.get("name").and_then(Value::as_str).unwrap_or(""));
            let count = shape.iter().fold(1u64, |acc, d| acc.saturating_mul(*d));
            elements = elements.saturating_add(count);
            if elements > spec.limits.max_elements {
                return Err(self.refuse(
                    Reason::TooManyElements,
                    format!(
                        "the request holds more than {} tensor elements (validation.max_elements)",
                        spec.limits.max_elements
                    ),
                    name,
                ));
            }
            if spec.max_batch_size > 0 {
                let first = shape[0];
                if !(1..=spec.max_batch_size).contains(&first) {
                    return Err(self.refuse(
                        Reason::Shape,
                        format!(
                            "batch size {first} of input {} is outside 1..{} (max_batch_size)",
                            repr_str(name),
                            spec.max_batch_size
                        ),
                        name,
                    ));
                }
                if let Some(b) = batch {
                    if first != b {
                        return Err(self.refuse(
                            Reason::Shape,
                            format!(
                                "input {} has batch size {first}, another input has {b}: all inputs share one batch size",
                                repr_str(name)
                            ),
                            name,
                        ));
                    }
                }
                batch = Some(first);
            }
            let size = match tensor.get("parameters") {
                Some(params) => params.get("binary_data_size"),
                None => None,
            };
            let values = if let Some(size) = size {
                if tensor.get("data").is_some() {
                    return Err(self.refuse(
                        Reason::Schema,
                        format!("input {} has both 'data' and binary_data_size", repr_str(name)),
                        name,
                    ));
                }
                // Checked as an unsigned integer with the tensor's parameters.
                let size = match size.number() {
                    Some(Number::Int(v)) => v as u64,
                    Some(Number::UInt(v)) => v,
                    _ => 0,
                };
                let left = (binary.len() - offset) as u64;
                if size > left {
                    return Err(self.refuse(
                        Reason::Shape,
                        format!(
                            "input {} announces {size} binary bytes, but only {left} follow the header",
                            repr_str(name)
                        ),
                        name,
                    ));
                }
                let size = size as usize;
                let chunk = &binary[offset..offset + size];
                self.binary_size(&tspec, &shape, count, chunk)?;
                let at = offset;
                offset += size;
                Values::Binary { offset: at, size }
            } else if let Some(data) = tensor.get("data") {
                if let Some(refused) = self.json_data(&tspec, &shape, count, data)? {
                    bool_in_numbers.get_or_insert(refused);
                }
                Values::Json(i)
            } else {
                return Err(self.refuse(
                    Reason::Schema,
                    format!("input {} has neither 'data' nor binary_data_size", repr_str(name)),
                    name,
                ));
            };
            checked.push(CheckedInput { name: tspec.name.clone(), datatype: tspec.datatype.clone(), shape, values });
        }
        if offset != binary.len() {
            return Err(self.refuse(
                Reason::Shape,
                format!(
                    "{} bytes follow the last binary input; binary_data_size values do not add up to the body",
                    binary.len() - offset
                ),
                "",
            ));
        }
        let missing = spec
            .inputs
            .iter()
            .filter(|t| !t.optional && !seen.contains(&t.name.as_str()))
            .map(|t| t.name.as_str())
            .min();
        if let Some(missing) = missing {
            return Err(self.refuse(
                Reason::MissingInput,
                format!("required input {} is missing (model inputs: {})", repr_str(missing), self.input_names()),
                missing,
            ));
        }
        if let Some(refused) = bool_in_numbers {
            return Err(refused);
        }
        if spec.limits.reject_non_finite {
            for input in &checked {
                if let Values::Binary { offset, size } = input.values {
                    self.binary_values(&input.name, &input.datatype, &binary[offset..offset + size])?;
                }
            }
        }
        Ok((elements, requested, checked))
    }

    fn input_names(&self) -> String {
        let mut names: Vec<&str> = self.spec.inputs.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        names.join(", ")
    }

    fn parameters(
        &self,
        params: Option<&Value>,
        kind_of: fn(&str) -> ParamKind,
        place: &str,
        tensor: &str,
    ) -> Outcome<()> {
        let members = match params {
            None | Some(Value::Null) => return Ok(()),
            Some(Value::Object(members)) => members,
            Some(_) => {
                return Err(self.refuse(Reason::Parameter, format!("{place} 'parameters' must be an object"), tensor))
            }
        };
        for (key, value) in members {
            if SHARED_MEMORY_PARAMETERS.contains(&key.as_ref()) {
                return Err(self.refuse(
                    Reason::SharedMemory,
                    "shared-memory tensors are not available through the sidecar; send the data in the request".into(),
                    tensor,
                ));
            }
            let kind = kind_of(key);
            let ok = match kind {
                ParamKind::UInt => is_uint(value),
                ParamKind::Bool => matches!(value, Value::Bool(_)),
                ParamKind::UIntOrString => is_uint(value) || matches!(value, Value::Str(_)),
                ParamKind::Any => match value.number() {
                    Some(Number::Int(_)) => true,
                    Some(Number::Float(f)) => f.is_finite(),
                    Some(_) => false,
                    None => matches!(value, Value::Str(_) | Value::Bool(_)),
                },
            };
            if !ok {
                let expected = match kind {
                    ParamKind::UInt => "an unsigned integer",
                    ParamKind::Bool => "true or false",
                    ParamKind::UIntOrString => "an unsigned integer or a string",
                    ParamKind::Any => "a string, a bool, an integer or a finite number",
                };
                return Err(self.refuse(
                    Reason::Parameter,
                    format!("{place} parameter {} must be {expected}, got {}", repr_str(&echo_str(key)), echo(value)),
                    tensor,
                ));
            }
        }
        Ok(())
    }

    fn requested_outputs(&self, outputs: Option<&Value>) -> Outcome<Vec<String>> {
        let spec = self.spec;
        let items = match outputs {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Array(items)) => items,
            // A list of numbers: its first element is not an output.
            Some(Value::Numbers(_)) => {
                return Err(self.refuse(
                    Reason::Schema,
                    "each requested output must be an object with a string 'name'".into(),
                    "",
                ))
            }
            Some(_) => {
                return Err(self.refuse(
                    Reason::Schema,
                    "'outputs' must be a list of {\"name\": ...} objects".into(),
                    "",
                ))
            }
        };
        let mut names: Vec<String> = Vec::with_capacity(items.len());
        for output in items {
            let name: &str = match (output, output.get("name")) {
                (Value::Object(_), Some(Value::Str(name))) => name,
                _ => {
                    return Err(self.refuse(
                        Reason::Schema,
                        "each requested output must be an object with a string 'name'".into(),
                        "",
                    ))
                }
            };
            if let Some(key) = first_unknown_key(output, &OUTPUT_KEYS) {
                return Err(self.refuse(
                    Reason::Schema,
                    format!("unknown field {} in requested output", repr_str(&echo_str(key))),
                    "",
                ));
            }
            if spec.hidden_outputs.contains(name) || (spec.outputs.is_empty() && (self.is_hidden)(name)) {
                return Err(self.refuse(
                    Reason::FilteredOutput,
                    format!(
                        "output {} of model {} is not available outside the pod (filtering rules)",
                        repr_str(name),
                        spec.model
                    ),
                    "",
                ));
            }
            if !spec.outputs.is_empty() && !spec.outputs.iter().any(|o| o == name) {
                let mut visible: Vec<&str> =
                    spec.outputs.iter().filter(|o| !spec.hidden_outputs.contains(*o)).map(|o| o.as_str()).collect();
                visible.sort_unstable();
                visible.dedup();
                return Err(self.refuse(
                    Reason::UnknownOutput,
                    format!(
                        "model {} has no output {} (outputs: {})",
                        spec.model,
                        repr_str(&echo_str(name)),
                        visible.join(", ")
                    ),
                    "",
                ));
            }
            if names.iter().any(|n| n == name) {
                return Err(self.refuse(Reason::Schema, format!("output {} is requested twice", repr_str(name)), ""));
            }
            self.parameters(output.get("parameters"), output_parameter, &format!("output {}", repr_str(name)), "")?;
            names.push(name.to_owned());
        }
        Ok(names)
    }

    fn tensor_header(&self, tensor: &Value, index: usize, seen: &[&str]) -> Outcome<(InputSpec, Vec<u64>)> {
        let spec = self.spec;
        if !matches!(tensor, Value::Object(_)) {
            return Err(self.refuse(
                Reason::Schema,
                format!("inputs[{index}] must be an object with name, shape, datatype, data"),
                "",
            ));
        }
        let name: &str = match tensor.get("name") {
            Some(Value::Str(name)) => name,
            _ => return Err(self.refuse(Reason::Schema, format!("inputs[{index}] needs a string 'name'"), "")),
        };
        if let Some(key) = first_unknown_key(tensor, &INPUT_KEYS) {
            return Err(self.refuse(
                Reason::Schema,
                format!("unknown field {} in input {}", repr_str(&echo_str(key)), repr_str(&echo_str(name))),
                name,
            ));
        }
        let tspec = if spec.inputs.is_empty() {
            self.undeclared_input(tensor, name)?
        } else {
            match spec.inputs.iter().find(|t| t.name == name) {
                Some(t) => t.clone(),
                None => {
                    return Err(self.refuse(
                        Reason::UnknownInput,
                        format!(
                            "model {} has no input {} (inputs: {})",
                            spec.model,
                            repr_str(&echo_str(name)),
                            self.input_names()
                        ),
                        "",
                    ))
                }
            }
        };
        if seen.contains(&name) {
            return Err(self.refuse(Reason::Schema, format!("input {} is sent twice", repr_str(name)), name));
        }
        let datatype = tensor.get("datatype");
        if datatype.and_then(Value::as_str) != Some(tspec.datatype.as_str()) {
            return Err(self.refuse(
                Reason::Datatype,
                format!(
                    "input {} must be {}, got {}",
                    repr_str(name),
                    tspec.datatype,
                    datatype.map(echo).unwrap_or_else(|| "null".into())
                ),
                name,
            ));
        }
        let shape_value = tensor.get("shape");
        let shape: Option<Vec<u64>> = shape_value
            .and_then(Value::items)
            .and_then(|dims| dims.iter().map(|d| int64_of(d).and_then(|v| u64::try_from(v).ok())).collect());
        let shown = || shape_value.map(echo).unwrap_or_else(|| "null".into());
        let Some(shape) = shape else {
            return Err(self.refuse(
                Reason::Shape,
                format!("input {}: 'shape' must be a list of non-negative integers, got {}", repr_str(name), shown()),
                name,
            ));
        };
        let fits = shape.len() == tspec.shape.len()
            && tspec.shape.iter().zip(&shape).all(|(want, got)| *want == -1 || *want as i128 == *got as i128);
        if !fits {
            return Err(self.refuse(
                Reason::Shape,
                format!(
                    "input {} must have shape {} (-1 = any), got {}",
                    repr_str(name),
                    shape_text(&tspec.shape),
                    shown()
                ),
                name,
            ));
        }
        self.parameters(tensor.get("parameters"), input_parameter, &format!("input {}", repr_str(name)), name)?;
        Ok((tspec, shape))
    }

    /// The input as the client declares it, for a server whose metadata declares no inputs: its name
    /// and shape cannot be checked, but its datatype must be a v2 one, and its data must match it.
    fn undeclared_input(&self, tensor: &Value, name: &str) -> Outcome<InputSpec> {
        let datatype = tensor.get("datatype");
        let known = datatype.and_then(Value::as_str).filter(|d| ALL_SORTED.contains(d));
        let Some(datatype) = known else {
            return Err(self.refuse(
                Reason::Datatype,
                format!(
                    "input {}: {} is not a v2 datatype ({})",
                    repr_str(&echo_str(name)),
                    datatype.map(echo).unwrap_or_else(|| "null".into()),
                    ALL_SORTED.join(", ")
                ),
                name,
            ));
        };
        let rank = tensor.get("shape").and_then(Value::items).map_or(0, |dims| dims.len());
        Ok(InputSpec { name: name.to_owned(), datatype: datatype.to_owned(), shape: vec![-1; rank], optional: false })
    }

    /// JSON `data` of one input. `Ok(Some(refusal))`: a bool among numbers, reported later.
    fn json_data(&self, tspec: &InputSpec, shape: &[u64], count: u64, data: &Value) -> Outcome<Option<Refused>> {
        let name = tspec.name.as_str();
        let datatype = tspec.datatype.as_str();
        if !data.is_array() {
            return Err(self.refuse(Reason::Schema, format!("input {}: 'data' must be a list", repr_str(name)), name));
        }
        if datatype == "BYTES" {
            self.json_bytes(tspec, count, &data.items().unwrap_or_default())?;
            return Ok(None);
        }
        if datatype == "BF16" {
            return Err(self.refuse(
                Reason::Datatype,
                format!("input {}: BF16 tensors can only be sent as binary data", repr_str(name)),
                name,
            ));
        }
        let mut leaves: Vec<Leaf> = Vec::new();
        if let Err(message) = regular_leaves(data, &mut leaves) {
            return Err(self.refuse(
                Reason::Shape,
                format!("input {}: 'data' is not a regular array of values ({})", repr_str(name), echo_str(&message)),
                name,
            ));
        }
        let size = leaves.iter().map(Leaf::len).sum::<usize>() as u64;
        if size != count {
            return Err(self.refuse(
                Reason::Shape,
                format!(
                    "input {}: shape {} holds {count} values, 'data' has {size}",
                    repr_str(name),
                    ushape_text(shape)
                ),
                name,
            ));
        }
        let stats = Stats::of(&leaves, datatype);
        if datatype == "BOOL" {
            if stats.kind != Kind::Bool && size > 0 {
                return Err(self.refuse(
                    Reason::Datatype,
                    format!("input {}: BOOL data must be true/false", repr_str(name)),
                    name,
                ));
            }
            return Ok(None);
        }
        let int_range = int_range(datatype);
        let numeric = matches!(stats.kind, Kind::Int | Kind::UInt | Kind::Float);
        if !numeric || (int_range.is_some() && stats.kind == Kind::Float) {
            let want = if int_range.is_some() { "integers" } else { "numbers" };
            return Err(self.refuse(
                Reason::Datatype,
                format!("input {}: {datatype} data must be {want}", repr_str(name)),
                name,
            ));
        }
        let bool_refusal = stats.last_bool.map(|b| {
            self.refuse(
                Reason::Datatype,
                format!("input {}: {datatype} data must be numbers, got {b}", repr_str(name)),
                name,
            )
        });
        if size == 0 {
            return Ok(bool_refusal);
        }
        if let Some((low, high)) = int_range {
            if stats.int_min < low || stats.int_max > high {
                let bad = if stats.int_min < low { stats.int_min } else { stats.int_max };
                return Err(self.refuse(
                    Reason::OutOfRange,
                    format!("input {}: value {bad} does not fit {datatype} ({low}..{high})", repr_str(name)),
                    name,
                ));
            }
            return Ok(bool_refusal);
        }
        let Some(max) = float_max(datatype) else {
            return Ok(bool_refusal);
        };
        if let Some(i) = stats.first_non_finite {
            return Err(self.refuse(
                Reason::NonFinite,
                format!("input {}: NaN/Infinity at element {i}; JSON numbers must be finite", repr_str(name)),
                name,
            ));
        }
        if stats.largest > max && self.spec.limits.reject_non_finite {
            return Err(self.refuse(
                Reason::NonFinite,
                format!("input {}: value {} overflows {datatype} to infinity", repr_str(name), format_g(stats.largest)),
                name,
            ));
        }
        Ok(bool_refusal)
    }

    fn json_bytes(&self, tspec: &InputSpec, count: u64, items: &[Value]) -> Outcome<()> {
        let name = tspec.name.as_str();
        let mut flat: Vec<&str> = Vec::new();
        let mut stack: Vec<std::slice::Iter<'_, Value>> = vec![items.iter()];
        while let Some(top) = stack.last_mut() {
            match top.next() {
                None => {
                    stack.pop();
                }
                Some(Value::Array(inner)) => {
                    if stack.len() >= MAX_BYTES_NESTING {
                        return Err(self.refuse(
                            Reason::Shape,
                            format!("input {}: 'data' is nested too deeply", repr_str(name)),
                            name,
                        ));
                    }
                    stack.push(inner.iter());
                }
                Some(Value::Numbers(run)) => {
                    if stack.len() >= MAX_BYTES_NESTING {
                        return Err(self.refuse(
                            Reason::Shape,
                            format!("input {}: 'data' is nested too deeply", repr_str(name)),
                            name,
                        ));
                    }
                    let first = run.iter().next().unwrap_or(Value::Null);
                    return Err(self.refuse(
                        Reason::Datatype,
                        format!("input {}: BYTES data must be strings, got {}", repr_str(name), echo(&first)),
                        name,
                    ));
                }
                Some(Value::Str(s)) => flat.push(s),
                Some(other) => {
                    return Err(self.refuse(
                        Reason::Datatype,
                        format!("input {}: BYTES data must be strings, got {}", repr_str(name), echo(other)),
                        name,
                    ))
                }
            }
        }
        if flat.len() as u64 != count {
            return Err(self.refuse(
                Reason::Shape,
                format!("input {}: shape holds {count} values, 'data' has {}", repr_str(name), flat.len()),
                name,
            ));
        }
        let limit = self.spec.limits.max_bytes_element;
        if let Some(i) = flat.iter().position(|s| s.len() as u64 > limit) {
            return Err(self.refuse(
                Reason::BytesTooLong,
                format!(
                    "input {}: element {i} is longer than {limit} bytes (validation.max_bytes_element)",
                    repr_str(name)
                ),
                name,
            ));
        }
        Ok(())
    }

    fn binary_size(&self, tspec: &InputSpec, shape: &[u64], count: u64, chunk: &[u8]) -> Outcome<()> {
        let name = tspec.name.as_str();
        let datatype = tspec.datatype.as_str();
        let Some(element) = element_size(datatype) else {
            return self.binary_bytes(name, count, chunk);
        };
        let expected = count.saturating_mul(element as u64);
        if chunk.len() as u64 != expected {
            return Err(self.refuse(
                Reason::Shape,
                format!(
                    "input {}: shape {} of {datatype} is {expected} bytes, binary_data_size is {}",
                    repr_str(name),
                    ushape_text(shape),
                    chunk.len()
                ),
                name,
            ));
        }
        Ok(())
    }

    /// BYTES in binary form: each element is a 4-byte little-endian length and that many bytes.
    fn binary_bytes(&self, name: &str, count: u64, chunk: &[u8]) -> Outcome<()> {
        let limit = self.spec.limits.max_bytes_element;
        let mut pos: usize = 0;
        for i in 0..count {
            let Some(prefix) = chunk.get(pos..pos + 4) else {
                return Err(self.refuse(
                    Reason::Shape,
                    format!("input {}: binary data ends after {i} of {count} BYTES elements", repr_str(name)),
                    name,
                ));
            };
            let length = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as u64;
            if length > limit {
                return Err(self.refuse(
                    Reason::BytesTooLong,
                    format!(
                        "input {}: element {i} is {length} bytes, more than {limit} (validation.max_bytes_element)",
                        repr_str(name)
                    ),
                    name,
                ));
            }
            pos += 4 + length as usize;
        }
        if pos != chunk.len() {
            return Err(self.refuse(
                Reason::Shape,
                format!(
                    "input {}: {count} BYTES elements take {pos} bytes, binary_data_size is {}",
                    repr_str(name),
                    chunk.len()
                ),
                name,
            ));
        }
        Ok(())
    }

    fn binary_values(&self, name: &str, datatype: &str, chunk: &[u8]) -> Outcome<()> {
        match first_non_finite(datatype, chunk) {
            Some(i) => Err(self.refuse(
                Reason::NonFinite,
                format!("input {}: NaN or ±Inf at element {i} (validation.reject_non_finite)", repr_str(name)),
                name,
            )),
            None => Ok(()),
        }
    }
}

/// A leaf of a nested list: one scalar, or a run of numbers (read only when a check needs values).
enum Leaf<'v, 'a> {
    One(&'v Value<'a>),
    Run(&'v Numbers<'a>),
}

impl Leaf<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Leaf::One(_) => 1,
            Leaf::Run(run) => run.count,
        }
    }
}

/// The leaves of a nested list in order, or why it is not a regular (rectangular) array.
fn regular_leaves<'v, 'a>(data: &'v Value<'a>, out: &mut Vec<Leaf<'v, 'a>>) -> Result<(), String> {
    // The shape is the first path down; every list at a depth must have that depth's length.
    let mut dims: Vec<usize> = Vec::new();
    let mut node = data;
    loop {
        match node {
            Value::Array(items) => {
                dims.push(items.len());
                match items.first() {
                    Some(first) => node = first,
                    None => break,
                }
            }
            Value::Numbers(run) => {
                dims.push(run.count);
                break;
            }
            _ => break,
        }
    }
    fn walk<'v, 'a>(
        node: &'v Value<'a>,
        depth: usize,
        dims: &[usize],
        out: &mut Vec<Leaf<'v, 'a>>,
    ) -> Result<(), usize> {
        match node {
            Value::Array(items) => {
                if depth >= dims.len() || items.len() != dims[depth] {
                    return Err(depth);
                }
                for item in items {
                    walk(item, depth + 1, dims, out)?;
                }
                Ok(())
            }
            Value::Numbers(run) => {
                if depth >= dims.len() || run.count != dims[depth] {
                    return Err(depth);
                }
                // Its elements are scalars, one level down: the shape must end there.
                if depth + 1 != dims.len() {
                    return Err(depth + 1);
                }
                out.push(Leaf::Run(run));
                Ok(())
            }
            leaf => {
                if depth != dims.len() {
                    return Err(depth);
                }
                out.push(Leaf::One(leaf));
                Ok(())
            }
        }
    }
    walk(data, 0, &dims, out).map_err(|depth| {
        let detected: Vec<String> = dims[..depth.min(dims.len())].iter().map(|d| d.to_string()).collect();
        let detected =
            if detected.len() == 1 { format!("({},)", detected[0]) } else { format!("({})", detected.join(", ")) };
        format!(
            "setting an array element with a sequence. The requested array has an inhomogeneous shape after {depth} \
             dimensions. The detected shape was {detected} + inhomogeneous part."
        )
    })
}

/// One pass over a tensor's JSON values: what numpy would make of them, and the figures the checks
/// need (a float datatype's largest magnitude and first non-finite value, an integer's range).
struct Stats {
    kind: Kind,
    last_bool: Option<bool>,
    int_min: i128,
    int_max: i128,
    largest: f64,
    first_non_finite: Option<usize>,
}

/// Below 10^this, a value is finite in the datatype and needs no conversion to be judged: 10^4 <
/// 65504 (FP16), 10^38 < 3.4e38 (FP32), 10^308 < 1.8e308 (FP64).
fn float_exp10_bound(datatype: &str) -> Option<i32> {
    Some(match datatype {
        "FP16" => 4,
        "FP32" => 38,
        "FP64" => 308,
        _ => return None,
    })
}

/// Counts by kind while the leaves are read.
struct Tally {
    stats: Stats,
    float_bound: Option<i32>,
    wants_ints: bool,
    bools: usize,
    ints: usize,
    uints: usize,
    floats: usize,
    texts: usize,
    objects: usize,
    negative: bool,
}

impl Tally {
    /// One scalar, element `i` of the tensor.
    fn one(&mut self, i: usize, v: &Value) {
        let stats = &mut self.stats;
        match v {
            Value::Bool(b) => {
                self.bools += 1;
                stats.last_bool = Some(*b);
                stats.int_min = stats.int_min.min(*b as i128);
                stats.int_max = stats.int_max.max(*b as i128);
                stats.largest = stats.largest.max(*b as u8 as f64);
            }
            Value::Str(_) => self.texts += 1,
            Value::Null | Value::Object(_) | Value::Array(_) | Value::Numbers(_) => self.objects += 1,
            Value::NonFinite(_) => {
                self.floats += 1;
                stats.first_non_finite.get_or_insert(i);
            }
            Value::Number { text, integer, below_exp10 } => {
                if *integer {
                    // Under 10^18 it fits i64: only an integer datatype needs its value.
                    if *below_exp10 <= 18 && !self.wants_ints {
                        self.ints += 1;
                        self.negative |= text.starts_with('-');
                    } else {
                        match v.number() {
                            Some(Number::Int(n)) => {
                                self.ints += 1;
                                self.negative |= n < 0;
                                stats.int_min = stats.int_min.min(n as i128);
                                stats.int_max = stats.int_max.max(n as i128);
                            }
                            Some(Number::UInt(n)) => {
                                self.uints += 1;
                                stats.int_min = stats.int_min.min(n as i128);
                                stats.int_max = stats.int_max.max(n as i128);
                            }
                            // numpy holds a Python int wider than 64 bits as an object.
                            _ => self.objects += 1,
                        }
                    }
                } else {
                    self.floats += 1;
                }
                if self.float_bound.is_some_and(|bound| *below_exp10 > bound) {
                    let x = text.parse::<f64>().unwrap_or(f64::NAN);
                    if !x.is_finite() {
                        stats.first_non_finite.get_or_insert(i);
                    }
                    stats.largest = stats.largest.max(x.abs());
                }
            }
        }
    }

    /// A run of numbers starting at element `i`: judged from its summary unless a check needs its
    /// values (an integer datatype's range, a magnitude near the datatype's limit, a wide integer).
    fn run(&mut self, i: usize, run: &Numbers) {
        let needs_values = (!run.any_float && (run.any_wide || self.wants_ints))
            || self.float_bound.is_some_and(|bound| run.below_exp10 > bound);
        if needs_values {
            for (k, v) in run.iter().enumerate() {
                self.one(i + k, &v);
            }
        } else if run.any_float {
            self.floats += run.count;
        } else {
            self.ints += run.count;
            self.negative |= run.any_negative;
        }
    }
}

impl Stats {
    fn of(leaves: &[Leaf], datatype: &str) -> Stats {
        let mut tally = Tally {
            stats: Stats {
                kind: Kind::Float,
                last_bool: None,
                int_min: i128::MAX,
                int_max: i128::MIN,
                largest: 0.0,
                first_non_finite: None,
            },
            float_bound: float_exp10_bound(datatype),
            wants_ints: int_range(datatype).is_some(),
            bools: 0,
            ints: 0,
            uints: 0,
            floats: 0,
            texts: 0,
            objects: 0,
            negative: false,
        };
        let mut i = 0;
        for leaf in leaves {
            match leaf {
                Leaf::One(v) => tally.one(i, v),
                Leaf::Run(run) => tally.run(i, run),
            }
            i += leaf.len();
        }
        let t = &tally;
        let kind = if i == 0 {
            Kind::Float // numpy's empty array
        } else if t.objects > 0 {
            Kind::Object
        } else if t.texts > 0 {
            Kind::Text
        } else if t.floats > 0 {
            Kind::Float
        } else if t.uints > 0 {
            if t.negative {
                Kind::Object
            } else {
                Kind::UInt
            }
        } else if t.ints > 0 {
            Kind::Int
        } else if t.bools > 0 {
            Kind::Bool
        } else {
            Kind::Float
        };
        Stats { kind, ..tally.stats }
    }
}

/// The numeric values of a JSON input as numpy would hold them: (`"<i8"`, `"<u8"` or `"<f8"`,
/// little-endian bytes), for the drift monitor; None for BOOL, BYTES and anything not numeric.
pub fn json_numbers(data: &Value) -> Option<(&'static str, Vec<u8>)> {
    let mut leaves = Vec::new();
    regular_leaves(data, &mut leaves).ok()?;
    let kind = Stats::of(&leaves, "").kind;
    let mut out = Vec::with_capacity(leaves.iter().map(Leaf::len).sum::<usize>() * 8);
    let number = |v: &Value| match v {
        Value::Bool(b) => Some(Number::Int(*b as i64)),
        other => other.number(),
    };
    let mut values: Vec<Option<Number>> = Vec::new();
    for leaf in &leaves {
        match leaf {
            Leaf::One(v) => values.push(number(v)),
            Leaf::Run(run) => values.extend(run.iter().map(|v| number(&v))),
        }
    }
    for value in values {
        match (kind, value) {
            (Kind::Int, Some(Number::Int(n))) => out.extend_from_slice(&n.to_le_bytes()),
            (Kind::UInt, Some(Number::Int(n))) => out.extend_from_slice(&(n as u64).to_le_bytes()),
            (Kind::UInt, Some(Number::UInt(n))) => out.extend_from_slice(&n.to_le_bytes()),
            (Kind::Float, Some(Number::Int(n))) => out.extend_from_slice(&(n as f64).to_le_bytes()),
            (Kind::Float, Some(Number::UInt(n))) => out.extend_from_slice(&(n as f64).to_le_bytes()),
            (Kind::Float, Some(Number::Float(f))) => out.extend_from_slice(&f.to_le_bytes()),
            _ => return None,
        }
    }
    Some((
        match kind {
            Kind::Int => "<i8",
            Kind::UInt => "<u8",
            _ => "<f8",
        },
        out,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credit() -> RequestSpec {
        RequestSpec {
            model: "credit_risk".into(),
            inputs: vec![InputSpec {
                name: "INPUT0".into(),
                datatype: "FP32".into(),
                shape: vec![-1, 4],
                optional: false,
            }],
            outputs: vec!["OUTPUT0".into(), "SECRET".into()],
            hidden_outputs: ["SECRET".to_string()].into_iter().collect(),
            max_batch_size: 8,
            limits: Limits { max_elements: 1000, max_bytes_element: 16, reject_non_finite: true },
            rules: None,
        }
    }

    fn refused(spec: &RequestSpec, body: &str) -> Refused {
        match validate_infer_request(spec, body.as_bytes(), None, &|_| false) {
            Ok(_) => panic!("{body} passed"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_valid_request_passes_with_its_count() {
        let body = r#"{"inputs": [{"name": "INPUT0", "shape": [2, 4], "datatype": "FP32", "data": [[1,2,3,4],[5,6,7,8.5]]}],
                      "outputs": [{"name": "OUTPUT0"}]}"#;
        let checked = validate_infer_request(&credit(), body.as_bytes(), None, &|_| false).unwrap();
        assert_eq!(checked.elements, 8);
        assert_eq!(checked.requested_outputs, vec!["OUTPUT0".to_string()]);
        assert!(!checked.binary);
    }

    #[test]
    fn each_problem_is_named() {
        let spec = credit();
        let cases = [
            (r#"{"inputs": [], "inputs": []}"#, Reason::Malformed, "duplicate key inputs"),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3]}]}"#,
                Reason::Shape,
                "holds 4 values, 'data' has 3",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, NaN, 3, 4]}]}"#,
                Reason::NonFinite,
                "NaN/Infinity at element 1",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 1e39, 3, 4]}]}"#,
                Reason::NonFinite,
                "value 1e+39 overflows FP32",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, true, 3, 4]}]}"#,
                Reason::Datatype,
                "must be numbers, got true",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, "a", 3, 4]}]}"#,
                Reason::Datatype,
                "FP32 data must be numbers",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}]}"#,
                Reason::Datatype,
                "must be FP32, got INT32",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [9, 4], "datatype": "FP32", "data": []}]}"#,
                Reason::Shape,
                "batch size 9",
            ),
            (
                r#"{"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]}"#,
                Reason::UnknownInput,
                "has no input 'X' (inputs: INPUT0)",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1,2,3,4]}], "outputs": [{"name": "SECRET"}]}"#,
                Reason::FilteredOutput,
                "not available outside the pod",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1,2,3,4]}], "outputs": [{"name": "NOPE"}]}"#,
                Reason::UnknownOutput,
                "(outputs: OUTPUT0)",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1,2,3,4], "parameters": {"shared_memory_region": "r"}}]}"#,
                Reason::SharedMemory,
                "shared-memory",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1,2,3,4]}], "parameters": {"priority": -1}}"#,
                Reason::Parameter,
                "request parameter 'priority' must be an unsigned integer, got -1",
            ),
            (r#"{"id": 5, "inputs": []}"#, Reason::Schema, "'id' must be a string"),
            (
                r#"{"inputz": []}"#,
                Reason::Schema,
                "unknown request field 'inputz' (known: id, inputs, outputs, parameters)",
            ),
            (
                r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [[1,2],[3]]}]}"#,
                Reason::Shape,
                "not a regular array",
            ),
        ];
        for (body, reason, words) in cases {
            let e = refused(&spec, body);
            assert_eq!(e.reason, reason, "{body}: {}", e.message);
            assert!(e.message.contains(words), "{body}: {}", e.message);
        }
    }

    #[test]
    fn runs_of_numbers_are_judged_as_element_by_element() {
        let spec = |datatype: &str| RequestSpec {
            model: "m".into(),
            inputs: vec![InputSpec {
                name: "x".into(),
                datatype: datatype.into(),
                shape: vec![-1, 4],
                optional: false,
            }],
            outputs: vec![],
            hidden_outputs: Default::default(),
            max_batch_size: 8,
            limits: Limits { max_elements: 1000, max_bytes_element: 16, reject_non_finite: true },
            rules: None,
        };
        let body = |datatype: &str, data: &str| {
            format!(r#"{{"inputs": [{{"name": "x", "shape": [2, 4], "datatype": "{datatype}", "data": {data}}}]}}"#)
        };
        let cases = [
            (
                "INT8",
                "[[1, 2, 3, 4], [5, 6, 7, 200]]",
                Some((Reason::OutOfRange, "value 200 does not fit INT8 (-128..127)")),
            ),
            ("INT8", "[[1, 2, 3, 4], [5, 6, 7, -8]]", None),
            ("INT8", "[[1, 2, 3, 4], [5, 6, 7, 8.5]]", Some((Reason::Datatype, "INT8 data must be integers"))),
            ("FP16", "[[1, 2, 3, 4], [5, 6, 7, 70000]]", Some((Reason::NonFinite, "value 70000 overflows FP16"))),
            ("FP32", "[[1, 2, 3, 4], [5, 6, 7, 1e400]]", Some((Reason::NonFinite, "NaN/Infinity at element 7"))),
            (
                "FP32",
                "[[1, 2, 3, 4], [5, 6, 7, 99999999999999999999999]]",
                Some((Reason::Datatype, "FP32 data must be numbers")),
            ),
            ("UINT64", "[[1, 2, 3, 4], [5, 6, 7, 18446744073709551615]]", None),
            (
                "UINT64",
                "[[-1, 2, 3, 4], [5, 6, 7, 18446744073709551615]]",
                Some((Reason::Datatype, "UINT64 data must be integers")),
            ),
            ("FP32", "[[1, 2, 3, 4], [5, 6, 7]]", Some((Reason::Shape, "not a regular array"))),
            ("FP32", "[[1, 2, 3, 4], 5, 6, 7, 8]", Some((Reason::Shape, "not a regular array"))),
            ("FP32", "[[[1, 2], [3, 4]], [[5, 6], [7, 8]]]", None),
            ("BOOL", "[[1, 2, 3, 4], [5, 6, 7, 8]]", Some((Reason::Datatype, "BOOL data must be true/false"))),
            ("BYTES", "[[1, 2, 3, 4], [5, 6, 7, 8]]", Some((Reason::Datatype, "BYTES data must be strings, got 1"))),
        ];
        for (datatype, data, expected) in cases {
            let outcome = validate_infer_request(&spec(datatype), body(datatype, data).as_bytes(), None, &|_| false);
            match (outcome, expected) {
                (Ok(_), None) => {}
                (Err(e), Some((reason, words))) => {
                    assert_eq!(e.reason, reason, "{datatype} {data}: {}", e.message);
                    assert!(e.message.contains(words), "{datatype} {data}: {}", e.message);
                }
                (outcome, expected) => panic!("{datatype} {data}: {outcome:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn binary_tensors_are_read_in_place() {
        let header = r#"{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}]}"#;
        let mut body = header.as_bytes().to_vec();
        for v in [1.0f32, 2.0, 3.0, 4.0] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let checked = validate_infer_request(&credit(), &body, Some(header.len() as i64), &|_| false).unwrap();
        assert!(checked.binary);
        let mut bad = body.clone();
        let at = bad.len() - 4;
        bad[at..].copy_from_slice(&f32::NAN.to_le_bytes());
        let e = validate_infer_request(&credit(), &bad, Some(header.len() as i64), &|_| false).unwrap_err();
        assert_eq!(e.reason, Reason::NonFinite);
        assert!(e.message.contains("at element 3"), "{}", e.message);
        let e = validate_infer_request(&credit(), &body[..body.len() - 1], Some(header.len() as i64), &|_| false)
            .unwrap_err();
        assert_eq!(e.reason, Reason::Shape, "{}", e.message);
        let e = validate_infer_request(&credit(), &body, Some(body.len() as i64 + 1), &|_| false).unwrap_err();
        assert_eq!(e.reason, Reason::Malformed, "{}", e.message);
    }

    #[test]
    fn drift_reads_numbers_as_numpy_would() {
        let v = json::parse(b"[[1, 2], [3, 4]]").unwrap();
        let (dtype, bytes) = json_numbers(&v).unwrap();
        assert_eq!((dtype, bytes.len()), ("<i8", 32));
        let v = json::parse(b"[1, 2.5]").unwrap();
        assert_eq!(json_numbers(&v).unwrap().0, "<f8");
    }
}
