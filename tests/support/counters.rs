//! The `metrics` counters, histograms and gauges a test binary's code exported, read through
//! metrics-util's debugging recorder, installed once per binary. Tests that read it use
//! names of their own (a consumer name, say), so they can run in parallel.

use std::collections::BTreeMap;
use std::sync::Mutex;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// The recorder's snapshots give each counter's increments, and each histogram's values,
/// since the last snapshot; the totals add them up, and the histograms keep them all.
pub struct Counters {
    snapshotter: Snapshotter,
    totals: Mutex<BTreeMap<String, u64>>,
    histograms: Mutex<BTreeMap<String, Vec<f64>>>,
    gauges: Mutex<BTreeMap<String, f64>>,
}

impl Counters {
    /// The binary's recorder, installed on first use.
    pub fn installed() -> &'static Counters {
        static COUNTERS: std::sync::OnceLock<Counters> = std::sync::OnceLock::new();
        COUNTERS.get_or_init(|| {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            recorder
                .install()
                .expect("the only recorder of this binary");
            Counters {
                snapshotter,
                totals: Mutex::default(),
                histograms: Mutex::default(),
                gauges: Mutex::default(),
            }
        })
    }

    /// Every counter, as `name{label=value,...}` (labels in the order they were given) to
    /// its value.
    pub fn all(&self) -> BTreeMap<String, u64> {
        self.take_snapshot();
        self.totals.lock().unwrap().clone()
    }

    /// Every value a histogram (`name{label=value,...}`, as [`all`](Self::all) names
    /// counters) recorded so far, in the order recorded.
    pub fn histogram(&self, key: &str) -> Vec<f64> {
        self.take_snapshot();
        let histograms = self.histograms.lock().unwrap();
        histograms.get(key).cloned().unwrap_or_default()
    }

    /// A gauge's last value (`name{label=value,...}`, as [`all`](Self::all) names counters);
    /// `None` when it was never set.
    pub fn gauge(&self, key: &str) -> Option<f64> {
        self.take_snapshot();
        self.gauges.lock().unwrap().get(key).copied()
    }

    /// Adds what was recorded since the last snapshot to the totals and the histograms, and
    /// keeps each gauge's value.
    fn take_snapshot(&self) {
        let mut totals = self.totals.lock().unwrap();
        let mut histograms = self.histograms.lock().unwrap();
        let mut gauges = self.gauges.lock().unwrap();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let labels: Vec<String> = key
                .labels()
                .map(|label| format!("{}={}", label.key(), label.value()))
                .collect();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            match value {
                DebugValue::Counter(increments) => *totals.entry(name).or_default() += increments,
                DebugValue::Histogram(values) => histograms
                    .entry(name)
                    .or_default()
                    .extend(values.into_iter().map(|value| value.into_inner())),
                DebugValue::Gauge(value) => {
                    gauges.insert(name, value.into_inner());
                }
            }
        }
    }

    /// The key of the relay's `outbox_relay_claims_total` for `stream`'s claims that found
    /// `found` (`"rows"` or `"nothing"`), as [`all`](Self::all) and [`get`](Self::get) take it.
    pub fn claims_key(stream: &str, found: &str) -> String {
        format!("outbox_relay_claims_total{{stream={stream},found={found}}}")
    }

    /// One counter's value, 0 when it was never incremented.
    pub fn get(&self, key: &str) -> u64 {
        self.all().get(key).copied().unwrap_or(0)
    }
}
