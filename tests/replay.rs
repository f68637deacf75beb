//! Snapshot, cursor and replay (design §6): `/v1/state` + `/v1/events`.

#[path = "support/http_api.rs"]
mod http_api;
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_api::*;
use serde_json::json;
use support::*;

/// Broadcasts `n` custom events and waits until the broker has logged them.
async fn publish(h: &Harness, n: usize) -> u64 {
    let before = until_ready(&h.socket()).await["newest_seq"]
        .as_u64()
        .unwrap();
    for i in 0..n {
        h.gw.broadcast("test.event", json!({ "i": i }));
    }
    let target = before + n as u64;
    wait_newest_seq(&h.socket(), target).await;
    target
}

#[tokio::test]
async fn resuming_from_every_cursor_in_the_window_loses_and_repeats_nothing() {
    let h = start_with(mock_config(), |s| s.limits.replay_max_events = 20).await;
    let newest = publish(&h, 35).await;
    let s = state(&h.socket()).await;
    let (oldest, epoch) = (
        s["oldest_seq"].as_u64().unwrap(),
        s["epoch"].as_str().unwrap(),
    );
    assert_eq!(s["newest_seq"], newest);
    assert_eq!(
        newest - oldest + 1,
        20,
        "the window holds replay_max_events"
    );
    for cursor in oldest - 1..newest {
        let mut sse = open_events(
            &h.socket(),
            &format!("/v1/events?after_seq={cursor}&epoch={epoch}"),
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("cursor {cursor}: {e:?}"));
        assert_eq!(sse.headers["clawmux-epoch"], epoch);
        assert_eq!(
            sse.headers["clawmux-after-seq"],
            cursor.to_string().as_str()
        );
        let ids: Vec<u64> = sse
            .events_through(newest)
            .await
            .iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(
            ids,
            (cursor + 1..=newest).collect::<Vec<_>>(),
            "cursor {cursor}"
        );
    }
    // Resuming at the newest cursor: nothing replayed, the next live event is next.
    let mut sse = open_events(&h.socket(), &format!("/v1/events?after_seq={newest}"), &[])
        .await
        .unwrap();
    h.gw.broadcast("test.event", json!({"i": "live"}));
    let (id, name, data) = sse.next_event().await;
    assert_eq!((id, name.as_str()), (newest + 1, "test.event"));
    assert_eq!(data["payload"]["i"], "live");
    assert_eq!(
        data["seq"],
        newest + 1,
        "the data frame's seq is the cursor"
    );
}

#[tokio::test]
async fn last_event_id_wins_over_after_seq_and_filters_apply_to_replay() {
    let h = start().await;
    let newest = publish(&h, 6).await;
    h.gw.broadcast("other.event", json!({}));
    wait_newest_seq(&h.socket(), newest + 1).await;
    let mut sse = open_events(
        &h.socket(),
        "/v1/events?after_seq=0&events=test.event",
        &[("last-event-id", &(newest - 2).to_string())],
    )
    .await
    .unwrap();
    h.gw.broadcast("test.event", json!({"i": "after"}));
    let got: Vec<(u64, String)> = sse
        .events_through(newest + 2)
        .await
        .into_iter()
        .map(|(id, name, _)| (id, name))
        .collect();
    let name = "test.event".to_owned();
    assert_eq!(
        got,
        vec![
            (newest - 1, name.clone()),
            (newest, name.clone()),
            (newest + 2, name)
        ],
        "other.event ({}) is filtered out",
        newest + 1
    );
    let (status, body) = open_events(&h.socket(), "/v1/events?after_seq=x", &[])
        .await
        .err()
        .unwrap();
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("after_seq"),
        "{body}"
    );
    let bad_header = open_events(&h.socket(), "/v1/events", &[("last-event-id", "abc")]).await;
    assert_eq!(bad_header.err().unwrap().0, 400);
    let unknown = open_events(&h.socket(), "/v1/events?after=3", &[]).await;
    assert_eq!(
        unknown.err().unwrap().0,
        400,
        "unknown query parameters are refused"
    );
}

#[tokio::test]
async fn old_cursor_future_cursor_and_other_epoch_get_410() {
    let h = start_with(mock_config(), |s| s.limits.replay_max_events = 5).await;
    let newest = publish(&h, 12).await;
    let s = state(&h.socket()).await;
    let epoch = s["epoch"].as_str().unwrap().to_owned();
    let oldest = newest - 4;
    assert_eq!(s["oldest_seq"], oldest);
    let socket = h.socket();
    let gone = |path: String| {
        let socket = socket.clone();
        async move {
            match open_events(&socket, &path, &[]).await {
                Err((status, body)) => (status, body),
                Ok(_) => panic!("{path} should not stream"),
            }
        }
    };
    for path in [
        format!("/v1/events?after_seq={}", oldest - 2),
        format!("/v1/events?after_seq={}", newest + 1),
        format!("/v1/events?after_seq={newest}&epoch=not-this-one"),
        "/v1/events?epoch=not-this-one".to_owned(),
    ] {
        let (status, body) = gone(path.clone()).await;
        assert_eq!(status, 410, "{path}");
        assert_eq!(body["code"], "studio.replay_unavailable", "{path}");
        assert_eq!(body["oldest_seq"], oldest, "{path}");
        assert_eq!(body["newest_seq"], newest, "{path}");
        assert_eq!(body["epoch"], epoch.as_str(), "{path}");
        assert!(
            body["message"].as_str().unwrap().contains("/v1/state"),
            "{body}"
        );
    }
    assert!(
        open_events(
            &h.socket(),
            &format!("/v1/events?after_seq={}", oldest - 1),
            &[]
        )
        .await
        .is_ok(),
        "the oldest resumable cursor is oldest_seq - 1"
    );

    // A broker restart is a new epoch: the old cursor is refused even though
    // the new broker's numbers overlap it.
    let Harness { gw, broker, dir } = h;
    let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    broker.shutdown(Duration::from_secs(2)).await;
    let broker = RunningBroker::start(settings).await.unwrap();
    let h = Harness { gw, broker, dir };
    publish(&h, 3).await;
    let (status, body) = gone(format!("/v1/events?after_seq=1&epoch={epoch}")).await;
    assert_eq!(status, 410);
    assert_ne!(body["epoch"], epoch.as_str());
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("another broker life"),
        "{body}"
    );
}

/// The promise of `/v1/state`: streaming after its `newest_seq` continues
/// exactly where its snapshot stops, even while events keep arriving.
/// `presence` versions make it checkable: the snapshot holds version P, so
/// the first presence event streamed must be P+1 (P would be a repeat, P+2 a loss).
#[tokio::test]
async fn snapshot_then_stream_neither_misses_nor_repeats_under_concurrent_events() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let stop = AtomicBool::new(false);
    let broadcaster = async {
        let mut sent = 0u32;
        while !stop.load(Ordering::Relaxed) && sent < 50_000 {
            h.gw.broadcast_with_state_version("presence", json!({"presence": [{"n": sent}]}));
            sent += 1;
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        sent
    };
    let reader = async {
        for round in 0..25 {
            let s = state(&h.socket()).await;
            let held = s["snapshot"]["stateVersion"]["presence"].as_u64().unwrap();
            let mut sse = open_events(
                &h.socket(),
                &format!(
                    "/v1/events?after_seq={}&epoch={}&events=presence",
                    s["newest_seq"],
                    s["epoch"].as_str().unwrap()
                ),
                &[],
            )
            .await
            .unwrap();
            let mut last_id = s["newest_seq"].as_u64().unwrap();
            for expected in held + 1..=held + 3 {
                let (id, _, data) = sse.next_event().await;
                assert!(id > last_id, "round {round}: cursors increase");
                last_id = id;
                assert_eq!(
                    data["stateVersion"]["presence"], expected,
                    "round {round}: snapshot held presence v{held}"
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
    };
    let (sent, ()) = tokio::join!(broadcaster, reader);
    assert!(sent > 75, "events really flowed during the rounds ({sent})");
}

#[tokio::test]
async fn idle_streams_get_keep_alive_comments() {
    let h = start_with(mock_config(), |s| {
        s.limits.sse_keepalive = Duration::from_millis(50)
    })
    .await;
    let mut sse = open_events(&h.socket(), "/v1/events?events=nothing.matches", &[])
        .await
        .unwrap();
    match sse.next_item().await {
        Item::Comment(c) => assert!(c.contains("epoch"), "{c}"),
        other => panic!("the stream opens with a comment naming the epoch: {other:?}"),
    }
    until_ready(&h.socket()).await;
    // Events that the filter drops do not count as activity.
    h.gw.broadcast("test.event", json!({}));
    let mut keepalives = 0;
    while keepalives < 3 {
        match sse.next_item().await {
            Item::Comment(c) => {
                assert_eq!(c, ": keep-alive");
                keepalives += 1;
            }
            Item::Other(o) if o.starts_with("retry:") => {}
            other => panic!("only keep-alives on an idle stream: {other:?}"),
        }
    }
}

/// A stream whose reader stops reading is closed like a slow WebSocket
/// client (same queue policy), its connection is cut, and nobody else notices.
#[tokio::test]
async fn a_stuck_sse_reader_is_closed_as_a_slow_consumer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = start_with(mock_config(), |s| {
        // Above what hyper buffers for a body (~400 KiB), so the close
        // happens while hyper has stopped polling the stream.
        s.limits.queue_soft_bytes = 1024 * 1024;
        s.limits.queue_hard_bytes = 2 * 1024 * 1024;
        // The hard limit is raised to the gateway's 50 MiB buffer; a stuck
        // reader is caught by its lack of progress.
        s.limits.slow_grace = Duration::from_millis(300);
    })
    .await;
    until_ready(&h.socket()).await;
    let mut raw = tokio::net::UnixStream::connect(h.socket()).await.unwrap();
    raw.write_all(b"GET /v1/events HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    eventually("the stream is admitted", || {
        h.broker
            .ctx()
            .hub
            .clients()
            .iter()
            .any(|c| c.kind == clawmux::hub::ClientKind::Sse)
    })
    .await;
    let stats = &h.broker.ctx().hub.stats;
    let pad = "x".repeat(8 * 1024);
    let mut sent = 0;
    while stats.slow_closes.load(Ordering::Relaxed) == 0 {
        assert!(
            sent < 4000,
            "no slow-consumer close after {sent} events of 8 KiB"
        );
        for _ in 0..16 {
            h.gw.broadcast("test.big", json!({ "pad": pad }));
        }
        sent += 16;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // hyper cannot write the close record to a full socket, so it never
    // polls the stream again: the broker cuts the connection after a short
    // linger, without the reader doing anything.
    eventually("the stuck stream left the hub", || {
        h.broker.ctx().hub.clients().is_empty()
    })
    .await;
    let mut sink = Vec::new();
    tokio::time::timeout(PATIENCE, raw.read_to_end(&mut sink))
        .await
        .expect("reading what was buffered ends in EOF")
        .ok();
    assert!(!sink.is_empty());
    let s = state(&h.socket()).await;
    assert_eq!(s["upstream"]["phase"], "ready");
    assert_eq!(
        h.gw.total_connections(),
        1,
        "the upstream session never noticed"
    );
    let (status, res) = rpc(&h.socket(), r#"{"method":"health"}"#).await;
    assert_eq!((status, &res["ok"]), (200, &json!(true)));
}
