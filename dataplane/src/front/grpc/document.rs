//! A ModelInferRequest as the one validation rule reads it (serving/validation.rs): the v2 JSON
//! document with typed contents as `data`, raw (and BYTES) contents as binary chunks announced by
//! `binary_data_size`, written out as the binary extension's JSON header and followed by the chunks.
//! The same shape sidecar/fronts/grpc_server.py's `decode_infer_request` builds, so a request is
//! refused with the same reason and message whichever half decoded it.

use std::collections::HashMap;

use crate::protocol::pytext::{cut, float_repr, rapidjson_string, repr_str};
use crate::serving::refusals::{Reason, Refused};

use super::messages::{InferParameter, InferTensorContents, ModelInferRequest, ParameterChoice};

/// The header and chunks (one body) and the header's length, or the refusal decode_infer_request raises.
pub fn infer_document(request: &ModelInferRequest) -> Result<(Vec<u8>, usize), Refused> {
    let raw = &request.raw_input_contents;
    if !raw.is_empty() && raw.len() != request.inputs.len() {
        let message = format!(
            "{} raw_input_contents for {} inputs: send every input's data raw, or none",
            raw.len(),
            request.inputs.len()
        );
        return Err(Refused { reason: Reason::Schema, message, input: String::new() });
    }
    let mut out = String::with_capacity(256);
    let mut chunks: Vec<&[u8]> = Vec::new();
    let mut blobs: Vec<Vec<u8>> = Vec::new();
    out.push('{');
    let mut first = true;
    if !request.id.is_empty() {
        out.push_str("\"id\":");
        rapidjson_string(&request.id, &mut out);
        first = false;
    }
    let params = parameters(&request.parameters);
    if !params.is_empty() {
        if !first {
            out.push(',');
        }
        out.push_str("\"parameters\":");
        object(&params, &mut out);
        first = false;
    }
    if !first {
        out.push(',');
    }
    out.push_str("\"inputs\":[");
    // BYTES blobs are built first so the chunks borrow them in order.
    for tensor in &request.inputs {
        if raw.is_empty() && tensor.datatype == "BYTES" {
            let mut blob = Vec::new();
            for element in tensor.contents.as_ref().map(|c| c.bytes_contents.as_slice()).unwrap_or(&[]) {
                blob.extend_from_slice(&(element.len() as u32).to_le_bytes());
                blob.extend_from_slice(element);
            }
            blobs.push(blob);
        }
    }
    let mut blob_index = 0;
    for (i, tensor) in request.inputs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"name\":");
        rapidjson_string(&tensor.name, &mut out);
        out.push_str(",\"shape\":[");
        out.push_str(&tensor.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","));
        out.push_str("],\"datatype\":");
        rapidjson_string(&tensor.datatype, &mut out);
        let mut tensor_params = parameters(&tensor.parameters);
        let mut binary_size = None;
        if !raw.is_empty() {
            binary_size = Some(raw[i].len());
            chunks.push(&raw[i]);
        } else if tensor.datatype == "BYTES" {
            let blob = &blobs[blob_index];
            blob_index += 1;
            binary_size = Some(blob.len());
            chunks.push(blob);
        } else if let Some(data) = typed_data(&tensor.datatype, tensor.contents.as_ref()) {
            out.push_str(",\"data\":");
            out.push_str(&data);
        } else {
            let message = format!(
                "input {}: {} tensors can only be sent in raw_input_contents",
                repr_str(&cut(&tensor.name, 120)),
                cut(&tensor.datatype, 120)
            );
            return Err(Refused { reason: Reason::Datatype, message, input: tensor.name.clone() });
        }
        if let Some(size) = binary_size {
            let value = size.to_string();
            match tensor_params.iter_mut().find(|(k, _)| k == "binary_data_size") {
                Some(entry) => entry.1 = value,
                None => tensor_params.push(("binary_data_size".to_owned(), value)),
            }
        }
        if !tensor_params.is_empty() {
            out.push_str(",\"parameters\":");
            object(&tensor_params, &mut out);
        }
        out.push('}');
    }
    out.push(']');
    if !request.outputs.is_empty() {
        out.push_str(",\"outputs\":[");
        for (i, output) in request.outputs.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str("{\"name\":");
            rapidjson_string(&output.name, &mut out);
            if !output.parameters.is_empty() {
                out.push_str(",\"parameters\":");
                object(&parameters(&output.parameters), &mut out);
            }
            out.push('}');
        }
        out.push(']');
    }
    out.push('}');
    let header_length = out.len();
    let mut body = out.into_bytes();
    for chunk in chunks {
        body.extend_from_slice(chunk);
    }
    Ok((body, header_length))
}

/// The parameters that hold a value, as (key, JSON value), keys sorted (a protobuf map has no order).
fn parameters(params: &HashMap<String, InferParameter>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = params
        .iter()
        .filter_map(|(key, value)| {
            let json = match value.parameter_choice.as_ref()? {
                ParameterChoice::BoolParam(b) => b.to_string(),
                ParameterChoice::Int64Param(i) => i.to_string(),
                ParameterChoice::Uint64Param(u) => u.to_string(),
                ParameterChoice::DoubleParam(d) => float_json(*d),
                ParameterChoice::StringParam(s) => {
                    let mut quoted = String::new();
                    rapidjson_string(s, &mut quoted);
                    quoted
                }
            };
            Some((key.clone(), json))
        })
        .collect();
    out.sort();
    out
}

fn object(members: &[(String, String)], out: &mut String) {
    out.push('{');
    for (i, (key, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        rapidjson_string(key, out);
        out.push(':');
        out.push_str(value);
    }
    out.push('}');
}

/// A float as python-rapidjson writes it with NM_NAN (NaN and the infinities as Triton's parser reads them).
fn float_json(f: f64) -> String {
    if f.is_nan() {
        "NaN".to_owned()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned()
    } else {
        float_repr(f)
    }
}

/// The typed `contents` field of a datatype as a JSON list (grpc_server.py's _CONTENTS); None for a
/// datatype that can only be sent raw (FP16, BF16, or one Triton does not know).
fn typed_data(datatype: &str, contents: Option<&InferTensorContents>) -> Option<String> {
    let empty = InferTensorContents::default();
    let c = contents.unwrap_or(&empty);
    fn list<T>(values: &[T], each: impl Fn(&T) -> String) -> String {
        format!("[{}]", values.iter().map(each).collect::<Vec<_>>().join(","))
    }
    Some(match datatype {
        "BOOL" => list(&c.bool_contents, |b| b.to_string()),
        "INT8" | "INT16" | "INT32" => list(&c.int_contents, |v| v.to_string()),
        "INT64" => list(&c.int64_contents, |v| v.to_string()),
        "UINT8" | "UINT16" | "UINT32" => list(&c.uint_contents, |v| v.to_string()),
        "UINT64" => list(&c.uint64_contents, |v| v.to_string()),
        "FP32" => list(&c.fp32_contents, |v| float_json(f64::from(*v))),
        "FP64" => list(&c.fp64_contents, |v| float_json(*v)),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::messages::InferInputTensor;
    use super::*;

    fn tensor(name: &str, datatype: &str, shape: Vec<i64>, contents: Option<InferTensorContents>) -> InferInputTensor {
        InferInputTensor {
            name: name.to_owned(),
            datatype: datatype.to_owned(),
            shape,
            parameters: HashMap::new(),
            contents,
        }
    }

    #[test]
    fn typed_contents_become_data_and_raw_contents_binary_chunks() {
        let typed = ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![tensor(
                "x",
                "FP32",
                vec![1, 2],
                Some(InferTensorContents { fp32_contents: vec![0.5, f32::NAN], ..Default::default() }),
            )],
            ..Default::default()
        };
        let (body, length) = infer_document(&typed).expect("a document");
        assert_eq!(length, body.len());
        assert_eq!(
            String::from_utf8_lossy(&body),
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[0.5,NaN]}]}"#
        );
        let raw = ModelInferRequest {
            inputs: vec![tensor("x", "FP16", vec![2], None)],
            raw_input_contents: vec![bytes::Bytes::from_static(&[1, 2, 3, 4])],
            ..Default::default()
        };
        let (body, length) = infer_document(&raw).expect("a document");
        assert_eq!(
            String::from_utf8_lossy(&body[..length]),
            r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP16","parameters":{"binary_data_size":"4"}}]}"#
                .replace("\"4\"", "4")
        );
        assert_eq!(&body[length..], &[1, 2, 3, 4]);
    }

    #[test]
    fn fp16_typed_and_a_raw_count_mismatch_are_refused_as_python_refuses_them() {
        let fp16 = ModelInferRequest { inputs: vec![tensor("x", "FP16", vec![1], None)], ..Default::default() };
        let refused = infer_document(&fp16).expect_err("refused");
        assert_eq!(refused.reason, Reason::Datatype);
        assert_eq!(refused.message, "input 'x': FP16 tensors can only be sent in raw_input_contents");
        let mismatch = ModelInferRequest {
            inputs: vec![tensor("x", "FP32", vec![1], None), tensor("y", "FP32", vec![1], None)],
            raw_input_contents: vec![bytes::Bytes::from_static(&[0, 0, 0, 0])],
            ..Default::default()
        };
        let refused = infer_document(&mismatch).expect_err("refused");
        assert_eq!(refused.reason, Reason::Schema);
        assert_eq!(refused.message, "1 raw_input_contents for 2 inputs: send every input's data raw, or none");
    }
}
