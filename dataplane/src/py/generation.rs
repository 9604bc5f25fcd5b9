//! `GenerateLimits.check`: the generate body check of `serving::generation`, called by the Python
//! half's HTTP front until the fronts themselves move into this crate.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

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
    limits: generation::GenerateLimits,
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GenerateLimits>()?;
    m.add("GenerateRefused", m.py().get_type::<GenerateRefused>())?;
    Ok(())
}
