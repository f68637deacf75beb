//! Request accounting (counts by method and outcome, a latency histogram),
//! fed by the router, and the Prometheus text format (0.0.4) writer that
//! `GET /metrics` ([`crate::local::metrics`]) uses.
//!
//! Written by hand on purpose: almost every value already lives in the
//! broker as an atomic (hub stats, queue sizes, the upstream status), read
//! at scrape time. A client library (`prometheus-client`, `prometheus`)
//! would need a mirrored registry or a custom collector per value, while
//! the format itself is four kinds of line. What is new here is the request
//! accounting the router feeds: counts by method and outcome, and a latency
//! histogram.

use std::collections::HashMap;
use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Distinct method names counted separately at most; later new names are
/// counted as `other`, so the metrics (and the scrape) cannot grow without
/// bound. Names the gateway's method table does not know are `other` too.
pub const MAX_METHOD_LABELS: usize = 128;

/// Upper bounds (seconds) of the request latency buckets: from a local
/// round trip (sub-millisecond) to a long `agent` run.
const LATENCY_BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    120.0,
];

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The gateway answered `ok: true`.
    Ok,
    /// The gateway answered with an error.
    Error,
    /// No answer before the deadline (`studio.request_timeout`).
    Timeout,
    /// The upstream session was lost or not open (`studio.upstream_closed` …).
    UpstreamClosed,
    /// Refused by the broker before it was sent (e.g. too many in flight).
    Rejected,
}

impl Outcome {
    /// Every outcome, in the order of [`Outcome::index`].
    pub const ALL: [Outcome; 5] = [
        Outcome::Ok,
        Outcome::Error,
        Outcome::Timeout,
        Outcome::UpstreamClosed,
        Outcome::Rejected,
    ];

    fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
            Outcome::UpstreamClosed => "upstream_closed",
            Outcome::Rejected => "rejected",
        }
    }

    /// The outcome of a request the broker failed with `code`.
    pub fn of_studio_code(code: &str) -> Outcome {
        match code {
            "studio.request_timeout" => Outcome::Timeout,
            "studio.too_many_requests" => Outcome::Rejected,
            _ => Outcome::UpstreamClosed,
        }
    }
}

/// Counts per method label, one slot per [`Outcome`]. Looked up by `&str`:
/// a request of a method already seen allocates nothing.
#[derive(Debug, Default)]
struct Counts {
    by_method: HashMap<String, [u64; Outcome::ALL.len()]>,
    other: [u64; Outcome::ALL.len()],
}

/// Request counts and latencies, fed by the router.
#[derive(Debug)]
pub struct RequestMetrics {
    counts: Mutex<Counts>,
    /// Non-cumulative bucket counts; the last one is `+Inf`.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_micros: AtomicU64,
    observed: AtomicU64,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            counts: Mutex::default(),
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_micros: AtomicU64::new(0),
            observed: AtomicU64::new(0),
        }
    }
}

impl RequestMetrics {
    /// Counts one finished request; `elapsed` (from registration to the
    /// final answer) feeds the latency histogram when it was sent.
    pub fn record(&self, method: &str, outcome: Outcome, elapsed: Option<Duration>) {
        {
            let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            // Only the gateway's own method names become labels: a
            // method is whatever a client sent, and may carry user data
            // (a session key sent as a method name ended up in a label).
            let Counts { by_method, other } = &mut *counts;
            let labelled = by_method.contains_key(method)
                || (crate::policy::methods::is_known(method)
                    && by_method.len() < MAX_METHOD_LABELS);
            let slots = if labelled {
                // (Allocates only the first time a method is seen.)
                match by_method.get_mut(method) {
                    Some(slots) => slots,
                    None => by_method.entry(method.to_owned()).or_default(),
                }
            } else {
                other
            };
            slots[outcome.index()] += 1;
        }
        if let Some(elapsed) = elapsed {
            let secs = elapsed.as_secs_f64();
            let bucket = LATENCY_BUCKETS
                .iter()
                .position(|&le| secs <= le)
                .unwrap_or(LATENCY_BUCKETS.len());
            self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
            self.sum_micros
                .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
            self.observed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a request failed at once because the upstream session was
    /// not ready (it never reached the router's table).
    pub fn record_refused(&self, method: &str) {
        self.record(method, Outcome::UpstreamClosed, None);
    }

    /// `(method, outcome, count)`, sorted for a stable scrape.
    pub fn counts(&self) -> Vec<(String, Outcome, u64)> {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let labelled = counts
            .by_method
            .iter()
            .map(|(m, slots)| (m.as_str(), slots))
            .chain([("other", &counts.other)]);
        let mut v: Vec<_> = labelled
            .flat_map(|(m, slots)| {
                Outcome::ALL
                    .iter()
                    .filter(|o| slots[o.index()] > 0)
                    .map(move |o| (m.to_owned(), *o, slots[o.index()]))
            })
            .collect();
        v.sort_by(|a, b| (&a.0, a.1.as_str()).cmp(&(&b.0, b.1.as_str())));
        v
    }

    pub fn write_histogram(&self, out: &mut Exposition, name: &str) {
        // Read the count first: buckets observed after it only make the
        // buckets larger, never `+Inf` smaller than `_count`.
        let count = self.observed.load(Ordering::Relaxed);
        let mut cumulative = 0;
        let bucket_name = format!("{name}_bucket");
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            out.sample(
                &bucket_name,
                &[("le", &le.to_string())],
                cumulative.min(count),
            );
        }
        out.sample(&bucket_name, &[("le", "+Inf")], count);
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        out.sample(&format!("{name}_sum"), &[], sum);
        out.sample(&format!("{name}_count"), &[], count);
    }
}

/// A Prometheus text exposition being written.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// Starts a metric family: its `# HELP` and `# TYPE` lines.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {}", help.replace('\\', "\\\\"));
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample line; label values are escaped as the format requires.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"{}\"", escape_label(value));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_are_capped_and_escaped() {
        let m = RequestMetrics::default();
        for i in 0..MAX_METHOD_LABELS + 5 {
            m.record(&format!("m{i}"), Outcome::Ok, None);
        }
        m.record("health", Outcome::Error, Some(Duration::from_millis(3)));
        let counts = m.counts();
        let other = counts.iter().find(|(name, ..)| name == "other").unwrap();
        assert_eq!(other.2, MAX_METHOD_LABELS as u64 + 5);
        assert!(counts
            .iter()
            .any(|(n, o, c)| n == "health" && *o == Outcome::Error && *c == 1));
        let mut out = Exposition::default();
        out.sample("x", &[("method", "a\"b\\c\nd")], 1);
        assert_eq!(out.finish(), "x{method=\"a\\\"b\\\\c\\nd\"} 1\n");
    }

    /// Before: a request whose method was a session key put the key in a
    /// label of `/metrics`, which every socket may read.
    #[test]
    fn only_gateway_method_names_become_labels() {
        let m = RequestMetrics::default();
        m.record("agent:main:secret-session", Outcome::Rejected, None);
        m.record("chat.send", Outcome::Ok, None);
        let names: Vec<String> = m.counts().into_iter().map(|(n, ..)| n).collect();
        assert_eq!(names, vec!["chat.send".to_owned(), "other".to_owned()]);
    }

    #[test]
    fn histogram_is_cumulative() {
        let m = RequestMetrics::default();
        m.record("a", Outcome::Ok, Some(Duration::from_micros(300)));
        m.record("a", Outcome::Ok, Some(Duration::from_millis(30)));
        m.record("a", Outcome::Ok, Some(Duration::from_secs(500)));
        let mut out = Exposition::default();
        m.write_histogram(&mut out, "h");
        let text = out.finish();
        assert!(text.contains("h_bucket{le=\"0.0005\"} 1\n"), "{text}");
        assert!(text.contains("h_bucket{le=\"0.05\"} 2\n"), "{text}");
        assert!(text.contains("h_bucket{le=\"120\"} 2\n"), "{text}");
        assert!(text.contains("h_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("h_count 3\n"), "{text}");
    }
}
