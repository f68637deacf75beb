//! The upstream session survives what gateways do over weeks: restarts,
//! crashes, slow starts, silence, refused credentials (design §4, §10 of
//! gateway-protocol.md). Local clients stay connected and get honest signals.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;
use clawmux_mock::Rejection;
use serde_json::{json, Value};

/// Polls `/healthz` until the upstream phase is `phase`; returns the body.
async fn wait_phase(socket: &std::path::Path, phase: &str) -> Value {
    eventually_async(&format!("upstream phase {phase}"), || async {
        let (_, body) = http_get(socket, "/healthz").await;
        if body["upstream"] == phase {
            Ok(body)
        } else {
            Err(body)
        }
    })
    .await
}

/// A broker whose `backoff_max` (the cap on any delay the gateway asks
/// for) is above the hints these tests send.
async fn start_honouring_hints() -> Harness {
    start_with(mock_config(), |s| {
        s.upstream.backoff_max = Duration::from_secs(2);
    })
    .await
}

fn seq(ev: &Value) -> u64 {
    ev["seq"].as_u64().expect("event has a seq")
}

/// A restart announced by the gateway: `shutdown` with `restartExpectedMs`,
/// close 1012. Clients stay, see the event and a gap, and the broker waits
/// the announced time before reconnecting.
#[tokio::test(start_paused = true)]
async fn announced_restart_is_ridden_through_after_restart_expected_ms() {
    let h = start_honouring_hints().await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    h.gw.restart_notice(Some(400)).await;
    for c in [&mut a, &mut b] {
        let shutdown = c.event("shutdown").await;
        assert_eq!(shutdown["payload"]["restartExpectedMs"], 400);
        let lost = c.event("clawmux.upstream").await;
        assert_eq!(lost["payload"]["phase"], "backoff", "{lost}");
        assert!(
            lost["payload"]["reason"].as_str().unwrap().contains("1012"),
            "{lost}"
        );
        assert_eq!(seq(&lost), seq(&shutdown) + 1);
    }
    let lost_at = tokio::time::Instant::now();
    let back = a.event("clawmux.upstream").await;
    let waited = lost_at.elapsed();
    assert_eq!(back["payload"]["phase"], "ready", "{back}");
    assert_eq!(back["payload"]["reason"], "reconnected");
    assert!(
        waited >= Duration::from_millis(350),
        "reconnected after {waited:?}, before the announced 400 ms"
    );
    let back_b = b.event("clawmux.upstream").await;
    assert!(seq(&back_b) > 1, "{back_b}");
    assert_eq!(a.request("status", json!({})).await["ok"], true);
    assert_eq!(b.request("health", json!({})).await["ok"], true);
    assert_eq!(h.gw.total_connections(), 2, "one reconnect, no hammering");
}

/// A crash (sockets dropped without a close frame): clients stay, see a gap
/// and both events, and requests work again.
#[tokio::test]
async fn crash_is_ridden_through_with_a_gap() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    h.gw.broadcast("tick", json!({"ts": 1}));
    let before = a.event("tick").await;
    h.gw.drop_all();
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff");
    assert_eq!(seq(&lost), seq(&before) + 1);
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready");
    assert!(
        seq(&back) > seq(&lost) + 1,
        "a skipped seq tells gap-detecting clients to resync: {lost} then {back}"
    );
    assert_eq!(a.request("sessions.list", json!({})).await["ok"], true);
    let body = wait_phase(&h.socket(), "ready").await;
    assert_eq!(body["lastError"], Value::Null);
}

/// While the gateway starts it answers `UNAVAILABLE` + `retryAfterMs:500`
/// and closes 1013. The broker waits that long each time (no hammering) and
/// a local connect made meanwhile simply succeeds once the gateway is up.
#[tokio::test(start_paused = true)]
async fn slow_start_waits_retry_after_ms_between_attempts() {
    let faults = Faults {
        unavailable_connects: 2,
        ..Faults::default()
    };
    let t0 = tokio::time::Instant::now();
    let h = start_faulty(mock_config(), faults, |s| {
        s.upstream.backoff_max = Duration::from_secs(2);
    })
    .await;
    let (mut c, hello) = h.connected().await;
    let elapsed = t0.elapsed();
    assert_eq!(hello["type"], "hello-ok");
    assert_eq!(
        h.gw.total_connections(),
        3,
        "two refused attempts, then one"
    );
    assert!(
        elapsed >= Duration::from_millis(950),
        "two retryAfterMs waits of 500 ms, got {elapsed:?}"
    );
    assert_eq!(c.request("health", json!({})).await["ok"], true);
}

/// A wedged gateway sends nothing: after 2 × tickIntervalMs of silence the
/// broker closes (4000 "tick timeout") and reconnects. Ticks keep it alive.
#[tokio::test]
async fn silence_trips_the_watchdog_and_the_broker_reconnects() {
    let cfg = MockConfig {
        tick_interval_ms: 100,
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let (mut a, _) = h.connected().await;
    for _ in 0..4 {
        a.event("tick").await;
    }
    assert_eq!(
        h.gw.total_connections(),
        1,
        "ticks every 100 ms keep the 200 ms watchdog quiet"
    );
    h.gw.set_faults(Faults {
        silent: true,
        ..Faults::default()
    });
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff");
    let reason = lost["payload"]["reason"].as_str().unwrap();
    assert!(reason.contains("2 x tickIntervalMs"), "{reason}");
    h.gw.set_faults(Faults::default());
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready");
    assert_eq!(a.request("health", json!({})).await["ok"], true);
}

/// A refused connect (wrong token, pairing) is retried only every
/// `backoff_max`, never in a tight loop; once the gateway accepts again the
/// broker recovers by itself.
#[tokio::test(start_paused = true)]
async fn rejected_connects_are_retried_only_every_backoff_max() {
    let faults = Faults {
        reject_connect: Some(Rejection::token_mismatch()),
        ..Faults::default()
    };
    let t0 = tokio::time::Instant::now();
    let h = start_faulty(mock_config(), faults, |s| {
        s.upstream.backoff_initial = Duration::from_millis(1);
        s.upstream.backoff_max = Duration::from_millis(100);
    })
    .await;
    let body = wait_phase(&h.socket(), "rejected").await;
    assert_eq!(body["lastError"], "studio.upstream_rejected");
    eventually("four attempts", || h.gw.total_connections() >= 4).await;
    let elapsed = t0.elapsed();
    let attempts = h.gw.total_connections();
    assert!(
        elapsed >= Duration::from_millis(300),
        "{attempts} attempts in {elapsed:?}: retries must be ≥ 100 ms apart"
    );
    assert!(
        attempts as u128 <= elapsed.as_millis() / 100 + 1,
        "{attempts} attempts in {elapsed:?}"
    );
    // A local connect meanwhile fails at once with the gateway's reason.
    let mut c = h.client().await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "studio.upstream_rejected");
    assert_eq!(
        res["error"]["details"]["details"]["code"],
        "AUTH_TOKEN_MISMATCH"
    );
    h.gw.set_faults(Faults::default());
    wait_phase(&h.socket(), "ready").await;
    let (mut c, _) = h.connected().await;
    assert_eq!(c.request("health", json!({})).await["ok"], true);
}

/// A remote gateway that wants the broker's device approved: the local
/// connect error and `clawmux status` name the exact approval command with
/// the gateway's request id, and the broker picks the approval up by itself.
#[tokio::test]
async fn pairing_required_names_the_command_and_the_approval_is_picked_up() {
    let rejection = Rejection::pairing_required();
    let request_id = rejection.details.as_ref().unwrap()["requestId"]
        .as_str()
        .unwrap()
        .to_owned();
    let faults = Faults {
        reject_connect: Some(rejection),
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |s| {
        s.upstream.backoff_max = Duration::from_millis(200);
    })
    .await;
    wait_phase(&h.socket(), "rejected").await;
    let command = format!("openclaw devices approve {request_id}");
    let mut c = h.client().await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "studio.upstream_rejected");
    let message = res["error"]["message"].as_str().unwrap();
    assert!(message.contains(&command), "{message}");
    let home = h.dir.path().join("home");
    let socket = h.socket();
    let out = tokio::task::spawn_blocking(move || {
        crate::support::isolated_command(env!("CARGO_BIN_EXE_clawmux"), &home)
            .args(["status", "--socket"])
            .arg(&socket)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    // The error is wrapped at words: compare with the line breaks undone.
    let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        joined.contains(&command),
        "status shows the command: {text}"
    );
    // Approved on the gateway: the broker gets in by itself.
    h.gw.set_faults(Faults::default());
    wait_phase(&h.socket(), "ready").await;
    let (mut c, _) = h.connected().await;
    assert_eq!(c.request("health", json!({})).await["ok"], true);
}

/// Failures that are neither refusals nor timed by the gateway back off
/// exponentially from `backoff_initial`, capped at `backoff_max`. The
/// "gateway" here accepts TCP and never answers the upgrade, so every
/// attempt ends at the handshake timeout; the test times the accepts.
#[tokio::test]
async fn failures_back_off_exponentially_up_to_the_cap() {
    let mute = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}", mute.local_addr().unwrap());
    let (timeout, initial, max) = (30u64, 40u64, 150u64);
    let (_b, _d) = broker_only(|s| {
        s.gateway_url = url;
        s.upstream.handshake_timeout = Duration::from_millis(timeout);
        s.upstream.backoff_initial = Duration::from_millis(initial);
        s.upstream.backoff_max = Duration::from_millis(max);
    })
    .await;
    let mut accepted = Vec::new();
    let mut held = Vec::new();
    while accepted.len() < 8 {
        let (s, _) = tokio::time::timeout(PATIENCE, mute.accept())
            .await
            .expect("the broker keeps retrying")
            .unwrap();
        accepted.push(Instant::now());
        held.push(s);
    }
    for (k, pair) in accepted.windows(2).enumerate() {
        let gap = pair[1] - pair[0];
        let backoff = (initial << k).min(max);
        // Jitter takes off at most 20 %; the timeout comes on top.
        let least = Duration::from_millis(timeout + backoff * 8 / 10);
        assert!(gap >= least, "gap {k}: {gap:?} < {least:?}");
        if k == 6 {
            // Capped it is about 180 ms; uncapped it would be 2,078 ms at
            // the least (timers never fire early): a margin no loaded
            // machine's lateness reaches, unlike a bound near the capped value.
            let uncapped = Duration::from_millis(timeout + (initial << k) * 8 / 10);
            assert!(gap < uncapped, "gap {k}: {gap:?} is not capped");
        }
    }
}

/// The gateway rotates its shared token: it closes every session 4001
/// "gateway auth changed", and the old token is refused from then on. The
/// clients learn why, and the broker settles in `rejected` (retrying only
/// every `backoff_max`) until its token is updated.
#[tokio::test]
async fn token_rotation_ends_in_rejected_with_the_reason() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        reject_connect: Some(Rejection::token_mismatch()),
        ..Faults::default()
    });
    h.gw.close_all(4001, "gateway auth changed").await;
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff");
    let reason = lost["payload"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("4001") && reason.contains("gateway auth changed"),
        "{reason}"
    );
    let body = wait_phase(&h.socket(), "rejected").await;
    assert_eq!(body["lastError"], "studio.upstream_rejected");
    let res = a.request("health", json!({})).await;
    assert_eq!(res["error"]["code"], "studio.upstream_rejected", "{res}");
    assert_eq!(
        res["error"]["details"]["details"]["code"],
        "AUTH_TOKEN_MISMATCH"
    );
}

/// The gateway's own slow-consumer close (1008 mid-session) is a lost
/// session, not a refusal: the broker reconnects at once.
#[tokio::test]
async fn gateway_slow_consumer_close_is_a_reconnect_not_a_rejection() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    h.gw.slow_consumer_close().await;
    let lost = a.event("clawmux.upstream").await;
    assert!(
        lost["payload"]["reason"]
            .as_str()
            .unwrap()
            .contains("slow consumer"),
        "{lost}"
    );
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready");
    assert_eq!(a.request("health", json!({})).await["ok"], true);
}

/// Requests pending on a session that ends fail at once, with the restart
/// delay the gateway announced; they are never replayed on the next session.
#[tokio::test]
async fn pending_requests_fail_on_loss_and_are_never_replayed() {
    let h = start_honouring_hints().await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    });
    a.send_json(&json!({"type":"req","id":"held","method":"status","params":{}}))
        .await;
    h.gw.wait_request("status", PATIENCE)
        .await
        .expect("the double saw the request");
    h.gw.set_faults(Faults::default());
    h.gw.restart_notice(Some(250)).await;
    let res = a.response("held").await;
    assert_eq!(res["ok"], false);
    assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
    assert_eq!(res["error"]["retryable"], true);
    assert_eq!(res["error"]["retryAfterMs"], 250, "{res}");
    a.event("clawmux.upstream").await;
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready");
    assert_eq!(a.request("status", json!({})).await["ok"], true);
    let statuses: Vec<u64> =
        h.gw.requests()
            .iter()
            .filter(|(_, r)| r["method"] == "status")
            .map(|(conn, _)| *conn)
            .collect();
    assert_eq!(
        statuses,
        vec![0, 1],
        "one status per session: the held one was not replayed"
    );
}

/// Requests while the session is down fail fast with `retryAfterMs`, and
/// `/healthz` shows the phase and the reason.
#[tokio::test]
async fn requests_while_down_fail_fast_with_retry_after() {
    let h = start_with(mock_config(), |s| {
        s.upstream.backoff_initial = Duration::from_secs(5)
    })
    .await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        unavailable_connects: 1_000_000,
        ..Faults::default()
    });
    h.gw.drop_all();
    a.event("clawmux.upstream").await;
    // Fails fast: answered before the broker's next attempt (5 s away),
    // not held until it.
    let attempts = h.gw.total_connections();
    let res = a.request("health", json!({})).await;
    assert_eq!(
        h.gw.total_connections(),
        attempts,
        "answered before the next attempt"
    );
    assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
    assert_eq!(res["error"]["retryable"], true);
    let retry = res["error"]["retryAfterMs"].as_u64().expect("retryAfterMs");
    assert!(retry <= 5000, "{res}");
    let body = wait_phase(&h.socket(), "backoff").await;
    assert_eq!(body["lastError"], "studio.upstream_closed");
}

/// Every phase is visible on `/healthz`: connecting (TCP open, no upgrade
/// answer), handshaking (no `hello-ok` yet), ready, and stopped at shutdown.
#[tokio::test]
async fn phases_are_reported_on_healthz() {
    // A loopback listener that accepts and never answers the upgrade.
    let mute = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}", mute.local_addr().unwrap());
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&held);
    let acceptor = tokio::spawn(async move {
        while let Ok((s, _)) = mute.accept().await {
            keep.lock().unwrap().push(s);
        }
    });
    let (b, _d) = broker_only(|s| {
        s.gateway_url = url;
        s.upstream.handshake_timeout = Duration::from_millis(300);
    })
    .await;
    wait_phase(b.socket_path(), "connecting").await;
    let body = wait_phase(b.socket_path(), "backoff").await;
    assert_eq!(body["lastError"], "studio.upstream_timeout");
    acceptor.abort();
    b.shutdown(PATIENCE).await;

    let faults = Faults {
        hello_delay: Some(Duration::from_millis(300)),
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |_| {}).await;
    wait_phase(&h.socket(), "handshaking").await;
    let body = wait_phase(&h.socket(), "ready").await;
    assert!(body["deviceId"].is_string(), "{body}");
    let ctx = Arc::clone(h.broker.ctx());
    h.broker.shutdown(PATIENCE).await;
    assert_eq!(ctx.upstream().phase().as_str(), "stopped");
}

/// The socket buffers between broker and gateway, each way: set by the
/// test on both ends, so what fills first is the test's figure, not the
/// kernel's defaults (loopback TCP may otherwise buffer tens of MiB).
const SOCKET_BUFFER: usize = 64 * 1024;

/// Frames of [`fill_socket_buffers`]: 8 MiB in all, far more than the
/// [`SOCKET_BUFFER`]s hold (the kernel at most doubles each) and half the
/// outlet's 16 MiB bound, so the writer stalls with every request queued.
const FILL_FRAMES: usize = 8;

/// A broker in front of a double whose sockets have [`SOCKET_BUFFER`]s.
async fn start_small_buffers(cfg: MockConfig, tweak: impl FnOnce(&mut Settings)) -> Harness {
    let cfg = MockConfig {
        recv_buffer_bytes: Some(SOCKET_BUFFER as u32),
        ..cfg
    };
    start_with(cfg, |s| {
        s.upstream.send_buffer_bytes = Some(SOCKET_BUFFER);
        tweak(s);
    })
    .await
}

/// Sends [`FILL_FRAMES`] requests of 1 MiB: more than the socket buffers
/// between broker and a gateway that stopped reading can hold.
async fn fill_socket_buffers(a: &mut WsClient) {
    let pad = "x".repeat(1 << 20);
    for i in 0..FILL_FRAMES {
        a.send_json(
            &json!({"type":"req","id":format!("big{i}"),"method":"health","params":{"pad":pad}}),
        )
        .await;
    }
}

/// A gateway that stops reading must not freeze the broker: while its
/// writes wait, events are still read (the gateway's ticks keep the silence
/// watchdog quiet, which would otherwise fire first); a write that makes no
/// progress for `write_timeout` ends the session, pending requests fail at
/// once, and the broker reconnects when the gateway reads again. On paused
/// time: ticks every second (silence limit 2 s) and a 1.5 s write timeout
/// come in that order on any machine.
#[tokio::test(start_paused = true)]
async fn a_gateway_that_stops_reading_ends_the_session_not_the_broker() {
    let cfg = MockConfig {
        tick_interval_ms: 1000,
        ..mock_config()
    };
    let h = start_small_buffers(cfg, |s| {
        s.upstream.write_timeout = Duration::from_millis(1500);
    })
    .await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        stop_reading: true,
        ..Faults::default()
    });
    fill_socket_buffers(&mut a).await;
    // Read while the writer waits: the tick the gateway sends meanwhile.
    a.event("tick").await;
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff", "{lost}");
    assert!(
        lost["payload"]["reason"]
            .as_str()
            .unwrap()
            .contains("no progress"),
        "the writer timed out while the reader kept reading ticks: {lost}"
    );
    // The first may have been read as the gateway stopped (its read was
    // already under way); from the first failed one on, every one fails.
    let mut failing = false;
    for i in 0..FILL_FRAMES {
        let res = a.response(&format!("big{i}")).await;
        failing |= res["ok"] == false;
        if failing {
            assert_eq!(
                res["error"]["code"], "studio.upstream_closed",
                "big{i}: {res}"
            );
        }
    }
    assert!(
        failing,
        "the requests written to a gateway that stopped reading fail"
    );
    h.gw.set_faults(Faults::default());
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready", "{back}");
    assert_eq!(a.request("status", json!({})).await["ok"], true);
}

/// A full upstream queue answers at once with a retryable error instead of
/// blocking the client's reads (and with them every other request).
#[tokio::test(start_paused = true)]
async fn a_full_upstream_queue_fails_requests_at_once() {
    let h = start_small_buffers(mock_config(), |s| {
        s.upstream.write_timeout = Duration::from_secs(30);
        s.limits.max_inflight = 4096;
    })
    .await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        stop_reading: true,
        ..Faults::default()
    });
    fill_socket_buffers(&mut a).await;
    let n = clawmux::upstream::UPSTREAM_QUEUE_FRAMES + 200;
    for i in 0..n {
        a.send_json(&json!({"type":"req","id":format!("s{i}"),"method":"health","params":{}}))
            .await;
    }
    let last = a.response(&format!("s{}", n - 1)).await;
    assert_eq!(last["ok"], false, "{last}");
    assert_eq!(last["error"]["code"], "studio.too_many_requests", "{last}");
    assert_eq!(last["error"]["retryable"], true, "{last}");
    assert!(last["error"]["retryAfterMs"].as_u64().is_some(), "{last}");
    h.gw.set_faults(Faults::default());
}

/// A day-long restart hint is capped at `backoff_max`: the broker is back
/// as soon as the gateway is.
#[tokio::test]
async fn a_restart_hint_of_a_day_is_capped_at_backoff_max() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    h.gw.restart_notice(Some(86_400_000)).await;
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff");
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready", "{back}");
}

/// A gateway that closes every session right after `hello-ok` is retried
/// with growing delays, not at a fixed pace.
#[tokio::test(start_paused = true)]
async fn sessions_closed_right_after_hello_back_off() {
    let h = start_with(mock_config(), |s| {
        s.upstream.backoff_initial = Duration::from_millis(50);
        s.upstream.backoff_max = Duration::from_millis(800);
    })
    .await;
    let (_a, _) = h.connected().await;
    let before = h.gw.total_connections();
    h.gw.set_faults(Faults {
        close_after_hello: true,
        ..Faults::default()
    });
    h.gw.restart_notice(Some(0)).await;
    // Two seconds of tokio's paused clock: the count is the backoff's,
    // whatever this machine's speed.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sessions = h.gw.total_connections() - before;
    h.gw.set_faults(Faults::default());
    // 250 (hint floor), then 100, 200, 400, 800, 800 ms: about 6 in 2 s.
    // Without backoff (a fixed 50 ms) it would be about 30.
    assert!(sessions <= 10, "{sessions} sessions in 2 s");
    assert!(sessions >= 2, "{sessions} sessions in 2 s");
}

/// A frame over the upstream limit ends the session (the broker never
/// buffers an unbounded frame) and the broker reconnects.
#[tokio::test]
async fn an_oversized_gateway_frame_ends_the_session() {
    let h = start_with(mock_config(), |s| {
        s.upstream.max_frame_bytes = 64 * 1024;
    })
    .await;
    let (mut a, _) = h.connected().await;
    let big = json!({"type":"event","event":"custom.big","payload":{"pad":"x".repeat(100 * 1024)},"seq":999});
    h.gw.send_raw(&big.to_string());
    let lost = a.event("clawmux.upstream").await;
    assert!(
        lost["payload"]["reason"]
            .as_str()
            .unwrap()
            .contains("over the broker's limit"),
        "{lost}"
    );
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready");
}

/// Events before `hello-ok` are kept only up to a bound; beyond it clients
/// see a gap instead.
#[tokio::test]
async fn early_events_are_bounded() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        early_events: 300,
        ..Faults::default()
    });
    h.gw.drop_all();
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff");
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready");
    h.gw.broadcast("custom.after", json!({}));
    let mut early = 0;
    loop {
        let ev = a.event_any().await;
        if ev["event"] == "custom.after" {
            break;
        }
        if ev["event"] == "tick" && ev["payload"]["early"].is_u64() {
            early += 1;
        }
    }
    h.gw.set_faults(Faults::default());
    assert_eq!(early, 256, "the pre-hello buffer keeps 256 events");
}

/// An event whose `seq` is not a non-negative integer is still delivered.
#[tokio::test]
async fn events_with_malformed_seq_are_delivered() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    for (n, seq) in ["-1", "1.5", "\"7\""].iter().enumerate() {
        h.gw.send_raw(&format!(
            r#"{{"type":"event","event":"custom.odd","payload":{{"n":{n}}},"seq":{seq}}}"#
        ));
        let ev = a.event("custom.odd").await;
        assert_eq!(ev["payload"]["n"], n, "{ev}");
        assert!(
            ev["seq"].is_u64(),
            "the client gets the broker's own seq: {ev}"
        );
    }
}

/// A local connect during a long backoff makes the broker try now: a
/// gateway that is back is used at once, not at the end of the backoff.
#[tokio::test]
async fn a_waiting_connect_triggers_an_attempt_during_backoff() {
    let h = start_with(mock_config(), |s| {
        s.upstream.backoff_initial = Duration::from_secs(30);
        s.upstream.backoff_max = Duration::from_secs(30);
        s.limits.connect_wait = Duration::from_secs(1);
    })
    .await;
    let (mut a, _) = h.connected().await;
    let Harness { gw, broker, dir } = h;
    let addr = gw.addr();
    gw.stop().await;
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff");
    let gw = MockGateway::start_on(addr, mock_config()).await.unwrap();
    // The next scheduled attempt is 2 s away at the soonest (loopback);
    // a client waiting 1 s gets the session anyway.
    // The hello-ok itself shows it: past `connect_wait` the broker would
    // answer the connect with an error instead.
    let mut c = WsClient::open(broker.socket_path(), "/ws").await;
    let hello = c.handshake().await;
    assert_eq!(hello["type"], "hello-ok", "{hello}");
    drop((gw, broker, dir));
}

/// A loopback gateway is probed at least every 2 s while it is down, so a
/// restarted local gateway is used within 2 s of being ready.
#[test]
fn loopback_urls_are_recognised() {
    use clawmux::upstream::is_loopback_url;
    assert!(is_loopback_url("ws://localhost:18789"));
    assert!(is_loopback_url("ws://127.0.0.1:18789/ws"));
    assert!(is_loopback_url("ws://[::1]:18789"));
    assert!(!is_loopback_url("wss://gateway.example:443"));
    assert!(!is_loopback_url("ws://192.168.1.2:18789"));
}

/// Clients that need to see a restart (Claw3D's restart flow waits for its
/// socket to drop) are closed as a direct connection would be: by default on
/// Claw3D's path `/api/gateway/ws`, on any path with `?restarts=mirror`.
/// Others stay connected through it.
#[tokio::test]
async fn restarts_can_be_mirrored_per_connection() {
    let h = start().await;
    let mut claw3d = WsClient::open(&h.socket(), "/api/gateway/ws").await;
    claw3d.handshake().await;
    let mut chosen = WsClient::open(&h.socket(), "/ws?restarts=mirror").await;
    chosen.handshake().await;
    let mut kept = WsClient::open(&h.socket(), "/api/gateway/ws?restarts=continuity").await;
    kept.handshake().await;
    h.gw.restart_notice(Some(100)).await;
    for c in [&mut claw3d, &mut chosen] {
        c.event("shutdown").await;
        assert_eq!(c.expect_close().await, (1012, "service restart".into()));
    }
    let back = loop {
        let ev = kept.event("clawmux.upstream").await;
        if ev["payload"]["phase"] == "ready" {
            break ev;
        }
    };
    assert_eq!(back["payload"]["reason"], "reconnected");
    assert_eq!(kept.request("health", json!({})).await["ok"], true);
}
