//! The rules of one request, wire-free: the same names as the Python package's `sidecar/serving/`.

pub mod drift;
pub mod filtering;
pub mod generation;
pub mod refusals;
pub mod request_rules;
pub mod rollouts;
pub mod validation;
