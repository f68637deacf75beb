//! `GET /metrics`: the broker's state and counters in the Prometheus text
//! format, read at scrape time from what the broker already holds (hub
//! stats, queue sizes, the sessions' status, the request accounting of
//! [`crate::metrics`]).

use std::sync::atomic::Ordering;

use crate::context::Ctx;
use crate::hub::ClientKind;
use crate::metrics::Exposition;
use crate::upstream::Phase;

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
        "Bytes held by all client queues together (each shared event counted once); past queue_total_bytes the client that has gone longest without reading is closed.",
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
    let status = ctx.upstream().status();
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
}
