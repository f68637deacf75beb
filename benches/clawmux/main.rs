//! `cargo bench --bench clawmux`: clawmux measured side by side with the
//! physical ceiling and a direct-connection baseline, in one run, as ratios.
//! BENCHMARKS.md has a full run and what limits each figure.
//!
//! - fan-out: one source → N WebSocket clients through the broker, vs the same
//!   frames over bare unix sockets (ceiling) and N clients on the gateway
//!   directly (baseline); max rate and half of it. The broker path also with
//!   its upstream over `wss://` (TLS), as a ratio to `ws://`.
//! - requests: closed-loop `health` through the broker, through a bare relay
//!   (bytes copied untouched: the floor for a forwarder) and straight to the
//!   double; 10 clients and one at a time, with the forwarder's CPU per request.
//! - memory and isolation: `clawmux serve` as a child process (its RSS is its
//!   own): idle, per idle client, and full fan-out with one client that never reads.
//!
//! A bench target rather than a binary: it is built by `cargo test
//! --all-targets` (so it cannot rot) and run there as a seconds-long smoke
//! variant (it is only a full run when cargo passes `--bench`), it may use
//! dev-dependencies, and `cargo install` does not ship it to users.
//! Components run on threads of their own (`bench-gw`, `broker`, `clients`)
//! so one read of /proc splits CPU time between them.

mod clients;
mod double;
mod fanout;
mod handover;
mod memory;
mod procfs;
mod relay;
mod report;
mod source;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// Options of a run (all have defaults that match design §10).
#[derive(Parser, Debug, Clone)]
#[command(name = "clawmux-bench")]
struct Args {
    /// Local clients in the fan-out scenarios.
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Size of each event frame (JSON bytes).
    #[arg(long, default_value_t = 300)]
    frame_bytes: usize,
    /// Seconds of each measured window.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Seconds of warmup before each window.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Events the source may be ahead of the slowest healthy reader.
    #[arg(long, default_value_t = 2048)]
    window: u64,
    /// Idle clients connected for the per-client memory figure.
    #[arg(long, default_value_t = 1000)]
    idle_clients: usize,
    /// Clients in the requests scenario (one request in flight each).
    #[arg(long, default_value_t = 10)]
    request_clients: usize,
    /// Deliveries/s (events/s × clients) of the fan-out latency point; design
    /// §10 asks for p99 at half of its 1,000,000 budget.
    #[arg(long, default_value_t = 500_000.0)]
    latency_point: f64,
    /// Which scenarios to run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fanout,requests,memory,handover"
    )]
    scenarios: Vec<Scenario>,
    /// Passed by `cargo bench`: a full run. Without it (`cargo test`): the smoke variant.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Fanout,
    Requests,
    Memory,
    /// The pause clients see at a `SIGUSR2` handover (`--idle-clients` of them).
    Handover,
}

/// The resolved settings of a run.
#[derive(Debug, Clone)]
pub struct Config {
    pub clients: usize,
    pub frame_bytes: usize,
    pub measure: Duration,
    pub warmup: Duration,
    pub window: u64,
    pub idle_clients: usize,
    pub request_clients: usize,
    pub latency_point: f64,
    pub smoke: bool,
}

impl Args {
    fn config(&self) -> Config {
        Config {
            clients: self.clients.max(2),
            frame_bytes: self.frame_bytes,
            measure: Duration::from_secs_f64(self.seconds),
            warmup: Duration::from_secs_f64(self.warmup),
            window: self.window.max(1),
            idle_clients: self.idle_clients.max(1),
            request_clients: self.request_clients.max(1),
            latency_point: self.latency_point.max(1.0),
            smoke: false,
        }
    }

    /// The command that reproduces this run.
    fn command(&self) -> String {
        let scenarios: Vec<&str> = self
            .scenarios
            .iter()
            .map(|s| match s {
                Scenario::Fanout => "fanout",
                Scenario::Requests => "requests",
                Scenario::Memory => "memory",
                Scenario::Handover => "handover",
            })
            .collect();
        format!(
            "cargo bench --bench clawmux -- --clients {} --frame-bytes {} --seconds {} --warmup {} --window {} --idle-clients {} --request-clients {} --latency-point {} --scenarios {}",
            self.clients,
            self.frame_bytes,
            self.seconds,
            self.warmup,
            self.window,
            self.idle_clients,
            self.request_clients,
            self.latency_point,
            scenarios.join(",")
        )
    }
}

/// The smoke variant `cargo test --all-targets` runs: every scenario, tiny.
fn smoke_config() -> Config {
    Config {
        clients: 4,
        frame_bytes: 300,
        measure: Duration::from_millis(200),
        warmup: Duration::from_millis(100),
        window: 256,
        idle_clients: 8,
        request_clients: 2,
        latency_point: 0.0,
        smoke: true,
    }
}

fn main() -> ExitCode {
    // The in-process broker allocates as `clawmux serve` does.
    clawmux::bounds::return_large_blocks_at_once();
    let full = std::env::args().any(|a| a == "--bench");
    let (cfg, scenarios, command) = if full {
        match Args::try_parse() {
            Ok(args) => (args.config(), args.scenarios.clone(), args.command()),
            // --help exits 0, a bad option 2.
            Err(e) => e.exit(),
        }
    } else {
        // Under `cargo test`, arguments meant for libtest may be passed: ignored.
        let all = vec![
            Scenario::Fanout,
            Scenario::Requests,
            Scenario::Memory,
            Scenario::Handover,
        ];
        (
            smoke_config(),
            all,
            "cargo test --bench clawmux (smoke variant)".to_owned(),
        )
    };
    raise_fd_limit(cfg.idle_clients * 2 + cfg.clients * 4 + 256);
    let runtime = |name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(name)
            .enable_all()
            .build()
            .expect("a tokio runtime")
    };
    let clients_rt = runtime(procfs::CLIENTS_THREAD);
    let broker_rt = runtime(procfs::BROKER_THREAD);
    let handle = broker_rt.handle().clone();
    let result = clients_rt.block_on(run(cfg, scenarios, command, handle));
    broker_rt.shutdown_timeout(Duration::from_secs(5));
    clients_rt.shutdown_timeout(Duration::from_secs(5));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("clawmux bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(
    cfg: Config,
    scenarios: Vec<Scenario>,
    command: String,
    broker_rt: tokio::runtime::Handle,
) -> Result<(), String> {
    let mut report = report::Report::new(&cfg, command);
    report.print_header();
    if scenarios.contains(&Scenario::Fanout) {
        let double = double::broadcast_rate(&cfg).await?;
        // All three paths are set up at once and measured in turn at each
        // rate, so the figures compared in a ratio are seconds apart.
        let mut runs = vec![
            fanout::broker(&cfg, broker_rt.clone()).await?,
            fanout::ceiling(&cfg, broker_rt.clone())?,
            fanout::direct(&cfg, broker_rt.clone()).await?,
        ];
        // The broker path again with its upstream over wss://, measured
        // right after the ws:// one at the max rate and the latency point
        // (not at ½ max: two windows keep the run short).
        let tls = source::GatewayTls::self_signed().map_err(|e| format!("certificate: {e}"))?;
        let mut wss = fanout::broker_wss(&cfg, broker_rt.clone(), &tls).await?;
        let mut wss_phases = Vec::new();
        let mut phases: Vec<Vec<fanout::Phase>> = vec![Vec::new(); runs.len()];
        measure_round(
            &mut runs,
            &mut phases,
            Some((&mut wss, &mut wss_phases)),
            None,
            &cfg,
        )
        .await?;
        // Offered rates (events/s per client) after the max: half of the
        // broker's max, and the latency point (design §10: half of the
        // budget of 1,000,000 deliveries/s).
        let half = phases[0][0].per_second() / cfg.clients as f64 / 2.0;
        let design = if cfg.smoke {
            half / 2.0
        } else {
            cfg.latency_point / cfg.clients as f64
        };
        let labels = vec![
            "max".to_owned(),
            format!("½ max: {} ev/s", report::count(half)),
            format!(
                "{}: {} ev/s",
                if cfg.latency_point == 500_000.0 {
                    "design"
                } else {
                    "point"
                },
                report::count(design)
            ),
        ];
        measure_round(&mut runs, &mut phases, None, Some(half), &cfg).await?;
        measure_round(
            &mut runs,
            &mut phases,
            Some((&mut wss, &mut wss_phases)),
            Some(design),
            &cfg,
        )
        .await?;
        wss.stop().await;
        let mut paths = Vec::new();
        for (run, phases) in runs.into_iter().zip(phases) {
            paths.push(fanout::PathPhases {
                name: run.name,
                upstream_connections: run.upstream_connections,
                phases,
            });
            run.stop().await;
        }
        paths.swap(0, 1); // shown as ceiling, broker, direct
        report.fanout(&labels, &paths, &double)?;
        let ws = &paths
            .iter()
            .find(|p| p.name == "broker")
            .ok_or("no broker path")?
            .phases;
        report.fanout_wss(
            [&labels[0], &labels[2]],
            [&ws[0], &ws[2]],
            &wss_phases,
            tls.negotiated(),
        )?;
    }
    if scenarios.contains(&Scenario::Requests) {
        // With `--request-clients` clients, then one at a time (a single
        // client's closed loop); each set's three paths measured in turn, so
        // the ratios compare windows seconds apart.
        let mut sets = vec![cfg.request_clients];
        if cfg.request_clients != 1 {
            sets.push(1);
        }
        let mut measured = Vec::new();
        for clients in sets {
            let mut set = Vec::new();
            for path in [
                double::RequestPath::Broker,
                double::RequestPath::Relay,
                double::RequestPath::Direct,
            ] {
                set.push(double::requests(&cfg, broker_rt.clone(), path, clients).await?);
            }
            measured.push(set);
        }
        report.requests(&measured)?;
    }
    if scenarios.contains(&Scenario::Memory) {
        let binary = std::path::Path::new(env!("CARGO_BIN_EXE_clawmux"));
        let memory = memory::run(&cfg, binary).await?;
        report.memory(&memory)?;
        let many = memory::many_stalled(&cfg, binary).await?;
        report.many_stalled(&many);
    }
    if scenarios.contains(&Scenario::Handover) {
        // Another build (say, the commit before a change) can be measured
        // with this bench's clients: HANDOVER_BENCH_BINARY=/path/to/clawmux.
        let binary = std::env::var_os("HANDOVER_BENCH_BINARY")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_clawmux").into());
        // Every client reading (the baseline), then a tenth not reading
        // around each handover: the same run, the same machine.
        let all_read = handover::run(&cfg, &binary, false).await?;
        let some_stall = handover::run(&cfg, &binary, true).await?;
        handover::print(&all_read, &some_stall);
        if std::env::var_os("HANDOVER_BENCH_BINARY").is_some() {
            println!("- the broker measured: {}", binary.display());
        }
        // Each new instance is the old one's child, and outlives it: it is
        // no child this bench waits for, so its CPU is not the bench's own.
        report.others_include("the broker's instances after the first handover");
        // HANDOVER_BENCH_AGAINST=/path/to/other/clawmux: the two take turns,
        // handover by handover, in the same run (handover::Builds).
        if let Some(other) = std::env::var_os("HANDOVER_BENCH_AGAINST") {
            println!(
                "- A: {}, B: {} (HANDOVER_BENCH_AGAINST)",
                binary.display(),
                std::path::Path::new(&other).display()
            );
        }
        for pauses in [&all_read, &some_stall] {
            if pauses.gaps.is_empty() || pauses.lost > 0 || pauses.skipped + pauses.repeated > 0 {
                return Err(format!(
                    "handover: {} handovers measured, {} clients lost, {} events missed, {} repeated",
                    pauses.gaps.len(),
                    pauses.lost,
                    pauses.skipped,
                    pauses.repeated
                ));
            }
        }
    }
    report.print_targets();
    if cfg.smoke {
        // Each scenario that moved data counts as passed (timings are never judged).
        println!("\nsmoke: {} passed, 0 failed", scenarios.len());
    }
    Ok(())
}

/// Measures every path at `rate` (None = max), in turn; `wss` (when given)
/// right after the first path, the broker's, so the two windows compared in
/// the wss / ws ratio are seconds apart.
async fn measure_round(
    runs: &mut [fanout::PathRun],
    phases: &mut [Vec<fanout::Phase>],
    mut wss: Option<(&mut fanout::PathRun, &mut Vec<fanout::Phase>)>,
    rate: Option<f64>,
    cfg: &Config,
) -> Result<(), String> {
    for (i, (run, phases)) in runs.iter_mut().zip(phases.iter_mut()).enumerate() {
        phases.push(run.measure(rate, cfg).await?);
        if i == 0 {
            if let Some((run, phases)) = wss.as_mut() {
                phases.push(run.measure(rate, cfg).await?);
            }
        }
    }
    Ok(())
}

/// 1,000 idle clients need 2,000 descriptors here and 1,000 in the broker
/// child (which inherits the limit): raise the soft limit toward the hard one.
fn raise_fd_limit(wanted: usize) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    let want = (wanted as u64).min(hard);
    if limit.current.is_some_and(|c| c < want) {
        limit.current = Some(want);
        let _ = setrlimit(Resource::Nofile, limit);
    }
}
