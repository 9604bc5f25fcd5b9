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

    /// Count one answered request the Python chain served: each tensor as (name, its values as
    /// float64 little-endian bytes).
    fn observe(&self, model: &str, version: &str, inputs: Vec<(String, Vec<u8>)>, outputs: Vec<(String, Vec<u8>)>) {
        fn decoded(tensors: &[(String, Vec<u8>)]) -> Vec<(&str, Vec<f64>)> {
            tensors.iter().map(|(name, bytes)| (name.as_str(), floats(bytes))).collect()
        }
        self.inner.observe_decoded(model, version, &decoded(&inputs), &decoded(&outputs));
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DriftWindows>()
}
