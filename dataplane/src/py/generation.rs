//! `GenerateLimits.check` and `screen_generate_event`: the generate body check and event screening of
//! `serving::generation`, called by the Python half's HTTP front until the fronts themselves move
//! into this crate.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::filtering::AnswerNotV2;
use super::validation::RequestSpec;
use crate::serving::generation;

create_exception!(
    _dataplane,
    GenerateRefused,
    PyValueError,
    "A generate body refused: args are (reason label, message, field or \"\", field is an input)."
);

/// What a generate request to one model may ask for; built once per model and configuration.
#[pyclass(frozen, module = "sidecar._dataplane")]
pub struct GenerateLimits {
    pub(crate) limits: generation::GenerateLimits,
}

#[pymethods]
impl GenerateLimits {
    #[new]
    fn new(max_text_bytes: u64, max_tokens: u64, token_limit_keys: Vec<String>, parameters: Vec<String>) -> Self {
        let limits = generation::GenerateLimits {
            max_text_bytes,
            max_tokens,
            token_limit_keys: token_limit_keys.into_iter().collect(),
            parameters: parameters.into_iter().collect(),
        };
        GenerateLimits { limits }
    }

    /// Check one generate body against the model's inputs (`spec`, the model's RequestSpec);
    /// raises GenerateRefused.
    fn check(&self, spec: &RequestSpec, body: &[u8]) -> PyResult<()> {
        generation::check_generate_request(&spec.spec, &self.limits, body)
            .map_err(|r| GenerateRefused::new_err((r.reason.label(), r.message, r.field, r.is_input)))
    }
}

/// (new event or None when untouched, dropped outputs, non-finite fields, Triton's error or None).
type ScreenedTuple<'py> = (Option<Bound<'py, PyBytes>>, Vec<String>, Vec<String>, Option<String>);

/// Remove hidden outputs from one generate answer or stream event, name its NaN/Inf fields and
/// Triton's error; raises AnswerNotV2 for an event that is not a JSON object.
#[pyfunction]
#[pyo3(signature = (data, is_hidden, check_non_finite))]
fn screen_generate_event<'py>(
    py: Python<'py>,
    data: &[u8],
    is_hidden: Option<Bound<'py, PyAny>>,
    check_non_finite: bool,
) -> PyResult<ScreenedTuple<'py>> {
    let hidden = super::output_filter(&is_hidden);
    let filter: Option<&dyn Fn(&str) -> bool> = if is_hidden.is_some() { Some(&hidden) } else { None };
    match generation::screen_event(data, filter, check_non_finite) {
        Ok(s) => Ok((s.data.map(|d| PyBytes::new(py, &d)), s.dropped, s.non_finite, s.error)),
        Err(e) => Err(AnswerNotV2::new_err(e.0)),
    }
}

/// False when an event can be passed on unparsed (no filter, no error key, no NaN/Infinity word).
#[pyfunction]
fn generate_event_needs_screening(data: &[u8], has_filter: bool, check_non_finite: bool) -> bool {
    generation::needs_screening(data, has_filter, check_non_finite)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(screen_generate_event, m)?)?;
    m.add_function(wrap_pyfunction!(generate_event_needs_screening, m)?)?;
    m.add_class::<GenerateLimits>()?;
    m.add("GenerateRefused", m.py().get_type::<GenerateRefused>())?;
    Ok(())
}
