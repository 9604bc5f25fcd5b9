//! `decode_answer`: the outputs of an HTTP infer answer (`protocol::answers`), for the health loop's
//! golden rounds, rollouts' compared answers and the drift monitor, through
//! sidecar/protocol/answers.py, which makes numpy arrays of them.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use pyo3::IntoPyObjectExt;

use super::filtering::AnswerNotV2;
use crate::protocol::answers::{self, Values};

/// (model_version or None, [(name, datatype, shape, values)]).
type DecodedTuple<'py> = (Option<String>, Vec<(String, String, Vec<i64>, Bound<'py, PyAny>)>);

/// Decode a 200 infer answer (JSON, or binary with `header_length`); raises AnswerNotV2. Each
/// output's values, flat: for BYTES a list of bytes (binary) or of str (JSON); else (dtype, data)
/// with dtype None for a binary section in the datatype's own layout, or "<f8", "<i8", "<u8" for JSON
/// numbers the caller casts to the datatype.
#[pyfunction]
#[pyo3(signature = (body, header_length))]
fn decode_answer<'py>(py: Python<'py>, body: &[u8], header_length: Option<i64>) -> PyResult<DecodedTuple<'py>> {
    decoded(py, body, header_length, |_, _, values| match values {
        Values::Binary { start, end } => (None::<&str>, PyBytes::new(py, &body[start..end])).into_bound_py_any(py),
        Values::Numbers { dtype, bytes } => (Some(dtype), PyBytes::new(py, &bytes)).into_bound_py_any(py),
        // Never here: `decoded` makes texts a list itself.
        Values::Texts(texts) => Ok(PyList::new(py, texts)?.into_any()),
    })
}

/// Decode a 200 infer answer as the health loop compares it (golden::compare), without numpy:
/// (model_version or None, [(name, datatype, shape, values)]) with each output's values flat, for
/// BYTES a list of bytes (binary) or of str (JSON), else the float64 values as little-endian bytes
/// (protocol::answers::numbers_as_f64). Raises AnswerNotV2.
#[pyfunction]
#[pyo3(signature = (body, header_length))]
fn read_answer<'py>(py: Python<'py>, body: &[u8], header_length: Option<i64>) -> PyResult<DecodedTuple<'py>> {
    decoded(py, body, header_length, |name, datatype, numbers| {
        let floats = answers::numbers_as_f64(datatype, &numbers, body)
            .map_err(|e| AnswerNotV2::new_err(format!("output {name}: {}", e.0)))?;
        Ok(PyBytes::new(py, &floats.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>()).into_any())
    })
}

/// The answer's outputs, BYTES as lists (the one rule of both functions above), numbers as
/// `numbers` makes them of (name, datatype, values).
fn decoded<'py>(
    py: Python<'py>,
    body: &[u8],
    header_length: Option<i64>,
    numbers: impl Fn(&str, &str, Values) -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<DecodedTuple<'py>> {
    let answer = answers::decode(body, header_length).map_err(|e| AnswerNotV2::new_err(e.0))?;
    let mut outputs = Vec::with_capacity(answer.outputs.len());
    for answers::Output { name, datatype, shape, values } in answer.outputs {
        let values = match values {
            Values::Binary { start, end } if datatype == "BYTES" => {
                let elements = answers::bytes_elements(&body[start..end]).map_err(|e| AnswerNotV2::new_err(e.0))?;
                PyList::new(py, elements.into_iter().map(|e| PyBytes::new(py, e)))?.into_any()
            }
            Values::Texts(texts) => PyList::new(py, texts)?.into_any(),
            other => numbers(&name, &datatype, other)?,
        };
        outputs.push((name, datatype, shape, values));
    }
    Ok((answer.model_version, outputs))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_answer, m)?)?;
    m.add_function(wrap_pyfunction!(read_answer, m)?)
}
