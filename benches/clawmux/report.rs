//! Prints the run as Markdown tables (ready to paste into BENCHMARKS.md),
//! the ratios, and the design §10 targets next to what was measured.
//!
//! Nothing here asserts a timing. The smoke variant only checks that every
//! scenario moved data at all (a harness that measures nothing is broken).

use hdrhistogram::Histogram;

use crate::double::{RequestPath, Requests};
use crate::fanout::{PathPhases, Phase};
use crate::memory::Memory;
use crate::procfs;
use crate::Config;

const MIB: f64 = 1024.0 * 1024.0;

pub struct Report {
    cfg: Config,
    command: String,
    /// (target, budget, measured, met)
    targets: Vec<(String, String, String, bool)>,
    started: procfs::MachineCpu,
    /// What the "other processes" of the last line include besides other
    /// programs (CPU of this run that the bench could not count as its own).
    others_include: Vec<&'static str>,
}

fn micros(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.0} ms", ns as f64 / 1e6)
    } else if ns >= 1_000_000 {
        format!("{:.2} ms", ns as f64 / 1e6)
    } else {
        format!("{:.0} µs", ns as f64 / 1e3)
    }
}

fn pct(h: &Histogram<u64>, q: f64) -> u64 {
    if h.is_empty() {
        0
    } else {
        h.value_at_quantile(q)
    }
}

fn share(p: &Phase, cpu: std::time::Duration) -> String {
    format!("{:.0} %", p.core_share(cpu) * 100.0)
}

fn signed_micros(ns: i64) -> String {
    if ns < 0 {
        format!("−{}", micros(ns.unsigned_abs()))
    } else {
        format!("+{}", micros(ns as u64))
    }
}

pub fn count(n: f64) -> String {
    let n = n.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl Report {
    pub fn new(cfg: &Config, command: String) -> Report {
        Report {
            cfg: cfg.clone(),
            command,
            targets: Vec::new(),
            started: procfs::MachineCpu::take(),
            others_include: Vec::new(),
        }
    }

    /// Says, in the last line, that the "other processes" include `what`.
    pub fn others_include(&mut self, what: &'static str) {
        self.others_include.push(what);
    }

    pub fn print_header(&self) {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("model name"))
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| "unknown".into());
        println!(
            "# clawmux benchmark{}\n",
            if self.cfg.smoke {
                " (smoke variant: tiny, figures meaningless)"
            } else {
                ""
            }
        );
        println!("- command: `{}`", self.command);
        println!(
            "- date: {}, commit {commit}, {}",
            chrono::Local::now().format("%Y-%m-%d %H:%M %Z"),
            if cfg!(debug_assertions) {
                "debug build"
            } else {
                "release build"
            }
        );
        println!("- machine: {cores} cores ({cpu}), Linux {}", kernel.trim());
        let binary = std::path::Path::new(env!("CARGO_BIN_EXE_clawmux"));
        println!(
            "- binary: {} ({:.1} MiB on disk)",
            binary.display(),
            std::fs::metadata(binary).map_or(0, |m| m.len()) as f64 / (1024.0 * 1024.0)
        );
        println!("- load average at start: {}", procfs::load_average());
        println!(
            "- {} clients, {}-byte events, {:.1} s windows after {:.1} s warmup, window {} events",
            self.cfg.clients,
            self.cfg.frame_bytes,
            self.cfg.measure.as_secs_f64(),
            self.cfg.warmup.as_secs_f64(),
            self.cfg.window
        );
    }

    fn check_moved(&self, what: &str, phase: &Phase) -> Result<(), String> {
        if phase.deliveries == 0 {
            return Err(format!("{what}: nothing was delivered in the window"));
        }
        Ok(())
    }

    /// `paths[i].phases[j]` is path i at offered rate `labels[j]`; the
    /// first label is the max rate, the last design §10's latency point.
    pub fn fanout(
        &mut self,
        labels: &[String],
        paths: &[PathPhases],
        double: &Phase,
    ) -> Result<(), String> {
        println!(
            "\n## Fan-out: 1 source → {} WebSocket clients, {}-byte events\n",
            self.cfg.clients, self.cfg.frame_bytes
        );
        println!("| path | offered | deliveries/s | MB/s | latency p50 | p99 | upstream conns | source CPU | broker CPU | clients CPU | others |");
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (j, label) in labels.iter().enumerate() {
            for path in paths {
                let p = &path.phases[j];
                self.check_moved(path.name, p)?;
                println!(
                    "| {} | {label} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {:.2} |",
                    path.name,
                    count(p.per_second()),
                    p.mb_per_second(),
                    micros(pct(&p.latency, 0.5)),
                    micros(pct(&p.latency, 0.99)),
                    match path.upstream_connections {
                        0 => "–".to_owned(),
                        n => n.to_string(),
                    },
                    share(p, p.gateway_cpu),
                    if path.name == "broker" {
                        share(p, p.broker_cpu)
                    } else {
                        "–".into()
                    },
                    share(p, p.clients_cpu),
                    p.others,
                );
            }
        }
        let find = |name: &str| paths.iter().find(|p| p.name.starts_with(name));
        let (Some(ceiling), Some(broker), Some(direct)) =
            (find("ceiling"), find("broker"), find("direct"))
        else {
            return Ok(());
        };
        let clients = self.cfg.clients as f64;
        // Every path delivers each event to every client: events = deliveries / clients.
        let source_ns_per_event =
            |p: &Phase| p.gateway_cpu.as_nanos() as f64 / (p.deliveries as f64 / clients);
        let (bmax, cmax, dmax) = (&broker.phases[0], &ceiling.phases[0], &direct.phases[0]);
        println!();
        println!(
            "- max rate: broker / ceiling **{:.2}**, broker / direct **{:.2}**",
            bmax.per_second() / cmax.per_second(),
            bmax.per_second() / dmax.per_second()
        );
        println!(
            "- source (gateway) CPU per event at max rate: {:.1} µs behind the broker (1 connection), {:.1} µs direct ({} connections): **{:.0}×** less",
            source_ns_per_event(bmax) / 1e3,
            source_ns_per_event(dmax) / 1e3,
            direct.upstream_connections,
            source_ns_per_event(dmax) / source_ns_per_event(bmax)
        );
        println!(
            "- broker CPU per delivery at max rate: {:.0} ns ({:.0} % of one core for {} deliveries/s)",
            bmax.broker_cpu.as_nanos() as f64 / bmax.deliveries as f64,
            bmax.core_share(bmax.broker_cpu) * 100.0,
            count(bmax.per_second())
        );
        for (j, label) in labels.iter().enumerate().skip(1) {
            let (b, d) = (&broker.phases[j].latency, &direct.phases[j].latency);
            println!(
                "- at {label}: latency added by the broker over direct: p50 {}, p99 {}",
                signed_micros(pct(b, 0.5) as i64 - pct(d, 0.5) as i64),
                signed_micros(pct(b, 0.99) as i64 - pct(d, 0.99) as i64),
            );
        }
        println!(
            "- the gateway double itself (`MockGateway::broadcast` → one direct reader): {} events/s at {} of its thread; the broker row at max rate needed {} events/s",
            count(double.per_second()),
            share(double, double.gateway_cpu),
            count(bmax.per_second() / clients),
        );
        self.target(
            "fan-out deliveries/s at 100 clients",
            "≥ 1,000,000",
            count(bmax.per_second()),
            bmax.per_second() >= 1e6,
        );
        let last = labels.len() - 1;
        let (b, d) = (&broker.phases[last].latency, &direct.phases[last].latency);
        let added99 = pct(b, 0.99) as i64 - pct(d, 0.99) as i64;
        self.target(
            &format!("fan-out p99 added over direct at {}", labels[last]),
            "≤ 2 ms",
            format!(
                "{} (source → client p99 {})",
                signed_micros(added99),
                micros(pct(b, 0.99))
            ),
            added99 <= 2_000_000,
        );
        Ok(())
    }

    /// The broker path with its upstream over `wss://` against `ws://`, at
    /// the max rate and at the latency point: `ws[k]` and `wss[k]` at `labels[k]`.
    pub fn fanout_wss(
        &mut self,
        labels: [&str; 2],
        ws: [&Phase; 2],
        wss: &[Phase],
        negotiated: Option<&str>,
    ) -> Result<(), String> {
        println!("\n## Fan-out with the broker's upstream over wss:// (TLS) vs ws://\n");
        println!(
            "The broker path above again, its one upstream connection over TLS on loopback \
             ({}, a self-signed certificate pinned as `--tls-fingerprint` pins it); each wss \
             window follows the ws one at the same offered rate.\n",
            negotiated.unwrap_or("no TLS session was recorded")
        );
        println!("| upstream | offered | deliveries/s | MB/s | latency p50 | p99 | source CPU | broker CPU | clients CPU | others |");
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        if wss.len() != 2 {
            return Err(format!("wss: {} windows measured, 2 expected", wss.len()));
        }
        for k in 0..2 {
            for (scheme, p) in [("ws://", ws[k]), ("wss://", &wss[k])] {
                self.check_moved(&format!("broker, {scheme} upstream"), p)?;
                println!(
                    "| {scheme} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {:.2} |",
                    labels[k],
                    count(p.per_second()),
                    p.mb_per_second(),
                    micros(pct(&p.latency, 0.5)),
                    micros(pct(&p.latency, 0.99)),
                    share(p, p.gateway_cpu),
                    share(p, p.broker_cpu),
                    share(p, p.clients_cpu),
                    p.others,
                );
            }
        }
        let clients = self.cfg.clients as f64;
        let per_event = |p: &Phase, cpu: std::time::Duration| {
            cpu.as_nanos() as f64 / (p.deliveries as f64 / clients) / 1e3
        };
        let (ws_max, wss_max) = (ws[0], &wss[0]);
        println!();
        println!(
            "- max rate: wss / ws deliveries/s **{:.2}**",
            wss_max.per_second() / ws_max.per_second()
        );
        for k in 0..2 {
            let (a, b) = (&ws[k].latency, &wss[k].latency);
            println!(
                "- at {}: latency added by TLS (wss − ws): p50 {}, p99 **{}**",
                labels[k],
                signed_micros(pct(b, 0.5) as i64 - pct(a, 0.5) as i64),
                signed_micros(pct(b, 0.99) as i64 - pct(a, 0.99) as i64),
            );
        }
        println!(
            "- CPU per event at max rate, ws → wss: source (gateway) {:.1} → {:.1} µs, broker {:.1} → {:.1} µs ({} clients)",
            per_event(ws_max, ws_max.gateway_cpu),
            per_event(wss_max, wss_max.gateway_cpu),
            per_event(ws_max, ws_max.broker_cpu),
            per_event(wss_max, wss_max.broker_cpu),
            self.cfg.clients,
        );
        Ok(())
    }

    /// `sets[i]` holds the broker, bare-relay and direct runs with one
    /// number of clients: `--request-clients` first, then one at a time.
    pub fn requests(&mut self, sets: &[Vec<Requests>]) -> Result<(), String> {
        for (i, set) in sets.iter().enumerate() {
            let find = |path: RequestPath| {
                set.iter()
                    .find(|r| r.path == path)
                    .ok_or_else(|| format!("no {} run", path.name()))
            };
            let (broker, relay, direct) = (
                find(RequestPath::Broker)?,
                find(RequestPath::Relay)?,
                find(RequestPath::Direct)?,
            );
            let n = broker.clients;
            if n == 1 {
                println!(
                    "\n## Requests one at a time: 1 client, one `health` in flight (closed loop), gateway double\n"
                );
            } else {
                println!(
                    "\n## Requests: {n} clients, one `health` in flight each (closed loop), gateway double\n"
                );
            }
            println!(
                "| path | round trips/s | p50 | p99 | double CPU | forwarder CPU | forwarder CPU / request | clients CPU | errors | others |"
            );
            println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
            for r in set {
                let path = r.path.name();
                self.check_moved(path, &r.phase)?;
                // A refused or failed request is not a round trip: a row
                // with errors is not a figure, and fails the run.
                if r.errors > 0 {
                    return Err(format!(
                        "{path}: {} requests failed ({} clients); the figures would count them",
                        r.errors, r.clients
                    ));
                }
                let p = &r.phase;
                let forwards = r.path != RequestPath::Direct;
                println!(
                    "| {path} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} |",
                    count(p.per_second()),
                    micros(pct(&p.latency, 0.5)),
                    micros(pct(&p.latency, 0.99)),
                    share(p, p.gateway_cpu),
                    if forwards {
                        share(p, p.broker_cpu)
                    } else {
                        "–".into()
                    },
                    if forwards {
                        format!("{:.1} µs", r.forwarder_cpu_per_request())
                    } else {
                        "–".into()
                    },
                    share(p, p.clients_cpu),
                    r.errors,
                    p.others
                );
            }
            let added = |r: &Requests, q: f64| {
                pct(&r.phase.latency, q).saturating_sub(pct(&direct.phase.latency, q))
            };
            let (added50, added99) = (added(broker, 0.5), added(broker, 0.99));
            let rt_ratio = broker.phase.per_second() / direct.phase.per_second();
            let cpu_ratio = broker.forwarder_cpu_per_request() / relay.forwarder_cpu_per_request();
            println!(
                "\n- broker / direct round trips/s: **{rt_ratio:.2}**; added latency p50 {}, p99 {}",
                micros(added50),
                micros(added99)
            );
            println!(
                "- bare relay / direct round trips/s: {:.2}; added latency p50 {}, p99 {}",
                relay.phase.per_second() / direct.phase.per_second(),
                micros(added(relay, 0.5)),
                micros(added(relay, 0.99))
            );
            println!(
                "- broker / bare relay: round trips/s {:.2}; CPU per request {:.1} / {:.1} µs = **{cpu_ratio:.2}×**",
                broker.phase.per_second() / relay.phase.per_second(),
                broker.forwarder_cpu_per_request(),
                relay.forwarder_cpu_per_request(),
            );
            let clients = if n == 1 {
                "one at a time".to_owned()
            } else {
                format!("{n} clients")
            };
            if i == 0 {
                self.target(
                    &format!("round trips/s through the broker, {clients}"),
                    "≥ 50,000",
                    count(broker.phase.per_second()),
                    broker.phase.per_second() >= 50_000.0,
                );
                self.target(
                    &format!("broker / direct round trips/s, {clients}"),
                    "≥ 0.8",
                    format!("{rt_ratio:.2}"),
                    rt_ratio >= 0.8,
                );
                self.target(
                    "added p50 per request",
                    "≤ 100 µs",
                    micros(added50),
                    added50 <= 100_000,
                );
            }
            self.target(
                &format!("broker CPU per request / bare relay's, {clients}"),
                "≤ 1.2×",
                format!("{cpu_ratio:.2}×"),
                cpu_ratio <= 1.2,
            );
        }
        Ok(())
    }

    pub fn memory(&mut self, m: &Memory) -> Result<(), String> {
        println!("\n## Memory (`clawmux serve` as a child process) and slow-client isolation\n");
        println!("| measure | value |");
        println!("|---|---:|");
        println!(
            "| idle broker RSS (upstream ready, no clients) | {:.1} MiB |",
            m.idle_rss as f64 / MIB
        );
        println!(
            "| RSS with {} idle clients | {:.1} MiB |",
            m.idle_clients,
            m.rss_with_idle_clients as f64 / MIB
        );
        println!(
            "| per idle client | {:.1} KiB |",
            m.per_idle_client() / 1024.0
        );
        let st = &m.state;
        println!(
            "| `/v1/state` with {} clients ({} KiB): time p50 / max, broker CPU per read | {:.1} / {:.1} ms, {:.1} ms |",
            st.clients,
            st.bytes / 1024,
            st.p50.as_secs_f64() * 1e3,
            st.max.as_secs_f64() * 1e3,
            st.broker_cpu_per_read.as_secs_f64() * 1e3
        );
        println!(
            "| RSS after they left | {:.1} MiB |",
            m.rss_after_clients_left as f64 / MIB
        );
        let healthy = self.cfg.clients.saturating_sub(1).max(1);
        for (what, w) in [
            (format!("{healthy} readers"), &m.reference),
            (
                format!("{healthy} readers + 1 that never reads"),
                &m.stalled,
            ),
        ] {
            self.check_moved(&what, &w.phase)?;
            println!(
                "| full fan-out, {what}: RSS max | {:.1} MiB |",
                w.max_rss as f64 / MIB
            );
            println!(
                "| full fan-out, {what}: healthy deliveries/s (broker CPU) | {} ({:.0} %) |",
                count(w.phase.per_second()),
                w.broker_core_share * 100.0
            );
        }
        match m.stalled.first_close_after {
            Some(t) => println!(
                "| the reader that never reads: closed `1008 slow consumer` after | {:.1} s |",
                t.as_secs_f64()
            ),
            None => println!("| the reader that never reads: closed | not within the phase |"),
        }
        let ratio = m.stalled.phase.per_second() / m.reference.phase.per_second();
        println!("\n- isolation: healthy readers' throughput with / without the stalled client, whole window: **{ratio:.2}**");
        let attached = m
            .stalled
            .rate_while_attached
            .map(|r| r / m.reference.phase.per_second());
        if let Some(a) = attached {
            println!("- the same while the stalled client was still attached (before its close): **{a:.2}**");
        }
        self.target(
            "idle broker RSS",
            "≤ 16 MiB",
            format!("{:.1} MiB", m.idle_rss as f64 / MIB),
            m.idle_rss as f64 <= 16.0 * MIB,
        );
        self.target(
            "RSS per idle client",
            "≤ 64 KiB",
            format!("{:.1} KiB", m.per_idle_client() / 1024.0),
            m.per_idle_client() <= 64.0 * 1024.0,
        );
        let worst = attached.map_or(ratio, |a| a.min(ratio));
        self.target(
            "isolation: throughput with / without a stalled client",
            "≥ 0.95",
            format!("{worst:.2}"),
            worst >= 0.95,
        );
        // A client that never reads may hold up to the hard queue limit
        // (50 MiB, never stricter than the gateway's maxBufferedBytes) for up
        // to `slow_grace` (10 s) before it is closed: bounded by that, not by
        // an early close.
        let hard = clawmux::config::Limits::default().queue_hard_bytes as u64;
        self.target(
            "RSS with a stalled client under full fan-out",
            "≤ without it + hard queue limit (50 MiB) + 16 MiB",
            format!(
                "{:.1} MiB max ({:+.1} MiB)",
                m.stalled.max_rss as f64 / MIB,
                (m.stalled.max_rss as f64 - m.reference.max_rss as f64) / MIB
            ),
            m.stalled.slow_closes > 0
                || m.stalled.max_rss < m.reference.max_rss + hard + (16 << 20),
        );
        Ok(())
    }

    /// The many-clients scenario: peak RSS against the queue budget.
    pub fn many_stalled(&mut self, m: &crate::memory::ManyStalled) {
        println!(
            "\n### {} clients, {} never reading, {} events of {} B\n",
            m.readers + m.stalled,
            m.stalled,
            count(m.events as f64),
            m.frame_bytes
        );
        println!("| measure | value |");
        println!("|---|---:|");
        println!("| idle broker RSS | {:.1} MiB |", m.idle_rss as f64 / MIB);
        println!(
            "| RSS max (queue_total_bytes {:.0} MiB) | {:.1} MiB |",
            m.budget as f64 / MIB,
            m.max_rss as f64 / MIB
        );
        println!(
            "| RSS after the stalled clients were closed | {:.1} MiB |",
            m.rss_after_cut as f64 / MIB
        );
        println!(
            "| slow-consumer closes (stalled clients: {}) | {} |",
            m.stalled, m.slow_closes
        );
        // The bound: the budget plus a fixed baseline (the idle broker, and
        // per client its socket buffers and writer batch: 64 MiB for 1,000).
        let bound = m.idle_rss + m.budget + (64 << 20);
        self.target(
            "RSS with many stalled clients and small events",
            "≤ idle + queue_total_bytes + 64 MiB",
            format!(
                "{:.1} MiB max ({:.1} MiB after the cut)",
                m.max_rss as f64 / MIB,
                m.rss_after_cut as f64 / MIB
            ),
            m.max_rss <= bound,
        );
    }

    fn target(&mut self, what: &str, budget: &str, measured: String, met: bool) {
        self.targets
            .push((what.to_owned(), budget.to_owned(), measured, met));
    }

    pub fn print_targets(&self) {
        if !self.targets.is_empty() {
            println!("\n## Targets (design §10)\n");
            println!("| target | budget | measured | |");
            println!("|---|---|---:|---|");
            for (what, budget, measured, met) in &self.targets {
                println!(
                    "| {what} | {budget} | {measured} | {} |",
                    if *met { "met" } else { "**missed**" }
                );
            }
        }
        println!("\n- load average at the end: {}", procfs::load_average());
        let including = if self.others_include.is_empty() {
            String::new()
        } else {
            format!(" (including {})", self.others_include.join(", "))
        };
        println!(
            "- other processes on the machine{including} used {:.2} cores on average during the run",
            procfs::MachineCpu::take().others_since(&self.started)
        );
    }
}
