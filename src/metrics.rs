//! `GET /metrics`: the broker's counters in the Prometheus text format (0.0.4).
//!
//! Written by hand on purpose: almost every value already lives in the
//! broker as an atomic (hub stats, queue sizes, the upstream status), read
//! at scrape time. A client library (`prometheus-client`, `prometheus`)
//! would need a mirrored registry or a custom collector per value, while
//! the format itself is four kinds of line. What is new here is the request
//! accounting the router feeds: counts by method and outcome, and a latency
//! histogram.

use std::collections::{HashMap, HashSet};
use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::context::Ctx;
use crate::hub::ClientKind;
use crate::upstream::Phase;

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

#[derive(Debug, Default)]
struct Counts {
    by_label: HashMap<(String, Outcome), u64>,
    methods: HashSet<String>,
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
            let label = if !crate::policy::methods::is_known(method) {
                "other".to_owned()
            } else if counts.methods.contains(method) {
                method.to_owned()
            } else if counts.methods.len() < MAX_METHOD_LABELS {
                counts.methods.insert(method.to_owned());
                method.to_owned()
            } else {
                "other".to_owned()
            };
            *counts.by_label.entry((label, outcome)).or_default() += 1;
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
        let mut v: Vec<_> = counts
            .by_label
            .iter()
            .map(|((m, o), n)| (m.clone(), *o, *n))
            .collect();
        v.sort_by(|a, b| (&a.0, a.1.as_str()).cmp(&(&b.0, b.1.as_str())));
        v
    }

    fn write_histogram(&self, out: &mut Exposition, name: &str) {
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

/// The whole `/metrics` document.
pub fn render(ctx: &Ctx) -> String {
    let mut out = Exposition::default();
    let clients = ctx.hub.clients();
    let kinds = [ClientKind::Ws, ClientKind::Sse];
    out.family(
        "clawmux_clients",
        "gauge",
        "Local clients connected now, by kind.",
    );
    for kind in kinds {
        let n = clients.iter().filter(|c| c.kind == kind).count();
        out.sample("clawmux_clients", &[("kind", kind.as_str())], n);
    }
    out.family(
        "clawmux_client_queue_bytes",
        "gauge",
        "Bytes queued for local clients and not yet written, by kind.",
    );
    for kind in kinds {
        let bytes: usize = clients
            .iter()
            .filter(|c| c.kind == kind)
            .map(|c| c.queued_bytes())
            .sum();
        out.sample(
            "clawmux_client_queue_bytes",
            &[("kind", kind.as_str())],
            bytes,
        );
    }
    let stats = &ctx.hub.stats;
    let counters = [
        (
            "clawmux_events_total",
            "Gateway and broker events published to local clients.",
            stats.events.load(Ordering::Relaxed),
        ),
        (
            "clawmux_event_drops_total",
            "Event deliveries dropped because a client was over its soft queue limit.",
            stats.drops.load(Ordering::Relaxed),
        ),
        (
            "clawmux_slow_consumer_closes_total",
            "Clients closed as slow consumers (1008 slow consumer).",
            stats.slow_closes.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, value) in counters {
        out.family(name, "counter", help);
        out.sample(name, &[], value);
    }
    out.family(
        "clawmux_requests_total",
        "counter",
        "Requests forwarded to the gateway, by method and outcome.",
    );
    for (method, outcome, n) in ctx.router.metrics.counts() {
        out.sample(
            "clawmux_requests_total",
            &[("method", &method), ("outcome", outcome.as_str())],
            n,
        );
    }
    out.family(
        "clawmux_request_duration_seconds",
        "histogram",
        "Time from forwarding a request to its final answer or failure.",
    );
    ctx.router
        .metrics
        .write_histogram(&mut out, "clawmux_request_duration_seconds");
    out.family(
        "clawmux_requests_pending",
        "gauge",
        "Requests waiting for the gateway's answer.",
    );
    out.sample("clawmux_requests_pending", &[], ctx.router.pending_count());
    out.family(
        "clawmux_queue_budget_bytes",
        "gauge",
        "Bytes held by all client queues together (each shared event counted once); closes the largest backlog past queue_total_bytes.",
    );
    out.sample(
        "clawmux_queue_budget_bytes",
        &[],
        ctx.hub.queue_budget().used(),
    );
    let own = ctx.sessions.own.snapshot();
    out.family(
        "clawmux_broker_requests_total",
        "counter",
        "Requests the broker sent on its own behalf (re-subscribes, releases), by result.",
    );
    out.sample(
        "clawmux_broker_requests_total",
        &[("result", "sent")],
        own.sent,
    );
    out.sample(
        "clawmux_broker_requests_total",
        &[("result", "failed")],
        own.failed,
    );
    out.family(
        "clawmux_dedicated_connections",
        "gauge",
        "Connections open now on /ws/dedicated (each one its own gateway connection).",
    );
    out.sample("clawmux_dedicated_connections", &[], ctx.dedicated.count());
    out.family(
        "clawmux_dedicated_total",
        "counter",
        "Connections on /ws/dedicated by how their handshake ended: connected, rejected (by the gateway), failed (studio.* before its answer), refused (max_dedicated), rate_limited (over [limits] upstream_open_*), abandoned (the client left before its connect), invalid (first frame not a connect), timed_out (no connect in time).",
    );
    for (outcome, n) in ctx.dedicated.outcomes.counts() {
        out.sample("clawmux_dedicated_total", &[("outcome", outcome)], n);
    }
    out.family(
        "clawmux_dedicated_upstream_opens_total",
        "counter",
        "Gateway connections opened for /ws/dedicated clients (after their connect, or after 100 ms of waiting for the gateway's challenge).",
    );
    out.sample(
        "clawmux_dedicated_upstream_opens_total",
        &[],
        ctx.dedicated
            .outcomes
            .upstream_opens
            .load(Ordering::Relaxed),
    );
    out.family(
        "clawmux_dedicated_ends_total",
        "counter",
        "Dedicated connections that reached the relay, by how it ended: client_closed, gateway_closed, unanswered, client_gone, client_slow, gateway_gone, shutdown.",
    );
    for (reason, n) in ctx.dedicated.outcomes.ends() {
        out.sample("clawmux_dedicated_ends_total", &[("reason", reason)], n);
    }
    let status = ctx.upstream.status();
    out.family(
        "clawmux_upstream_phase",
        "gauge",
        "1 for the upstream session's current phase, 0 for the others.",
    );
    for phase in Phase::ALL {
        let current = u8::from(phase == status.phase);
        out.sample(
            "clawmux_upstream_phase",
            &[("phase", phase.as_str())],
            current,
        );
    }
    out.family(
        "clawmux_upstream_reconnects_total",
        "counter",
        "Upstream sessions re-established after the first.",
    );
    out.sample("clawmux_upstream_reconnects_total", &[], status.reconnects);
    let (open, opened, fallbacks) = ctx.sessions.narrower.counts();
    out.family(
        "clawmux_narrower_sessions",
        "gauge",
        "Narrower upstream sessions open (one per distinct grant of fewer scopes than the broker's).",
    );
    out.sample("clawmux_narrower_sessions", &[], open);
    out.family(
        "clawmux_narrower_sessions_opened_total",
        "counter",
        "Narrower upstream sessions opened.",
    );
    out.sample("clawmux_narrower_sessions_opened_total", &[], opened);
    out.family(
        "clawmux_narrower_session_fallbacks_total",
        "counter",
        "Requests of a narrower grant run on the main session because MAX_GRANT_SESSIONS were open.",
    );
    out.sample("clawmux_narrower_session_fallbacks_total", &[], fallbacks);
    let (held, bytes) = ctx.hub.replay_held();
    out.family(
        "clawmux_replay_events",
        "gauge",
        "Events held for /v1/events resumption.",
    );
    out.sample("clawmux_replay_events", &[], held);
    out.family(
        "clawmux_replay_bytes",
        "gauge",
        "Bytes held for /v1/events resumption.",
    );
    out.sample("clawmux_replay_bytes", &[], bytes);
    out.family(
        "clawmux_build_info",
        "gauge",
        "Always 1; the labels say which clawmux this is.",
    );
    out.sample(
        "clawmux_build_info",
        &[
            ("version", env!("CARGO_PKG_VERSION")),
            (
                "profile",
                if cfg!(debug_assertions) {
                    "debug"
                } else {
                    "release"
                },
            ),
        ],
        1,
    );
    write_process_metrics(&mut out);
    out.finish()
}

/// The standard `process_*` series (the names and meanings every Prometheus
/// client library uses), read from `/proc/self` at scrape time. By hand: the
/// `procfs` crate would bring a dozen modules for five numbers, and these
/// fields are fixed by proc(5). A series whose source cannot be read is
/// left out rather than reported as 0.
fn write_process_metrics(out: &mut Exposition) {
    let stat = ProcessStat::read();
    if let Some(st) = &stat {
        let ticks = rustix::param::clock_ticks_per_second() as f64;
        out.family(
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
        );
        out.sample(
            "process_cpu_seconds_total",
            &[],
            (st.utime_ticks + st.stime_ticks) as f64 / ticks,
        );
        out.family(
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
        );
        out.sample(
            "process_resident_memory_bytes",
            &[],
            st.rss_pages * rustix::param::page_size() as u64,
        );
        out.family(
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
        );
        out.sample("process_virtual_memory_bytes", &[], st.vsize_bytes);
        out.family(
            "process_threads",
            "gauge",
            "Number of OS threads in the process.",
        );
        out.sample("process_threads", &[], st.threads);
        if let Some(boot) = boot_time_secs() {
            out.family(
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
            );
            out.sample(
                "process_start_time_seconds",
                &[],
                boot as f64 + st.start_ticks as f64 / ticks,
            );
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        out.family(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
        );
        out.sample("process_open_fds", &[], fds.count());
    }
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if let Some(max) = limit.current {
        out.family(
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
        );
        out.sample("process_max_fds", &[], max);
    }
}

/// The fields of `/proc/self/stat` the `process_*` series need (proc(5)).
#[derive(Debug, PartialEq)]
struct ProcessStat {
    utime_ticks: u64,
    stime_ticks: u64,
    threads: u64,
    start_ticks: u64,
    vsize_bytes: u64,
    rss_pages: u64,
}

impl ProcessStat {
    fn read() -> Option<ProcessStat> {
        Self::parse(&std::fs::read_to_string("/proc/self/stat").ok()?)
    }

    /// Fields are counted from 1; `comm` (field 2) may hold spaces and
    /// parentheses, so counting starts after its last `)`: field 3 is
    /// index 0 there.
    fn parse(text: &str) -> Option<ProcessStat> {
        let (_, rest) = text.rsplit_once(')')?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
        Some(ProcessStat {
            utime_ticks: field(14)?,
            stime_ticks: field(15)?,
            threads: field(20)?,
            start_ticks: field(22)?,
            vsize_bytes: field(23)?,
            rss_pages: field(24)?,
        })
    }
}

/// When the machine booted (`btime` of `/proc/stat`), in Unix seconds.
fn boot_time_secs() -> Option<u64> {
    std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
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

    /// Issue 24: a request whose method was a session key put the key in a
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
    fn proc_stat_fields_are_found_after_the_command_name() {
        let line = "4242 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 111 222 13 14 15 16 7 0 3333 4096000 250 rest";
        assert_eq!(
            ProcessStat::parse(line),
            Some(ProcessStat {
                utime_ticks: 111,
                stime_ticks: 222,
                threads: 7,
                start_ticks: 3333,
                vsize_bytes: 4096000,
                rss_pages: 250,
            })
        );
        assert_eq!(ProcessStat::parse("garbage"), None);
        assert!(
            ProcessStat::read().is_some(),
            "this process's own stat parses"
        );
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
