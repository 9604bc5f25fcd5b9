//! `sidecar._dataplane`: the compiled half of triton-sidecar.
//!
//! Python keeps the control plane (configuration, the health loop, heals, golden files, reloads,
//! rollout and drift decisions, metrics registry and logging); this crate holds the per-request
//! rules, each written once and called from whichever side needs it. Its modules mirror the Python
//! package's map: `serving` (the rules of a request), `protocol` (the v2 vocabulary: JSON as Triton
//! reads it), `metrics` (counters kept as atomics, read by Python's registry at scrape time), `py`
//! (the PyO3 surface, the only place that touches Python objects).
//!
//! Nothing here reads a file or an environment variable: everything comes from Python.

pub mod front;
pub mod golden;
pub mod metrics;
pub mod protocol;
pub mod py;
pub mod serving;

use pyo3::prelude::*;

/// mimalloc for every Rust allocation (Python's own stay on pymalloc and glibc). A sampled request's
/// span is built on the front's thread and freed on the exporter's, and glibc paid for that twice:
/// frees into another thread's arena, and `malloc_consolidate` walking the fast bins at each large
/// allocation (a quarter of the export thread's time). With mimalloc the front's thread paid 2-4 µs
/// less a traced request (bench/RESULTS.md §1p).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[pymodule]
fn _dataplane(m: &Bound<'_, PyModule>) -> PyResult<()> {
    py::register(m)
}
