//! Live drift windows: each measured model version's inputs and outputs binned against its
//! reference, the last `drift.window` rows kept, per request at a bounded cost. The one binning rule
//! of the sidecar: the fronts' lanes call it for the answers they serve, and the Python chain (a
//! handed-over request, the grpcio front) through `sidecar._dataplane.DriftWindows`.
//!
//! What stays in Python (sidecar/serving/drift.py): reading reference files, PSI and missing ratios
//! from the count tables (at a scrape or a /status, never per request), the metrics and /status.
//!
//! Why it looks the way it does:
//! - A row's cells overwrite the oldest row of a ring of `window` rows; the count table is built
//!   from the ring when asked for (a scrape every 15-30 s), not kept up to date per request: two
//!   scattered updates per row (add the new cells, remove the old row's) would cost more than the
//!   binning for a table read rarely.
//! - Missing values (the configured sentinels of an input; NaN where validation lets it through)
//!   go to an extra cell per feature: they count for the missing ratio, not the distribution.
//! - Each tensor's ring has its own mutex, held for one row's binning: requests of one model on two
//!   workers contend for microseconds; the references are an arc-swapped map, read without a lock.
//! - Nothing here decides anything: a drifted model is reported and still served (issue 22).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;

use crate::protocol::answers;

/// One tensor's reference as the windows bin against it (sidecar.serving.drift.TensorReference).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorBins {
    pub name: String,
    /// Elements of one row (one batch item).
    pub features: usize,
    /// Bins per feature (interior edges per feature: bins - 1).
    pub bins: usize,
    /// (features, bins - 1) interior edges, row-major, padded with +inf where a feature has fewer
    /// distinct quantiles; value v is in bin = number of edges <= v (bisect_right).
    pub edges: Vec<f64>,
    /// Values that mean "missing" for this tensor (drift.missing_sentinels; inputs only).
    pub sentinels: Vec<f64>,
    /// NaN counts as missing: a float tensor while validation lets NaN through.
    pub count_nan: bool,
}

impl TensorBins {
    /// The flat cell of `value` of feature `feature` in a (features, bins + 1) table; the last
    /// column of each feature counts its missing values.
    fn cell(&self, feature: usize, value: f64) -> u32 {
        let width = self.bins + 1;
        if (value.is_nan() && self.count_nan) || self.sentinels.contains(&value) {
            return (feature * width + self.bins) as u32;
        }
        let per = self.bins - 1;
        let edges = &self.edges[feature * per..(feature + 1) * per];
        // bisect_right: the first edge the value is below (NaN is below none: the last bin, as
        // Python's bisect placed it).
        let below = |edge: &f64| value.partial_cmp(edge) == Some(std::cmp::Ordering::Less);
        let bin = edges.partition_point(|edge| !below(edge));
        (feature * width + bin) as u32
    }

    /// Is `bin` a missing value's cell?
    fn is_missing(&self, cell: u32) -> bool {
        cell as usize % (self.bins + 1) == self.bins
    }
}

/// The last `window` rows of one tensor.
struct Ring {
    /// The cells of the rows, `features` a row; rows 0..rows are filled, in order, until it is full.
    cells: Vec<u32>,
    next: usize,
    rows: usize,
    /// Every row ever seen, per bin, and their sum (a one-feature tensor's cumulative histogram,
    /// as Prometheus wants it; missing values excluded).
    total: Vec<u64>,
    sum: f64,
}

pub struct TensorWindow {
    pub bins: TensorBins,
    pub window: usize,
    ring: Mutex<Ring>,
}

/// What a window holds now (Python computes PSI and the missing ratio from it).
#[derive(Debug, Clone, PartialEq)]
pub struct WindowCounts {
    pub rows: usize,
    /// (features, bins + 1) counts of the window's rows, row-major; the last column of each feature
    /// counts missing values.
    pub table: Vec<u64>,
    pub total: Vec<u64>,
    pub sum: f64,
}

impl TensorWindow {
    pub fn new(bins: TensorBins, window: usize) -> Self {
        let window = window.max(1);
        let ring =
            Ring { cells: vec![0; window * bins.features], next: 0, rows: 0, total: vec![0; bins.bins], sum: 0.0 };
        TensorWindow { bins, window, ring: Mutex::new(ring) }
    }

    fn ring(&self) -> MutexGuard<'_, Ring> {
        // A panic while the lock was held leaves at worst one row half-written: counts, not state
        // anyone acts on, so the window goes on.
        self.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Count `values` (flat, C order) as rows of `features`, forgetting the rows that fall out of
    /// the window; false (nothing counted) when they are not a whole number of rows.
    pub fn add(&self, values: &[f64]) -> bool {
        let features = self.bins.features;
        if features == 0 || values.is_empty() || values.len() % features != 0 {
            return false;
        }
        let rows = values.len() / features;
        // Only the last `window` rows can be in the window once these are added.
        let skip = rows.saturating_sub(self.window) * features;
        let mut ring = self.ring();
        for row in values[skip..].chunks_exact(features) {
            let slot = ring.next;
            for (feature, value) in row.iter().enumerate() {
                let cell = self.bins.cell(feature, *value);
                ring.cells[slot * features + feature] = cell;
                if features == 1 && !self.bins.is_missing(cell) {
                    ring.total[cell as usize] += 1;
                    ring.sum += value;
                }
            }
            ring.next = (slot + 1) % self.window;
            ring.rows = (ring.rows + 1).min(self.window);
        }
        true
    }

    pub fn counts(&self) -> WindowCounts {
        let (rows, cells, total, sum) = {
            let ring = self.ring();
            (ring.rows, ring.cells[..ring.rows * self.bins.features].to_vec(), ring.total.clone(), ring.sum)
        };
        let mut table = vec![0u64; self.bins.features * (self.bins.bins + 1)];
        for cell in cells {
            table[cell as usize] += 1;
        }
        WindowCounts { rows, table, total, sum }
    }
}

/// One reference file: the tensors it bins, inputs and outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub inputs: Vec<TensorBins>,
    pub outputs: Vec<TensorBins>,
}

/// One model version's windows (made at its first measured answer).
pub struct ModelWindow {
    /// The key of the reference it bins against: the version's own, or "" (any version).
    pub reference: String,
    pub inputs: Vec<TensorWindow>,
    pub outputs: Vec<TensorWindow>,
}

impl ModelWindow {
    fn new(reference: String, of: &Reference, window: usize) -> Self {
        let windows = |tensors: &[TensorBins]| tensors.iter().map(|t| TensorWindow::new(t.clone(), window)).collect();
        ModelWindow { reference, inputs: windows(&of.inputs), outputs: windows(&of.outputs) }
    }
}

/// The drift settings the windows follow (drift.window, drift.sample_rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub window: usize,
    pub sample_rate: f64,
}

/// What the windows bin against now, swapped whole by Python at a reload.
#[derive(Default)]
struct Measured {
    /// model -> version key ("" = any version) -> reference.
    references: HashMap<String, HashMap<String, Arc<Reference>>>,
    sampling: Option<Sampling>,
}

/// A decoded tensor: its name and its values as float64, flat.
pub type Tensor<'a> = (&'a str, &'a [f64]);

/// Every model's windows: shared by the fronts (their lanes) and Python (the Python chain feeds it,
/// the scrape reads it).
#[derive(Default)]
pub struct DriftWindows {
    measured: ArcSwap<Measured>,
    /// (model, answered version) -> its windows. Looked up once per measured request; a write only
    /// when a version is first measured or a reference is replaced.
    windows: Mutex<HashMap<(String, String), Arc<ModelWindow>>>,
    /// Live recordings running now, by model (record-reference --live).
    recordings: ArcSwap<HashMap<String, Vec<Arc<Recording>>>>,
}

impl DriftWindows {
    /// Bin against `references` (model -> version key -> reference) from now on; a model whose
    /// references changed (edges, sentinels or NaN rule), or every model when the window size did,
    /// counts again from empty.
    pub fn set(&self, references: HashMap<String, HashMap<String, Arc<Reference>>>, sampling: Sampling) {
        let before = self.measured.load();
        let resized = before.sampling.map(|s| s.window) != Some(sampling.window);
        let mut windows = self.windows();
        windows.retain(|(model, _), _| !resized && before.references.get(model) == references.get(model));
        self.measured.store(Arc::new(Measured { references, sampling: Some(sampling) }));
    }

    fn windows(&self) -> MutexGuard<'_, HashMap<(String, String), Arc<ModelWindow>>> {
        self.windows.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Is a request to `model` measured? One map lookup for a model without a reference or a
    /// recording, a draw at drift.sample_rate for one with (`draw` gives a uniform number in [0, 1)).
    pub fn wants(&self, model: &str, draw: impl FnOnce() -> f64) -> bool {
        let measured = self.measured.load();
        let Some(sampling) = measured.sampling else { return false };
        if !measured.references.contains_key(model) && !self.recordings.load().contains_key(model) {
            return false;
        }
        sampling.sample_rate >= 1.0 || draw() < sampling.sample_rate
    }

    /// Record `model`'s answers from now on, until `stop`.
    pub fn record(&self, recording: Arc<Recording>) {
        self.recordings.rcu(|now| {
            let mut next = HashMap::clone(now);
            next.entry(recording.model.clone()).or_default().push(recording.clone());
            next
        });
    }

    pub fn stop(&self, recording: &Arc<Recording>) {
        self.recordings.rcu(|now| {
            let mut next = HashMap::clone(now);
            if let Some(list) = next.get_mut(&recording.model) {
                list.retain(|r| !Arc::ptr_eq(r, recording));
                if list.is_empty() {
                    next.remove(&recording.model);
                }
            }
            next
        });
    }

    pub fn measures(&self, model: &str) -> bool {
        self.measured.load().references.contains_key(model)
    }

    /// Count one answered request of `model`, `version` the one that answered: each tensor the
    /// reference bins is counted when its values are a whole number of rows.
    pub fn observe(&self, model: &str, version: &str, inputs: &[Tensor], outputs: &[Tensor]) {
        let Some(window) = self.window(model, version) else { return };
        for (tensors, windows) in [(inputs, &window.inputs), (outputs, &window.outputs)] {
            for (name, values) in tensors {
                if let Some(tw) = windows.iter().find(|tw| tw.bins.name == *name) {
                    tw.add(values);
                }
            }
        }
    }

    /// Count and record one answered exchange of `model` whose tensors are decoded
    /// (`numeric_tensors`); true when it completed a live recording (its waiter must be told).
    pub fn observe_decoded(
        &self,
        model: &str,
        version: &str,
        batched: bool,
        inputs: &[Numeric],
        outputs: &[Numeric],
    ) -> bool {
        let mut completed = false;
        if let Some(recordings) = self.recordings.load().get(model) {
            for recording in recordings {
                completed |= recording.add(version, inputs, outputs, batched);
            }
        }
        fn borrowed<'a>(tensors: &'a [Numeric<'a>]) -> Vec<Tensor<'a>> {
            tensors.iter().map(|t| (t.name, t.values.as_slice())).collect()
        }
        self.observe(model, version, &borrowed(inputs), &borrowed(outputs));
        completed
    }

    /// Count an answered HTTP-shaped exchange (a v2 request and answer, JSON or with binary
    /// sections: (body, Inference-Header-Content-Length)): the version is the one the answer names,
    /// else `version` (the one the request went to). A document that does not decode is not
    /// counted: measuring never fails a request. True when it completed a live recording.
    pub fn observe_documents(
        &self,
        model: &str,
        version: &str,
        batched: bool,
        request: (&[u8], Option<i64>),
        answer: (&[u8], Option<i64>),
    ) -> bool {
        let (Ok(asked), Ok(answered)) =
            (answers::decode_inputs(request.0, request.1), answers::decode(answer.0, answer.1))
        else {
            return false;
        };
        let version = answered.model_version.as_deref().unwrap_or(version);
        let inputs = numeric_tensors(&asked, request.0);
        let outputs = numeric_tensors(&answered, answer.0);
        self.observe_decoded(model, version, batched, &inputs, &outputs)
    }

    fn window(&self, model: &str, version: &str) -> Option<Arc<ModelWindow>> {
        let measured = self.measured.load();
        let references = measured.references.get(model)?;
        let sampling = measured.sampling?;
        let mut windows = self.windows();
        let key = (model.to_owned(), version.to_owned());
        if let Some(window) = windows.get(&key) {
            return Some(window.clone());
        }
        let (reference, of) = match references.get(version) {
            Some(of) => (version.to_owned(), of),
            None => (String::new(), references.get("")?),
        };
        let window = Arc::new(ModelWindow::new(reference, of, sampling.window));
        windows.insert(key, window.clone());
        Some(window)
    }

    /// Every window of `model` (all models for None), sorted by (model, version).
    pub fn snapshot(&self, model: Option<&str>) -> Vec<((String, String), Arc<ModelWindow>)> {
        let mut found: Vec<_> = self
            .windows()
            .iter()
            .filter(|((m, _), _)| model.is_none_or(|model| m == model))
            .map(|(key, window)| (key.clone(), window.clone()))
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        found
    }
}

/// Datatypes a window bins (sidecar.protocol.answers.BINARY_DTYPES: BYTES and BOOL are no
/// distribution, BF16 has no numpy dtype the Python chain could read it with).
pub fn binnable(datatype: &str) -> bool {
    matches!(
        datatype,
        "UINT8" | "UINT16" | "UINT32" | "UINT64" | "INT8" | "INT16" | "INT32" | "INT64" | "FP16" | "FP32" | "FP64"
    )
}

/// One numeric tensor of a decoded infer request or answer, its values as float64, flat.
pub struct Numeric<'a> {
    pub name: &'a str,
    pub datatype: &'a str,
    pub shape: &'a [i64],
    pub values: Vec<f64>,
}

/// The numeric tensors of a decoded infer request or answer (a tensor that does not read is left
/// out: measuring never fails a request).
pub fn numeric_tensors<'a>(decoded: &'a answers::Answer, body: &[u8]) -> Vec<Numeric<'a>> {
    decoded
        .outputs
        .iter()
        .filter(|tensor| binnable(&tensor.datatype))
        .filter_map(|tensor| {
            let values = answers::numbers_as_f64(&tensor.datatype, &tensor.values, body).ok()?;
            Some(Numeric { name: &tensor.name, datatype: &tensor.datatype, shape: &tensor.shape, values })
        })
        .collect()
}

/// One tensor of a live recording: its values, rows of `features`, in the order they came.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedTensor {
    pub name: String,
    pub datatype: String,
    pub features: usize,
    pub values: Vec<f64>,
}

#[derive(Default)]
struct Recorded {
    seen: usize,
    inputs: Vec<RecordedTensor>,
    outputs: Vec<RecordedTensor>,
}

/// A live recording (record-reference --live): the raw values of the next `rows` answered rows of
/// one model (of one answered version when `version` is set), held in memory only while someone
/// records, never logged. The reference is built from them in Python (quantiles).
pub struct Recording {
    pub model: String,
    /// "" records every version's answers; else only this version's.
    pub version: String,
    pub rows: usize,
    state: Mutex<Recorded>,
}

impl Recording {
    pub fn new(model: String, version: String, rows: usize) -> Self {
        Recording { model, version, rows, state: Mutex::new(Recorded::default()) }
    }

    fn state(&self) -> MutexGuard<'_, Recorded> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Rows recorded so far (the largest count of any tensor of each request, added up).
    pub fn seen(&self) -> usize {
        self.state().seen
    }

    pub fn done(&self) -> bool {
        self.seen() >= self.rows
    }

    /// Record one answered exchange of `version`; `batched`: the first dimension of every tensor is
    /// the batch (the model's max_batch_size > 0). True when this exchange completed the recording.
    pub fn add(&self, version: &str, inputs: &[Numeric], outputs: &[Numeric], batched: bool) -> bool {
        if !self.version.is_empty() && version != self.version {
            return false;
        }
        let mut state = self.state();
        if state.seen >= self.rows {
            return false;
        }
        let mut count = 0;
        for (tensors, store) in [(inputs, 0), (outputs, 1)] {
            for tensor in tensors {
                let Some(&first) = tensor.shape.first() else { continue };
                let batch = if batched { first.max(1) as usize } else { 1 };
                let elements: i64 = tensor.shape.iter().product();
                let features = ((elements.max(0) as usize) / batch).max(1);
                if tensor.values.is_empty() || tensor.values.len() % features != 0 {
                    continue;
                }
                let kept = if store == 0 { &mut state.inputs } else { &mut state.outputs };
                match kept.iter_mut().find(|t| t.name == tensor.name) {
                    // A tensor whose row width changed cannot be stacked with its earlier rows.
                    Some(t) if t.features != features => continue,
                    Some(t) => t.values.extend_from_slice(&tensor.values),
                    None => kept.push(RecordedTensor {
                        name: tensor.name.to_owned(),
                        datatype: tensor.datatype.to_owned(),
                        features,
                        values: tensor.values.clone(),
                    }),
                }
                count = count.max(tensor.values.len() / features);
            }
        }
        state.seen += count;
        state.seen >= self.rows
    }

    /// What was recorded, each tensor cut to the first `rows` rows (inputs, outputs).
    pub fn take(&self) -> (Vec<RecordedTensor>, Vec<RecordedTensor>) {
        let mut state = self.state();
        let cut = |tensors: &mut Vec<RecordedTensor>, rows: usize| {
            let mut out = std::mem::take(tensors);
            for t in &mut out {
                t.values.truncate(rows * t.features);
            }
            out
        };
        (cut(&mut state.inputs, self.rows), cut(&mut state.outputs, self.rows))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two features, three bins: edges [0, 1] for feature 0, [10, +inf] for feature 1 (a discrete
    /// one with a single interior edge).
    fn bins(sentinels: &[f64], count_nan: bool) -> TensorBins {
        TensorBins {
            name: "x".into(),
            features: 2,
            bins: 3,
            edges: vec![0.0, 1.0, 10.0, f64::INFINITY],
            sentinels: sentinels.to_vec(),
            count_nan,
        }
    }

    #[test]
    fn a_value_lands_in_the_bin_of_the_edges_at_or_below_it_and_missing_ones_in_the_last_column() {
        let b = bins(&[-999.0], true);
        // Feature 0: below 0 is bin 0, an edge itself goes up (bisect_right), above 1 is bin 2.
        assert_eq!([b.cell(0, -0.5), b.cell(0, 0.0), b.cell(0, 0.5), b.cell(0, 1.0), b.cell(0, 7.0)], [0, 1, 1, 2, 2]);
        // Feature 1's cells start at 4; the +inf padding is never passed by a finite value.
        assert_eq!([b.cell(1, 9.0), b.cell(1, 10.0), b.cell(1, 1e300)], [4, 5, 5]);
        assert_eq!([b.cell(0, -999.0), b.cell(1, f64::NAN)], [3, 7]);
        // NaN not counted as missing: the last bin, as bisect placed it.
        assert_eq!(bins(&[], false).cell(0, f64::NAN), 2);
    }

    #[test]
    fn the_window_counts_exactly_its_last_rows_after_it_wraps() {
        let window = TensorWindow::new(bins(&[-999.0], false), 3);
        assert!(!window.add(&[1.0, 2.0, 3.0]), "not a whole number of rows: nothing counted");
        assert!(window.add(&[-1.0, 5.0, 0.5, 50.0]));
        assert!(window.add(&[2.0, -999.0]));
        assert!(window.add(&[0.5, 5.0]));
        // Rows kept: (0.5, 50), (2, missing), (0.5, 5).
        let counts = window.counts();
        assert_eq!(counts.rows, 3);
        assert_eq!(counts.table, vec![0, 2, 1, 0, 1, 1, 0, 1]);
        // A batch larger than the window keeps its last rows only.
        window.add(&[9.0, 9.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]);
        assert_eq!(window.counts().table, vec![3, 0, 0, 0, 3, 0, 0, 0]);
    }

    #[test]
    fn a_one_feature_output_keeps_its_cumulative_histogram_and_sum() {
        let one =
            TensorBins { name: "p".into(), features: 1, bins: 2, edges: vec![0.5], sentinels: vec![], count_nan: true };
        let window = TensorWindow::new(one, 2);
        window.add(&[0.2, 0.7]);
        window.add(&[0.9, f64::NAN]);
        let counts = window.counts();
        assert_eq!((counts.rows, counts.table.clone()), (2, vec![0, 1, 1]), "the window: 0.9 and NaN");
        assert_eq!(counts.total, vec![1, 2], "every row ever seen but the missing one");
        assert!((counts.sum - 1.8).abs() < 1e-12);
        // A batch past the window counts only the rows that can stay in it, as the Python chain did.
        window.add(&[5.0, 5.0, 0.1, 0.1]);
        assert_eq!(window.counts().total, vec![3, 2]);
    }

    fn numeric<'a>(name: &'a str, shape: &'a [i64], values: &[f64]) -> Numeric<'a> {
        Numeric { name, datatype: "FP32", shape, values: values.to_vec() }
    }

    #[test]
    fn a_recording_keeps_the_next_rows_of_its_version_and_is_measured_without_a_reference() {
        let drift = DriftWindows::default();
        drift.set(HashMap::new(), Sampling { window: 10, sample_rate: 1.0 });
        assert!(!drift.wants("m", || 0.0));
        let recording = Arc::new(Recording::new("m".into(), "2".into(), 3));
        drift.record(recording.clone());
        assert!(drift.wants("m", || 0.0) && !drift.wants("other", || 0.0));
        let (two, one) = ([2i64, 2], [1i64, 1]);
        let batch = [numeric("x", &two, &[1.0, 2.0, 3.0, 4.0])];
        assert!(!drift.observe_decoded("m", "1", true, &batch, &[]), "another version: not recorded");
        assert!(!drift.observe_decoded("m", "2", true, &batch, &[numeric("p", &[2, 1], &[0.1, 0.2])]));
        assert_eq!(recording.seen(), 2);
        assert!(drift.observe_decoded("m", "2", true, &[numeric("x", &one, &[5.0]), numeric("y", &one, &[7.0])], &[]));
        assert!(recording.done());
        assert!(!drift.observe_decoded("m", "2", true, &batch, &[]), "done: nothing more is kept");
        let (inputs, outputs) = recording.take();
        // x's rows are two wide until a one-wide row came: that one could not be stacked with them.
        assert_eq!(
            inputs[0],
            RecordedTensor { name: "x".into(), datatype: "FP32".into(), features: 2, values: vec![1.0, 2.0, 3.0, 4.0] }
        );
        assert_eq!((inputs[1].name.as_str(), inputs[1].values.clone()), ("y", vec![7.0]));
        assert_eq!(outputs[0].values, vec![0.1, 0.2]);
        drift.stop(&recording);
        assert!(!drift.wants("m", || 0.0));
    }

    #[test]
    fn versions_get_windows_of_their_own_and_a_replaced_reference_starts_again() {
        let drift = DriftWindows::default();
        let reference = Arc::new(Reference { inputs: vec![bins(&[], false)], outputs: vec![] });
        let sampling = Sampling { window: 10, sample_rate: 1.0 };
        let refs = |r: &Arc<Reference>| HashMap::from([("m".to_owned(), HashMap::from([(String::new(), r.clone())]))]);
        drift.set(refs(&reference), sampling);
        assert!(drift.wants("m", || 0.9) && !drift.wants("other", || 0.0));
        drift.observe("m", "1", &[("x", &[0.5, 5.0])], &[]);
        drift.observe("m", "2", &[("x", &[0.5, 5.0, 0.5, 5.0]), ("y", &[1.0])], &[]);
        let rows: Vec<_> = drift.snapshot(None).iter().map(|(k, w)| (k.1.clone(), w.inputs[0].counts().rows)).collect();
        assert_eq!(rows, vec![("1".to_owned(), 1), ("2".to_owned(), 2)]);
        // The same reference again keeps the windows; a different one empties them.
        drift.set(refs(&reference), sampling);
        assert_eq!(drift.snapshot(Some("m")).len(), 2);
        let other = Arc::new(Reference { inputs: vec![bins(&[-1.0], false)], outputs: vec![] });
        drift.set(refs(&other), sampling);
        assert!(drift.snapshot(None).is_empty());
        drift.set(refs(&other), Sampling { window: 10, sample_rate: 0.25 });
        assert!(drift.wants("m", || 0.2) && !drift.wants("m", || 0.3));
    }
}
