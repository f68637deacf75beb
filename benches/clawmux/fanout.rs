//! Scenario 1: one source → N clients, through the broker, straight from the
//! gateway over TCP (the direct baseline), and over bare unix sockets (the
//! ceiling). Every path runs with the same source, frames, readers' counting
//! and window, so the figures differ only by the path. The broker path is
//! also measured with its upstream over `wss://` (the same source behind TLS).

use std::path::Path;
use std::time::{Duration, Instant};

use clawmux::config::Secret;
use clawmux::{RunningBroker, Settings};
use hdrhistogram::Histogram;
use tokio::net::{TcpStream, UnixStream};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::clients::{self, Receivers};
use crate::procfs::{CpuSnapshot, MachineCpu, BROKER_THREAD, CLIENTS_THREAD, GATEWAY_THREAD};
use crate::source::{GatewayTls, Offer, Source};
use crate::Config;

/// The token the in-bench gateways expect and the broker injects.
pub const BENCH_TOKEN: &str = "bench-token";

/// One measured window.
#[derive(Debug, Clone)]
pub struct Phase {
    pub window: Duration,
    /// Events the healthy readers received in the window, all readers together.
    pub deliveries: u64,
    pub bytes: u64,
    pub latency: Histogram<u64>,
    /// CPU time in the window by component.
    pub gateway_cpu: Duration,
    pub broker_cpu: Duration,
    pub clients_cpu: Duration,
    /// Cores' worth of CPU other processes on the machine used in the window
    /// (a phase disturbed by someone else's build shows here).
    pub others: f64,
}

impl Phase {
    pub fn per_second(&self) -> f64 {
        self.deliveries as f64 / self.window.as_secs_f64()
    }

    pub fn mb_per_second(&self) -> f64 {
        self.bytes as f64 / self.window.as_secs_f64() / 1e6
    }

    /// Share of one core a component used in the window.
    pub fn core_share(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / self.window.as_secs_f64()
    }
}

/// Offers `rate` (None = max) for warmup + measure and measures the second part.
pub async fn measure(
    source: &mut Source,
    receivers: &Receivers,
    rate: Option<f64>,
    cfg: &Config,
) -> Result<Phase, String> {
    source.start(Offer {
        rate,
        duration: cfg.warmup + cfg.measure,
    });
    tokio::time::sleep(cfg.warmup).await;
    let (n0, b0) = receivers.healthy_totals();
    let cpu0 = CpuSnapshot::take();
    let machine0 = MachineCpu::take();
    let t0 = Instant::now();
    receivers.open_window();
    tokio::time::sleep(cfg.measure).await;
    let (n1, b1) = receivers.healthy_totals();
    let cpu1 = CpuSnapshot::take();
    let others = MachineCpu::take().others_since(&machine0);
    let window = t0.elapsed();
    let latency = receivers.close_window();
    source.finish().await.map_err(|e| format!("source: {e}"))?;
    Ok(Phase {
        window,
        deliveries: n1 - n0,
        bytes: b1 - b0,
        latency,
        gateway_cpu: cpu1.since(&cpu0, GATEWAY_THREAD),
        broker_cpu: cpu1.since(&cpu0, BROKER_THREAD),
        clients_cpu: cpu1.since(&cpu0, CLIENTS_THREAD),
        others,
    })
}

/// One path's figures at every offered rate, in the order of the rates.
pub struct PathPhases {
    pub name: &'static str,
    pub upstream_connections: usize,
    pub phases: Vec<Phase>,
}

/// A path under test: its source, readers and (for the broker) the broker.
pub struct PathRun {
    source: Source,
    receivers: Receivers,
    readers: Vec<JoinHandle<()>>,
    broker: Option<RunningBroker>,
    broker_rt: Handle,
    _dir: Option<tempfile::TempDir>,
    pub name: &'static str,
    pub upstream_connections: usize,
}

impl PathRun {
    pub async fn measure(&mut self, rate: Option<f64>, cfg: &Config) -> Result<Phase, String> {
        measure(&mut self.source, &self.receivers, rate, cfg).await
    }

    /// Stops the broker (if any) and the source; readers end with their sockets.
    pub async fn stop(self) {
        if let Some(broker) = self.broker {
            let _ = self
                .broker_rt
                .spawn(broker.shutdown(Duration::from_secs(5)))
                .await;
        }
        drop(self.source);
        for reader in self.readers {
            let abort = reader.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), reader)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }
}

/// The ceiling: frames written to `clients` unix sockets, read raw.
pub fn ceiling(cfg: &Config, broker_rt: Handle) -> Result<PathRun, String> {
    let receivers = Receivers::new(cfg.clients, 0);
    let mut writers = Vec::new();
    let mut readers = Vec::new();
    for slot in 0..cfg.clients {
        let (w, r) = std::os::unix::net::UnixStream::pair().map_err(|e| e.to_string())?;
        r.set_nonblocking(true).map_err(|e| e.to_string())?;
        let r = UnixStream::from_std(r).map_err(|e| e.to_string())?;
        readers.push(tokio::spawn(clients::read_raw(r, receivers.clone(), slot)));
        writers.push(w);
    }
    let source = Source::raw(writers, receivers.clone(), cfg.window, cfg.frame_bytes);
    Ok(PathRun {
        source,
        receivers,
        readers,
        broker: None,
        broker_rt,
        _dir: None,
        name: "ceiling (raw unix)",
        upstream_connections: 0,
    })
}

/// Broker settings for a bench run: defaults, except no device identity
/// (no state dir is written) and the bench gateway's token.
pub fn broker_settings(socket: &Path, gateway: &str) -> Settings {
    let mut settings = Settings::new(socket);
    settings.gateway_url = gateway.to_owned();
    settings.token = Some(Secret::new(BENCH_TOKEN));
    settings.upstream.device_identity = None;
    settings
}

/// Starts a broker on `broker_rt` (its own threads, so its CPU time is its own).
pub async fn start_broker(broker_rt: &Handle, settings: Settings) -> Result<RunningBroker, String> {
    broker_rt
        .spawn(RunningBroker::start(settings))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("broker: {e}"))
}

/// Opens `count` WebSocket clients with `open` (in parallel) and gives each
/// its reader task, or stalls it until `stall` is cancelled when given.
pub async fn open_ws_clients<S, F, Fut>(
    count: usize,
    first_slot: usize,
    open: F,
    token: Option<&'static str>,
    receivers: &Receivers,
    stall: Option<CancellationToken>,
) -> Result<Vec<JoinHandle<()>>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = std::io::Result<S>> + Send + 'static,
{
    let handshakes: Vec<_> = (0..count)
        .map(|_| {
            let opening = open();
            tokio::spawn(async move {
                let stream = opening.await.map_err(|e| format!("connect: {e}"))?;
                clients::handshake(stream, token).await
            })
        })
        .collect();
    let mut tasks = Vec::with_capacity(count);
    for (i, handshake) in handshakes.into_iter().enumerate() {
        let ws = handshake.await.map_err(|e| e.to_string())??;
        let task = match &stall {
            Some(until) => tokio::spawn(clients::stall(ws, until.clone())),
            None => tokio::spawn(clients::read_ws(ws, receivers.clone(), first_slot + i)),
        };
        tasks.push(task);
    }
    Ok(tasks)
}

/// Through the broker: the gateway's one connection is the broker's.
pub async fn broker(cfg: &Config, broker_rt: Handle) -> Result<PathRun, String> {
    broker_over(cfg, broker_rt, None).await
}

/// The same path with the broker's upstream over `wss://` (TLS on
/// loopback), the certificate pinned as `--tls-fingerprint` pins it.
pub async fn broker_wss(
    cfg: &Config,
    broker_rt: Handle,
    tls: &GatewayTls,
) -> Result<PathRun, String> {
    broker_over(cfg, broker_rt, Some(tls)).await
}

async fn broker_over(
    cfg: &Config,
    broker_rt: Handle,
    tls: Option<&GatewayTls>,
) -> Result<PathRun, String> {
    let receivers = Receivers::new(cfg.clients, 0);
    let (source, addr) = match tls {
        None => Source::gateway(1, receivers.clone(), cfg.window, cfg.frame_bytes),
        Some(tls) => Source::gateway_tls(1, tls, receivers.clone(), cfg.window, cfg.frame_bytes),
    }
    .map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("clawmux.sock");
    let scheme = if tls.is_some() { "wss" } else { "ws" };
    let mut settings = broker_settings(&socket, &format!("{scheme}://{addr}"));
    settings.tls.fingerprint = tls.map(|t| t.fingerprint.clone());
    let broker = start_broker(&broker_rt, settings).await?;
    let readers = open_ws_clients(
        cfg.clients,
        0,
        || UnixStream::connect(socket.clone()),
        None,
        &receivers,
        None,
    )
    .await?;
    Ok(PathRun {
        source,
        receivers,
        readers,
        broker: Some(broker),
        broker_rt,
        _dir: Some(dir),
        name: if tls.is_some() {
            "broker, wss:// upstream"
        } else {
            "broker"
        },
        upstream_connections: 1,
    })
}

/// The direct baseline: every client is its own gateway connection.
pub async fn direct(cfg: &Config, broker_rt: Handle) -> Result<PathRun, String> {
    let receivers = Receivers::new(cfg.clients, 0);
    let (source, addr) =
        Source::gateway(cfg.clients, receivers.clone(), cfg.window, cfg.frame_bytes)
            .map_err(|e| e.to_string())?;
    let readers = open_ws_clients(
        cfg.clients,
        0,
        move || async move {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            Ok(tcp)
        },
        Some(BENCH_TOKEN),
        &receivers,
        None,
    )
    .await?;
    Ok(PathRun {
        source,
        receivers,
        readers,
        broker: None,
        broker_rt,
        _dir: None,
        name: "direct (TCP)",
        upstream_connections: cfg.clients,
    })
}
