//! Who the broker-wide queue budget (`queue_total_bytes`) closes: clients
//! that stopped reading, never a reader that keeps reading while it is
//! behind for a moment (design §5).

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::backpressure::HEAVY;
use crate::support::*;

/// Bytes of padding in each flood event (the size the adversarial run used).
const PAD: usize = 2048;
/// Stalled readers of each kind opened in each round.
const STALLED_PER_KIND: usize = 10;
/// Flood units (a tool call's start and result, and a broadcast event) a
/// healthy reader stays behind: ~6 MB for an observer, several times what a
/// stalled reader holds when the budget runs out, so its backlog is the
/// largest there is.
const LAG: i64 = 1000;
/// Units published between two synchronizations with the readers.
const CHUNK: i64 = 8;
/// What the budget is set below the use at the moment it runs out: more
/// than closing one stalled stream frees.
const SHORT_BY: usize = 512 * 1024;
const ROUNDS: usize = 3;
/// The send buffer of every local socket (`send_buffer_bytes`).
const SEND_BUFFER: usize = 32 * 1024;

/// The events of flood unit `u`: runs of 64 tool calls (lifecycle start
/// and end, broadcast), each call's start and result (tool streams: seen by
/// observers, `/v1/events?tool_events=all` and `/v1/hud`), and a broadcast
/// `test.event` every reader sees; the unit's last event is the
/// `test.event`.
fn unit_events(u: i64, pad: &str) -> Vec<(&'static str, Value)> {
    let run = format!("run-{}", u / 64);
    let mut events = Vec::new();
    if u % 64 == 0 {
        if u > 0 {
            let ended = format!("run-{}", u / 64 - 1);
            events.push((
                "agent",
                json!({"runId": ended, "sessionKey": "agent:main:main", "stream": "lifecycle", "data": {"phase": "end"}}),
            ));
        }
        events.push((
            "agent",
            json!({"runId": run, "sessionKey": "agent:main:main", "stream": "lifecycle", "data": {"phase": "start"}}),
        ));
    }
    let call = format!("call-{u}");
    events.push((
        "agent",
        json!({"runId": run, "sessionKey": "agent:main:main", "stream": "tool",
               "data": {"phase": "start", "name": "probe", "toolCallId": call, "args": {"u": u, "pad": pad}}}),
    ));
    events.push((
        "agent",
        json!({"runId": run, "sessionKey": "agent:main:main", "stream": "tool",
               "data": {"phase": "result", "name": "probe", "toolCallId": call, "isError": false, "result": {"u": u, "pad": pad}}}),
    ));
    events.push(("test.event", json!({"n": u, "pad": pad})));
    events
}

/// A reader task: it reads while the last unit it has seen is below its
/// permit, says how far it got, and ends with why it stopped (it never
/// stops on its own while the broker keeps it open).
struct Reader {
    name: &'static str,
    progress: watch::Receiver<i64>,
    /// HUD `received` events for the message [`MARK`] (a HUD reader's).
    marks: Option<watch::Receiver<u32>>,
    task: JoinHandle<String>,
}

/// The message sent after the flood, for the HUD reader's `received` event.
const MARK: &str = "after the flood";

/// Next unit a reader must see: every unit, in order, from the first.
fn check_next(name: &str, last: i64, u: i64) -> Result<i64, String> {
    if last >= 0 && u != last + 1 {
        return Err(format!("{name}: unit {u} after {last}: a hole"));
    }
    Ok(u)
}

/// A `/ws` client reading `test.event`s under `permit`.
fn ws_reader(name: &'static str, mut ws: WsClient, mut permit: watch::Receiver<i64>) -> Reader {
    let (tx, progress) = watch::channel(-1i64);
    let task = tokio::spawn(async move {
        let mut last = -1;
        loop {
            if permit.wait_for(|p| last < *p).await.is_err() {
                return format!("{name}: the test ended");
            }
            match ws.recv_within(Duration::from_secs(30)).await {
                Some(Got::Json(v)) if v["event"] == "test.event" => {
                    let u = v["payload"]["n"].as_i64().unwrap_or(-1);
                    match check_next(name, last, u) {
                        Ok(u) => last = u,
                        Err(e) => return e,
                    }
                    let _ = tx.send(last);
                }
                Some(Got::Json(_)) => {}
                other => return format!("{name}: closed: {other:?}"),
            }
        }
    });
    Reader {
        name,
        progress,
        marks: None,
        task,
    }
}

/// A Server-Sent Events reader (`/v1/events` or `/v1/hud`): `unit` tells
/// the unit a record completes, if any; a `clawmux.close` record ends it.
async fn sse_reader(
    name: &'static str,
    socket: &Path,
    path: &str,
    unit: fn(&str, &Value) -> Option<i64>,
    mut permit: watch::Receiver<i64>,
) -> Reader {
    let (status, _, resp) = crate::http_api::request(socket, "GET", path, &[], b"").await;
    assert_eq!(status, 200, "{path}");
    let mut body = resp.into_body();
    let (tx, progress) = watch::channel(-1i64);
    let (marks_tx, marks) = watch::channel(0u32);
    let task = tokio::spawn(async move {
        let mut buf = String::new();
        let mut last = -1;
        loop {
            while let Some(end) = buf.find("\n\n") {
                if permit.wait_for(|p| last < *p).await.is_err() {
                    return format!("{name}: the test ended");
                }
                let record: String = buf.drain(..end + 2).collect();
                let (mut event, mut data) = ("", Value::Null);
                for line in record.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        event = v;
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data = serde_json::from_str(v).unwrap_or(Value::Null);
                    }
                }
                if event == "clawmux.close" {
                    return format!("{name}: closed: {data}");
                }
                if data["event"] == "received" && data["payload"]["preview"] == MARK {
                    marks_tx.send_modify(|n| *n += 1);
                }
                if let Some(u) = unit(event, &data) {
                    match check_next(name, last, u) {
                        Ok(u) => last = u,
                        Err(e) => return e,
                    }
                    let _ = tx.send(last);
                }
            }
            match tokio::time::timeout(Duration::from_secs(30), body.frame()).await {
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        buf.push_str(&String::from_utf8_lossy(&data));
                    }
                }
                other => return format!("{name}: the stream ended: {other:?}"),
            }
        }
    });
    Reader {
        name,
        progress,
        marks: path.starts_with("/v1/hud").then_some(marks),
        task,
    }
}

/// `/v1/events`: a unit ends with its `test.event`.
fn events_unit(event: &str, data: &Value) -> Option<i64> {
    (event == "test.event").then(|| data["payload"]["n"].as_i64())?
}

/// `/v1/hud`: a unit's call ends with its `tool_end`.
fn hud_unit(_: &str, data: &Value) -> Option<i64> {
    if data["event"] != "tool_end" {
        return None;
    }
    data["correlationId"]
        .as_str()?
        .strip_prefix("call-")?
        .parse()
        .ok()
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
    assert!(head.starts_with(b"HTTP/1.1 200"));
    s
}

/// The flood, in step with its readers: the sentinel (a `/ws` reader that
/// keeps up) shows the broker has published what was sent; the healthy
/// readers are then let read up to `LAG` units behind, and awaited.
struct Flood {
    gw: MockGateway,
    pad: String,
    next: i64,
    permit: watch::Sender<i64>,
    sentinel: Reader,
    healthy: Vec<Reader>,
}

impl Flood {
    async fn units(&mut self, n: i64) {
        let end = self.next + n;
        while self.next < end {
            let last = self.next + CHUNK - 1;
            for u in self.next..=last {
                for (name, payload) in unit_events(u, &self.pad) {
                    self.gw.broadcast(name, payload);
                }
            }
            self.next = last + 1;
            Self::reach(&mut self.sentinel, last).await;
            let _ = self.permit.send(last - LAG);
            for reader in &mut self.healthy {
                Self::reach(reader, last - LAG).await;
            }
        }
    }

    /// Waits until `reader` has seen unit `u`; fails with why it stopped.
    async fn reach(reader: &mut Reader, u: i64) {
        let patience = Duration::from_secs(30);
        let reached = tokio::time::timeout(patience, reader.progress.wait_for(|p| *p >= u)).await;
        let why = match reached {
            Ok(Ok(_)) => return,
            Err(_) => "no progress in 30 s".to_owned(),
            // It stopped: it says why.
            Ok(Err(_)) => match tokio::time::timeout(patience, &mut reader.task).await {
                Ok(Ok(why)) => why,
                other => format!("{other:?}"),
            },
        };
        panic!("the healthy {} did not reach unit {u}: {why}", reader.name);
    }
}

/// 30 readers that never read (10 each of `/ws`, `/v1/events`, `/v1/hud`)
/// join a flood of tool calls of 2 KB, round after round, while a healthy
/// reader of each kind keeps reading ~1,000 units (6 MB) behind: the
/// largest backlogs are the healthy readers'. When the budget runs out
/// (set below the use, as a flood takes it past), the stalled readers are
/// closed and the healthy ones read on, every event in order, the HUD
/// reader its request feed too (before: the largest backlog went first, a
/// healthy reader in the first round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_that_keep_reading_outlast_every_stalled_reader() {
    let _heavy = HEAVY.lock().await;
    init_test_log();
    let h = start_with(mock_config(), |s| {
        // Only the budget closes anyone here.
        s.limits.slow_grace = Duration::from_secs(600);
        s.limits.queue_hard_bytes = 64 << 20;
        s.limits.queue_total_bytes = 1 << 30;
        // A HUD stream applies the whole replay log when it opens: keep it
        // short, so opening thirty streams is quick.
        s.limits.replay_max_bytes = 1 << 20;
        // Every local socket takes this many bytes, whatever the kernel's
        // default: a reader that stops reading fills it soon.
        s.limits.send_buffer_bytes = SEND_BUFFER;
    })
    .await;
    let socket = h.socket();
    let hub = std::sync::Arc::clone(&h.broker.ctx().hub);
    let (permit, permits) = watch::channel(-1i64);
    let (_never_tx, never) = watch::channel(i64::MAX);
    let sentinel = ws_reader("/ws sentinel", h.connected().await.0, never);
    let healthy = vec![
        ws_reader("/ws reader", h.connected().await.0, permits.clone()),
        sse_reader(
            "/v1/events reader",
            &socket,
            "/v1/events?tool_events=all",
            events_unit,
            permits.clone(),
        )
        .await,
        sse_reader("/v1/hud reader", &socket, "/v1/hud", hud_unit, permits).await,
    ];
    let mut flood = Flood {
        gw: h.gw.clone(),
        pad: "x".repeat(PAD),
        next: 0,
        permit,
        sentinel,
        healthy,
    };
    // The healthy readers fall behind.
    flood.units(LAG).await;
    let ids =
        |hub: &clawmux::hub::Hub| -> HashSet<u64> { hub.clients().iter().map(|c| c.id).collect() };
    let base = ids(&hub);
    let mut budget_closes = 0;
    for round in 0..ROUNDS {
        let mut stalled_ws = Vec::new();
        let mut stalled_streams = Vec::new();
        for _ in 0..STALLED_PER_KIND {
            stalled_ws.push(h.connected().await.0);
            stalled_streams.push(open_unread(&socket, "/v1/events?tool_events=all").await);
            stalled_streams.push(open_unread(&socket, "/v1/hud").await);
        }
        let stalled: Vec<_> = hub
            .clients()
            .into_iter()
            .filter(|c| !base.contains(&c.id))
            .collect();
        assert_eq!(stalled.len(), 3 * STALLED_PER_KIND, "round {round}");
        // They fill their sockets (of `SEND_BUFFER` bytes) and stop: each
        // has a backlog, and the stall sweep sees it wait with no progress.
        // A reader whose writer was behind can drain its queue into its
        // socket after the flood pauses and wait with no backlog, which is
        // never stalled: the flood goes on, a chunk at a time, until every
        // stalled reader is seen stalled.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let without_backlog = stalled.iter().filter(|c| c.backlog().is_none()).count();
            let waiting = stalled
                .iter()
                .filter(|c| !c.backlog().is_some_and(|b| b.stalled))
                .count();
            if waiting == 0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "round {round}: every stalled reader seen stalled within 30 s \
                 ({waiting} not yet, {without_backlog} of them with no backlog)"
            );
            if without_backlog > 0 {
                flood.units(CHUNK).await;
            } else {
                // The sweep runs every 100 ms.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // The healthy readers read on (each takes batches again), then the
        // budget runs out.
        flood.units(100).await;
        let closes_before = hub.stats.slow_closes.load(Ordering::Relaxed);
        hub.set_queue_budget(hub.queue_budget().used() - SHORT_BY);
        flood.units(200).await;
        let closed = stalled.iter().filter(|c| c.is_closing()).count();
        let closes = hub.stats.slow_closes.load(Ordering::Relaxed) - closes_before;
        assert!(
            closed >= 1,
            "round {round}: the budget closed stalled readers"
        );
        // Besides them, only their HUD streams' request taps (which their
        // streams stopped taking too).
        assert!(
            (closed..=closed + STALLED_PER_KIND).contains(&(closes as usize)),
            "round {round}: {closes} closed by the budget, {closed} of them stalled readers"
        );
        budget_closes += closes;
        // The stalled readers that are left go away; the budget is back.
        drop(stalled);
        drop(stalled_ws);
        drop(stalled_streams);
        hub.set_queue_budget(1 << 30);
        // (One the budget closed is cut after a linger of 2 s.)
        eventually_within("the stalled readers left", Duration::from_secs(20), || {
            let left = ids(&hub).difference(&base).count();
            async move {
                if left == 0 {
                    Ok(())
                } else {
                    Err(format!("{left} still connected"))
                }
            }
        })
        .await;
    }
    flood.units(CHUNK).await;
    for reader in flood.healthy.iter().chain([&flood.sentinel]) {
        assert!(
            !reader.task.is_finished(),
            "{} is still reading",
            reader.name
        );
    }
    // The healthy HUD reader still gets what clients ask, too.
    let _ = flood.permit.send(i64::MAX);
    let (mut asker, _) = h.connected().await;
    let res = asker
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": MARK, "idempotencyKey": "mark"}),
        )
        .await;
    assert_eq!(res["ok"], true, "{res}");
    let hud = flood
        .healthy
        .iter_mut()
        .find(|r| r.marks.is_some())
        .unwrap();
    let seen = tokio::time::timeout(
        Duration::from_secs(30),
        hud.marks.as_mut().unwrap().wait_for(|n| *n > 0),
    )
    .await;
    assert!(
        matches!(seen, Ok(Ok(_))),
        "the HUD reader's request feed was cut"
    );
    assert_eq!(hub.stats.slow_closes.load(Ordering::Relaxed), budget_closes);
    eprintln!(
        "{ROUNDS} rounds, {} units: {budget_closes} stalled readers closed by the budget, no healthy one",
        flood.next
    );
}
