//! Snapshot, cursor and replay (design §6): `/v1/state` + `/v1/events`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::http_api::*;
use crate::support::*;
use serde_json::json;

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
    // Resuming at the newest cursor, named as the stream names it
    // (`<epoch>:<cursor>`): nothing replayed, the next live event is next,
    // and its id carries the broker life.
    let mut sse = open_events(
        &h.socket(),
        &format!("/v1/events?after_seq={epoch}:{newest}"),
        &[],
    )
    .await
    .unwrap();
    h.gw.broadcast("test.event", json!({"i": "live"}));
    let (id, id_epoch, name, data) = loop {
        if let Item::Event {
            id,
            epoch,
            name,
            data,
        } = sse.next_item().await
        {
            break (id, epoch, name, data);
        }
    };
    assert_eq!(id_epoch, epoch, "id: <epoch>:<cursor>");
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
    let epoch = wait_newest_seq(&h.socket(), newest + 1).await["epoch"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut sse = open_events(
        &h.socket(),
        &format!("/v1/events?after_seq={epoch}:0&events=test.event"),
        &[("last-event-id", &format!("{epoch}:{}", newest - 2))],
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
    for (path, why) in [
        (
            format!("/v1/events?after_seq={}&epoch={epoch}", oldest - 2),
            "no longer held",
        ),
        (
            format!("/v1/events?after_seq={epoch}:{}", newest + 1),
            "newer than the newest",
        ),
        (
            format!("/v1/events?after_seq={newest}&epoch=not-this-one"),
            "another broker life",
        ),
        (
            "/v1/events?epoch=not-this-one".to_owned(),
            "another broker life",
        ),
        (
            format!("/v1/events?after_seq={epoch}:{newest}&epoch=not-this-one"),
            "another broker life",
        ),
    ] {
        let (status, body) = gone(path.clone()).await;
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(why), "{path}: {message}");
        assert_eq!(status, 410, "{path}");
        assert_eq!(body["error"]["code"], "studio.replay_unavailable", "{path}");
        assert_eq!(body["error"]["details"]["oldest_seq"], oldest, "{path}");
        assert_eq!(body["error"]["details"]["newest_seq"], newest, "{path}");
        assert_eq!(body["error"]["details"]["epoch"], epoch.as_str(), "{path}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("/v1/state"),
            "{body}"
        );
    }
    assert!(
        open_events(
            &h.socket(),
            &format!("/v1/events?after_seq={epoch}:{}", oldest - 1),
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
    assert_ne!(body["error"]["details"]["epoch"], epoch.as_str());
    assert!(
        body["error"]["message"]
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

/// The id of an event as the stream wrote it, which is what a browser
/// `EventSource` sends back as `Last-Event-ID`.
fn raw_id(epoch: &str, cursor: u64) -> String {
    if epoch.is_empty() {
        cursor.to_string()
    } else {
        format!("{epoch}:{cursor}")
    }
}

/// The next event record with the raw id it carried.
async fn next_with_raw_id(sse: &mut Sse) -> (String, u64, String) {
    loop {
        if let Item::Event {
            id, epoch, name, ..
        } = sse.next_item().await
        {
            return (raw_id(&epoch, id), id, name);
        }
    }
}

/// A browser `EventSource` never changes its URL: after a broker restart it
/// resends only the last id it saw. That id names the old broker life, so
/// the new broker refuses it (410) even though its own cursors overlap it,
/// and a bare cursor that names no life is refused the same way.
#[tokio::test]
async fn a_last_event_id_from_an_earlier_broker_life_never_resumes() {
    let h = start().await;
    let newest = publish(&h, 3).await;
    let old_epoch = state(&h.socket()).await["epoch"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut sse = open_events(&h.socket(), "/v1/events", &[]).await.unwrap();
    h.gw.broadcast("test.event", json!({"i": "seen"}));
    let (seen, cursor, _) = next_with_raw_id(&mut sse).await;
    assert_eq!(cursor, newest + 1);
    drop(sse);

    let Harness { gw, broker, dir } = h;
    let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    broker.shutdown(Duration::from_secs(2)).await;
    let broker = RunningBroker::start(settings).await.unwrap();
    let h = Harness { gw, broker, dir };
    // The new life has handed out more cursors than the old id names.
    let newest = publish(&h, cursor as usize + 3).await;
    let s = state(&h.socket()).await;
    let epoch = s["epoch"].as_str().unwrap().to_owned();
    assert_ne!(epoch, old_epoch);

    let (status, body) = open_events(&h.socket(), "/v1/events", &[("last-event-id", &seen)])
        .await
        .err()
        .expect("the old life's id must not resume");
    assert_eq!(status, 410);
    assert_eq!(body["error"]["code"], "studio.replay_unavailable");
    assert_eq!(body["error"]["details"]["epoch"], epoch.as_str());
    assert_eq!(body["error"]["details"]["newest_seq"], newest);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("another broker life"), "{message}");

    // A bare cursor (no epoch anywhere) could be from any life: refused.
    let bare = cursor.to_string();
    for (path, header) in [
        ("/v1/events".to_owned(), Some(bare.as_str())),
        (format!("/v1/events?after_seq={bare}"), None),
    ] {
        let headers: Vec<(&str, &str)> = header.map(|v| ("last-event-id", v)).into_iter().collect();
        let (status, body) = open_events(&h.socket(), &path, &headers)
            .await
            .err()
            .unwrap_or_else(|| panic!("a bare cursor must not resume: {path} {header:?}"));
        assert_eq!(status, 410, "{path}");
        assert_eq!(body["error"]["code"], "studio.replay_unavailable");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("<epoch>:<cursor>"),
            "{body}"
        );
    }

    // A bare cursor qualified by `epoch=` (as built from /v1/state) resumes,
    // as does this life's own id.
    for (path, headers) in [
        (
            format!("/v1/events?epoch={epoch}"),
            vec![("last-event-id", bare.clone())],
        ),
        (format!("/v1/events?after_seq={bare}&epoch={epoch}"), vec![]),
        (
            "/v1/events".to_owned(),
            vec![("last-event-id", format!("{epoch}:{bare}"))],
        ),
    ] {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut sse = open_events(&h.socket(), &path, &headers)
            .await
            .unwrap_or_else(|e| panic!("{path}: {e:?}"));
        let (id, cursor_next, _) = next_with_raw_id(&mut sse).await;
        assert_eq!(cursor_next, cursor + 1, "{path}");
        assert_eq!(id, format!("{epoch}:{}", cursor + 1));
    }
    assert_eq!(
        seen,
        format!("{old_epoch}:{cursor}"),
        "id: <epoch>:<cursor>"
    );
}

/// Reads records until the next event, returning it and any `clawmux.gap`
/// record seen on the way.
async fn next_event_and_gap(sse: &mut Sse) -> (u64, String, Option<String>) {
    let mut gap = None;
    loop {
        match sse.next_item().await {
            Item::Event { id, name, .. } => return (id, name, gap),
            Item::Other(o) if o.starts_with("event: clawmux.gap") => gap = Some(o),
            _ => {}
        }
    }
}

/// An upstream reconnect or an upstream `seq` gap consumes a cursor, so
/// SSE streams see a skipped id (as WebSocket clients see a skipped `seq`)
/// and a `clawmux.gap` record, filtered streams included; resuming across
/// the gap works from either side of it.
#[tokio::test]
async fn upstream_gaps_and_reconnects_show_as_skipped_ids_and_replay_across_them() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let epoch = state(&h.socket()).await["epoch"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut all = open_events(&h.socket(), "/v1/events", &[]).await.unwrap();
    let mut filtered = open_events(&h.socket(), "/v1/events?events=test.event", &[])
        .await
        .unwrap();

    // The gateway drops the connection; the broker reconnects.
    h.gw.drop_all();
    let (lost, name, _) = next_event_and_gap(&mut all).await;
    assert_eq!(name, "clawmux.upstream");
    let (back, name, gap) = next_event_and_gap(&mut all).await;
    assert_eq!(name, "clawmux.upstream");
    assert_eq!(back, lost + 2, "the reconnect skipped one id");
    let gap = gap.expect("a clawmux.gap record before the skipped id");
    assert!(
        gap.contains(&format!(r#"{{"after":{lost},"next":{back}}}"#)),
        "{gap}"
    );
    until_ready(&h.socket()).await;

    // The gateway skips a seq: one more skipped id.
    h.gw.broadcast("test.event", json!({"i": 1}));
    let (one, _, gap) = next_event_and_gap(&mut all).await;
    assert_eq!((one, gap), (back + 1, None));
    h.gw.skip_seq();
    h.gw.broadcast("test.event", json!({"i": 2}));
    let (two, _, gap) = next_event_and_gap(&mut all).await;
    assert_eq!(two, one + 2, "the upstream seq gap skipped one id");
    assert!(gap.is_some());

    // The filtered stream never saw the clawmux.upstream events, yet it is
    // told about both gaps.
    let (id, _, gap) = next_event_and_gap(&mut filtered).await;
    assert_eq!(id, one);
    assert!(
        gap.unwrap()
            .contains(&format!(r#"{{"after":{lost},"next":{back}}}"#)),
        "the reconnect"
    );
    let (id, _, gap) = next_event_and_gap(&mut filtered).await;
    assert_eq!(id, two);
    assert!(gap.is_some(), "the upstream seq gap");

    // Replaying across the skipped ids: after the last event before a gap,
    // and after the skipped cursor itself (e.g. a /v1/state newest_seq).
    for (after, first, gap_expected) in [(lost, back, true), (lost + 1, back, false)] {
        let mut sse = open_events(
            &h.socket(),
            &format!("/v1/events?after_seq={epoch}:{after}"),
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("resume after {after} (next to a gap): {e:?}"));
        let (id, _, gap) = next_event_and_gap(&mut sse).await;
        assert_eq!((id, gap.is_some()), (first, gap_expected), "after {after}");
        let ids: Vec<u64> = sse.events_through(two).await.iter().map(|e| e.0).collect();
        assert_eq!(ids, [one, two], "after {after}");
    }
}
