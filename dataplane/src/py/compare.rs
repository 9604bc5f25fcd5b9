//! `compare_output`: the rule of `golden::compare`, called by the health loop (a golden case's
//! expected outputs against Triton's answer) and by rollouts (one version's answer against the
//! other's), through sidecar/golden/compare.py.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::golden::compare::{self, Element, Elements, Expected};

/// (datatype, shape, values) of a received output.
type ReceivedTuple<'py> = (String, Vec<i64>, Bound<'py, PyAny>);

/// Every way one output differs from its expectation, as messages (empty: it matches). `values` and
/// the received values are each float64 little-endian bytes, a flat list or tuple, or a numpy array
/// (any shape, read flat in C order): numbers for a numeric datatype, str or bytes for BYTES. Raises ValueError when the values disagree with their
/// own shape.
#[pyfunction]
#[pyo3(signature = (name, datatype, shape, values, atol, rtol, got))]
fn compare_output(
    name: &str,
    datatype: &str,
    shape: Vec<i64>,
    values: &Bound<'_, PyAny>,
    atol: f64,
    rtol: f64,
    got: Option<ReceivedTuple<'_>>,
) -> PyResult<Vec<String>> {
    let header = got.as_ref().map(|(d, s, _)| (d.as_str(), s.as_slice()));
    if let Some(mismatch) = compare::compare_header(name, datatype, &shape, header) {
        return Ok(vec![mismatch]);
    }
    let Some((_, _, got_values)) = got else {
        return Ok(Vec::new());
    };
    let result = if datatype == "BYTES" {
        let (want, have) = (elements(values)?, elements(&got_values)?);
        let expected = Expected { datatype, shape: &shape, values: Elements::Bytes(&want), atol, rtol };
        compare::compare_values(name, &expected, &Elements::Bytes(&have))
    } else {
        let (want, have) = (numbers(values)?, numbers(&got_values)?);
        let expected = Expected { datatype, shape: &shape, values: Elements::Numbers(&want), atol, rtol };
        compare::compare_values(name, &expected, &Elements::Numbers(&have))
    };
    result.map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

/// A numeric side's values as float64, flat: the little-endian float64 bytes the health loop's
/// reading hands over (read_answer, a golden file's expected values), a list or tuple of numbers, or
/// a numpy array (rollouts, tests), which numpy converts (its astype is the one every numeric
/// datatype, FP16 and BOOL included, has always been read with).
fn numbers(values: &Bound<'_, PyAny>) -> PyResult<Vec<f64>> {
    let owned;
    let raw = if let Ok(raw) = values.cast::<PyBytes>() {
        raw.as_bytes()
    } else if values.is_instance_of::<PyList>() || values.is_instance_of::<PyTuple>() {
        return values.try_iter()?.map(|v| v?.extract::<f64>()).collect();
    } else {
        owned = values.call_method1("astype", ("<f8",))?.call_method0("tobytes")?;
        owned.cast::<PyBytes>()?.as_bytes()
    };
    if raw.len() % 8 != 0 {
        return Err(PyValueError::new_err(format!("{} bytes are not a whole number of float64 values", raw.len())));
    }
    Ok(raw
        .chunks_exact(8)
        .map(|chunk| {
            let mut le = [0u8; 8];
            le.copy_from_slice(chunk);
            f64::from_le_bytes(le)
        })
        .collect())
}

/// A BYTES side's elements (a list, a tuple or a numpy array): a str as its UTF-8, anything else as `bytes(value)` (as the Python rule
/// read them); quoted as Python's `repr` quotes them, by Rust for plain str and bytes.
fn elements(array: &Bound<'_, PyAny>) -> PyResult<Vec<Element>> {
    // A list or tuple (read_answer, a golden file) is flat already; a numpy array is flattened.
    let flat = if array.is_instance_of::<PyList>() || array.is_instance_of::<PyTuple>() {
        array.clone()
    } else {
        array.call_method1("reshape", (-1,))?
    };
    let mut out = Vec::new();
    for item in flat.try_iter()? {
        let item = item?;
        let element = if let Ok(text) = item.cast::<PyString>() {
            let text = text.to_str()?;
            if item.is_exact_instance_of::<PyString>() {
                Element::text(text)
            } else {
                // A str subclass (numpy's str_) has a repr of its own.
                Element { bytes: text.as_bytes().to_vec(), repr: item.repr()?.to_str()?.to_owned() }
            }
        } else if item.is_exact_instance_of::<PyBytes>() {
            Element::binary(item.cast::<PyBytes>()?.as_bytes())
        } else {
            let bytes = item.py().get_type::<PyBytes>().call1((&item,))?;
            Element { bytes: bytes.cast::<PyBytes>()?.as_bytes().to_vec(), repr: item.repr()?.to_str()?.to_owned() }
        };
        out.push(element);
    }
    Ok(out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compare_output, m)?)
}
