//! `screen_infer_response`: the screening of `serving::filtering`, called by the Python half's fronts
//! on each answer until the fronts themselves move into this crate.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::serving::filtering;

create_exception!(_dataplane, AnswerNotV2, PyValueError, "Triton's answer is not what the v2 protocol says.");

/// (new body or None when untouched, header length, dropped outputs, non-finite outputs).
type ScreenedTuple<'py> = (Option<Bound<'py, PyBytes>>, Option<usize>, Vec<String>, Vec<String>);

/// Remove hidden outputs from an infer answer (JSON, or binary with `header_length`) and name the
/// kept float outputs holding NaN or ±Inf; raises AnswerNotV2.
#[pyfunction]
#[pyo3(signature = (body, header_length, is_hidden, check_non_finite))]
fn screen_infer_response<'py>(
    py: Python<'py>,
    body: &[u8],
    header_length: Option<i64>,
    is_hidden: Option<Bound<'py, PyAny>>,
    check_non_finite: bool,
) -> PyResult<ScreenedTuple<'py>> {
    let hidden = super::output_filter(&is_hidden);
    let filter: Option<&dyn Fn(&str) -> bool> = if is_hidden.is_some() { Some(&hidden) } else { None };
    match filtering::screen_infer_response(body, header_length, filter, check_non_finite) {
        Ok(s) => Ok((s.body.map(|b| PyBytes::new(py, &b)), s.header_length, s.dropped, s.non_finite)),
        Err(e) => Err(AnswerNotV2::new_err(e.0)),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(screen_infer_response, m)?)?;
    m.add("AnswerNotV2", m.py().get_type::<AnswerNotV2>())?;
    Ok(())
}
