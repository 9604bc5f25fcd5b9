//! `RequestSpec.validate`: the request checks of `serving::validation`, called by the Python half
//! (HTTP and gRPC fronts) until the fronts themselves move into this crate.

use std::collections::HashSet;
use std::sync::Arc;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::protocol::json::{self, Value};
use crate::serving::request_rules;
use crate::serving::validation::{self, Checked, InputSpec, Limits, Values};

create_exception!(
    _dataplane,
    RequestRefused,
    PyValueError,
    "A request refused before Triton: args are (reason label, message, input name or \"\")."
);

/// A model's rule file (`validation.schemas.<model>`), compiled once: Python reads and checks the file
/// at start-up and hands its JSON down; every spec of the model shares it.
#[pyclass(frozen, module = "sidecar._dataplane")]
pub struct RequestRules {
    rules: Arc<request_rules::RequestRules>,
}

#[pymethods]
impl RequestRules {
    /// `file_name`: as refusals quote it; `schema`: the file's JSON text. ValueError says what cannot
    /// be compiled.
    #[new]
    fn new(file_name: &str, schema: &str) -> PyResult<Self> {
        let rules = request_rules::RequestRules::new(file_name, schema).map_err(PyValueError::new_err)?;
        Ok(RequestRules { rules: Arc::new(rules) })
    }
}

/// What a valid request to one model (version) looks like, built once per spec on the Python side.
#[pyclass(frozen, module = "sidecar._dataplane")]
pub struct RequestSpec {
    pub(crate) spec: validation::RequestSpec,
    /// The filtering rules' verdict by output name, for servers whose metadata declares no outputs.
    is_hidden: Option<Py<PyAny>>,
}

#[pymethods]
impl RequestSpec {
    #[new]
    #[pyo3(signature = (model, inputs, outputs, hidden_outputs, max_batch_size, max_elements, max_bytes_element,
                        reject_non_finite, is_hidden=None, rules=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: String,
        inputs: Vec<(String, String, Vec<i64>, bool)>,
        outputs: Vec<String>,
        hidden_outputs: Vec<String>,
        max_batch_size: u64,
        max_elements: u64,
        max_bytes_element: u64,
        reject_non_finite: bool,
        is_hidden: Option<Py<PyAny>>,
        rules: Option<PyRef<'_, RequestRules>>,
    ) -> Self {
        let inputs = inputs
            .into_iter()
            .map(|(name, datatype, shape, optional)| InputSpec { name, datatype, shape, optional })
            .collect();
        let spec = validation::RequestSpec {
            model,
            inputs,
            outputs,
            hidden_outputs: hidden_outputs.into_iter().collect::<HashSet<_>>(),
            max_batch_size,
            limits: Limits { max_elements, max_bytes_element, reject_non_finite },
            rules: rules.map(|r| r.rules.clone()),
        };
        RequestSpec { spec, is_hidden }
    }

    /// Check one infer request body; raises RequestRefused. `header_length`: the
    /// Inference-Header-Content-Length of the binary tensor extension, None for plain JSON.
    #[pyo3(signature = (body, header_length=None))]
    fn validate(&self, py: Python<'_>, body: &Bound<'_, PyBytes>, header_length: Option<i64>) -> PyResult<CheckedBody> {
        let is_hidden = |name: &str| -> bool {
            match &self.is_hidden {
                // A filter that fails is taken as "hidden": refusing is the safe side.
                Some(f) => f.call1(py, (name,)).and_then(|v| v.is_truthy(py)).unwrap_or(true),
                None => false,
            }
        };
        match validation::validate_infer_request(&self.spec, body.as_bytes(), header_length, &is_hidden) {
            Ok(checked) => Ok(CheckedBody { checked, body: body.clone().unbind() }),
            Err(refused) => Err(RequestRefused::new_err((refused.reason.label(), refused.message, refused.input))),
        }
    }
}

/// A request that passed: counts for the proxy, and where each input's values are (for the drift
/// monitor and per-model rules, which read them only for the models they watch).
#[pyclass(frozen, module = "sidecar._dataplane")]
pub struct CheckedBody {
    checked: Checked,
    /// The request, kept (a reference, not a copy) for the rare reader of its values.
    body: Py<PyBytes>,
}

#[pymethods]
impl CheckedBody {
    #[getter]
    fn elements(&self) -> u64 {
        self.checked.elements
    }

    #[getter]
    fn requested_outputs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.checked.requested_outputs)
    }

    #[getter]
    fn binary(&self) -> bool {
        self.checked.binary
    }

    /// Each input as (name, datatype, shape, json_index, binary_offset, binary_size): json_index is the
    /// input's position in `inputs` when its values are JSON `data` (else -1); a binary input's bytes
    /// are body[binary_offset:binary_offset + binary_size].
    fn layout(&self) -> Vec<(String, String, Vec<u64>, i64, usize, usize)> {
        self.checked
            .inputs
            .iter()
            .map(|input| {
                let (index, offset, size) = match input.values {
                    Values::Json(i) => (i as i64, 0, 0),
                    Values::Binary { offset, size } => (-1, self.checked.header_length + offset, size),
                };
                (input.name.clone(), input.datatype.clone(), input.shape.clone(), index, offset, size)
            })
            .collect()
    }

    /// The numbers of JSON input `index` as (numpy dtype, little-endian bytes), None when not numeric.
    /// The header is read again: only the drift monitor asks, for the models it measures.
    fn json_numbers<'py>(&self, py: Python<'py>, index: usize) -> Option<(&'static str, Bound<'py, PyBytes>)> {
        let body = self.body.bind(py).as_bytes();
        let doc = json::parse(body.get(..self.checked.header_length)?).ok()?;
        let data = match doc.get("inputs") {
            Some(Value::Array(items)) => items.get(index)?.get("data")?,
            _ => return None,
        };
        let (dtype, bytes) = validation::json_numbers(data)?;
        Some((dtype, PyBytes::new(py, &bytes)))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestSpec>()?;
    m.add_class::<RequestRules>()?;
    m.add_class::<CheckedBody>()?;
    m.add("RequestRefused", m.py().get_type::<RequestRefused>())?;
    Ok(())
}
