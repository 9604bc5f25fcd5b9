//! `inflate`: the Python listener's compressed request bodies, inflated by the rule the HTTP front's
//! lane uses (protocol::inflate), so that the two never differ.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::protocol::inflate::{self as rule, Unpacked};

/// The inflated body of `encoding` ("gzip", "deflate" or "zstd"), or None when it inflates past
/// `limit` bytes (never inflated further); raises ValueError (zlib's message) for a corrupt stream.
#[pyfunction]
fn inflate<'py>(py: Python<'py>, body: &[u8], encoding: &str, limit: usize) -> PyResult<Option<Bound<'py, PyBytes>>> {
    if !matches!(encoding, "gzip" | "deflate" | "zstd") {
        return Err(PyValueError::new_err(format!("not an encoding the sidecar inflates: {encoding:?}")));
    }
    // The GIL is let go while a body (up to validation.max_body_bytes) inflates.
    let inflated = py.detach(|| match encoding {
        "zstd" => rule::unzstd(body, limit),
        _ => rule::inflate(body, encoding == "gzip", limit),
    });
    match inflated {
        Ok(out) => Ok(Some(PyBytes::new(py, &out))),
        Err(Unpacked::TooLarge) => Ok(None),
        Err(Unpacked::Unreadable(message)) => Err(PyValueError::new_err(message)),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(inflate, m)?)
}
