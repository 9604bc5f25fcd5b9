//! Screening of Triton's infer answers: outputs that never leave the pod are removed, JSON or binary,
//! and outputs holding NaN or ±Inf are reported (the serving core withholds them). Kept tensors pass
//! byte for byte: a hidden output's object is cut out of Triton's JSON text and its binary section
//! out of the binary body; nothing is re-encoded.

use crate::protocol::datatypes::{first_non_finite, float_max};
use crate::protocol::json::{self, Number, Value};
use crate::protocol::pytext::repr_str;

/// Words servers write for non-finite floats in JSON (Triton: NaN, Infinity; MLServer: null): absent
/// from the text means no NaN/Inf in it, and the common answer costs three substring searches.
const NON_FINITE_WORDS: [&[u8]; 3] = [b"NaN", b"Infinity", b"null"];

#[derive(Debug, PartialEq, Eq)]
pub struct Screened {
    /// The new answer, None when it passes untouched.
    pub body: Option<Vec<u8>>,
    /// The new Inference-Header-Content-Length of a binary answer.
    pub header_length: Option<usize>,
    pub dropped: Vec<String>,
    /// Kept float outputs holding NaN or ±Inf (only looked for when asked).
    pub non_finite: Vec<String>,
}

impl Screened {
    fn untouched(header_length: Option<usize>) -> Screened {
        Screened { body: None, header_length, dropped: Vec::new(), non_finite: Vec::new() }
    }
}

/// Triton's answer is not what the v2 protocol says; the message says how.
#[derive(Debug, PartialEq, Eq)]
pub struct AnswerFormatError(pub String);

/// `needle` somewhere in `haystack` (a word looked for before any parsing).
pub(crate) fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn has_non_finite_words(text: &[u8]) -> bool {
    NON_FINITE_WORDS.iter().any(|w| contains(text, w))
}

pub fn screen_infer_response(
    body: &[u8],
    header_length: Option<i64>,
    is_hidden: Option<&dyn Fn(&str) -> bool>,
    check_non_finite: bool,
) -> Result<Screened, AnswerFormatError> {
    if is_hidden.is_none() && !check_non_finite {
        return Ok(Screened::untouched(header_length.map(|h| h as usize)));
    }
    match header_length {
        None => {
            if is_hidden.is_none() && !has_non_finite_words(body) {
                return Ok(Screened::untouched(None));
            }
            screen_json(body, is_hidden, check_non_finite)
        }
        Some(h) => screen_binary(body, h, is_hidden, check_non_finite),
    }
}

type Outputs<'t> = (Vec<&'t Value<'t>>, Option<Vec<(usize, usize)>>);

fn outputs_of<'t>(doc: &'t Value<'t>, spans: Option<Vec<(usize, usize)>>) -> Result<Outputs<'t>, AnswerFormatError> {
    let no_outputs = || AnswerFormatError("Triton's answer has no 'outputs' list".into());
    match doc {
        Value::Object(_) => match doc.get("outputs") {
            None => Ok((Vec::new(), None)),
            Some(Value::Array(items)) => Ok((items.iter().collect(), spans)),
            Some(_) => Err(no_outputs()),
        },
        _ => Err(no_outputs()),
    }
}

fn parse(text: &[u8]) -> Result<json::WithSpans<'_>, AnswerFormatError> {
    json::parse_with_spans(text, "outputs").map_err(|e| {
        let detail: String = e.to_string().chars().take(120).collect();
        AnswerFormatError(format!("Triton's answer is not valid JSON: {detail}"))
    })
}

fn name_of<'v>(output: &'v Value) -> &'v str {
    output.get("name").and_then(Value::as_str).unwrap_or("")
}

fn is_float(output: &Value) -> bool {
    output.get("datatype").and_then(Value::as_str).is_some_and(|d| float_max(d).is_some())
}

/// Every value of `data` finite, as numpy would read it as float64; data that is not numbers at all
/// (strings, ragged lists) is not ours to judge.
fn all_finite(data: &Value) -> bool {
    fn walk(v: &Value, bad: &mut bool) -> bool {
        match v {
            Value::Array(items) => items.iter().all(|item| walk(item, bad)),
            // A run holds no literal NaN or Infinity: only an exponent past a double's range can be one.
            Value::Numbers(run) => {
                if run.below_exp10 > 308 {
                    run.iter().for_each(|item| {
                        walk(&item, bad);
                    });
                }
                true
            }
            Value::Null | Value::NonFinite(_) => {
                *bad = true;
                true
            }
            Value::Number { below_exp10, .. } if *below_exp10 > 308 => {
                if matches!(v.number(), Some(Number::Float(f)) if !f.is_finite()) {
                    *bad = true;
                }
                true
            }
            Value::Number { .. } | Value::Bool(_) => true,
            Value::Str(_) | Value::Object(_) => false,
        }
    }
    let mut bad = false;
    let numbers = walk(data, &mut bad);
    !(numbers && bad)
}

fn hidden(is_hidden: Option<&dyn Fn(&str) -> bool>, name: &str) -> bool {
    is_hidden.is_some_and(|f| f(name))
}

/// The text with the outputs at `drop` (indices) cut out, the others kept as they are.
fn drop_from_json(text: &[u8], spans: &[(usize, usize)], drop: &[bool]) -> Vec<u8> {
    let keep: Vec<bool> = drop.iter().map(|d| !d).collect();
    json::splice(text, spans, &keep)
}

fn screen_json(
    body: &[u8],
    is_hidden: Option<&dyn Fn(&str) -> bool>,
    check_non_finite: bool,
) -> Result<Screened, AnswerFormatError> {
    let (doc, spans) = parse(body)?;
    let (outputs, spans) = outputs_of(&doc, spans)?;
    let drop: Vec<bool> = outputs.iter().map(|o| hidden(is_hidden, name_of(o))).collect();
    let mut non_finite = Vec::new();
    if check_non_finite && has_non_finite_words(body) {
        for (o, dropped) in outputs.iter().zip(&drop) {
            if is_float(o) && !*dropped && !o.get("data").is_none_or(all_finite) {
                non_finite.push(name_of(o).to_owned());
            }
        }
    }
    let dropped: Vec<String> =
        outputs.iter().zip(&drop).filter(|(_, d)| **d).map(|(o, _)| name_of(o).to_owned()).collect();
    if dropped.is_empty() {
        return Ok(Screened { body: None, header_length: None, dropped, non_finite });
    }
    let spans = spans.unwrap_or_default();
    Ok(Screened { body: Some(drop_from_json(body, &spans, &drop)), header_length: None, dropped, non_finite })
}

fn screen_binary(
    body: &[u8],
    header_length: i64,
    is_hidden: Option<&dyn Fn(&str) -> bool>,
    check_non_finite: bool,
) -> Result<Screened, AnswerFormatError> {
    if header_length <= 0 || header_length as u64 > body.len() as u64 {
        return Err(AnswerFormatError(format!(
            "Inference-Header-Content-Length {header_length} is outside the answer"
        )));
    }
    let split = header_length as usize;
    let header = &body[..split];
    let (doc, spans) = parse(header)?;
    let (outputs, spans) = outputs_of(&doc, spans)?;
    // (start, end) in body per output; (0, 0) for an output sent as JSON data.
    let mut sections: Vec<(usize, usize)> = Vec::with_capacity(outputs.len());
    let mut offset = split;
    for o in &outputs {
        let size = match o.get("parameters").and_then(|p| p.get("binary_data_size")) {
            None | Some(Value::Null) => {
                sections.push((0, 0));
                continue;
            }
            Some(size) => size,
        };
        let size = match size.number() {
            Some(Number::Int(n)) if n >= 0 && (offset as u64).saturating_add(n as u64) <= body.len() as u64 => {
                n as usize
            }
            _ => {
                let name = o.get("name").and_then(Value::as_str).map(repr_str).unwrap_or_else(|| "None".into());
                return Err(AnswerFormatError(format!("binary_data_size of output {name} runs past the answer")));
            }
        };
        sections.push((offset, offset + size));
        offset += size;
    }
    if offset != body.len() {
        return Err(AnswerFormatError("binary sizes do not add up to the answer's length".into()));
    }
    let drop: Vec<bool> = outputs.iter().map(|o| hidden(is_hidden, name_of(o))).collect();
    let mut non_finite = Vec::new();
    if check_non_finite {
        let words = has_non_finite_words(header);
        for ((o, (start, end)), dropped) in outputs.iter().zip(&sections).zip(&drop) {
            if *dropped || !is_float(o) {
                continue;
            }
            let datatype = o.get("datatype").and_then(Value::as_str).unwrap_or("");
            let bad = if end > start {
                first_non_finite(datatype, &body[*start..*end]).is_some()
            } else {
                words && !o.get("data").is_none_or(all_finite)
            };
            if bad {
                non_finite.push(name_of(o).to_owned());
            }
        }
    }
    let dropped: Vec<String> =
        outputs.iter().zip(&drop).filter(|(_, d)| **d).map(|(o, _)| name_of(o).to_owned()).collect();
    if dropped.is_empty() {
        return Ok(Screened { body: None, header_length: Some(split), dropped, non_finite });
    }
    let mut out = drop_from_json(header, &spans.unwrap_or_default(), &drop);
    let new_header_length = out.len();
    for ((start, end), dropped) in sections.iter().zip(&drop) {
        if end > start && !*dropped {
            out.extend_from_slice(&body[*start..*end]);
        }
    }
    Ok(Screened { body: Some(out), header_length: Some(new_header_length), dropped, non_finite })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(name: &str) -> bool {
        name == "secret"
    }

    #[test]
    fn a_hidden_output_is_cut_out_and_the_rest_kept_byte_for_byte() {
        let answer = br#"{"model_name":"m","model_version":"1","outputs":[{"name":"scores","datatype":"FP32","shape":[1],"data":[0.1234]},{"name":"secret","datatype":"FP32","shape":[1],"data":[0.5]}]}"#;
        let s = screen_infer_response(answer, None, Some(&secret), true).unwrap();
        assert_eq!(s.dropped, vec!["secret".to_string()]);
        assert_eq!(
            s.body.unwrap(),
            br#"{"model_name":"m","model_version":"1","outputs":[{"name":"scores","datatype":"FP32","shape":[1],"data":[0.1234]}]}"#
        );
        let untouched = screen_infer_response(answer, None, None, true).unwrap();
        assert_eq!(untouched, Screened::untouched(None));
    }

    #[test]
    fn non_finite_outputs_are_named_unless_hidden() {
        let answer = br#"{"outputs":[{"name":"a","datatype":"FP32","data":[1,NaN]},{"name":"b","datatype":"FP64","data":[null]},{"name":"secret","datatype":"FP32","data":[Infinity]},{"name":"t","datatype":"BYTES","data":["NaN"]}]}"#;
        let s = screen_infer_response(answer, None, Some(&secret), true).unwrap();
        assert_eq!(s.non_finite, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(s.dropped, vec!["secret".to_string()]);
    }

    #[test]
    fn binary_sections_follow_their_outputs() {
        let header = br#"{"outputs":[{"name":"secret","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}},{"name":"scores","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}"#;
        let mut body = header.to_vec();
        body.extend_from_slice(&1.5f32.to_le_bytes());
        body.extend_from_slice(&f32::NAN.to_le_bytes());
        let s = screen_infer_response(&body, Some(header.len() as i64), Some(&secret), true).unwrap();
        assert_eq!(s.non_finite, vec!["scores".to_string()]);
        let new = s.body.unwrap();
        let h = s.header_length.unwrap();
        assert_eq!(&new[h..], &f32::NAN.to_le_bytes());
        assert!(!contains(&new[..h], b"secret"));
        let e = screen_infer_response(&body[..body.len() - 1], Some(header.len() as i64), None, true).unwrap_err();
        assert!(e.0.contains("runs past the answer"), "{}", e.0);
    }

    #[test]
    fn what_is_not_v2_is_said() {
        let e = screen_infer_response(b"{nope", None, Some(&secret), true).unwrap_err();
        assert!(e.0.starts_with("Triton's answer is not valid JSON"), "{}", e.0);
        let e = screen_infer_response(br#"{"outputs": 5}"#, None, Some(&secret), true).unwrap_err();
        assert_eq!(e.0, "Triton's answer has no 'outputs' list");
    }
}
