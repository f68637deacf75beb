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
    // Resuming at the newest cursor as /v1/state gives it (a bare
    // integer, the Holon contract): nothing replayed, the next live event
    // is next, and its id is the plain cursor.
    let mut sse = open_events(&h.socket(), &format!("/v1/events?after_seq={newest}"), &[])
        .await
        .expect("a bare after_seq=<newest_seq> streams");
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
    assert_eq!(id_epoch, "", "id: <cursor>, a plain integer");
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

/// 410 is for cursors that are really gone (older than the oldest kept)
/// or never existed (newer than the newest); the details name the window.
/// `epoch` is information: an old-style `<epoch>:<cursor>` or an `epoch=`
/// of any life resumes like the bare cursor.
#[tokio::test]
async fn only_cursors_gone_or_never_handed_out_get_410() {
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
            format!("/v1/events?after_seq={}", oldest - 2),
            "no longer held",
        ),
        (
            format!("/v1/events?after_seq={epoch}:{}", oldest - 2),
            "no longer held",
        ),
        (
            format!("/v1/events?after_seq={}", newest + 1),
            "newer than the newest",
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
        assert!(message.contains("/v1/state"), "{body}");
    }
    for path in [
        format!("/v1/events?after_seq={}", oldest - 1),
        format!("/v1/events?after_seq={}&epoch={epoch}", oldest - 1),
        format!("/v1/events?after_seq={epoch}:{}", oldest - 1),
        format!("/v1/events?epoch={epoch}"),
    ] {
        assert!(
            open_events(&h.socket(), &path, &[]).await.is_ok(),
            "{path}: the oldest resumable cursor is oldest_seq - 1"
        );
    }
    // A life the log does not remember (e.g. an older clawmux whose
    // cursors restarted at 1): its cursors mean nothing here, said clearly.
    for path in [
        format!("/v1/events?after_seq={}&epoch=another-life", oldest - 1),
        format!("/v1/events?after_seq=another-life:{}", oldest - 1),
        "/v1/events?epoch=another-life".to_owned(),
    ] {
        let (status, body) = gone(path.clone()).await;
        assert_eq!(status, 410, "{path}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("epoch another-life is not a broker life this replay log remembers"),
            "{path}: {message}"
        );
        assert_eq!(body["error"]["details"]["oldest_seq"], oldest, "{path}");
    }
}

/// Stops the harness's broker cleanly and starts another on the same
/// socket and state dir.
async fn restart(h: Harness, tweak: impl FnOnce(&mut Settings)) -> Harness {
    let Harness { gw, broker, dir } = h;
    let mut settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    tweak(&mut settings);
    assert!(broker.shutdown(Duration::from_secs(5)).await, "clean stop");
    let broker = RunningBroker::start(settings).await.unwrap();
    Harness { gw, broker, dir }
}

/// Reads records up to and including the event with cursor `last`: the
/// events (id, name, data) and the `clawmux.gap` records (as items).
async fn records_through(sse: &mut Sse, last: u64) -> Vec<(u64, String, serde_json::Value)> {
    let mut out = Vec::new();
    loop {
        match sse.next_item().await {
            Item::Event { id, name, data, .. } => {
                out.push((id, name, data));
                if id >= last {
                    return out;
                }
            }
            Item::Other(o) if o.contains("event: clawmux.gap") => {
                let data = o.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
                out.push((0, "clawmux.gap".into(), serde_json::from_str(data).unwrap()));
            }
            _ => {}
        }
    }
}

/// The Holon contract across a broker restart: a cursor taken before it
/// replays the rest of the old life, then one `clawmux.gap` for the
/// downtime (with an id, so resuming after it works), then the new life's
/// events; the new life's cursors continue the old ones (never repeat).
#[tokio::test]
async fn a_cursor_from_before_a_restart_resumes_with_the_rest_a_gap_then_new_events() {
    let h = start().await;
    let before = publish(&h, 3).await;
    let s = state(&h.socket()).await;
    let old_epoch = s["epoch"].as_str().unwrap().to_owned();
    let file = s["replay_file"]
        .as_str()
        .expect("the log is kept on disk")
        .to_owned();
    assert!(
        file.starts_with(&h.dir.path().join("state").display().to_string()),
        "{file}"
    );
    let cursor = before - 1;
    let h = restart(h, |_| {}).await;
    until_ready(&h.socket()).await;
    h.gw.broadcast("test.event", json!({"i": "new"}));
    let is_new = |r: &(u64, String, serde_json::Value)| r.2["payload"]["i"] == "new";
    let mut newest = 0;
    while newest == 0 {
        let mut sse = open_events(&h.socket(), &format!("/v1/events?after_seq={before}"), &[])
            .await
            .unwrap();
        let s = state(&h.socket()).await;
        assert_ne!(s["epoch"], old_epoch.as_str());
        let got = records_through(&mut sse, s["newest_seq"].as_u64().unwrap()).await;
        newest = got.iter().find(|r| is_new(r)).map_or(0, |r| r.0);
    }

    // As /v1/state gave it, as an EventSource resends it, and old-style.
    for (path, headers) in [
        (format!("/v1/events?after_seq={cursor}"), vec![]),
        (
            "/v1/events".to_owned(),
            vec![("last-event-id", cursor.to_string())],
        ),
        (format!("/v1/events?after_seq={old_epoch}:{cursor}"), vec![]),
    ] {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut sse = open_events(&h.socket(), &path, &headers)
            .await
            .unwrap_or_else(|e| panic!("{path}: a cursor from the previous life resumes: {e:?}"));
        let got = records_through(&mut sse, newest).await;
        // The old life's last event first, the new event last, one gap between.
        assert_eq!(
            (got[0].0, &*got[0].1),
            (before, "test.event"),
            "{path}: {got:#?}"
        );
        assert_eq!(got[0].2["payload"]["i"], 2);
        assert!(is_new(got.last().unwrap()), "{path}: {got:#?}");
        let gaps: Vec<usize> = (0..got.len())
            .filter(|&i| got[i].1 == "clawmux.gap")
            .collect();
        let [g] = gaps[..] else {
            panic!("{path}: one gap: {got:#?}")
        };
        assert!(
            got[..g].iter().any(|r| r.1 == "shutdown"),
            "{path}: the old life ends with its shutdown: {got:#?}"
        );
        let ids: Vec<u64> = got.iter().map(|r| r.0).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{path}: {ids:?}");
        let (gap_id, _, gap) = &got[g];
        // Cursors only grow: a new life starts above the last one's newest
        // and above the current time in microseconds (so above any life
        // that kept no file in between).
        assert!(*gap_id > got[g - 1].0, "{path}: {got:#?}");
        assert_eq!(gap["reason"], "broker_restart");
        assert_eq!(gap["clean"], true);
        assert_eq!(gap["after"], got[g - 1].0);
        assert_eq!(gap["next"], *gap_id);
        assert!(gap["down_ms"].is_u64(), "{gap}");
    }
}

/// A crash mid-write leaves a torn last line (and no clean-stop record):
/// the next life keeps every valid event, logs the rest, and starts its
/// cursors above anything the crashed life may have handed out unwritten.
#[tokio::test]
async fn a_torn_log_file_is_recovered() {
    let h = start().await;
    let newest = publish(&h, 5).await;
    let file = std::path::PathBuf::from(state(&h.socket()).await["replay_file"].as_str().unwrap());
    let Harness { gw, broker, dir } = h;
    assert!(broker.shutdown(Duration::from_secs(5)).await);
    // Cut the file inside the line of event `newest` (dropping the shutdown
    // event and the clean-stop record after it).
    let text = std::fs::read_to_string(&file).unwrap();
    let at = text
        .find(&format!(r#"{{"seq":{newest},"#))
        .expect("the last published event is in the file");
    std::fs::write(&file, &text[..at + 20]).unwrap();
    let broker = RunningBroker::start(test_settings(dir.path(), &gw.url(), Some("test-token")))
        .await
        .unwrap();
    let h = Harness { gw, broker, dir };
    let mut sse = open_events(
        &h.socket(),
        &format!("/v1/events?after_seq={}", newest - 3),
        &[],
    )
    .await
    .unwrap();
    let got = records_through(&mut sse, newest + 1).await;
    let ids: Vec<u64> = got.iter().map(|(id, _, _)| *id).collect();
    assert_eq!(&ids[..2], [newest - 2, newest - 1], "{got:#?}");
    assert_eq!(got.len(), 3, "{got:#?}");
    assert_eq!(got[2].1, "clawmux.gap");
    assert!(ids[2] > newest, "after a crash cursors jump: {got:#?}");
    assert_eq!(got[2].2["clean"], false);
    assert_eq!(got[2].2["after"], newest - 1);
    // The file was rewritten whole: every line parses.
    let text = std::fs::read_to_string(&file).unwrap();
    for line in text.lines() {
        serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
}

/// The file is rewritten from what the log keeps whenever it outgrows it,
/// so it stays under `file_bound` of the limits, and is private.
#[tokio::test]
async fn the_log_file_stays_under_its_bound() {
    use std::os::unix::fs::PermissionsExt;
    let h = start_with(mock_config(), |s| {
        s.limits.replay_max_events = 20;
        s.limits.replay_max_bytes = 64 * 1024;
    })
    .await;
    let file = std::path::PathBuf::from(state(&h.socket()).await["replay_file"].as_str().unwrap());
    let limits = clawmux::hub::ReplayLimits {
        max_events: 20,
        max_bytes: 64 * 1024,
    };
    let bound = clawmux::hub::replay::file_bound(limits);
    let pad = "p".repeat(2000);
    let mut largest = 0;
    for round in 0..20 {
        let before = state(&h.socket()).await["newest_seq"].as_u64().unwrap();
        for i in 0..50 {
            h.gw.broadcast("test.event", json!({ "round": round, "i": i, "pad": pad }));
        }
        wait_newest_seq(&h.socket(), before + 50).await;
        largest = largest.max(std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0));
    }
    assert!(largest > 0);
    assert!(largest <= bound, "{largest} > {bound}");
    // 1000 events of 2 KB went through; the file holds about 2 × 20 of them.
    assert!(largest < 200 * 1024, "compacted: {largest}");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(file.parent().unwrap()), 0o700);
    let h = restart(h, |s| {
        s.limits.replay_max_events = 20;
        s.limits.replay_max_bytes = 64 * 1024;
    })
    .await;
    let s = state(&h.socket()).await;
    let (oldest, newest) = (
        s["oldest_seq"].as_u64().unwrap(),
        s["newest_seq"].as_u64().unwrap(),
    );
    let mut sse = open_events(
        &h.socket(),
        &format!("/v1/events?after_seq={}", oldest - 1),
        &[],
    )
    .await
    .unwrap();
    let held = records_through(&mut sse, newest).await;
    assert_eq!(held.iter().filter(|r| r.0 != 0).count(), 20, "{held:#?}");
}

/// Without persistence (`[limits] replay_persist = false`) history ends at
/// a restart, but cursors still never repeat: an old one is gone (410).
#[tokio::test]
async fn without_persistence_cursors_still_never_repeat() {
    let off = |s: &mut Settings| s.limits.replay_persist = false;
    let h = start_with(mock_config(), off).await;
    let old = publish(&h, 3).await;
    assert!(state(&h.socket()).await["replay_file"].is_null());
    let h = restart(h, off).await;
    let s = until_ready(&h.socket()).await;
    assert!(s["oldest_seq"].as_u64().unwrap() > old, "{s}");
    let (status, body) = open_events(&h.socket(), &format!("/v1/events?after_seq={old}"), &[])
        .await
        .err()
        .expect("an earlier life's cursor is gone");
    assert_eq!(status, 410);
    assert_eq!(body["error"]["details"]["oldest_seq"], s["oldest_seq"]);
    let files: Vec<String> = std::fs::read_dir(h.dir.path().join("state"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(!files.iter().any(|f| f.starts_with("replay-")), "{files:?}");
}

/// Before: cursors only grow across every kind of broker life. A life
/// with persistence, one without, then one with again: the third does not
/// continue below the second (its cursors went backwards before).
#[tokio::test]
async fn cursors_only_grow_across_lives_with_and_without_persistence() {
    let off = |s: &mut Settings| s.limits.replay_persist = false;
    let h = start().await;
    let first = publish(&h, 2).await;
    let h = restart(h, off).await;
    let second = publish(&h, 2).await;
    assert!(second > first, "{second} > {first}");
    let h = restart(h, |_| {}).await;
    let third = publish(&h, 2).await;
    assert!(
        third > second,
        "cursors went backwards: {third} after {second}"
    );
    assert!(third < 1 << 53);
}

/// Before: a FIFO in the replay log's place hung the broker in `open`
/// at start (socket bound, nothing logged). It is refused at once, as a
/// file that is not a regular file; the broker serves with history in memory.
#[tokio::test]
async fn a_fifo_in_place_of_the_log_is_refused_at_once() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    let file = clawmux::hub::replay::log_file(&settings).expect("a state dir");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::set_permissions(
        file.parent().unwrap(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &file,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let broker = tokio::time::timeout(PATIENCE, RunningBroker::start(settings))
        .await
        .expect("the broker starts at once, not stuck opening a FIFO")
        .unwrap();
    let h = Harness { gw, broker, dir };
    let s = until_ready(&h.socket()).await;
    assert!(s["replay_file"].is_null(), "{s}");
    assert!(publish(&h, 1).await > 0);
}

/// Before: a log whose cursors are near 2^64 or 2^53 wrapped to 1 and
/// reused old ids, or handed out cursors above 2^53. Such records are not
/// the log's: the broker starts a new epoch, with a gap, below 2^53, and
/// the old cursors are answered 410.
#[tokio::test]
async fn a_log_near_two_to_the_64th_or_53rd_starts_a_new_epoch_below_two_to_the_53rd() {
    for huge in [u64::MAX - 5, (1u64 << 53) - 10] {
        let gw = MockGateway::start(mock_config()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
        let file = clawmux::hub::replay::log_file(&settings).unwrap();
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::set_permissions(
            file.parent().unwrap(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        let line = |seq: u64| {
            format!(
                "{{\"seq\":{seq},\"ts\":1,\"frame\":{{\"type\":\"event\",\"event\":\"tick\",\"payload\":{{}}}}}}\n"
            )
        };
        let text = format!(
            "{}{}{{\"stop\":{},\"ts\":2}}\n",
            line(huge),
            line(huge + 1),
            huge + 1
        );
        std::fs::write(&file, text).unwrap();
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let broker = RunningBroker::start(settings).await.unwrap();
        let h = Harness { gw, broker, dir };
        let newest = publish(&h, 2).await;
        let s = state(&h.socket()).await;
        assert!(newest < (1 << 53) - (1 << 44), "{huge}: {s}");
        let oldest = s["oldest_seq"].as_u64().unwrap();
        let mut sse = open_events(
            &h.socket(),
            &format!("/v1/events?after_seq={}", oldest - 1),
            &[],
        )
        .await
        .unwrap();
        let got = records_through(&mut sse, newest).await;
        assert_eq!(got[0].1, "clawmux.gap", "{huge}: {got:#?}");
        assert_eq!(got[0].2["reason"], "new_epoch", "{got:#?}");
        let old = huge.min(1 << 53);
        let refused = open_events(&h.socket(), &format!("/v1/events?after_seq={old}"), &[]).await;
        assert!(matches!(refused, Err((410, _))), "{huge}");
    }
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
        s.limits.queue_soft_bytes = 1024 * 1024;
        s.limits.queue_hard_bytes = 2 * 1024 * 1024;
        s.limits.slow_grace = Duration::from_millis(300);
        // What the socket holds is this test's figure, not the machine's.
        s.limits.send_buffer_bytes = 8 * 1024;
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
    // 3.2 MiB: more than the hard limit (2 MiB) plus all the stream may
    // hold outside its queue (the socket's 16 KiB, its 64 KiB of unwritten
    // chunks, one batch of 256 KiB), so the close comes whatever the timing.
    let stats = &h.broker.ctx().hub.stats;
    let pad = "x".repeat(8 * 1024);
    for _ in 0..400 {
        h.gw.broadcast("test.big", json!({ "pad": pad }));
    }
    eventually("a slow-consumer close", || {
        stats.slow_closes.load(Ordering::Relaxed) > 0
    })
    .await;
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

/// `clawmux serve` from the binary under test on `socket`, its state dir
/// under `home`, with `config` as its config file, once ready.
async fn serve_binary(
    home: &std::path::Path,
    gw: &MockGateway,
    config: &str,
) -> (ChildGuard, std::path::PathBuf) {
    let socket = home.join("c.sock");
    let config_path = home.join("config.toml");
    std::fs::write(&config_path, config).unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"))
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--gateway-url", &gw.url(), "--token", "test-token"])
        .arg("--config")
        .arg(&config_path)
        .env("HOME", home)
        .env("XDG_STATE_HOME", home.join("state"))
        .env_remove("CLAWMUX_CONFIG")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_PID")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let child = ChildGuard(child);
    // (After a crash the old socket file is still there until the new
    // broker replaces it.)
    eventually_async("the broker accepts", || async {
        tokio::net::UnixStream::connect(&socket)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    })
    .await;
    until_ready(&socket).await;
    (child, socket)
}

/// The newest cursor after `n` more events.
async fn publish_on(socket: &std::path::Path, gw: &MockGateway, n: u64) -> u64 {
    let before = state(socket).await["newest_seq"].as_u64().unwrap();
    for i in 0..n {
        gw.broadcast("test.event", json!({ "i": i }));
    }
    wait_newest_seq(socket, before + n).await["newest_seq"]
        .as_u64()
        .unwrap()
}

/// Stops a broker as systemd does (SIGTERM) and waits for its exit.
async fn stop_cleanly(mut child: ChildGuard) {
    let pid = rustix::process::Pid::from_raw(child.0.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = tokio::task::spawn_blocking(move || child.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}

/// Cursors a person types back into `--after` are short in normal use: a
/// new state dir starts at 1, a clean stop goes on right after the last
/// cursor, a crash (SIGKILL) skips at most one reserved block, and a life
/// that keeps no log file (`replay_persist = false`) goes on the same way;
/// across all of them cursors only grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_stay_short_and_only_grow_across_stops_crashes_and_lives_without_a_log() {
    const BLOCK: u64 = 65_536; // the reservation's block (replay/cursors.rs)
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    let (broker, socket) = serve_binary(home, &gw, "").await;
    let first = publish_on(&socket, &gw, 3).await;
    assert!(first < 100, "a new state dir's cursors are short: {first}");
    stop_cleanly(broker).await;

    let (broker, socket) = serve_binary(home, &gw, "").await;
    let second = publish_on(&socket, &gw, 3).await;
    assert!(
        second > first && second < first + 100,
        "after a clean stop, right after: {second} after {first}"
    );
    drop(broker); // SIGKILL: no stop is recorded

    let (broker, socket) = serve_binary(home, &gw, "").await;
    let third = publish_on(&socket, &gw, 3).await;
    assert!(
        third > second && third < second + BLOCK + 100,
        "after a crash, past the reservation only: {third} after {second}"
    );
    stop_cleanly(broker).await;

    let no_log = "[limits]\nreplay_persist = false\n";
    let (broker, socket) = serve_binary(home, &gw, no_log).await;
    let fourth = publish_on(&socket, &gw, 3).await;
    assert!(
        fourth > third && fourth < third + 100,
        "a life without the log file: {fourth} after {third}"
    );
    drop(broker);
    let (_broker, socket) = serve_binary(home, &gw, no_log).await;
    let fifth = publish_on(&socket, &gw, 3).await;
    assert!(
        fifth > fourth && fifth < fourth + BLOCK + 100,
        "{fifth} after {fourth}"
    );
}
