//! Counters the data plane keeps itself, as atomics, and hands to Python's registry at scrape time:
//! /metrics shows them under the names, labels and buckets the dashboard, the alert rules and their
//! promtool tests know (sidecar/metrics.py keeps the catalog: names and help texts).
//!
//! One file per family kind; `request.rs` holds the per-request families, `stream.rs` the streams'.

pub mod family;
pub mod request;
pub mod stream;
