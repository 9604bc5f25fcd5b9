//! The PyO3 surface of `sidecar._dataplane`: the only module that touches Python objects. Each class
//! here wraps one rule of `serving` or `protocol`; `sidecar/_dataplane.pyi` types them for Python.

mod answers;
mod compare;
mod filtering;
mod metrics;
mod validation;

use pyo3::prelude::*;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    validation::register(m)?;
    compare::register(m)?;
    answers::register(m)?;
    filtering::register(m)?;
    metrics::register(m)
}
