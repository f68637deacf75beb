//! A slow client hurts nobody else (design §5).

mod support;

use std::time::Duration;

use serde_json::json;
use support::*;

/// 50 MiB of events while one client never reads: that client is closed as
/// a slow consumer, the reading client gets every event in order with
/// contiguous seq, the broker's memory stays bounded, and the upstream never
/// notices. The broker runs as its own process so its peak RSS is its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_closed_and_nobody_else_notices() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let config = dir.path().join("clawmux.toml");
    std::fs::write(&config, "[limits]\nreplay_max_bytes = 1048576\n").unwrap();
    let broker = ChildGuard(
        std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"))
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args([
                "--gateway-url",
                &gw.url(),
                "--token",
                "test-token",
                "--no-device-identity",
            ])
            // The replay ring (16 MiB by default, for /v1/events) is not what
            // this test bounds: keep it small so the figure is the queues'.
            .arg("--config")
            .arg(&config)
            .env("HOME", dir.path())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    let mut stalled = WsClient::open(&socket, "/ws").await;
    stalled.handshake().await;
    let mut reader = WsClient::open(&socket, "/ws").await;
    reader.handshake().await;
    let pad = "x".repeat(10 * 1024);
    let total = 5 * 1024; // 5,120 events of ~10 KiB = 50 MiB
    let producer_gw = gw.clone();
    let producer = tokio::spawn(async move {
        for n in 0..total {
            let name = if n % 2 == 0 { "tick" } else { "test.event" };
            producer_gw.broadcast(name, json!({"n": n, "pad": pad}));
            if n % 64 == 0 {
                tokio::task::yield_now().await;
            }
        }
        producer_gw.broadcast("test.marker", json!({}));
    });
    let mut last_seq = 0;
    let mut next_n = 0;
    loop {
        let e = reader.event_any().await;
        let seq = e["seq"].as_u64().expect("seq");
        assert_eq!(seq, last_seq + 1, "contiguous seq for the reading client");
        last_seq = seq;
        match e["event"].as_str().unwrap() {
            "tick" | "test.event" => {
                assert_eq!(e["payload"]["n"], next_n, "in order, nothing lost");
                next_n += 1;
            }
            "test.marker" => break,
            _ => {}
        }
    }
    producer.await.unwrap();
    assert_eq!(next_n, total);
    let (code, reason) = stalled.expect_close().await;
    assert_eq!((code, reason.as_str()), (1008, "slow consumer"));
    assert_eq!(
        gw.total_connections(),
        1,
        "the upstream socket was never closed"
    );
    assert_eq!(gw.open_connections(), 1);
    let status = std::fs::read_to_string(format!("/proc/{}/status", broker.0.id())).unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    eprintln!("broker peak RSS: {peak_kib} KiB");
    // Bound: the idle broker (~10 MiB) + the stalled client's hard limit
    // (8 MiB) + one batch in flight per client; far below the 50 MiB that flowed.
    assert!(
        peak_kib < 40 * 1024,
        "broker peak RSS {peak_kib} KiB while 50 MiB flowed"
    );
    let (_, _) = http_get(&socket, "/healthz").await;
    let metrics = metrics_text(&socket).await;
    assert!(
        metrics.contains("clawmux_slow_consumer_closes_total 1"),
        "{metrics}"
    );
}

async fn metrics_text(socket: &std::path::Path) -> String {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::TokioIo;
    let stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/metrics")
        .header("host", "localhost")
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// Drops consume seq numbers: a client that reads late sees exactly the
/// events it was sent, each at its original seq, and a gap exactly where
/// droppable events were dropped — never a lost non-droppable event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_limit_drops_show_as_gaps_and_spare_everything_else() {
    let h = start_with(mock_config(), |s| {
        s.limits.queue_soft_bytes = 64 * 1024;
        s.limits.queue_hard_bytes = 64 * 1024 * 1024;
        s.limits.slow_grace = Duration::from_secs(600);
    })
    .await;
    let (mut late, _) = h.connected().await;
    let (mut reader, _) = h.connected().await;
    let pad = "y".repeat(2048);
    let rounds = 2000;
    // Each round: one non-droppable event, then three droppable ticks.
    for n in 0..rounds {
        h.gw.broadcast("test.event", json!({"i": n * 4, "pad": pad}));
        for k in 1..4 {
            h.gw.broadcast("tick", json!({"i": n * 4 + k, "pad": pad}));
        }
    }
    h.gw.broadcast("test.marker", json!({"i": rounds * 4}));
    reader.event("test.marker").await; // the broker has queued everything for `late`
    let mut expected_event = 0;
    let mut gaps = 0;
    let mut last_seq = 0;
    loop {
        let e = late.event_any().await;
        let i = e["payload"]["i"].as_u64().unwrap();
        let seq = e["seq"].as_u64().unwrap();
        assert_eq!(
            seq,
            i + 1,
            "each event keeps its seq; drops consumed theirs"
        );
        if seq > last_seq + 1 {
            gaps += 1;
            assert!(seq - last_seq - 1 <= 3, "a gap spans only dropped ticks");
        }
        last_seq = seq;
        match e["event"].as_str().unwrap() {
            "test.event" => {
                assert_eq!(i, expected_event * 4, "no non-droppable event lost");
                expected_event += 1;
            }
            "test.marker" => break,
            _ => {}
        }
    }
    assert_eq!(expected_event, rounds);
    let dropped = late_client_drops(&h);
    assert!(dropped > 0, "the soft limit was reached");
    assert!(gaps > 0 && gaps <= rounds);
}

fn late_client_drops(h: &Harness) -> u64 {
    h.broker
        .ctx()
        .hub
        .clients()
        .iter()
        .map(|c| c.dropped.load(std::sync::atomic::Ordering::Relaxed))
        .sum()
}

/// One event larger than the hard limit still reaches a client that is
/// keeping up: the limit is about falling behind, not about event size.
#[tokio::test]
async fn one_large_event_is_not_a_slow_consumer() {
    let h = start_with(mock_config(), |s| s.limits.queue_hard_bytes = 64 * 1024).await;
    let (mut a, _) = h.connected().await;
    h.gw.broadcast("test.big", json!({"pad": "z".repeat(200 * 1024)}));
    let e = a.event("test.big").await;
    assert_eq!(e["payload"]["pad"].as_str().unwrap().len(), 200 * 1024);
    assert_eq!(
        a.request("health", json!({})).await["ok"],
        true,
        "still connected"
    );
}
