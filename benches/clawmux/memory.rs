//! Scenarios 3 and 4 against the real `clawmux serve` binary in a child
//! process, so its resident memory is its own: the idle broker, the broker
//! with many idle clients, and full fan-out with and without one client
//! that never reads (isolation, and memory that must stay bounded).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clawmux::cli::BrokerClient;
use http::Method;
use tokio::net::UnixStream;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::clients::Receivers;
use crate::fanout::{self, Phase, BENCH_TOKEN};
use crate::procfs;
use crate::source::Source;
use crate::Config;

/// What scenario 3 and 4 measured.
pub struct Memory {
    pub idle_rss: u64,
    pub idle_clients: usize,
    pub rss_with_idle_clients: u64,
    pub rss_after_clients_left: u64,
    /// `/v1/state` with the idle clients connected.
    pub state: StateReads,
    /// Full fan-out to the healthy readers only.
    pub reference: FanoutUnderWatch,
    /// The same plus one client that never reads.
    pub stalled: FanoutUnderWatch,
}

impl Memory {
    pub fn per_idle_client(&self) -> f64 {
        self.rss_with_idle_clients.saturating_sub(self.idle_rss) as f64 / self.idle_clients as f64
    }
}

/// [`STATE_READS`] reads of `/v1/state`, one after another, with the idle
/// clients connected: each one's time to the whole answer, and the broker's
/// CPU (the whole child process) per read.
pub struct StateReads {
    pub clients: usize,
    pub p50: Duration,
    pub max: Duration,
    pub broker_cpu_per_read: Duration,
    /// The answer's size (the last one).
    pub bytes: usize,
}

const STATE_READS: usize = 20;

/// A fan-out phase with the child's memory sampled throughout.
pub struct FanoutUnderWatch {
    pub phase: Phase,
    pub max_rss: u64,
    /// Broker CPU (whole child process) in the phase, as a share of one core.
    pub broker_core_share: f64,
    /// Clients the broker closed as slow consumers during the phase.
    pub slow_closes: u64,
    /// When the first of those closes was seen, from the phase's start.
    pub first_close_after: Option<Duration>,
    /// Healthy readers' deliveries/s from the end of the warmup until the
    /// first slow-consumer close (while the stalled client was still
    /// attached), when that span was long enough to measure.
    pub rate_while_attached: Option<f64>,
}

/// The broker child, killed if the harness stops early.
struct BrokerChild {
    child: Child,
    pid: u32,
    api: BrokerClient,
}

impl BrokerChild {
    async fn spawn(
        binary: &Path,
        socket: &Path,
        gateway: &str,
        log: &Path,
    ) -> Result<Self, String> {
        let log = std::fs::File::create(log).map_err(|e| e.to_string())?;
        let child = Command::new(binary)
            .arg("serve")
            .arg("--socket")
            .arg(socket)
            .arg("--gateway-url")
            .arg(gateway)
            .arg("--no-device-identity")
            // The token goes through the environment, never the command line.
            .env("CLAWMUX_GATEWAY_TOKEN", BENCH_TOKEN)
            .env("CLAWMUX_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        let pid = child.id().ok_or("the broker child exited at once")?;
        let api = BrokerClient::new(socket.to_owned());
        let me = BrokerChild { child, pid, api };
        me.wait_until(Duration::from_secs(15), |h| h["upstream"] == "ready")
            .await?;
        Ok(me)
    }

    async fn healthz(&self) -> Option<serde_json::Value> {
        let (_, body) = self.api.json(Method::GET, "/healthz", None).await.ok()?;
        Some(body)
    }

    /// Polls `/healthz` until `pred` holds (bounded).
    async fn wait_until(
        &self,
        patience: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + patience;
        loop {
            if let Some(h) = self.healthz().await {
                if pred(&h) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the broker child did not reach the expected state in {patience:?} (last /healthz: {:?})",
                    self.healthz().await
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `clawmux_slow_consumer_closes_total` from `/metrics`.
    async fn slow_closes(&self) -> Option<u64> {
        use http_body_util::BodyExt;
        let resp = self
            .api
            .send(Method::GET, "/metrics", &[], None)
            .await
            .ok()?;
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        let text = String::from_utf8_lossy(&body);
        text.lines()
            .find_map(|l| l.strip_prefix("clawmux_slow_consumer_closes_total "))
            .and_then(|v| v.trim().parse().ok())
    }

    /// [`StateReads`]: `/v1/state` read [`STATE_READS`] times in a row.
    async fn read_state(&self, clients: usize) -> Result<StateReads, String> {
        use http_body_util::BodyExt;
        let cpu_before = procfs::process_cpu(self.pid).unwrap_or_default();
        let mut times = Vec::with_capacity(STATE_READS);
        let mut bytes = 0;
        for _ in 0..STATE_READS {
            let started = Instant::now();
            let resp = tokio::time::timeout(
                Duration::from_secs(10),
                self.api.send(Method::GET, "/v1/state", &[], None),
            )
            .await
            .map_err(|_| "/v1/state took over 10 s".to_owned())?
            .map_err(|e| format!("/v1/state: {e}"))?;
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("/v1/state body: {e}"))?
                .to_bytes();
            times.push(started.elapsed());
            bytes = body.len();
        }
        let cpu = procfs::process_cpu(self.pid)
            .unwrap_or_default()
            .saturating_sub(cpu_before);
        times.sort();
        Ok(StateReads {
            clients,
            p50: times[times.len() / 2],
            max: times[times.len() - 1],
            broker_cpu_per_read: cpu / STATE_READS as u32,
            bytes,
        })
    }

    fn rss(&self) -> u64 {
        procfs::rss_bytes(self.pid).unwrap_or(0)
    }

    async fn stop(mut self) {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(self.pid as i32).expect("a child pid is positive"),
            rustix::process::Signal::TERM,
        );
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// Waits for memory to settle after a change (allocator, lazily touched pages).
const SETTLE: Duration = Duration::from_millis(300);

pub async fn run(cfg: &Config, binary: &Path) -> Result<Memory, String> {
    let healthy = cfg.clients.saturating_sub(1).max(1);
    let receivers = Receivers::new(healthy, 1);
    let (mut source, addr) = Source::gateway(1, receivers.clone(), cfg.window, cfg.frame_bytes)
        .map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("clawmux.sock");
    let log: PathBuf = dir.path().join("broker.log");
    let broker = BrokerChild::spawn(binary, &socket, &format!("ws://{addr}"), &log).await?;
    let result = measure_all(cfg, &broker, &mut source, &receivers, &socket, healthy).await;
    finish(broker, source, &log, result).await
}

async fn measure_all(
    cfg: &Config,
    broker: &BrokerChild,
    source: &mut Source,
    receivers: &Receivers,
    socket: &Path,
    healthy: usize,
) -> Result<Memory, String> {
    tokio::time::sleep(SETTLE).await;
    let idle_rss = broker.rss();

    // Idle clients: connected and greeted, then silent (no events flow yet).
    let idle = CancellationToken::new();
    let mut idle_tasks = Vec::new();
    for chunk_start in (0..cfg.idle_clients).step_by(100) {
        let count = 100.min(cfg.idle_clients - chunk_start);
        let open = || UnixStream::connect(socket.to_owned());
        idle_tasks.extend(
            fanout::open_ws_clients(count, 0, open, None, receivers, Some(idle.clone())).await?,
        );
    }
    let n = cfg.idle_clients as u64;
    broker
        .wait_until(Duration::from_secs(10), |h| h["clients"] == n)
        .await?;
    tokio::time::sleep(SETTLE).await;
    let rss_with_idle_clients = broker.rss();
    let state = broker.read_state(cfg.idle_clients).await?;
    idle.cancel();
    for task in idle_tasks {
        let _ = task.await;
    }
    broker
        .wait_until(Duration::from_secs(10), |h| h["clients"] == 0)
        .await?;
    tokio::time::sleep(SETTLE).await;
    let rss_after_clients_left = broker.rss();

    // Full fan-out to the healthy readers.
    let open = || UnixStream::connect(socket.to_owned());
    let mut readers = fanout::open_ws_clients(healthy, 0, open, None, receivers, None).await?;
    let reference = watched_fanout(cfg, broker, source, receivers).await?;

    // Again, with one more client that completes its handshake and never reads.
    let stall = CancellationToken::new();
    readers.extend(
        fanout::open_ws_clients(1, healthy, open, None, receivers, Some(stall.clone())).await?,
    );
    // No warmup here (the readers are warm): the stalled client is closed at
    // its 8 MiB limit within about a second, and the window must include that.
    let no_warmup = Config {
        warmup: Duration::ZERO,
        ..cfg.clone()
    };
    let stalled = watched_fanout(&no_warmup, broker, source, receivers).await?;
    stall.cancel();
    for reader in readers {
        reader.abort();
    }
    Ok(Memory {
        idle_rss,
        idle_clients: cfg.idle_clients,
        rss_with_idle_clients,
        rss_after_clients_left,
        state,
        reference,
        stalled,
    })
}

/// A max-rate fan-out phase while RSS and slow-consumer closes are sampled.
async fn watched_fanout(
    cfg: &Config,
    broker: &BrokerChild,
    source: &mut Source,
    receivers: &Receivers,
) -> Result<FanoutUnderWatch, String> {
    let closes_before = broker.slow_closes().await.unwrap_or(0);
    let cpu_before = procfs::process_cpu(broker.pid).unwrap_or_default();
    let started = Instant::now();
    let done = CancellationToken::new();
    let sampler = async {
        let mut max_rss = broker.rss();
        let mut first_close = None;
        let mut delivered: Vec<(Duration, u64)> = Vec::new();
        while !done.is_cancelled() {
            max_rss = max_rss.max(broker.rss());
            if first_close.is_none() {
                delivered.push((started.elapsed(), receivers.healthy_totals().0));
                if broker.slow_closes().await.unwrap_or(0) > closes_before {
                    first_close = Some(started.elapsed());
                }
            }
            tokio::select! {
                _ = done.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        (max_rss, first_close, rate_between(&delivered, cfg.warmup))
    };
    let measured = async {
        let phase = fanout::measure(source, receivers, None, cfg).await;
        done.cancel();
        phase
    };
    let ((max_rss, first_close_after, attached_rate), phase) = tokio::join!(sampler, measured);
    let phase = phase?;
    let elapsed = started.elapsed();
    let cpu = procfs::process_cpu(broker.pid)
        .unwrap_or_default()
        .saturating_sub(cpu_before);
    let slow_closes = broker.slow_closes().await.unwrap_or(0) - closes_before;
    Ok(FanoutUnderWatch {
        phase,
        max_rss,
        broker_core_share: cpu.as_secs_f64() / elapsed.as_secs_f64(),
        slow_closes,
        first_close_after,
        rate_while_attached: first_close_after.and(attached_rate),
    })
}

/// Deliveries/s between the first sample after `from` and the last sample,
/// if they are at least half a second apart.
fn rate_between(samples: &[(Duration, u64)], from: Duration) -> Option<f64> {
    let (t0, n0) = *samples.iter().find(|(t, _)| *t >= from)?;
    let (t1, n1) = *samples.last()?;
    let span = t1.checked_sub(t0)?;
    (span >= Duration::from_millis(500)).then(|| (n1 - n0) as f64 / span.as_secs_f64())
}

/// The memory scenario: many clients, almost all of them never
/// reading, and many small events. Before the queues' slots counted against
/// `queue_total_bytes`, 980 stalled clients × 50,000 events of 1 KiB held
/// 1,176 MiB against a 256 MiB budget.
pub struct ManyStalled {
    pub readers: usize,
    pub stalled: usize,
    pub frame_bytes: usize,
    /// Events the source offered (per sink: the broker's one connection).
    pub events: u64,
    /// `limits.queue_total_bytes` of the broker child (its default).
    pub budget: u64,
    pub idle_rss: u64,
    pub max_rss: u64,
    /// After the stalled clients were closed and the readers had drained.
    pub rss_after_cut: u64,
    /// Closes beyond the stalled clients: readers cut too.
    pub slow_closes: u64,
}

/// Frame size of [`many_stalled`], as in the issue.
const MANY_STALLED_FRAME_BYTES: usize = 1024;

pub async fn many_stalled(cfg: &Config, binary: &Path) -> Result<ManyStalled, String> {
    let total = cfg.idle_clients.max(2);
    let readers = (total / 50).clamp(1, 20);
    let stalled = total - readers;
    let (events, offer_for) = if cfg.smoke {
        (2_000u64, Duration::from_millis(500))
    } else {
        (50_000u64, Duration::from_secs(5))
    };
    let receivers = Receivers::new(readers, stalled);
    let (mut source, addr) =
        Source::gateway(1, receivers.clone(), cfg.window, MANY_STALLED_FRAME_BYTES)
            .map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("clawmux.sock");
    let log: PathBuf = dir.path().join("broker.log");
    let broker = BrokerChild::spawn(binary, &socket, &format!("ws://{addr}"), &log).await?;
    let result = async {
        tokio::time::sleep(SETTLE).await;
        let idle_rss = broker.rss();
        let open = || UnixStream::connect(socket.clone());
        let mut tasks = fanout::open_ws_clients(readers, 0, open, None, &receivers, None).await?;
        let stall = CancellationToken::new();
        for chunk_start in (0..stalled).step_by(100) {
            let count = 100.min(stalled - chunk_start);
            tasks.extend(
                fanout::open_ws_clients(
                    count,
                    readers + chunk_start,
                    open,
                    None,
                    &receivers,
                    Some(stall.clone()),
                )
                .await?,
            );
        }
        let n = total as u64;
        broker
            .wait_until(Duration::from_secs(20), |h| h["clients"] == n)
            .await?;
        let closes_before = broker.slow_closes().await.unwrap_or(0);
        source.start(crate::source::Offer {
            rate: Some(events as f64 / offer_for.as_secs_f64()),
            duration: offer_for,
        });
        let mut max_rss = broker.rss();
        let offered = loop {
            tokio::select! {
                done = source.finish() => break done.map_err(|e| format!("source: {e}"))?,
                _ = tokio::time::sleep(Duration::from_millis(50)) => {
                    max_rss = max_rss.max(broker.rss());
                }
            }
        };
        // The stalled clients are closed by the budget or, at the latest,
        // after `slow_grace` (10 s) without progress.
        let r = readers as u64;
        let settled = async {
            loop {
                max_rss = max_rss.max(broker.rss());
                if broker
                    .healthz()
                    .await
                    .is_some_and(|h| h["clients"].as_u64().is_some_and(|n| n <= r))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), settled)
            .await
            .map_err(|_| "the stalled clients were not closed within 30 s".to_owned())?;
        tokio::time::sleep(SETTLE).await;
        let rss_after_cut = broker.rss();
        let slow_closes = broker.slow_closes().await.unwrap_or(0) - closes_before;
        stall.cancel();
        for task in tasks {
            task.abort();
        }
        Ok(ManyStalled {
            readers,
            stalled,
            frame_bytes: MANY_STALLED_FRAME_BYTES,
            events: offered,
            budget: clawmux::config::Limits::default().queue_total_bytes as u64,
            idle_rss,
            max_rss,
            rss_after_cut,
            slow_closes,
        })
    }
    .await;
    finish(broker, source, &log, result).await
}

/// Stops the broker child and the source; on a failure, shows what the
/// broker logged.
async fn finish<T>(
    broker: BrokerChild,
    source: Source,
    log: &Path,
    result: Result<T, String>,
) -> Result<T, String> {
    broker.stop().await;
    drop(source);
    if result.is_err() {
        if let Ok(text) = std::fs::read_to_string(log) {
            eprintln!("broker child log:\n{text}");
        }
    }
    result
}
