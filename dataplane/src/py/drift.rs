//! `DriftWindows`: the drift windows (serving::drift) as Python holds them. sidecar/serving/drift.py's
//! DriftMonitor makes one, hands it to the HTTP front (whose lanes, on both ports, count the answers
//! they serve in it), feeds it the answers the Python chain serves, and reads its count tables at a
//! scrape or a /status to compute PSI.

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::serving::drift::{self, Reference, Sampling, TensorBins};

/// (name, features, bins, edges as float64 little-endian bytes, sentinels, count NaN as missing).
type TensorTuple = (String, usize, usize, Vec<u8>, Vec<f64>, bool);
/// (model, version key "" for any version, inputs, outputs).
type ReferenceTuple = (String, String, Vec<TensorTuple>, Vec<TensorTuple>);
/// (name, datatype, shape, values as float64 little-endian bytes): a tensor the Python chain decoded.
type TensorValues = (String, String, Vec<i64>, Vec<u8>);
/// (name, datatype, features, values as float64 little-endian bytes, rows of `features`).
type RecordedTuple<'py> = (String, String, usize, Bound<'py, PyBytes>);
/// (name, rows, table, total, sum): table and total as uint64 little-endian bytes.
type CountsTuple<'py> = (String, usize, Bound<'py, PyBytes>, Bound<'py, PyBytes>, f64);
/// (model, version, reference key, inputs' counts, outputs' counts).
type WindowTuple<'py> = (String, String, String, Vec<CountsTuple<'py>>, Vec<CountsTuple<'py>>);

#[pyclass(module = "sidecar._dataplane", frozen)]
pub struct DriftWindows {
    pub inner: Arc<drift::DriftWindows>,
}

fn floats(bytes: &[u8]) -> Vec<f64> {
    bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect()
}

fn le_bytes<'py>(py: Python<'py>, counts: &[u64]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &counts.iter().flat_map(|c| c.to_le_bytes()).collect::<Vec<u8>>())
}

fn tensor_bins((name, features, bins, edges, sentinels, count_nan): TensorTuple) -> PyResult<TensorBins> {
    let edges = floats(&edges);
    if features == 0 || bins < 2 || edges.len() != features * (bins - 1) {
        return Err(PyValueError::new_err(format!(
            "tensor {name}: {} edges for {features} features of {bins} bins",
            edges.len()
        )));
    }
    Ok(TensorBins { name, features, bins, edges, sentinels, count_nan })
}

#[pymethods]
impl DriftWindows {
    #[new]
    fn new() -> Self {
        DriftWindows { inner: Arc::default() }
    }

    /// Bin against these references from now on, with drift.window rows a window and
    /// drift.sample_rate of the requests measured; a model whose reference changed (or every
    /// model, for a new window size) counts again from empty.
    fn set(&self, references: Vec<ReferenceTuple>, window: usize, sample_rate: f64) -> PyResult<()> {
        let mut by_model: HashMap<String, HashMap<String, Arc<Reference>>> = HashMap::new();
        for (model, version, inputs, outputs) in references {
            let inputs = inputs.into_iter().map(tensor_bins).collect::<PyResult<Vec<_>>>()?;
            let outputs = outputs.into_iter().map(tensor_bins).collect::<PyResult<Vec<_>>>()?;
            by_model.entry(model).or_default().insert(version, Arc::new(Reference { inputs, outputs }));
        }
        self.inner.set(by_model, Sampling { window, sample_rate });
        Ok(())
    }

    /// Count one answered request the Python chain served: each tensor as (name, datatype, shape,
    /// its values as float64 little-endian bytes); `batched`: the model's max_batch_size > 0. True
    /// when it completed a live recording.
    fn observe(
        &self,
        model: &str,
        version: &str,
        batched: bool,
        inputs: Vec<TensorValues>,
        outputs: Vec<TensorValues>,
    ) -> bool {
        fn decoded(tensors: &[TensorValues]) -> Vec<drift::Numeric<'_>> {
            tensors
                .iter()
                .map(|(name, datatype, shape, bytes)| drift::Numeric { name, datatype, shape, values: floats(bytes) })
                .collect()
        }
        self.inner.observe_decoded(model, version, batched, &decoded(&inputs), &decoded(&outputs))
    }

    /// Count one HTTP-shaped exchange as the lanes do (the v2 request and answer bodies, each with
    /// its Inference-Header-Content-Length or None): what bench.drift_cost times as the lane's step.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (model, version, batched, request, request_header_length, answer, answer_header_length))]
    fn observe_exchange(
        &self,
        model: &str,
        version: &str,
        batched: bool,
        request: &[u8],
        request_header_length: Option<i64>,
        answer: &[u8],
        answer_header_length: Option<i64>,
    ) -> bool {
        let asked = (request, request_header_length);
        self.inner.observe_documents(model, version, batched, asked, (answer, answer_header_length))
    }

    /// Record the next `rows` answered rows of `model` (of `version` only, when given) from now on.
    fn record(&self, model: String, rows: usize, version: String) -> Recording {
        let recording = Arc::new(drift::Recording::new(model, version, rows));
        self.inner.record(recording.clone());
        Recording { inner: recording }
    }

    /// Stop recording (what was recorded stays readable with `take`).
    fn stop(&self, recording: &Recording) {
        self.inner.stop(&recording.inner);
    }

    /// Every window of `model` (of every model for None), sorted by (model, version).
    #[pyo3(signature = (model = None))]
    fn windows<'py>(&self, py: Python<'py>, model: Option<&str>) -> Vec<WindowTuple<'py>> {
        let counted = |windows: &[drift::TensorWindow]| -> Vec<CountsTuple<'py>> {
            windows
                .iter()
                .map(|tw| {
                    let counts = tw.counts();
                    (
                        tw.bins.name.clone(),
                        counts.rows,
                        le_bytes(py, &counts.table),
                        le_bytes(py, &counts.total),
                        counts.sum,
                    )
                })
                .collect()
        };
        self.inner
            .snapshot(model)
            .into_iter()
            .map(|((model, version), window)| {
                (model, version, window.reference.clone(), counted(&window.inputs), counted(&window.outputs))
            })
            .collect()
    }
}

/// A live recording (record-reference --live) running in `DriftWindows`.
#[pyclass(module = "sidecar._dataplane", frozen)]
pub struct Recording {
    inner: Arc<drift::Recording>,
}

#[pymethods]
impl Recording {
    /// Rows recorded so far.
    #[getter]
    fn seen(&self) -> usize {
        self.inner.seen()
    }

    #[getter]
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// What was recorded (inputs, outputs), each tensor's values cut to the recording's rows.
    fn take<'py>(&self, py: Python<'py>) -> (Vec<RecordedTuple<'py>>, Vec<RecordedTuple<'py>>) {
        let (inputs, outputs) = self.inner.take();
        let tuples = |tensors: Vec<drift::RecordedTensor>| -> Vec<RecordedTuple<'py>> {
            tensors
                .into_iter()
                .map(|t| {
                    let bytes: Vec<u8> = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    (t.name, t.datatype, t.features, PyBytes::new(py, &bytes))
                })
                .collect()
        };
        (tuples(inputs), tuples(outputs))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DriftWindows>()?;
    m.add_class::<Recording>()
}
