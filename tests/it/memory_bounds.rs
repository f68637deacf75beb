//! Memory bounds that hold against clients that misbehave at scale:
//! streams that never read, clients that send one large request and
//! go idle. Each test runs the broker as its own process and reads its
//! resident size from `/proc`, so the figure is the broker's alone; the
//! figures measured are in the limits page.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::backpressure::HEAVY;
use crate::support::*;

/// `clawmux serve` on `socket` with these `[limits]` lines. The binary is
/// the one built with the tests, or `CLAWMUX_TEST_BIN` (a copy, when
/// several worktrees share one target directory and another build may
/// replace the binary under the test). `args`: more arguments to `serve`.
fn spawn_broker(
    dir: &Path,
    socket: &Path,
    gateway: &str,
    limits: &str,
    args: &[&str],
) -> ChildGuard {
    let config = dir.join("clawmux.toml");
    std::fs::write(&config, format!("[limits]\n{limits}")).unwrap();
    let bin = std::env::var_os("CLAWMUX_TEST_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_clawmux").into());
    ChildGuard(
        std::process::Command::new(bin)
            .arg("serve")
            .arg("--socket")
            .arg(socket)
            .args([
                "--gateway-url",
                gateway,
                "--token",
                "test-token",
                "--no-device-identity",
            ])
            .arg("--config")
            .arg(&config)
            .args(args)
            .env("HOME", dir)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A gateway double and `clawmux serve` in front of it on a temporary
/// socket, with these `[limits]` lines, once the socket exists.
struct Rig {
    gw: MockGateway,
    socket: std::path::PathBuf,
    pid: u32,
    _broker: ChildGuard,
    _dir: tempfile::TempDir,
}

impl Rig {
    async fn start(config: clawmux_mock::MockConfig, limits: &str) -> Rig {
        Rig::start_with(config, limits, &[]).await
    }

    /// [`Rig::start`], with more arguments to `serve`.
    async fn start_with(mut config: clawmux_mock::MockConfig, limits: &str, args: &[&str]) -> Rig {
        // These tests read the frames a client gets one by one: no `tick`
        // (every 30 s by default) among them, however slow the run.
        config.tick_interval_ms = config.tick_interval_ms.max(3_600_000);
        let gw = MockGateway::start(config).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("c.sock");
        let broker = spawn_broker(dir.path(), &socket, &gw.url(), limits, args);
        let pid = broker.0.id();
        eventually("socket exists", || socket.exists()).await;
        Rig {
            gw,
            socket,
            pid,
            _broker: broker,
            _dir: dir,
        }
    }
}

/// A `/proc/<pid>/status` figure in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| {
            v.trim_start_matches(':')
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap()
}

/// The broker's RSS (KiB) as soon as it is under `bound_kib`, or as it is
/// once `PATIENCE` has passed (the caller's assertion says what stayed).
/// Polled: nothing signals memory handed back.
async fn rss_once_under(pid: u32, bound_kib: u64) -> u64 {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let rss = status_kib(pid, "VmRSS");
        if rss < bound_kib || std::time::Instant::now() >= deadline {
            return rss;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Opens a streamed `GET` and reads its response head, then never reads again.
async fn open_unread(socket: &Path, path: &str) -> UnixStream {
    let mut s = UnixStream::connect(socket).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tokio::time::timeout(PATIENCE, s.read_exact(&mut byte))
            .await
            .expect("a response head")
            .unwrap();
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s
}

/// `n` WebSocket clients of the broker on `socket`, each past its handshake.
async fn greeted(socket: &Path, n: usize) -> Vec<WsClient> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        let mut c = WsClient::open(socket, "/ws").await;
        c.handshake().await;
        clients.push(c);
    }
    clients
}

/// Every client still gets answers: none was closed.
async fn all_still_answered(clients: &mut [WsClient]) {
    for c in clients {
        let res = c.request("health", json!({})).await;
        assert_eq!(res["ok"], true, "{res}");
    }
}

/// `events` gateway events of `size` bytes to everyone, paced by `reader`
/// (a WebSocket client that reads them all): the producer stays a few
/// events ahead of it, so the reader's own backlog stays small.
async fn flow(gw: &MockGateway, reader: &mut WsClient, events: u64, size: usize) {
    flow_of(gw, reader, events, size, |n, pad| {
        ("test.event", json!({"n": n, "pad": pad}))
    })
    .await
}

/// [`flow`] of the events `make(n, pad)` names and shapes (each payload
/// carries `n`, where the reader finds it).
async fn flow_of(
    gw: &MockGateway,
    reader: &mut WsClient,
    events: u64,
    size: usize,
    make: fn(u64, &str) -> (&'static str, Value),
) {
    const WINDOW: u64 = 8;
    let pad = "x".repeat(size);
    let (read_tx, mut read_rx) = tokio::sync::watch::channel(0u64);
    let gw = gw.clone();
    let producer = tokio::spawn(async move {
        for n in 0..events {
            let (name, payload) = make(n, &pad);
            gw.broadcast(name, payload);
            tokio::time::timeout(
                Duration::from_secs(30),
                read_rx.wait_for(|&read| n < read + WINDOW),
            )
            .await
            .expect("the reader keeps reading")
            .unwrap();
        }
        gw.broadcast("test.marker", json!({}));
    });
    loop {
        let e = match reader.recv_within(Duration::from_secs(30)).await {
            Some(Got::Json(v)) if v["type"] == "event" => v,
            Some(Got::Json(_)) => continue,
            other => panic!("the reader was cut off: {other:?}"),
        };
        if e["event"] == "test.marker" {
            break;
        }
        if let Some(n) = e["payload"]["n"].as_u64() {
            let _ = read_tx.send(n + 1);
        }
    }
    producer.await.unwrap();
}

/// 150 `/v1/hud` readers that never read while agent runs stream 16 MiB
/// of assistant text and tool calls (every event a HUD event): each HUD
/// stream's queue counts in `queue_total_bytes` and the shedder closes
/// the streams that stopped reading, so the peak stays near idle plus the budget
/// and the WebSocket client that reads is never cut off; what each stream
/// keeps besides its queue (its projection, the chunk it parses) is small
/// or counted. Before : peaks of 671 MiB in 2 of 11 runs, and a
/// reading client closed with a 106-byte backlog in 4 of 9; then +47 MiB
/// (each stream's projection kept every ended run's output). Measured
/// after: +7.6 MiB. Slow in a debug build (~7 min: 150 streams each parse
/// all 16 MiB); run it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hud_streams_that_never_read_stay_within_the_queue_budget() {
    const STREAMS: usize = 150;
    let _heavy = HEAVY.lock().await;
    let rig = Rig::start(mock_config(), "replay_max_bytes = 1048576\nmax_frame_bytes = 4194304\nqueue_hard_bytes = 8388608\nqueue_total_bytes = 16777216\n").await;
    let (gw, socket, pid) = (&rig.gw, rig.socket.as_path(), rig.pid);
    let mut reader = WsClient::open(socket, "/ws").await;
    reader.handshake().await;
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        streams.push(open_unread(socket, "/v1/hud").await);
    }
    let idle_kib = status_kib(pid, "VmRSS");
    flow_of(gw, &mut reader, 4096, 4096, |n, pad| {
        let run = format!("run-{}", n / 64);
        let payload = match n % 64 {
            0 => json!({"n": n, "runId": run, "sessionKey": "agent:main:main", "stream": "lifecycle", "data": {"phase": "start"}}),
            63 => json!({"n": n, "runId": run, "sessionKey": "agent:main:main", "stream": "lifecycle", "data": {"phase": "end"}}),
            _ => json!({"n": n, "runId": run, "sessionKey": "agent:main:main", "stream": "assistant", "data": {"text": pad, "delta": pad}}),
        };
        ("agent", payload)
    })
    .await;
    let peak_kib = status_kib(pid, "VmHWM");
    eprintln!(
        "{STREAMS} unread /v1/hud streams, 16 MiB of agent events: broker RSS {idle_kib} KiB before, peak {peak_kib} KiB"
    );
    assert!(
        peak_kib < idle_kib + 40 * 1024,
        "peak {peak_kib} KiB, {idle_kib} KiB before the flow, budget 16 MiB"
    );
    drop(streams);
}

/// 150 `/v1/events` readers that never read while 16 MiB of events flow
/// (to them and to one WebSocket client that reads): what each stream
/// holds outside its queue counts in `queue_total_bytes` (16 MiB here) and
/// is bounded, so the broker's peak stays near idle plus the budget, and
/// the reader is never cut off. Before , hyper held ~650 KB of
/// each stream outside the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_that_never_read_stay_within_the_queue_budget() {
    const STREAMS: usize = 150;
    let _heavy = HEAVY.lock().await;
    let rig = Rig::start(mock_config(), "replay_max_bytes = 1048576\nmax_frame_bytes = 4194304\nqueue_hard_bytes = 8388608\nqueue_total_bytes = 16777216\n").await;
    let (gw, socket, pid) = (&rig.gw, rig.socket.as_path(), rig.pid);
    let mut reader = WsClient::open(socket, "/ws").await;
    reader.handshake().await;
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        streams.push(open_unread(socket, "/v1/events").await);
    }
    let idle_kib = status_kib(pid, "VmRSS");
    flow(gw, &mut reader, 4096, 4096).await;
    let peak_kib = status_kib(pid, "VmHWM");
    eprintln!(
        "{STREAMS} unread /v1/events streams, 16 MiB of events: broker RSS {idle_kib} KiB before, peak {peak_kib} KiB"
    );
    assert!(
        peak_kib < idle_kib + 40 * 1024,
        "peak {peak_kib} KiB, {idle_kib} KiB before the flow, budget 16 MiB"
    );
    drop(streams);
}

/// Ten clients each send one 16 MiB request, get its answer and go idle:
/// the broker's resident size comes back near where it was before, instead
/// of keeping each client's read buffer at 16 MiB for the life of its
/// connection (before: 10 × 16 MiB pinned 368 MiB, 80 × 25 MiB 2,003 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_request_does_not_pin_its_read_buffer() {
    const CLIENTS: usize = 10;
    let _heavy = HEAVY.lock().await;
    let rig = Rig::start(mock_config(), "").await;
    let (socket, pid) = (rig.socket.as_path(), rig.pid);
    let mut clients = greeted(socket, CLIENTS).await;
    let idle_kib = status_kib(pid, "VmRSS");
    // A second `connect` is answered by the broker itself: the request's
    // bytes go nowhere else, so what stays is the read side's alone.
    let pad = "x".repeat(16 << 20);
    for (i, c) in clients.iter_mut().enumerate() {
        let id = format!("big-{i}");
        c.send_json(&json!({"type": "req", "id": id, "method": "connect", "params": {"pad": pad}}))
            .await;
        let res = c.response(&id).await;
        assert_eq!(res["ok"], false, "{res}");
    }
    // Every client is answered, so every request was read; its buffer is
    // given back when the client's task next polls its socket, just after.
    // Every block of 1 MiB or more is unmapped when freed
    // (`bounds::return_large_blocks_at_once`): measured +0.05 to +0.1 MiB
    // once settled (+32 MiB when glibc kept freed large blocks in its
    // heaps). Before, each client kept its own 16 MiB: +164 MiB for ten.
    let bound_kib = idle_kib + 4 * 1024;
    let after_kib = rss_once_under(pid, bound_kib).await;
    let peak_kib = status_kib(pid, "VmHWM");
    eprintln!(
        "{CLIENTS} clients × one 16 MiB request: broker RSS {idle_kib} KiB before, {after_kib} KiB after (peak {peak_kib} KiB)"
    );
    assert!(
        after_kib < bound_kib,
        "{after_kib} KiB after, {idle_kib} KiB before: read buffers kept their grown size"
    );
    // The clients still work.
    all_still_answered(&mut clients).await;
}

/// Ten clients each send one 16 MiB request that the broker forwards to a
/// `wss://` gateway, and go idle: the broker's resident size comes back
/// near where it was. Each request's frame is written beside tungstenite,
/// through the TLS stream, and freed once written; through tungstenite,
/// its write buffer kept the largest request's size for the life of the
/// gateway connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_request_over_wss_does_not_pin_a_write_buffer() {
    const CLIENTS: usize = 10;
    let _heavy = HEAVY.lock().await;
    let leaf = crate::tls::leaf(&["localhost"], None, false);
    let rig = Rig::start_with(
        crate::tls::tls_config(&leaf),
        "",
        &["--tls-fingerprint", &leaf.fingerprint],
    )
    .await;
    let (socket, pid) = (rig.socket.as_path(), rig.pid);
    let mut clients = greeted(socket, CLIENTS).await;
    let idle_kib = status_kib(pid, "VmRSS");
    let pad = "x".repeat(16 << 20);
    for (i, c) in clients.iter_mut().enumerate() {
        let id = format!("big-{i}");
        c.send_json(&json!({"type": "req", "id": id, "method": "health", "params": {"pad": pad}}))
            .await;
        let res = c.response(&id).await;
        assert_eq!(res["ok"], true, "forwarded and answered: {res}");
    }
    let bound_kib = idle_kib + 8 * 1024;
    let after_kib = rss_once_under(pid, bound_kib).await;
    let peak_kib = status_kib(pid, "VmHWM");
    eprintln!(
        "{CLIENTS} clients × one 16 MiB request over wss://: broker RSS {idle_kib} KiB before, {after_kib} KiB after (peak {peak_kib} KiB)"
    );
    assert!(
        after_kib < bound_kib,
        "{after_kib} KiB after, {idle_kib} KiB before: the gateway connection kept a large request's size"
    );
    all_still_answered(&mut clients).await;
}

/// One 20 MiB event from a `wss://` gateway to four readers: once they
/// have it, the broker's resident size comes back near where it was. The
/// event's frame header reaches the parser alone, as over a plain socket,
/// so the parser's read buffer holds exactly the payload and nothing of it
/// stays; read as it came, the parser's buffer went on pointing into the
/// event's allocation, and kept it, for as long as the connection lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_event_over_wss_does_not_pin_the_read_buffer() {
    const EVENT_BYTES: usize = 20 << 20;
    let _heavy = HEAVY.lock().await;
    let leaf = crate::tls::leaf(&["localhost"], None, false);
    let config = one_frame_of(crate::tls::tls_config(&leaf), EVENT_BYTES);
    let rig = Rig::start_with(config, "", &["--tls-fingerprint", &leaf.fingerprint]).await;
    // Closer to idle than over a plain socket (+32 MiB there): the
    // parser's buffer keeping the event would be +20 MiB.
    large_event_on(&rig, 4, EVENT_BYTES, 8 * 1024).await;
}

/// Ten clients each get one 16 MiB answer from the gateway (a transcript
/// holding one 16 MiB message) and go idle: the broker's resident size
/// comes back near where it was, instead of each client's WebSocket
/// keeping a write buffer the size of the largest frame it carried
/// (measured before: +192–208 MiB for ten). The answer's bytes are
/// written from the one copy the broker read, then given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_does_not_pin_a_write_buffer() {
    const CLIENTS: usize = 10;
    const MESSAGE_BYTES: usize = 16 << 20;
    let _heavy = HEAVY.lock().await;
    let rig = Rig::start(mock_config(), "").await;
    let (socket, pid) = (rig.socket.as_path(), rig.pid);
    let mut clients = greeted(socket, CLIENTS).await;
    let key = "agent:main:big";
    let res = clients[0]
        .request(
            "chat.inject",
            json!({"sessionKey": key, "message": "x".repeat(MESSAGE_BYTES)}),
        )
        .await;
    assert_eq!(res["ok"], true, "{res}");
    let idle_kib = status_kib(pid, "VmRSS");
    for c in &mut clients {
        let res = c.request("chat.history", json!({"sessionKey": key})).await;
        assert_eq!(res["ok"], true);
        let text = res["payload"]["messages"][0].to_string();
        assert!(text.len() > MESSAGE_BYTES, "the whole message came back");
    }
    // Nothing stays: the gateway connection's read buffer and each
    // client's frame are given back once handled. Measured +0.2 MiB; +24
    // MiB when the gateway's read buffer kept the answer's size, +37 to
    // +41 MiB when glibc kept freed large blocks in per-thread heaps.
    let bound_kib = idle_kib + 16 * 1024;
    let after_kib = rss_once_under(pid, bound_kib).await;
    let peak_kib = status_kib(pid, "VmHWM");
    eprintln!(
        "{CLIENTS} clients × one 16 MiB answer: broker RSS {idle_kib} KiB before, {after_kib} KiB after (peak {peak_kib} KiB)"
    );
    assert!(
        after_kib < bound_kib,
        "{after_kib} KiB after, {idle_kib} KiB before: the answers' buffers were kept"
    );
    all_still_answered(&mut clients).await;
}

/// Twenty-four clients each send the first 8 MiB fragment of a message
/// and wait: each message counts against `queue_total_bytes` (32 MiB
/// here) from that first fragment, so the broker holds at most the budget
/// of them and closes the others `1009` before reading their payload,
/// instead of holding every fragment (24 × 8 MiB). The messages it read
/// are then finished and answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragments_count_against_the_budget_from_the_first() {
    const BUDGET: usize = 32 << 20;
    first_fragments_against_the_budget(
        24,
        8 << 20,
        0,
        BUDGET,
        &format!(
            "queue_total_bytes = {BUDGET}\nqueue_hard_bytes = {BUDGET}\nqueue_soft_bytes = {}\nmax_frame_bytes = {}\n",
            BUDGET / 2,
            BUDGET / 2
        ),
    )
    .await;
}

/// Eighty clients each send the first 24 MiB fragment of a message, with
/// the default limits (a 256 MiB budget, 25 MiB frames): the broker holds
/// at most the budget of them, as for whole messages. It reads 10 and
/// closes 70 `1009`; a fragment read is held once, in the message being
/// collected (it reaches the parser in pieces, so the parser's read buffer
/// never holds it beside the message, and keeps its idle size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eighty_first_fragments_of_24_mib_stay_within_the_default_budget() {
    first_fragments_against_the_budget(80, 24 << 20, 0, 256 << 20, "").await;
}

/// Forty clients each send a 20 MiB request in two fragments of 10 MiB,
/// with the default limits: a message counts against the budget with
/// each fragment's header, so the broker holds at most the budget of them
/// as they grow (the others are closed `1009`), answers those it read,
/// and keeps nothing of them once they are handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_requests_of_20_mib_in_two_fragments_stay_within_the_default_budget() {
    first_fragments_against_the_budget(40, 10 << 20, 10 << 20, 256 << 20, "").await;
}

/// `clients` clients each send the first `fragment_bytes` fragment of a
/// message against a `budget` of queued bytes (the `[limits]` lines say
/// so), then finish it with a fragment of `last_bytes`: at most the budget
/// of them is read and answered,
/// the others are closed `1009`, and the broker holds at most the budget
/// (and 40 MiB) over idle meanwhile, at most the budget and 64 MiB at its
/// peak, and less than 8 MiB once they are handled (no buffer a message
/// passed through, the gateway connection's included, keeps its size).
/// How long a client of [`first_fragments_against_the_budget`] waits for
/// its answer or its close once it sent its last fragment: each answer comes
/// after the gateway double has read every earlier message of megabytes,
/// one after another, which a debug build on a loaded 2-core machine takes
/// seconds for each. A bound against a hang, not a figure the test judges.
const ANSWER_WAIT: Duration = Duration::from_secs(120);

async fn first_fragments_against_the_budget(
    clients: usize,
    fragment_bytes: usize,
    last_bytes: usize,
    budget: usize,
    limits: &str,
) {
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::Message;
    let _heavy = HEAVY.lock().await;
    let rig = Rig::start(mock_config(), limits).await;
    let (socket, pid) = (rig.socket.as_path(), rig.pid);
    let connected = greeted(socket, clients).await;
    let idle_kib = status_kib(pid, "VmRSS");
    let first = Bytes::from(format!(
        r#"{{"type":"req","id":"big","method":"health","params":{{"pad":"{}"#,
        "x".repeat(fragment_bytes)
    ));
    let last = Bytes::from(format!(r#"{}"}}}}"#, "y".repeat(last_bytes)));
    let (go, _) = tokio::sync::broadcast::channel::<()>(1);
    let (sent_tx, mut sent_rx) = tokio::sync::mpsc::channel(clients);
    let tasks: Vec<_> = connected
        .into_iter()
        .map(|mut c| {
            let first = first.clone();
            let last = last.clone();
            let mut go = go.subscribe();
            let sent = sent_tx.clone();
            tokio::spawn(async move {
                let fragment = Frame::message(first, OpCode::Data(Data::Text), false);
                let _ = c.ws_mut().send(Message::Frame(fragment)).await;
                let _ = sent.send(()).await;
                let _ = go.recv().await;
                let last = Frame::message(last, OpCode::Data(Data::Continue), true);
                let _ = c.ws_mut().send(Message::Frame(last)).await;
                loop {
                    match c.recv_within(ANSWER_WAIT).await {
                        None => panic!("neither answered nor closed within {ANSWER_WAIT:?}"),
                        Some(Got::Close(code, _)) => return Err(code),
                        Some(Got::Eof) => return Err(0),
                        // Read whole and answered: by the gateway, or, when
                        // the gateway has not yet taken the earlier ones of
                        // 8 MiB (its queue holds 16 MiB of requests), refused
                        // retryable before it was sent. Which one depends on
                        // how fast the gateway reads, not on the budget.
                        Some(Got::Json(v)) if v["id"] == "big" => {
                            let ok = v["ok"] == true
                                || (v["error"]["code"] == "studio.too_many_requests"
                                    && v["error"]["details"]["sent"] == false);
                            return Ok((ok, v));
                        }
                        Some(Got::Json(_)) => {}
                    }
                }
            })
        })
        .collect();
    // Every first fragment written (taken, or refused with the socket).
    for _ in 0..clients {
        tokio::time::timeout(Duration::from_secs(30), sent_rx.recv())
            .await
            .expect("each client's first fragment is taken or refused");
    }
    let held_kib = status_kib(pid, "VmRSS");
    go.send(()).unwrap();
    let mut answered = 0;
    let mut refused = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok((ok, answer)) => {
                assert!(
                    ok,
                    "an answered message is answered ok (or refused unsent, the gateway's queue full): {answer}"
                );
                answered += 1;
            }
            Err(code) => {
                assert!(code == 1009 || code == 0, "closed {code}");
                refused += 1;
            }
        }
    }
    eprintln!(
        "{clients} clients × an unfinished {} MiB fragment, budget {} MiB: broker RSS {idle_kib} KiB before, {held_kib} KiB holding them; {answered} answered, {refused} refused",
        fragment_bytes >> 20,
        budget >> 20
    );
    assert!(answered >= 1, "a message within the budget is read");
    assert!(
        answered * fragment_bytes <= budget,
        "{answered} messages of {fragment_bytes} bytes held against a budget of {budget}"
    );
    let bound_kib = idle_kib + (budget as u64 + (40 << 20)) / 1024;
    assert!(
        held_kib < bound_kib,
        "{held_kib} KiB holding the fragments, {idle_kib} KiB before"
    );
    // Handled, the messages and every buffer they passed through are gone.
    let after_bound_kib = idle_kib + 8 * 1024;
    let after_kib = rss_once_under(pid, after_bound_kib).await;
    let peak_kib = status_kib(pid, "VmHWM");
    eprintln!("{after_kib} KiB once the messages were handled, peak {peak_kib} KiB");
    // Meanwhile, the messages read were forwarded and answered: the
    // budget and what is being written (a message in flight to the
    // gateway) at most.
    let peak_bound_kib = idle_kib + (budget as u64 + (64 << 20)) / 1024;
    assert!(
        peak_kib < peak_bound_kib,
        "peak {peak_kib} KiB, {idle_kib} KiB before"
    );
    assert!(
        after_kib < after_bound_kib,
        "{after_kib} KiB once the messages were handled, {idle_kib} KiB before"
    );
}

/// A tool call's start for run `run`, as the gateway sends it to observers.
fn tool_start(run: &str, call: &str, pad: &str) -> Value {
    json!({"runId": run, "sessionKey": "agent:main:main", "stream": "tool",
           "data": {"phase": "start", "name": "exec", "toolCallId": call, "args": {"command": pad}}})
}

/// The HUD events of a `/v1/hud` stream's next records (others skipped).
async fn next_hud_event(sse: &mut crate::http_api::Sse) -> Value {
    loop {
        let crate::http_api::Item::Other(record) = sse.next_item().await else {
            continue;
        };
        if let Some(data) = record.lines().find_map(|l| l.strip_prefix("data: ")) {
            if !record.lines().any(|l| l.starts_with("event: ")) {
                return serde_json::from_str(data).expect("one HUD event per data line");
            }
        }
    }
}

/// The gateway opens 300 runs that never end: a HUD stream's projection
/// and the broker's own (the runs `/v1/state` lists) keep 200, and the
/// HUD stream is told of each run dropped, the one idle longest first: its
/// open tool call's `tool_end` and its `turn_end`, both `truncated: true`
/// (`truncatedBy: "runs"`), with no status (before: every running run was
/// kept, for as long as it ran, and nothing was said).
#[tokio::test]
async fn runs_that_never_end_are_dropped_past_the_bound_and_the_hud_says_so() {
    let h = start().await;
    let socket = h.socket();
    crate::http_api::until_ready(&socket).await;
    let mut hud = crate::http_api::open_events(&socket, "/v1/hud", &[])
        .await
        .expect("a HUD stream");
    for run in 0..300 {
        let run = format!("run-{run}");
        h.gw.broadcast("agent", tool_start(&run, &format!("{run}-call"), "ls"));
    }
    // A tool_end and a turn_end for each of the 100 runs dropped.
    let mut dropped = Vec::new();
    while dropped.len() < 2 * 100 {
        let event = next_hud_event(&mut hud).await;
        if event["truncated"] == true {
            assert_eq!(event["truncatedBy"], "runs", "{event}");
            assert!(event.get("status").is_none(), "{event}");
            dropped.push(event.clone());
        }
    }
    for (n, pair) in dropped.chunks(2).enumerate() {
        let run = format!("run-{n}");
        assert_eq!(
            (
                &pair[0]["event"],
                &pair[0]["correlationId"],
                &pair[0]["parentId"]
            ),
            (
                &json!("tool_end"),
                &json!(format!("{run}-call")),
                &json!(run)
            ),
        );
        assert_eq!(
            (&pair[1]["event"], &pair[1]["correlationId"]),
            (&json!("turn_end"), &json!(run))
        );
    }
    // Every event was published (the stream saw the last): the broker's
    // projection has them all.
    let state = crate::http_api::state(&socket).await;
    let runs = state["runs"].as_array().expect("runs in flight");
    assert_eq!(
        runs.len(),
        200,
        "the broker's own projection is bounded too"
    );
    assert!(
        runs.iter().all(|r| r["runId"] != "run-0"),
        "the idlest went"
    );
}

/// Four HUD streams that read everything while the gateway opens 50 runs
/// of 128 tool calls that never end (2 KB of arguments each, 13 MB in
/// all): what each stream keeps of them is bounded (1 MiB), so the broker
/// stays near where it was (before: each stream kept every open call's
/// arguments; 8 streams × 50 runs × 256 calls held +1.9 GiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hud_streams_of_runs_that_never_end_stay_bounded() {
    const STREAMS: usize = 4;
    const RUNS: u64 = 50;
    const CALLS: u64 = 128;
    let _heavy = HEAVY.lock().await;
    let rig = Rig::start(mock_config(), "replay_max_bytes = 1048576\n").await;
    let (gw, socket, pid) = (&rig.gw, rig.socket.as_path(), rig.pid);
    let mut reader = WsClient::open(socket, "/ws").await;
    reader.handshake().await;
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        let hud = crate::http_api::open_events(socket, "/v1/hud", &[])
            .await
            .expect("a HUD stream");
        streams.push(tokio::spawn(async move {
            let mut hud = hud;
            let last = format!("run-{}-{}", RUNS - 1, CALLS - 1);
            loop {
                let event = next_hud_event(&mut hud).await;
                if event["event"] == "tool_start" && event["correlationId"] == last.as_str() {
                    return;
                }
            }
        }));
    }
    let idle_kib = status_kib(pid, "VmRSS");
    // Calls go round the runs (each run stays busy), each followed by a
    // broadcast event the pacing reader sees.
    flow_of(gw, &mut reader, 2 * RUNS * CALLS, 2048, |n, pad| {
        if n % 2 == 1 {
            return ("test.event", json!({"n": n}));
        }
        let (run, call) = ((n / 2) % RUNS, (n / 2) / RUNS);
        let run_id = format!("run-{run}");
        let mut start = tool_start(&run_id, &format!("{run_id}-{call}"), pad);
        start["n"] = json!(n);
        ("agent", start)
    })
    .await;
    for stream in streams {
        tokio::time::timeout(Duration::from_secs(120), stream)
            .await
            .expect("each HUD stream read every call")
            .unwrap();
    }
    let peak_kib = status_kib(pid, "VmHWM");
    eprintln!(
        "{STREAMS} /v1/hud streams, {RUNS} runs × {CALLS} open calls of 2 KB: broker RSS {idle_kib} KiB before, peak {peak_kib} KiB"
    );
    assert!(
        peak_kib < idle_kib + 40 * 1024,
        "peak {peak_kib} KiB, {idle_kib} KiB before"
    );
}

/// One gateway event of `event_bytes` to `clients` WebSocket clients that
/// read, with these `[limits]`: the broker holds its bytes once, shared by
/// every client's frame, so its peak stays within a few times the event
/// over idle, and once every client has it the memory comes back to idle
/// (+32 MiB: what the allocator may keep at a heap's top). The gateway
/// connection's read buffer goes back to its normal size after the event,
/// as every local connection's does. Returns (idle, peak, after) in KiB.
async fn large_event_to_readers(
    clients: usize,
    event_bytes: usize,
    limits: &str,
) -> (u64, u64, u64) {
    let _heavy = HEAVY.lock().await;
    let rig = Rig::start(one_frame_of(mock_config(), event_bytes), limits).await;
    large_event_on(&rig, clients, event_bytes, 32 * 1024).await
}

/// `config` for a double that sends an event of `event_bytes` as one
/// frame, whole: it closes a connection whose backlog passes its
/// `max_buffered_bytes`.
fn one_frame_of(
    mut config: clawmux_mock::MockConfig,
    event_bytes: usize,
) -> clawmux_mock::MockConfig {
    config.max_buffered_bytes = config.max_buffered_bytes.max(2 * event_bytes as u64);
    config
}

/// [`large_event_to_readers`] on a broker already started: once every
/// reader has the event, the broker's resident size must come back under
/// idle + `after_bound_kib`.
async fn large_event_on(
    rig: &Rig,
    clients: usize,
    event_bytes: usize,
    after_bound_kib: u64,
) -> (u64, u64, u64) {
    let (gw, socket, pid) = (&rig.gw, rig.socket.as_path(), rig.pid);
    let mut readers = greeted(socket, clients).await;
    let idle_kib = status_kib(pid, "VmRSS");
    gw.broadcast("test.big", json!({"pad": "x".repeat(event_bytes)}));
    for c in &mut readers {
        let frame = c
            .recv_text_within(PATIENCE)
            .await
            .expect("every client gets the event");
        assert!(
            frame.starts_with(r#"{"type":"event","event":"test.big""#) && frame.len() > event_bytes,
            "the whole event: {} bytes, {:?}…",
            frame.len(),
            &frame[..frame.len().min(80)]
        );
    }
    let peak_kib = status_kib(pid, "VmHWM");
    let bound_kib = idle_kib + after_bound_kib;
    let after_kib = rss_once_under(pid, bound_kib).await;
    assert!(
        after_kib < bound_kib,
        "the broker gives the event's memory back: {after_kib} KiB after, {idle_kib} KiB before"
    );
    eprintln!(
        "{clients} clients × one {} MiB event: broker RSS {idle_kib} KiB before, peak {peak_kib} KiB, {after_kib} KiB after",
        event_bytes >> 20
    );
    // The peak is the read path's two copies (the frame as read, the
    // encoded event every client shares): measured 2.05 to 2.1 events'
    // worth. A copy per client would be `clients`; the replay log's cut
    // made from a whole parsed copy, 5.
    let event_kib = (event_bytes / 1024) as u64;
    assert!(
        peak_kib < idle_kib + 3 * event_kib,
        "peak {peak_kib} KiB over {idle_kib} KiB idle: more than a few copies of a {event_kib} KiB event"
    );
    all_still_answered(&mut readers).await;
    (idle_kib, peak_kib, after_kib)
}

/// One 20 MiB event to 60 readers. (A writer that built each client's
/// frame as its own copy held (clients + 3) × the event: +1,262 MiB; a
/// gateway read buffer that kept the event's size, +21 MiB after.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_large_event_to_many_readers_is_held_once() {
    large_event_to_readers(60, 20 << 20, "").await;
}

/// One 40 MiB event (frames allowed up to 64 MiB) to 20 readers: the
/// peak stays a few events over idle and the memory comes back. (Before:
/// peak +954 MiB and +894 MiB 8 s later.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_40_mib_event_to_readers_comes_back_to_idle() {
    large_event_to_readers(
        20,
        40 << 20,
        "max_frame_bytes = 67108864\nqueue_hard_bytes = 134217728\n",
    )
    .await;
}

/// A gateway snapshot of 30 MiB (its `health` that large) and 20 clients
/// that connect one after the other: no client's `hello-ok` is larger than
/// the `maxPayload` it announces (it gets the snapshot without `presence`
/// and `health`, their versions 0, so the next events of each apply), and
/// the broker holds the snapshot once, not once per client. (Before: each
/// client got a 31.4 MB hello above the 25 MiB it was told, +739 MiB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_larger_than_max_payload_is_sent_without_presence_and_health() {
    const CLIENTS: usize = 20;
    const HEALTH_BYTES: usize = 30 << 20;
    let _heavy = HEAVY.lock().await;
    let mut config = mock_config();
    config.max_buffered_bytes = config.max_buffered_bytes.max(2 * HEALTH_BYTES as u64);
    let rig = Rig::start(
        config,
        "max_frame_bytes = 67108864\nqueue_hard_bytes = 134217728\n",
    )
    .await;
    let (gw, socket, pid) = (&rig.gw, rig.socket.as_path(), rig.pid);
    let mut first = greeted(socket, 1).await;
    let idle_kib = status_kib(pid, "VmRSS");
    gw.broadcast_with_state_version(
        "health",
        json!({"ok": true, "pad": "x".repeat(HEALTH_BYTES)}),
    );
    let event = first[0]
        .recv_text_within(PATIENCE)
        .await
        .expect("the reader gets the health event");
    assert!(event.len() > HEALTH_BYTES, "{} bytes", event.len());
    drop(event);
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let mut c = WsClient::open(socket, "/ws").await;
        let challenge = c.recv_json().await;
        assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
        c.send_json(&connect_frame("connect-1")).await;
        let frame = c
            .recv_text_within(PATIENCE)
            .await
            .expect("the client gets its hello");
        let res: Value = serde_json::from_str(&frame).unwrap();
        assert_eq!(res["ok"], true, "{}", &frame[..frame.len().min(300)]);
        let hello = &res["payload"];
        let max_payload = hello["policy"]["maxPayload"].as_u64().unwrap();
        assert!(
            (frame.len() as u64) <= max_payload,
            "a {} byte hello announces maxPayload {max_payload}",
            frame.len()
        );
        let snapshot = &hello["snapshot"];
        assert_eq!(snapshot["presence"], json!([]), "{snapshot}");
        assert_eq!(snapshot["health"], json!({}), "{snapshot}");
        assert_eq!(
            snapshot["stateVersion"],
            json!({"presence": 0, "health": 0})
        );
        assert!(snapshot["uptimeMs"].is_u64(), "{snapshot}");
        assert_eq!(snapshot["sessionDefaults"]["mainKey"], "main", "{snapshot}");
        clients.push(c);
    }
    let peak_kib = status_kib(pid, "VmHWM");
    let after_kib = status_kib(pid, "VmRSS");
    eprintln!(
        "a 30 MiB snapshot, {CLIENTS} clients connect: broker RSS {idle_kib} KiB before, peak {peak_kib} KiB, {after_kib} KiB after"
    );
    // The event's read path (two copies of it) and the snapshot held
    // (parsed, and encoded once): measured +121 MiB, 4 events' worth;
    // nothing grows with the clients.
    let event_kib = (HEALTH_BYTES / 1024) as u64;
    assert!(
        peak_kib < idle_kib + 5 * event_kib,
        "peak {peak_kib} KiB over {idle_kib} KiB idle"
    );
    assert!(
        after_kib < idle_kib + 4 * event_kib,
        "{after_kib} KiB held over {idle_kib} KiB idle"
    );
    // A health event after the cut one applies (its version is above 0),
    // and a client connecting now gets it whole.
    gw.broadcast_with_state_version("health", json!({"ok": true}));
    first[0]
        .recv_text_within(PATIENCE)
        .await
        .expect("the small health event");
    let (_c, hello) = {
        let mut c = WsClient::open(socket, "/ws").await;
        let hello = c.handshake().await;
        (c, hello)
    };
    assert_eq!(
        hello["snapshot"]["health"],
        json!({"ok": true}),
        "{}",
        hello["snapshot"]
    );
    assert!(
        hello["snapshot"]["stateVersion"]["health"]
            .as_u64()
            .unwrap()
            > 0
    );
    all_still_answered(&mut clients).await;
}

/// Six 49 MiB gateway events (the largest the gateway connection reads,
/// 50 MiB, allows) to 10 WebSocket clients that never read and one that
/// does: each event is held once, whoever has it queued, and a client
/// that falls a frame behind its hard limit is closed, so the broker stays
/// within its queue budget (256 MiB) and 64 MiB over idle (measured:
/// +205 MiB), and gives it back once the non-readers are gone; the reader
/// gets every event. (Before: a copy per client, peak +886 MiB; with the
/// replay log's cut made from a whole parsed copy of each event, +350 MiB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_events_to_clients_that_never_read_stay_within_the_budget() {
    const STALLED: usize = 10;
    const EVENTS: usize = 6;
    const EVENT_BYTES: usize = 49 << 20;
    let _heavy = HEAVY.lock().await;
    // The gateway's own maxBufferedBytes (50 MiB): each client's hard
    // limit, which the broker never sets below it. The events are paced by
    // the reader, so the gateway's queue to the broker holds one.
    let rig = Rig::start(mock_config(), "").await;
    let (gw, socket, pid) = (&rig.gw, rig.socket.as_path(), rig.pid);
    let stalled = greeted(socket, STALLED).await;
    let mut reader = greeted(socket, 1).await;
    let idle_kib = status_kib(pid, "VmRSS");
    let pad = "x".repeat(EVENT_BYTES);
    for n in 0..EVENTS {
        gw.broadcast("test.big", json!({"n": n, "pad": pad}));
        let frame = reader[0]
            .recv_text_within(PATIENCE)
            .await
            .expect("the reader gets every event");
        let event: Value = serde_json::from_str(&frame).unwrap();
        assert_eq!(event["payload"]["n"], n, "in order, none missing");
    }
    drop(pad);
    let peak_kib = status_kib(pid, "VmHWM");
    let budget_kib = (256 + 64) * 1024;
    let bound_kib = idle_kib + 32 * 1024;
    let after_kib = rss_once_under(pid, bound_kib).await;
    assert!(
        after_kib < bound_kib,
        "the broker gives the events' memory back: {after_kib} KiB after, {idle_kib} KiB before"
    );
    eprintln!(
        "{EVENTS} × 49 MiB events to {STALLED} clients that never read and one that does: broker RSS {idle_kib} KiB before, peak {peak_kib} KiB, {after_kib} KiB after"
    );
    assert!(
        peak_kib < idle_kib + budget_kib,
        "peak {peak_kib} KiB over {idle_kib} KiB idle: more than the queue budget and one event's read path"
    );
    all_still_answered(&mut reader).await;
    drop(stalled);
}
