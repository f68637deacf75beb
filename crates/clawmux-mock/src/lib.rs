//! `clawmux-mock`: an in-process test double of the OpenClaw Gateway.
//!
//! It speaks the gateway's WebSocket protocol (`shared/docs/gateway-protocol.md`)
//! on a loopback TCP port (or a unix socket), faithfully enough that the broker cannot tell it
//! from the real thing for the behaviour it depends on: the challenge/connect
//! handshake with its exact error frames and close codes, per-connection
//! `seq`, `tick`s, `stateVersion`, scope checks, scripted `chat`/`agent` runs,
//! session subscriptions, and the fault modes of a real gateway (startup
//! `UNAVAILABLE`/1013, `shutdown`/1012, slow-consumer 1008, crashes, silence).
//!
//! It serves integration tests, `clawmux mock-gateway` and `--demo` mode.
//!
//! Map of the module:
//! - [`faults`]: the fault-injection knobs ([`Faults`], [`Rejection`]).
//! - `schema`: the closed frame/`ConnectParams` schemas, Ajv-style errors.
//! - `handshake`: pure admission and device-proof rules (no I/O).
//! - `connection`: one reader and one writer task per WebSocket.
//! - `methods`: scope table and request handlers.
//! - `runs`: scripted agent runs, transcripts, demo and health loops.
//! - `state`: the shared registry behind [`MockGateway`].
//! - [`recording`], [`replay`]: the `clawmux record` format, and serving a
//!   recorded session instead of the double's own behaviour.
//! - [`provider`]: a mock OpenAI-compatible model provider, for a real gateway.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use clawmux_mock::{MockConfig, MockGateway};
//! let gw = MockGateway::start(MockConfig { token: Some("secret".into()), ..Default::default() }).await?;
//! println!("connect to {}", gw.url());
//! # Ok(()) }
//! ```

pub mod faults;
pub mod provider;
pub mod recording;
pub mod replay;

mod connection;
mod handshake;
mod methods;
mod origin;
mod runs;
mod schema;
mod state;

#[cfg(test)]
mod tests;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpSocket};
use tokio::task::JoinHandle;

pub use faults::{Faults, Rejection};
/// The TLS library the double serves `wss://` with, for tests that build a
/// [`MockConfig::tls`] by hand.
pub use tokio_rustls::rustls;

use state::{lock, Inner, Outbound};

/// How the double behaves; `Default` matches a real gateway's defaults.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// `Some(t)`: auth mode `token`; a connect must carry `auth.token == t`
    /// (or a device token this double minted, together with its device).
    /// `None`: auth mode `none`; any or no auth is accepted.
    pub token: Option<String>,
    /// The server's protocol version (hello-ok `protocol`); a connect is
    /// admitted when `minProtocol ≤ protocol ≤ maxProtocol`.
    pub protocol: u32,
    /// hello-ok `server.version`.
    pub server_version: String,
    /// A `tick` event is sent this often on every ready connection
    /// (hello-ok `policy.tickIntervalMs`).
    pub tick_interval_ms: u64,
    /// If set, a `health` event with a bumped `stateVersion.health` is
    /// broadcast this often (the real gateway refreshes every 60 s).
    pub health_interval_ms: Option<u64>,
    /// Largest frame accepted after hello (bigger ⇒ close 1009);
    /// hello-ok `policy.maxPayload`.
    pub max_payload: u64,
    /// Per-connection queued-bytes budget (hello-ok `policy.maxBufferedBytes`):
    /// over it, droppable events are skipped (consuming a `seq`) and any
    /// other event closes the socket with 1008 "slow consumer".
    pub max_buffered_bytes: u64,
    /// A socket without a successful connect after this long is closed with
    /// 1000 and no reason.
    pub handshake_timeout: Duration,
    /// Verify the Ed25519 device proof (id, nonce, freshness, v3/v2
    /// signature) when a `device` block is present.
    pub verify_device: bool,
    /// Reject device-less connects with `NOT_PAIRED` "device identity required".
    pub require_device: bool,
    /// Play a scripted agent run on `agent:main:main` to all ready
    /// connections every `demo_interval`, so a newcomer sees traffic.
    pub demo: bool,
    /// How often demo mode starts a run (default 3 s).
    pub demo_interval: Duration,
    /// Pause between the events of a scripted run (deltas stream at this pace).
    pub run_step_delay: Duration,
    /// Methods this gateway does not have: left out of
    /// `hello-ok.features.methods` and answered "unknown method" (a real
    /// 2026.9.6 gateway has no `sessions.unsubscribe`).
    pub without_methods: Vec<String>,
    /// Extra fields for the `connect.challenge` payload (a newer gateway
    /// adds e.g. `capabilities`; clients must pass them on or ignore them).
    pub challenge_extra: Option<Value>,
    /// Serve this recorded session (hello-ok, events, answers) instead of
    /// the double's own behaviour (see [`replay`]).
    pub replay: Option<Arc<replay::Replay>>,
    /// Serve `wss://` with this TLS configuration (see [`tls_server_config`])
    /// instead of plaintext, as a gateway with `gateway.tls.enabled` does.
    /// A client that fails the TLS handshake never reaches the WebSocket
    /// and is not counted in [`MockGateway::total_connections`].
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// `SO_RCVBUF` of every accepted TCP socket (set on the listener, so
    /// the kernel's autotuning is off from the first byte): with
    /// [`Faults::stop_reading`], how much a client can write before its
    /// socket is full. `None`: the kernel's own sizing.
    pub recv_buffer_bytes: Option<u32>,
}

/// A TLS server configuration from a PEM certificate chain (leaf first) and
/// a PEM private key, TLS 1.2 and 1.3 (the real gateway requires 1.3).
pub fn tls_server_config(
    cert_chain_pem: &str,
    key_pem: &str,
) -> io::Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let invalid =
        |e: &dyn std::fmt::Display| io::Error::new(io::ErrorKind::InvalidInput, e.to_string());
    let chain = CertificateDer::pem_slice_iter(cert_chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(&e))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| invalid(&e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(&e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| invalid(&e))?;
    Ok(Arc::new(config))
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            token: None,
            protocol: 4,
            server_version: "2026.9.6-mock".into(),
            tick_interval_ms: 30_000,
            health_interval_ms: None,
            max_payload: 26_214_400,
            max_buffered_bytes: 52_428_800,
            handshake_timeout: Duration::from_secs(10),
            verify_device: true,
            require_device: false,
            demo: false,
            demo_interval: Duration::from_secs(3),
            run_step_delay: Duration::from_millis(20),
            without_methods: Vec::new(),
            challenge_extra: None,
            replay: None,
            tls: None,
            recv_buffer_bytes: None,
        }
    }
}

/// Counters for tests and the `mock-gateway` command's status line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MockStats {
    /// WebSocket connections currently open (any state).
    pub open_connections: usize,
    /// Open connections past hello-ok.
    pub ready_connections: usize,
    /// WebSocket connections accepted since start.
    pub total_connections: usize,
    /// `connect` requests received.
    pub connects: usize,
    /// Post-handshake requests received.
    pub requests: usize,
}

/// Stops the background tasks when the last [`MockGateway`] clone goes away.
#[derive(Debug)]
struct Lifecycle {
    inner: Arc<Inner>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Lifecycle {
    /// Stops listening and background loops; returns their handles.
    fn stop_tasks(&self) -> Vec<JoinHandle<()>> {
        self.inner.shutdown.send_replace(true);
        let tasks = std::mem::take(&mut *lock(&self.tasks));
        for task in &tasks {
            task.abort();
        }
        tasks
    }
}

impl Drop for Lifecycle {
    fn drop(&mut self) {
        self.stop_tasks();
        kill_all(&self.inner);
    }
}

/// Drops every connection without a close frame. All entries leave the
/// registry at once, so no departure notice reaches a socket that is about
/// to be cut (a crash says nothing).
fn kill_all(inner: &Inner) {
    let removed: Vec<state::ConnEntry> = lock(&inner.conns).drain().map(|(_, c)| c).collect();
    let ready = removed.iter().filter(|c| c.session.is_some()).count();
    for _ in 0..ready {
        inner.bump_presence();
    }
    for entry in &removed {
        entry.ctl.kill.notify_one();
    }
    inner.notify_changed();
}

/// A running gateway double. Clones share it; it shuts down when the last
/// clone is dropped or on [`MockGateway::stop`].
#[derive(Clone, Debug)]
pub struct MockGateway {
    inner: Arc<Inner>,
    addr: SocketAddr,
    lifecycle: Arc<Lifecycle>,
}

impl MockGateway {
    /// Starts the double on an ephemeral port of 127.0.0.1.
    pub async fn start(cfg: MockConfig) -> io::Result<MockGateway> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), cfg).await
    }

    /// Starts the double on `addr`, which must be a loopback address (the
    /// double has no authentication worth exposing). `SO_REUSEADDR` is set so
    /// a test can restart a gateway on the port it just stopped.
    pub async fn start_on(addr: SocketAddr, cfg: MockConfig) -> io::Result<MockGateway> {
        if !addr.ip().is_loopback() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("mock gateway refuses to listen on non-loopback address {addr}"),
            ));
        }
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        if let Some(bytes) = cfg.recv_buffer_bytes {
            socket.set_recv_buffer_size(bytes)?;
        }
        socket.bind(addr)?;
        let listener = socket.listen(1024)?;
        let addr = listener.local_addr()?;
        tracing::info!(%addr, "mock gateway listening");
        Ok(Self::launch(cfg, addr, |inner| {
            tokio::spawn(accept_loop(inner, listener))
        }))
    }

    /// Starts the double on a unix socket at `path` (created 0600 by the
    /// umask-free bind into a directory the caller keeps private): the
    /// demo's gateway, so `serve --demo` listens on no TCP port. `addr()` is
    /// then `127.0.0.1:0` and `url()` `ws://localhost`; dial the path.
    pub async fn start_unix(path: &std::path::Path, cfg: MockConfig) -> io::Result<MockGateway> {
        let listener = tokio::net::UnixListener::bind(path)?;
        tracing::info!(path = %path.display(), "mock gateway listening on a unix socket");
        let addr = SocketAddr::from(([127, 0, 0, 1], 0));
        Ok(Self::launch(cfg, addr, |inner| {
            tokio::spawn(accept_unix_loop(inner, listener))
        }))
    }

    /// Starts the shared state, the accept task and the demo/health loops.
    fn launch(
        cfg: MockConfig,
        addr: SocketAddr,
        accept: impl FnOnce(Arc<Inner>) -> JoinHandle<()>,
    ) -> MockGateway {
        let demo = cfg.demo;
        let health_every = cfg
            .health_interval_ms
            .map(|ms| Duration::from_millis(ms.max(1)));
        let inner = Inner::new(cfg);
        let mut tasks = vec![accept(inner.clone())];
        if demo {
            tasks.push(tokio::spawn(runs::demo_loop(inner.clone())));
        }
        if let Some(every) = health_every {
            tasks.push(tokio::spawn(runs::health_loop(inner.clone(), every)));
        }
        let lifecycle = Arc::new(Lifecycle {
            inner: inner.clone(),
            tasks: Mutex::new(tasks),
        });
        MockGateway {
            inner,
            addr,
            lifecycle,
        }
    }

    /// The bound address (with the real port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `ws://127.0.0.1:PORT` (or `ws://[::1]:PORT`); `wss://` with [`MockConfig::tls`].
    pub fn url(&self) -> String {
        let scheme = if self.inner.cfg.tls.is_some() {
            "wss"
        } else {
            "ws"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// The configuration the double runs with.
    pub fn config(&self) -> &MockConfig {
        &self.inner.cfg
    }

    /// WebSocket connections currently open, in any state.
    pub fn open_connections(&self) -> usize {
        self.inner.counts().0
    }

    /// WebSocket connections accepted since start.
    pub fn total_connections(&self) -> usize {
        self.inner.total_connections.load(Ordering::Acquire)
    }

    /// Connections currently open and past hello-ok.
    pub fn ready_connections(&self) -> usize {
        self.inner.counts().1
    }

    /// Indices (as in [`requests`](Self::requests)) of the ready connections.
    pub fn ready_connection_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = lock(&self.inner.conns)
            .values()
            .filter(|c| c.is_ready())
            .map(|c| c.index)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// All counters at once.
    pub fn stats(&self) -> MockStats {
        let (open, ready) = self.inner.counts();
        let records = lock(&self.inner.records);
        MockStats {
            open_connections: open,
            ready_connections: ready,
            total_connections: self.total_connections(),
            connects: records.connects.len(),
            requests: records.requests.len(),
        }
    }

    /// Waits until `pred` holds, re-checking on every state change (no
    /// polling). Returns false on timeout.
    async fn wait_until(&self, timeout: Duration, pred: impl Fn() -> bool) -> bool {
        let mut changes = self.inner.changed.subscribe();
        let wait = async {
            loop {
                changes.borrow_and_update();
                if pred() {
                    return true;
                }
                if changes.changed().await.is_err() {
                    return pred();
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }

    /// Waits until at least `n` connections are ready; false on timeout.
    pub async fn wait_ready_connections(&self, n: usize, timeout: Duration) -> bool {
        self.wait_until(timeout, || self.ready_connections() >= n)
            .await
    }

    /// Waits until no connection is open at all; false on timeout.
    pub async fn wait_no_connections(&self, timeout: Duration) -> bool {
        self.wait_until(timeout, || self.open_connections() == 0)
            .await
    }

    /// The `params` of every handshake `connect` received, in order (also
    /// rejected ones; a repeated `connect` after hello is only in
    /// [`requests`](Self::requests)).
    pub fn connects(&self) -> Vec<Value> {
        lock(&self.inner.records).connects.clone()
    }

    /// The `Origin` header of the connection each of [`connects`](Self::connects)
    /// came on (`None`: it sent none), in the same order.
    pub fn connect_origins(&self) -> Vec<Option<String>> {
        lock(&self.inner.records).connect_origins.clone()
    }

    /// Every valid post-handshake `req` frame, with the index of the
    /// connection it came on (0-based, in accept order; see
    /// [`ready_connection_ids`](Self::ready_connection_ids)).
    pub fn requests(&self) -> Vec<(u64, Value)> {
        lock(&self.inner.records).requests.clone()
    }

    fn find_request(&self, method: &str) -> Option<Value> {
        lock(&self.inner.records)
            .requests
            .iter()
            .find(|(_, r)| r["method"] == method)
            .map(|(_, r)| r.clone())
    }

    /// Waits for the first request with `method` ever received and returns
    /// its whole frame.
    pub async fn wait_request(&self, method: &str, timeout: Duration) -> Option<Value> {
        if self
            .wait_until(timeout, || self.find_request(method).is_some())
            .await
        {
            self.find_request(method)
        } else {
            None
        }
    }

    /// Sends an event to every ready connection, stamped with that
    /// connection's next `seq` (scope guards of §3.2 apply).
    pub fn broadcast(&self, event: &str, payload: Value) {
        self.inner.broadcast(event, &payload, None, false);
    }

    /// Like [`broadcast`](Self::broadcast), with `stateVersion` attached;
    /// `presence` bumps the presence counter and `health` the health counter.
    pub fn broadcast_with_state_version(&self, event: &str, payload: Value) {
        let sv = match event {
            "presence" => self.inner.bump_presence(),
            "health" => self.inner.bump_health(),
            _ => self.inner.state_version(),
        };
        if event == "health" {
            *lock(&self.inner.last_health) = Some(payload.clone());
        }
        self.inner.broadcast(event, &payload, Some(sv), false);
    }

    /// Sends a frame exactly as given to every ready connection (e.g. an
    /// event with a malformed `seq`, or one larger than a client allows).
    pub fn send_raw(&self, frame: &str) {
        for entry in lock(&self.inner.conns).values().filter(|c| c.is_ready()) {
            entry.send(state::Outbound::Frame(frame.to_owned()), frame.len());
        }
    }

    /// Starts a text message on every ready connection and never finishes
    /// it: the first fragment (no FIN), then nothing more of it (a gateway
    /// stalled inside a message).
    pub fn send_fragment_start(&self, text: &str) {
        for entry in lock(&self.inner.conns).values().filter(|c| c.is_ready()) {
            entry.send(state::Outbound::FragmentStart(text.to_owned()), 0);
        }
    }

    /// Ends the message [`MockGateway::send_fragment_start`] began, on
    /// every ready connection: its last fragment.
    pub fn send_fragment_end(&self, text: &str) {
        for entry in lock(&self.inner.conns).values().filter(|c| c.is_ready()) {
            entry.send(state::Outbound::FragmentEnd(text.to_owned()), 0);
        }
    }

    /// The connection-scoped subscriptions of each ready connection:
    /// (`sessions.subscribe` flag, `sessions.messages.subscribe` keys, sorted).
    pub fn subscriptions(&self) -> Vec<(bool, Vec<String>)> {
        lock(&self.inner.conns)
            .values()
            .filter(|c| c.is_ready())
            .map(|c| {
                let mut keys: Vec<String> = c.message_keys.iter().cloned().collect();
                keys.sort();
                (c.sessions_subscribed, keys)
            })
            .collect()
    }

    /// Sends `session.message` to the `sessions.subscribe` subscribers and
    /// to the `sessions.messages.subscribe` subscribers of `key`.
    pub fn emit_session_message(&self, key: &str, payload: Value) {
        runs::emit_session_message(&self.inner, key, &payload);
    }

    /// Sends `sessions.changed` to the `sessions.subscribe` subscribers.
    /// The reasons a real gateway (2026.9.6) sends to every connection with
    /// read access instead: `cron-bindings-loaded`, `cron-binding`,
    /// `runner-availability`, `activity-summary`.
    pub fn emit_sessions_changed(&self, payload: Value) {
        const TO_EVERYONE: [&str; 4] = [
            "cron-bindings-loaded",
            "cron-binding",
            "runner-availability",
            "activity-summary",
        ];
        let everyone = payload
            .get("reason")
            .and_then(Value::as_str)
            .is_some_and(|r| TO_EVERYONE.contains(&r));
        self.inner
            .broadcast_filtered("sessions.changed", &payload, None, false, |c| {
                everyone || c.sessions_subscribed
            });
    }

    /// Plays a scripted run on `session_key` replying `text`, as if some
    /// other client had started it; returns its `runId`.
    pub fn simulate_run(&self, session_key: &str, text: &str) -> String {
        runs::simulate_run(
            &self.inner,
            session_key,
            text,
            self.inner.cfg.run_step_delay,
        )
    }

    /// The transcript of `session_key` (canonicalized, `main` →
    /// `agent:main:main`) as `chat.history` would return it.
    pub fn chat_history(&self, session_key: &str) -> Vec<Value> {
        let key = runs::canonical_session_key(session_key);
        lock(&self.inner.chats)
            .history
            .get(&key)
            .cloned()
            .unwrap_or_default()
    }

    /// Replaces the fault settings.
    pub fn set_faults(&self, f: Faults) {
        *lock(&self.inner.faults) = f;
    }

    /// The current fault settings.
    pub fn faults(&self) -> Faults {
        self.inner.faults()
    }

    /// One-shot: the next event on every ready connection skips one `seq`.
    pub fn skip_seq(&self) {
        for entry in lock(&self.inner.conns)
            .values()
            .filter(|c| c.session.is_some())
        {
            entry.send(Outbound::SkipSeq, 0);
        }
    }

    /// Closes every open WebSocket with `code`/`reason`. Returns once the
    /// close frames are written (bounded wait); from then on those
    /// connections no longer count as ready, and each disappears from
    /// [`open_connections`](Self::open_connections) when its peer answers the
    /// close (or after a grace period).
    pub async fn close_all(&self, code: u16, reason: &str) {
        let reason = handshake::truncate_close_reason(reason);
        let ctls: Vec<Arc<state::ConnCtl>> = {
            let conns = lock(&self.inner.conns);
            conns.values().for_each(|c| c.close(code, &reason));
            conns.values().map(|c| c.ctl.clone()).collect()
        };
        // A connection that vanished (peer gone) never writes its frame, but
        // then its writer's queue is closed and the entry removed: also done.
        self.inner.notify_changed();
        let written = || {
            let conns = lock(&self.inner.conns);
            ctls.iter().all(|ctl| {
                ctl.close_sent.load(Ordering::Acquire)
                    || !conns.values().any(|c| Arc::ptr_eq(&c.ctl, ctl))
            })
        };
        if !self.wait_until(connection::CLOSE_GRACE, written).await {
            tracing::warn!("mock gateway: close frames not written in time (stuck peers?)");
        }
    }

    /// Closes one connection (its index as [`requests`](Self::requests)
    /// gives it) with `code`/`reason`; false when it is not open.
    pub fn close_connection(&self, index: u64, code: u16, reason: &str) -> bool {
        let reason = handshake::truncate_close_reason(reason);
        let found = {
            let conns = lock(&self.inner.conns);
            let conn = conns.values().find(|c| c.index == index);
            conn.inspect(|c| c.close(code, &reason)).is_some()
        };
        self.inner.notify_changed();
        found
    }

    /// The gateway's reaction to a client whose buffer overflowed: close
    /// with 1008 "slow consumer" (here: every connection).
    pub async fn slow_consumer_close(&self) {
        self.close_all(1008, "slow consumer").await;
    }

    /// A restart as the real gateway announces it: a `shutdown` event
    /// `{reason:"service restart", restartExpectedMs?}`, then close 1012.
    pub async fn restart_notice(&self, restart_expected_ms: Option<u64>) {
        self.announce_shutdown("service restart", restart_expected_ms);
        self.close_all(1012, "service restart").await;
    }

    fn announce_shutdown(&self, reason: &str, restart_expected_ms: Option<u64>) {
        let mut payload = json!({ "reason": reason });
        if let Some(ms) = restart_expected_ms {
            payload["restartExpectedMs"] = json!(ms);
        }
        self.inner.broadcast("shutdown", &payload, None, false);
    }

    /// A crash: every socket is dropped without a close frame (clients see
    /// EOF or a reset). The listener keeps accepting.
    pub fn drop_all(&self) {
        kill_all(&self.inner);
    }

    /// Stops listening (the port is free when this returns), then shuts down
    /// like a real gateway on SIGTERM: `shutdown` event, close 1012 "service
    /// restart", a bounded wait for the peers' close replies, and finally an
    /// abrupt drop of whatever is still open.
    pub async fn stop(self) {
        for task in self.lifecycle.stop_tasks() {
            let _ = task.await;
        }
        self.announce_shutdown("gateway stopping", None);
        self.close_all(1012, "service restart").await;
        self.wait_no_connections(connection::CLOSE_GRACE).await;
        kill_all(&self.inner);
    }
}

/// Accepts TCP connections until shutdown; each gets its own task.
async fn accept_unix_loop(inner: Arc<Inner>, listener: tokio::net::UnixListener) {
    let mut shutdown = inner.shutdown.subscribe();
    loop {
        tokio::select! {
            _ = state::until_shutdown(&mut shutdown) => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(connection::serve_io(inner.clone(), Box::new(stream)));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "mock gateway: accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let mut shutdown = inner.shutdown.subscribe();
    loop {
        tokio::select! {
            _ = state::until_shutdown(&mut shutdown) => return,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => match inner.cfg.tls.clone() {
                    None => {
                        tokio::spawn(connection::serve(inner.clone(), tcp));
                    }
                    Some(tls) => {
                        tokio::spawn(serve_tls(inner.clone(), tcp, tls));
                    }
                },
                Err(e) => {
                    // Typically EMFILE; back off briefly instead of spinning.
                    tracing::warn!(error = %e, "mock gateway: accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
}

/// Runs the TLS handshake (bounded by the handshake timeout), then serves
/// the WebSocket on it. A failed handshake just drops the socket, as a real
/// TLS server does after its alert.
async fn serve_tls(inner: Arc<Inner>, tcp: tokio::net::TcpStream, tls: Arc<rustls::ServerConfig>) {
    let _ = tcp.set_nodelay(true);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    match tokio::time::timeout(inner.cfg.handshake_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(stream)) => connection::serve_io(inner, Box::new(stream)).await,
        Ok(Err(e)) => tracing::debug!(error = %e, "mock gateway: TLS handshake failed"),
        Err(_) => tracing::debug!("mock gateway: TLS handshake timed out"),
    }
}
