//! The outputs of a KServe v2 infer answer over HTTP (JSON, or a JSON header + binary sections),
//! decoded for whoever reads their values: the health loop's golden rounds (judged against the
//! expected values), rollouts (one version's answer against the other's) and the drift monitor. The
//! answer's bytes are never changed here (screening, serving::filtering, is what edits answers).
//!
//! Values are handed over as numpy reads them: a binary section as it is (the datatype's
//! little-endian layout, or BYTES' length-prefixed elements), JSON numbers as float64, int64 or
//! uint64 for the caller to cast to the datatype (numpy's `np.array(data, dtype)` for a well-formed
//! answer), JSON BYTES as their texts.

use std::fmt;

use crate::protocol::datatypes::{self, JsonNumber};
use crate::protocol::json::{self, Number, Value};

/// One decoded answer.
#[derive(Debug, PartialEq)]
pub struct Answer {
    /// `model_version` when the answer names one as a string.
    pub model_version: Option<String>,
    /// In the answer's order (a name twice is kept twice: the reader decides).
    pub outputs: Vec<Output>,
}

#[derive(Debug, PartialEq)]
pub struct Output {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
    pub values: Values,
}

#[derive(Debug, PartialEq)]
pub enum Values {
    /// `body[start..end]`: the output's binary section.
    Binary { start: usize, end: usize },
    /// JSON numbers, flat in C order, as little-endian `dtype` ("<f8", "<i8" or "<u8").
    Numbers { dtype: &'static str, bytes: Vec<u8> },
    /// The JSON texts of a BYTES output, flat in C order.
    Texts(Vec<String>),
}

/// The answer is not what the v2 protocol says; the message says how.
#[derive(Debug, PartialEq, Eq)]
pub struct NotV2(pub String);

impl fmt::Display for NotV2 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn not_v2(what: impl Into<String>) -> NotV2 {
    NotV2(what.into())
}

/// Decode a 200 answer: `header_length` is its Inference-Header-Content-Length (None: all JSON).
pub fn decode(body: &[u8], header_length: Option<i64>) -> Result<Answer, NotV2> {
    decode_tensors(body, header_length, "outputs")
}

/// Decode an infer request's inputs (the same layout as an answer's outputs: `data`, or binary
/// sections announced by `parameters.binary_data_size`), for the drift windows; `model_version` is
/// None. Only a request validation passed is decoded.
pub fn decode_inputs(body: &[u8], header_length: Option<i64>) -> Result<Answer, NotV2> {
    decode_tensors(body, header_length, "inputs")
}

/// The tensors listed under `key` ("outputs", "inputs") of a v2 infer document.
fn decode_tensors(body: &[u8], header_length: Option<i64>, key: &str) -> Result<Answer, NotV2> {
    let header_end = match header_length {
        None => body.len(),
        Some(h) => usize::try_from(h)
            .ok()
            .filter(|&h| h <= body.len())
            .ok_or_else(|| not_v2(format!("header length {h} outside a body of {} bytes", body.len())))?,
    };
    let doc = json::parse(&body[..header_end]).map_err(|e| not_v2(format!("not valid JSON: {e}")))?;
    if !matches!(doc, Value::Object(_)) {
        return Err(not_v2("the answer is not a JSON object"));
    }
    let model_version = doc.get("model_version").and_then(Value::as_str).map(str::to_owned);
    let items = match doc.get(key) {
        None => &[][..],
        Some(Value::Array(items)) => items.as_slice(),
        Some(_) => return Err(not_v2(format!("'{key}' is not a list"))),
    };
    // Binary sections follow the header in the order of the outputs that have one.
    let mut offset = header_end;
    let mut outputs = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = |field: &str| item.get(field).ok_or_else(|| not_v2(format!("{key}[{i}] has no '{field}'")));
        let text = |field_name: &str| {
            field(field_name)?.as_str().ok_or_else(|| not_v2(format!("{key}[{i}].{field_name} is not a string")))
        };
        let (name, datatype) = (text("name")?.to_owned(), text("datatype")?.to_owned());
        let shape = field("shape")?
            .items()
            .and_then(|dims| dims.iter().map(integer).collect::<Option<Vec<i64>>>())
            .ok_or_else(|| not_v2(format!("{key}[{i}].shape is not a list of integers")))?;
        let size = item.get("parameters").and_then(|p| p.get("binary_data_size"));
        let values = match size {
            Some(size) if *size != Value::Null && header_length.is_some() => {
                let end = integer(size)
                    .and_then(|s| usize::try_from(s).ok())
                    .and_then(|s| offset.checked_add(s))
                    .filter(|&end| end <= body.len())
                    .ok_or_else(|| not_v2(format!("{key}[{i}].binary_data_size outside the body")))?;
                let section = Values::Binary { start: offset, end };
                offset = end;
                section
            }
            _ => json_values(&datatype, field("data")?).map_err(|what| not_v2(format!("{key}[{i}].data {what}")))?,
        };
        outputs.push(Output { name, datatype, shape, values });
    }
    Ok(Answer { model_version, outputs })
}

fn integer(value: &Value) -> Option<i64> {
    match value.number()? {
        Number::Int(n) => Some(n),
        _ => None,
    }
}

fn leaves<'a>(data: &Value<'a>, out: &mut Vec<Value<'a>>) {
    match data {
        Value::Array(items) => items.iter().for_each(|item| leaves(item, out)),
        Value::Numbers(run) => out.extend(run.iter()),
        leaf => out.push(leaf.clone()),
    }
}

/// A JSON `data` list as numpy reads it for `datatype`: null is NaN (MLServer writes NaN so) in a
/// float output; null, NaN and ±Inf are refused in an integer output, as numpy refuses them there.
fn json_values(datatype: &str, data: &Value) -> Result<Values, &'static str> {
    if !data.is_array() {
        return Err("is not a list");
    }
    let mut flat = Vec::new();
    leaves(data, &mut flat);
    if datatype == "BYTES" {
        return flat
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .map(Values::Texts)
            .ok_or("holds a value that is not a text");
    }
    let mut numbers = Vec::with_capacity(flat.len());
    for leaf in flat {
        numbers.push(match &leaf {
            Value::Null => Number::Float(f64::NAN),
            Value::Bool(b) => Number::Int(*b as i64),
            other => match other.number() {
                Some(Number::BigInt) => return Err("holds an integer wider than 64 bits"),
                Some(n) => n,
                None => return Err("holds a value that is not a number"),
            },
        });
    }
    let floats =
        matches!(datatype, "FP16" | "FP32" | "FP64" | "BF16") || numbers.iter().any(|n| matches!(n, Number::Float(_)));
    if floats {
        if datatype_is_integer(datatype) && numbers.iter().any(|n| matches!(n, Number::Float(f) if !f.is_finite())) {
            return Err("holds null, NaN or Inf in an integer output");
        }
        let bytes = numbers.iter().flat_map(|n| as_f64(*n).to_le_bytes()).collect();
        return Ok(Values::Numbers { dtype: "<f8", bytes });
    }
    if numbers.iter().any(|n| matches!(n, Number::UInt(_))) {
        let mut bytes = Vec::with_capacity(numbers.len() * 8);
        for n in numbers {
            match n {
                Number::UInt(u) => bytes.extend_from_slice(&u.to_le_bytes()),
                Number::Int(i) if i >= 0 => bytes.extend_from_slice(&(i as u64).to_le_bytes()),
                _ => return Err("mixes negative integers with integers above 2**63"),
            }
        }
        return Ok(Values::Numbers { dtype: "<u8", bytes });
    }
    let bytes = numbers.iter().flat_map(|n| if let Number::Int(i) = n { *i } else { 0 }.to_le_bytes()).collect();
    Ok(Values::Numbers { dtype: "<i8", bytes })
}

fn datatype_is_integer(datatype: &str) -> bool {
    !matches!(datatype, "FP16" | "FP32" | "FP64" | "BF16")
}

fn as_f64(n: Number) -> f64 {
    match n {
        Number::Int(i) => i as f64,
        Number::UInt(u) => u as f64,
        Number::Float(f) => f,
        Number::BigInt => f64::NAN,
    }
}

/// A numeric output's values as float64, flat, as the health loop compares them
/// (golden::compare): a binary section read in the datatype's layout, JSON numbers cast to the
/// datatype first (protocol::datatypes::json_as_f64), as numpy's arrays of them read. NotV2 for a
/// binary section that is not a whole number of the datatype's elements.
pub fn numbers_as_f64(datatype: &str, values: &Values, body: &[u8]) -> Result<Vec<f64>, NotV2> {
    match values {
        Values::Binary { start, end } => datatypes::binary_as_f64(datatype, &body[*start..*end]).ok_or_else(|| {
            not_v2(format!("a binary section of {} bytes is not a whole number of {datatype} elements", end - start))
        }),
        Values::Numbers { dtype, bytes } => Ok(bytes
            .chunks_exact(8)
            .map(|chunk| {
                let mut le = [0u8; 8];
                le.copy_from_slice(chunk);
                let number = match *dtype {
                    "<i8" => JsonNumber::Int(i64::from_le_bytes(le)),
                    "<u8" => JsonNumber::UInt(u64::from_le_bytes(le)),
                    _ => JsonNumber::Float(f64::from_le_bytes(le)),
                };
                datatypes::json_as_f64(datatype, number)
            })
            .collect()),
        Values::Texts(_) => Err(not_v2(format!("a {datatype} output holds texts"))),
    }
}

/// The elements of a binary BYTES section: each a 4-byte little-endian length, then its bytes.
pub fn bytes_elements(section: &[u8]) -> Result<Vec<&[u8]>, NotV2> {
    let mut elements = Vec::new();
    let mut rest = section;
    while !rest.is_empty() {
        let (length, tail) =
            rest.split_first_chunk::<4>().ok_or_else(|| not_v2("a BYTES element's length is cut short"))?;
        let length = u32::from_le_bytes(*length) as usize;
        if length > tail.len() {
            return Err(not_v2("a BYTES element is cut short"));
        }
        let (element, tail) = tail.split_at(length);
        elements.push(element);
        rest = tail;
    }
    Ok(elements)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f64s(values: &[f64]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn numbers_read_as_float64_the_way_they_are_compared() {
        let floats: Vec<u8> = [1.5f32, 0.1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let header = br#"{"outputs":[{"name":"f","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}},
            {"name":"j","datatype":"FP32","shape":[2],"data":[0.1,null]},
            {"name":"i","datatype":"INT8","shape":[1],"data":[-3]},
            {"name":"odd","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":0}}]}"#;
        let body = [&header[..], &floats].concat();
        let answer = decode(&body, Some(header.len() as i64)).unwrap();
        let read = |i: usize| numbers_as_f64(&answer.outputs[i].datatype, &answer.outputs[i].values, &body);
        assert_eq!(read(0).unwrap(), [1.5, f64::from(0.1f32)]);
        let json = read(1).unwrap();
        assert_eq!(json[0], f64::from(0.1f32), "a JSON FP32 number as float32 holds it");
        assert!(json[1].is_nan(), "null reads as NaN");
        assert_eq!(read(2).unwrap(), [-3.0]);
        assert_eq!(read(3).unwrap(), Vec::<f64>::new());
        let short = br#"{"outputs":[{"name":"f","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":3}}]}"#;
        let body = [&short[..], &[0, 0, 0]].concat();
        let answer = decode(&body, Some(short.len() as i64)).unwrap();
        let error = numbers_as_f64("FP32", &answer.outputs[0].values, &body).unwrap_err();
        assert_eq!(error.0, "a binary section of 3 bytes is not a whole number of FP32 elements");
    }

    #[test]
    fn binary_and_json_outputs_decode_in_the_answer_s_order() {
        let floats: Vec<u8> = [1.5f32, f32::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
        let strings = b"\x02\x00\x00\x00ab\x01\x00\x00\x00\xff".to_vec();
        let header = br#"{"model_name":"m","model_version":"2","outputs":[
            {"name":"f","datatype":"FP32","shape":[1,2],"parameters":{"binary_data_size":8}},
            {"name":"s","datatype":"BYTES","shape":[2],"parameters":{"binary_data_size":11}},
            {"name":"empty","datatype":"FP32","shape":[0],"parameters":{"binary_data_size":0}},
            {"name":"j","datatype":"FP64","shape":[3],"data":[1.0,null,2.5]},
            {"name":"i","datatype":"INT64","shape":[2],"data":[3,-4]},
            {"name":"t","datatype":"BYTES","shape":[1],"data":["x"]}]}"#;
        let body = [header.as_slice(), &floats, &strings].concat();
        let answer = decode(&body, Some(header.len() as i64)).unwrap();
        assert_eq!(answer.model_version.as_deref(), Some("2"));
        let h = header.len();
        let values: Vec<&Values> = answer.outputs.iter().map(|o| &o.values).collect();
        assert_eq!(values[0], &Values::Binary { start: h, end: h + 8 });
        assert_eq!(values[1], &Values::Binary { start: h + 8, end: h + 19 });
        assert_eq!(values[2], &Values::Binary { start: h + 19, end: h + 19 });
        assert_eq!(values[3], &Values::Numbers { dtype: "<f8", bytes: f64s(&[1.0, f64::NAN, 2.5]) });
        assert_eq!(
            values[4],
            &Values::Numbers { dtype: "<i8", bytes: [3i64, -4].iter().flat_map(|v| v.to_le_bytes()).collect() }
        );
        assert_eq!(values[5], &Values::Texts(vec!["x".into()]));
        assert_eq!(answer.outputs[0].shape, vec![1, 2]);
        assert_eq!(bytes_elements(&body[h + 8..h + 19]).unwrap(), vec![&b"ab"[..], &b"\xff"[..]]);
    }

    #[test]
    fn json_numbers_are_read_as_numpy_reads_them() {
        let answer = decode(
            br#"{"outputs":[{"name":"b","datatype":"BOOL","shape":[2],"data":[true,false]},
                {"name":"u","datatype":"UINT64","shape":[2],"data":[18446744073709551615,1]},
                {"name":"n","datatype":"FP32","shape":[2,1],"data":[[NaN],[-Infinity]]},
                {"name":"x","datatype":"INT32","shape":[2],"data":[1,2.5]}]}"#,
            None,
        )
        .unwrap();
        let values: Vec<&Values> = answer.outputs.iter().map(|o| &o.values).collect();
        assert_eq!(
            values[0],
            &Values::Numbers { dtype: "<i8", bytes: [1i64, 0].iter().flat_map(|v| v.to_le_bytes()).collect() }
        );
        assert_eq!(
            values[1],
            &Values::Numbers { dtype: "<u8", bytes: [u64::MAX, 1].iter().flat_map(|v| v.to_le_bytes()).collect() }
        );
        assert_eq!(values[2], &Values::Numbers { dtype: "<f8", bytes: f64s(&[f64::NAN, f64::NEG_INFINITY]) });
        assert_eq!(values[3], &Values::Numbers { dtype: "<f8", bytes: f64s(&[1.0, 2.5]) });
        assert_eq!(answer.model_version, None);
    }

    #[test]
    fn an_answer_that_is_not_v2_is_refused_with_what_is_wrong() {
        let refused = |body: &[u8], h: Option<i64>| decode(body, h).unwrap_err().0;
        assert!(refused(b"{not json", None).starts_with("not valid JSON"));
        assert_eq!(refused(b"[1]", None), "the answer is not a JSON object");
        assert_eq!(refused(br#"{"outputs":{}}"#, None), "'outputs' is not a list");
        assert_eq!(
            refused(br#"{"outputs":[{"name":"a","shape":[1],"data":[1]}]}"#, None),
            "outputs[0] has no 'datatype'"
        );
        assert_eq!(
            refused(br#"{"outputs":[{"name":"a","datatype":"FP32","shape":["1"],"data":[1]}]}"#, None),
            "outputs[0].shape is not a list of integers"
        );
        assert_eq!(
            refused(br#"{"outputs":[{"name":"a","datatype":"INT8","shape":[1],"data":[null]}]}"#, None),
            "outputs[0].data holds null, NaN or Inf in an integer output"
        );
        assert_eq!(
            refused(br#"{"outputs":[{"name":"a","datatype":"BYTES","shape":[1],"data":[1]}]}"#, None),
            "outputs[0].data holds a value that is not a text"
        );
        let header = br#"{"outputs":[{"name":"a","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}"#;
        assert_eq!(refused(header, Some(header.len() as i64)), "outputs[0].binary_data_size outside the body");
        assert_eq!(refused(header, Some(999)), format!("header length 999 outside a body of {} bytes", header.len()));
        assert!(bytes_elements(b"\x05\x00\x00\x00ab").is_err() && bytes_elements(b"\x05\x00").is_err());
        assert_eq!(decode(br#"{"model_name":"m"}"#, None), Ok(Answer { model_version: None, outputs: vec![] }));
    }
}
