//! The PyO3 surface of `sidecar._dataplane`: the only module that touches Python objects. Each class
//! here wraps one rule of `serving` or `protocol`; `sidecar/_dataplane.pyi` types them for Python.

mod answers;
mod compare;
mod drift;
mod filtering;
mod front;
mod generation;
mod inflate;
mod metrics;
mod spans;
mod validation;

use pyo3::prelude::*;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    validation::register(m)?;
    compare::register(m)?;
    drift::register(m)?;
    answers::register(m)?;
    filtering::register(m)?;
    metrics::register(m)?;
    front::register(m)?;
    spans::register(m)?;
    inflate::register(m)?;
    generation::register(m)
}

/// A Python output filter (`is_hidden(name) -> bool`; None: nothing hidden) as the rules take it.
/// A filter that fails is taken as "hidden": withholding an output is the safe side.
pub(crate) fn output_filter<'a, 'py>(is_hidden: &'a Option<Bound<'py, PyAny>>) -> impl Fn(&str) -> bool + 'a {
    move |name: &str| is_hidden.as_ref().is_some_and(|f| f.call1((name,)).and_then(|v| v.is_truthy()).unwrap_or(true))
}
