//! A metric family: one series per label set, each an atomic (or a few), found by its label values.
//!
//! The lock: a series is created once per label set (a model, a code, a reason: bounded sets) and
//! then only read under the read lock, so writers are rare and readers never wait on each other; the
//! counts themselves are atomics updated outside the lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

/// Label values joined by a byte no label value holds (an ASCII unit separator): one key, one hash.
fn key(labels: &[&str]) -> String {
    let mut key = String::with_capacity(labels.iter().map(|l| l.len() + 1).sum());
    for (i, label) in labels.iter().enumerate() {
        if i > 0 {
            key.push('\u{1f}');
        }
        key.push_str(label);
    }
    key
}

fn split(key: &str) -> Vec<String> {
    key.split('\u{1f}').map(str::to_owned).collect()
}

struct Series<T> {
    by_key: RwLock<HashMap<String, Arc<T>>>,
}

impl<T: Default> Series<T> {
    fn new() -> Self {
        Series { by_key: RwLock::new(HashMap::new()) }
    }

    fn get(&self, labels: &[&str]) -> Arc<T> {
        let key = key(labels);
        // A poisoned lock only means a panic elsewhere while it was held; the map is still whole.
        if let Some(series) = self.by_key.read().unwrap_or_else(PoisonError::into_inner).get(&key) {
            return Arc::clone(series);
        }
        let mut map = self.by_key.write().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(map.entry(key).or_default())
    }

    fn each(&self) -> Vec<(Vec<String>, Arc<T>)> {
        let map = self.by_key.read().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<(Vec<String>, Arc<T>)> = map.iter().map(|(k, v)| (split(k), Arc::clone(v))).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    fn find(&self, labels: &[&str]) -> Option<Arc<T>> {
        self.by_key.read().unwrap_or_else(PoisonError::into_inner).get(&key(labels)).cloned()
    }
}

/// A counter family (`_total` in the exposition).
pub struct CounterFamily {
    series: Series<AtomicU64>,
}

impl Default for CounterFamily {
    fn default() -> Self {
        CounterFamily { series: Series::new() }
    }
}

impl CounterFamily {
    pub fn inc(&self, labels: &[&str]) {
        self.add(labels, 1);
    }

    pub fn add(&self, labels: &[&str], n: u64) {
        self.series.get(labels).fetch_add(n, Ordering::Relaxed);
    }

    /// The series' value, None when it was never counted (no series: none is created by reading).
    pub fn value(&self, labels: &[&str]) -> Option<u64> {
        self.series.find(labels).map(|c| c.load(Ordering::Relaxed))
    }

    /// Every series: label values, count; sorted by label values.
    pub fn samples(&self) -> Vec<(Vec<String>, u64)> {
        self.series.each().into_iter().map(|(labels, c)| (labels, c.load(Ordering::Relaxed))).collect()
    }
}

/// A gauge family (a value that goes up and down, as requests in flight).
pub struct GaugeFamily {
    series: Series<AtomicI64>,
}

impl Default for GaugeFamily {
    fn default() -> Self {
        GaugeFamily { series: Series::new() }
    }
}

impl GaugeFamily {
    pub fn add(&self, labels: &[&str], delta: i64) {
        self.series.get(labels).fetch_add(delta, Ordering::Relaxed);
    }

    pub fn samples(&self) -> Vec<(Vec<String>, i64)> {
        self.series.each().into_iter().map(|(labels, g)| (labels, g.load(Ordering::Relaxed))).collect()
    }
}

#[derive(Default)]
pub struct HistogramSeries {
    /// Observations per bucket (not cumulative), the last one +Inf.
    counts: Vec<AtomicU64>,
    /// The sum of observations, an f64's bits (updated by compare-and-swap).
    sum_bits: AtomicU64,
}

/// A histogram family with fixed upper bounds (prometheus_client's `le` buckets).
pub struct HistogramFamily {
    bounds: Vec<f64>,
    series: RwLock<HashMap<String, Arc<HistogramSeries>>>,
}

/// One series' view: label values, cumulative bucket counts (the last is +Inf, the count), sum.
pub type HistogramSample = (Vec<String>, Vec<u64>, f64);

impl HistogramFamily {
    pub fn new(bounds: Vec<f64>) -> Self {
        HistogramFamily { bounds, series: RwLock::new(HashMap::new()) }
    }

    pub fn bounds(&self) -> &[f64] {
        &self.bounds
    }

    fn get(&self, labels: &[&str]) -> Arc<HistogramSeries> {
        let key = key(labels);
        if let Some(series) = self.series.read().unwrap_or_else(PoisonError::into_inner).get(&key) {
            return Arc::clone(series);
        }
        let mut map = self.series.write().unwrap_or_else(PoisonError::into_inner);
        let buckets = self.bounds.len() + 1;
        Arc::clone(map.entry(key).or_insert_with(|| {
            Arc::new(HistogramSeries {
                counts: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
                sum_bits: AtomicU64::new(0f64.to_bits()),
            })
        }))
    }

    pub fn observe(&self, labels: &[&str], value: f64) {
        let series = self.get(labels);
        // prometheus_client's rule: the first bucket whose bound is >= the value.
        let bucket = self.bounds.iter().position(|b| value <= *b).unwrap_or(self.bounds.len());
        if let Some(count) = series.counts.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let mut current = series.sum_bits.load(Ordering::Relaxed);
        loop {
            let next = (f64::from_bits(current) + value).to_bits();
            match series.sum_bits.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(seen) => current = seen,
            }
        }
    }

    pub fn samples(&self) -> Vec<HistogramSample> {
        let map = self.series.read().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<HistogramSample> = map
            .iter()
            .map(|(k, s)| {
                let mut total = 0;
                let cumulative = s
                    .counts
                    .iter()
                    .map(|c| {
                        total += c.load(Ordering::Relaxed);
                        total
                    })
                    .collect();
                (split(k), cumulative, f64::from_bits(s.sum_bits.load(Ordering::Relaxed)))
            })
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_count_per_label_set_and_reading_creates_nothing() {
        let f = CounterFamily::default();
        f.inc(&["http", "m", "200"]);
        f.add(&["http", "m", "200"], 2);
        f.inc(&["grpc", "m", "OK"]);
        assert_eq!(f.value(&["http", "m", "200"]), Some(3));
        assert_eq!(f.value(&["http", "other", "200"]), None);
        assert_eq!(f.samples().len(), 2);
    }

    #[test]
    fn histograms_bucket_as_prometheus_client_does() {
        let h = HistogramFamily::new(vec![0.001, 0.01, 0.1]);
        for v in [0.0005, 0.001, 0.05, 3.0] {
            h.observe(&["http", "m"], v);
        }
        let samples = h.samples();
        let (labels, cumulative, sum) = &samples[0];
        assert_eq!(labels, &vec!["http".to_string(), "m".to_string()]);
        assert_eq!(cumulative, &vec![2, 2, 3, 4]);
        assert!((sum - 3.0515).abs() < 1e-12);
    }
}
