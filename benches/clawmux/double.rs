//! Scenarios that use the library's gateway double (`clawmux_mock::MockGateway`)
//! itself: how fast `broadcast` can feed one reader (why the fan-out uses the
//! in-bench source instead), and scenario 2, closed-loop `health` requests
//! through the broker, through a bare relay and straight to the double.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clawmux_mock::{MockConfig, MockGateway};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio::net::{TcpStream, UnixStream};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::clients::{self, Receivers, Ws};
use crate::fanout::{self, Phase, BENCH_TOKEN};
use crate::procfs::{CpuSnapshot, MachineCpu, BROKER_THREAD, CLIENTS_THREAD, GATEWAY_THREAD};
use crate::relay::Relay;
use crate::source::{now_ns, FrameEncoder, EVENT_NAME};
use crate::Config;

/// The double on a thread of its own (a current-thread runtime), so its CPU
/// time is the `bench-gw` thread's.
pub struct MockThread {
    pub gw: MockGateway,
    pub handle: Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockThread {
    pub fn start() -> Result<MockThread, String> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(GATEWAY_THREAD.into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                rt.block_on(async move {
                    let cfg = MockConfig {
                        token: Some(BENCH_TOKEN.into()),
                        ..MockConfig::default()
                    };
                    match MockGateway::start(cfg).await {
                        Ok(gw) => {
                            let _ = ready_tx.send(Ok((gw.clone(), Handle::current())));
                            let _ = stop_rx.await;
                            drop(gw); // the last clone: the double drops every socket
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                        }
                    }
                });
            })
            .map_err(|e| e.to_string())?;
        let (gw, handle) = ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|e| format!("the gateway double did not start: {e}"))??;
        Ok(MockThread {
            gw,
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for MockThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `MockGateway::broadcast` as fast as one direct reader takes it (events
/// built as `serde_json::Value`, as tests do), under the same window.
pub async fn broadcast_rate(cfg: &Config) -> Result<Phase, String> {
    let mock = MockThread::start()?;
    let receivers = Receivers::new(1, 0);
    let addr = mock.gw.addr();
    let readers = fanout::open_ws_clients(
        1,
        0,
        move || TcpStream::connect(addr),
        Some(BENCH_TOKEN),
        &receivers,
        None,
    )
    .await?;
    let pad = "x".repeat(
        cfg.frame_bytes
            .saturating_sub(FrameEncoder::new(0).json(0, 100_000).len()),
    );
    let gw = mock.gw.clone();
    let (window, duration) = (cfg.window, cfg.warmup + cfg.measure);
    let loop_receivers = receivers.clone();
    let broadcasting = mock.handle.spawn(async move {
        let start = Instant::now();
        let mut emitted = 0u64;
        while start.elapsed() < duration {
            let ahead = emitted.saturating_sub(loop_receivers.slowest_healthy());
            let n = 64.min(window.saturating_sub(ahead));
            if n == 0 {
                tokio::time::sleep(Duration::from_micros(100)).await;
                continue;
            }
            for _ in 0..n {
                let t = format!("{:020}", now_ns());
                gw.broadcast(EVENT_NAME, json!({ "t": t, "text": pad }));
            }
            emitted += n;
            // The double's writer task runs on this thread too.
            tokio::task::yield_now().await;
        }
    });
    let phase = sample_window(&receivers, cfg).await;
    broadcasting.await.map_err(|e| e.to_string())?;
    drop(mock);
    for reader in readers {
        reader.abort();
    }
    Ok(phase)
}

/// Waits out the warmup, then measures one window of what `receivers` count.
async fn sample_window(receivers: &Receivers, cfg: &Config) -> Phase {
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
    Phase {
        window,
        deliveries: n1 - n0,
        bytes: b1 - b0,
        latency: receivers.close_window(),
        gateway_cpu: cpu1.since(&cpu0, GATEWAY_THREAD),
        broker_cpu: cpu1.since(&cpu0, BROKER_THREAD),
        clients_cpu: cpu1.since(&cpu0, CLIENTS_THREAD),
        others,
    }
}

/// Scenario 2's figures for one path: `deliveries` are round trips and
/// `latency` their round-trip times.
pub struct Requests {
    pub path: RequestPath,
    pub clients: usize,
    pub phase: Phase,
    pub errors: u64,
}

/// The per-client request rate the bench's broker allows: far above what
/// one closed-loop client reaches.
const REQUEST_RATE: u32 = 100_000_000;

/// The paths of the requests scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestPath {
    /// Over the broker's unix socket; the broker holds one upstream connection.
    Broker,
    /// Over the bare relay's unix socket (`relay.rs`): the same bytes, untouched.
    Relay,
    /// Loopback TCP straight to the double.
    Direct,
}

impl RequestPath {
    pub fn name(self) -> &'static str {
        match self {
            RequestPath::Broker => "broker",
            RequestPath::Relay => "bare relay",
            RequestPath::Direct => "direct (TCP)",
        }
    }
}

/// `clients` clients, each with one `health` request in flight at a time,
/// over `path`. The broker and the relay run on `broker_rt`, so the phase's
/// `broker_cpu` is the forwarder's CPU time in the window.
pub async fn requests(
    cfg: &Config,
    broker_rt: Handle,
    path: RequestPath,
    clients: usize,
) -> Result<Requests, String> {
    let mock = MockThread::start()?;
    let n = clients.max(1);
    let receivers = Receivers::new(n, 0);
    let errors = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("clawmux.sock");
    let mut broker = None;
    let mut relay = None;
    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    let spawn = |slot: usize| (receivers.clone(), stop.clone(), errors.clone(), slot);
    match path {
        RequestPath::Broker => {
            let mut settings = fanout::broker_settings(&socket, &mock.gw.url());
            // A closed loop on loopback runs past the default per-client
            // rate (10,000/s), and a refused request is not a round trip:
            // the bench measures forwarding, so no client is held back.
            settings.limits.request_rate = REQUEST_RATE;
            settings.limits.request_burst = REQUEST_RATE;
            broker = Some(fanout::start_broker(&broker_rt, settings).await?);
        }
        RequestPath::Relay => {
            relay = Some(Relay::start(&broker_rt, &socket, mock.gw.addr()).await?);
        }
        RequestPath::Direct => {}
    }
    for slot in 0..n {
        let (r, s, e, slot) = spawn(slot);
        if path == RequestPath::Direct {
            let tcp = TcpStream::connect(mock.gw.addr())
                .await
                .map_err(|e| e.to_string())?;
            tcp.set_nodelay(true).map_err(|e| e.to_string())?;
            let ws = clients::handshake(tcp, Some(BENCH_TOKEN)).await?;
            tasks.push(tokio::spawn(closed_loop(ws, r, slot, s, e)));
        } else {
            let stream = UnixStream::connect(&socket)
                .await
                .map_err(|e| e.to_string())?;
            // Through the relay the client talks to the double itself, so it
            // brings the token; the broker injects its own upstream.
            let token = (path == RequestPath::Relay).then_some(BENCH_TOKEN);
            let ws = clients::handshake(stream, token).await?;
            tasks.push(tokio::spawn(closed_loop(ws, r, slot, s, e)));
        }
    }
    let phase = sample_window(&receivers, cfg).await;
    stop.cancel();
    for task in tasks {
        let abort = task.abort_handle();
        if tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
    if let Some(broker) = broker {
        let _ = broker_rt
            .spawn(broker.shutdown(Duration::from_secs(5)))
            .await;
    }
    if let Some(relay) = relay {
        relay.stop().await;
    }
    drop(mock);
    Ok(Requests {
        path,
        clients: n,
        phase,
        errors: errors.load(Ordering::Relaxed),
    })
}

impl Requests {
    /// CPU time of the forwarder (broker or relay) per round trip, in µs.
    pub fn forwarder_cpu_per_request(&self) -> f64 {
        self.phase.broker_cpu.as_secs_f64() * 1e6 / self.phase.deliveries.max(1) as f64
    }
}

/// The fields of an answer the loop looks at.
#[derive(serde::Deserialize)]
struct Answer<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    #[serde(default)]
    id: Option<&'a str>,
    #[serde(default)]
    ok: bool,
}

/// One request in flight at a time until `stop`; a round trip is counted
/// when its answer arrives.
async fn closed_loop<S>(
    mut ws: Ws<S>,
    receivers: Receivers,
    slot: usize,
    stop: CancellationToken,
    errors: Arc<AtomicU64>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let stat = Arc::clone(&receivers.all()[slot]);
    let mut n = 0u64;
    while !stop.is_cancelled() {
        n += 1;
        let id = format!("r{n}");
        let sent = now_ns();
        let req = format!(r#"{{"type":"req","id":"{id}","method":"health"}}"#);
        if ws.send(Message::text(req)).await.is_err() {
            return;
        }
        loop {
            let Some(Ok(msg)) = ws.next().await else {
                return;
            };
            let Message::Text(text) = msg else { continue };
            let Ok(answer) = serde_json::from_str::<Answer>(text.as_str()) else {
                continue;
            };
            if answer.kind == "res" && answer.id == Some(id.as_str()) {
                if !answer.ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
        }
        stat.count(now_ns().saturating_sub(sent), 0, receivers.measuring());
    }
}
