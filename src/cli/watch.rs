//! What `clawmux top` and `clawmux tail --tree/--hud` share: following the
//! broker's events as an observer (`/v1/events?tool_events=all`, resuming
//! across disconnects and broker restarts), and the line renderings of the
//! [`crate::activity`] projection.

use std::time::Duration;

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::sync::mpsc;

use super::client::BrokerClient;
use super::CliError;
use crate::activity::render::{hud_line, TreePrinter};
use crate::activity::{Activity, Change, Observed};
use crate::hub::replay::EventId;
use crate::local::sse::{AFTER_SEQ_HEADER, EPOCH_HEADER, NEWEST_SEQ_HEADER};

/// Reconnect delays while the broker is away.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The query an observer adds to `/v1/events`: every tool-stream event.
pub const OBSERVER_QUERY: &str = "tool_events=all";

/// Whether a record from a stream opened when the newest cursor was
/// `newest` was replayed (read from the broker's log) rather than live.
/// Events outside the log (tool streams) carry no `seq` and are live.
pub fn is_replayed(frame: &Value, newest: Option<u64>) -> bool {
    match (frame["seq"].as_u64(), newest) {
        (Some(seq), Some(newest)) => seq <= newest,
        _ => false,
    }
}

/// What a follower reports.
#[derive(Debug)]
pub enum Feed {
    /// A gateway event: its name, its frame, whether it was replayed, and
    /// its cursor (`None` for events outside the log: tool streams).
    Event {
        name: String,
        frame: Value,
        replay: bool,
        seq: Option<u64>,
        /// The record's `data` as the broker sent it.
        data: String,
    },
    /// Connected (again): the broker life the stream belongs to, the cursor
    /// it starts after, and the newest cursor when it was admitted (records
    /// up to it are replayed).
    Connected {
        epoch: String,
        after: Option<u64>,
        newest: Option<u64>,
    },
    /// The broker is not answering; the follower keeps trying.
    Lost(String),
    /// Events were missed (a gap, or a resume the broker could not serve).
    Missed(String),
    /// The broker refused the request for good (a bad query): the follower
    /// stopped.
    Failed(CliError),
}

/// Where a follower starts.
#[derive(Debug, Clone)]
pub enum Start {
    /// With the newest event.
    Now,
    /// Right after this event.
    After(EventId),
    /// With the oldest event the broker's log holds (a dashboard opens on
    /// recent activity).
    WindowStart,
}

/// What a follower asks `/v1/events` for.
#[derive(Debug, Clone)]
pub struct Follow {
    pub start: Start,
    /// Only these event names (`events=`); all when empty.
    pub events: Vec<String>,
    /// Every tool-stream event too ([`OBSERVER_QUERY`]).
    pub observer: bool,
}

impl Follow {
    /// What `top` follows: everything, as an observer, from the log's start.
    pub fn observer() -> Self {
        Follow {
            start: Start::WindowStart,
            events: Vec::new(),
            observer: true,
        }
    }

    fn path(&self, after: Option<&EventId>) -> String {
        let mut query = Vec::new();
        if self.observer {
            query.push(("tool_events", "all".to_owned()));
        }
        if let Some(EventId { epoch, cursor }) = after {
            query.push(("after_seq", cursor.to_string()));
            if let Some(epoch) = epoch {
                query.push(("epoch", epoch.clone()));
            }
        }
        if !self.events.is_empty() {
            query.push(("events", self.events.join(",")));
        }
        match serde_urlencoded::to_string(&query) {
            Ok(q) if !q.is_empty() => format!("/v1/events?{q}"),
            _ => "/v1/events".to_owned(),
        }
    }
}

/// Follows `/v1/events` as an observer from the log's start ([`Follow::observer`]).
pub async fn follow(client: BrokerClient, tx: mpsc::Sender<Feed>) {
    follow_with(client, Follow::observer(), tx).await
}

/// Follows `/v1/events` until `tx` closes: resuming after each disconnect
/// right after the last cursor seen, so nothing is lost or seen twice; when
/// the broker cannot resume there (`410`: it restarted, or the events were
/// evicted) it says so ([`Feed::Missed`]) and goes on with the oldest event
/// the broker still holds (after a restart: everything the new broker
/// logged), or the newest one for a cursor from the future.
pub async fn follow_with(client: BrokerClient, how: Follow, tx: mpsc::Sender<Feed>) {
    let mut after: Option<EventId> = match &how.start {
        Start::After(id) => Some(id.clone()),
        _ => None,
    };
    let mut backoff = BACKOFF_MIN;
    let mut from_window_start = matches!(how.start, Start::WindowStart);
    loop {
        if from_window_start {
            if let Ok((status, state)) = client.json(Method::GET, "/v1/state", None).await {
                if status.is_success() {
                    after = state["epoch"].as_str().map(|epoch| EventId {
                        epoch: Some(epoch.to_owned()),
                        cursor: state["oldest_seq"].as_u64().unwrap_or(1).saturating_sub(1),
                    });
                    from_window_start = false;
                }
            }
        }
        let path = how.path(after.as_ref());
        let resp = match client.send(Method::GET, &path, &[], None).await {
            Ok(resp) => resp,
            Err(e) => {
                let why = match e {
                    CliError::Unreachable { .. } => "the broker is not answering".to_owned(),
                    other => other.to_string(),
                };
                if tx.send(Feed::Lost(why)).await.is_err() {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        let status = resp.status();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        if status != StatusCode::OK {
            let body = resp.into_body().collect().await.map(|b| b.to_bytes());
            let body: Value = body
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null);
            let feed = match status {
                StatusCode::GONE => {
                    let window = &body["error"]["details"];
                    let (message, next) = gone(after.as_ref(), window);
                    after = next;
                    Feed::Missed(message)
                }
                StatusCode::BAD_REQUEST => {
                    let _ = tx
                        .send(Feed::Failed(CliError::Usage(error_message(&body))))
                        .await;
                    return;
                }
                _ => Feed::Lost(format!(
                    "the broker answered {status}: {}",
                    error_message(&body)
                )),
            };
            let lost = matches!(feed, Feed::Lost(_));
            if tx.send(feed).await.is_err() {
                return;
            }
            if lost {
                tokio::time::sleep(BACKOFF_MAX).await;
            }
            continue;
        }
        backoff = BACKOFF_MIN;
        let epoch = header(EPOCH_HEADER).unwrap_or_default();
        let newest = header(NEWEST_SEQ_HEADER).and_then(|v| v.parse().ok());
        let start = header(AFTER_SEQ_HEADER).and_then(|v| v.parse().ok());
        if let Some(cursor) = start {
            after = Some(EventId {
                epoch: Some(epoch.clone()),
                cursor,
            });
        }
        let connected = Feed::Connected {
            epoch: epoch.clone(),
            after: start,
            newest,
        };
        if tx.send(connected).await.is_err() {
            return;
        }
        let mut events = resp.into_body().into_data_stream().eventsource();
        while let Some(Ok(event)) = events.next().await {
            match event.event.as_str() {
                "clawmux.close" => {
                    let what = stream_ended(&event.data);
                    if tx.send(Feed::Lost(what)).await.is_err() {
                        return;
                    }
                    break;
                }
                "clawmux.gap" => {
                    let gap: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
                    let what = format!(
                        "events after seq {} and before seq {} were not delivered (an upstream gap or reconnect, or this stream fell behind)",
                        gap["after"], gap["next"]
                    );
                    if tx.send(Feed::Missed(what)).await.is_err() {
                        return;
                    }
                    continue;
                }
                _ => {}
            }
            let frame: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
            let seq = frame["seq"].as_u64().filter(|_| !event.id.is_empty());
            if let Some(seq) = seq {
                after = Some(EventId {
                    epoch: Some(epoch.clone()),
                    cursor: seq,
                });
            }
            let replay = is_replayed(&frame, newest);
            let feed = Feed::Event {
                name: event.event,
                frame,
                replay,
                seq,
                data: event.data,
            };
            if tx.send(feed).await.is_err() {
                return;
            }
        }
        if tx.send(Feed::Lost("lost the stream".into())).await.is_err() {
            return;
        }
    }
}

/// A `clawmux.close` record (`{"code":1001,"reason":"going away"}`) as a
/// sentence: why the broker ended the stream, in words.
pub fn stream_ended(data: &str) -> String {
    let record: Value = serde_json::from_str(data).unwrap_or(Value::Null);
    let reason = record["reason"].as_str().unwrap_or_default();
    let why = match (record["code"].as_u64(), reason) {
        (Some(1001), _) => "the broker is shutting down or restarting".to_owned(),
        (Some(1008), "slow consumer") => {
            "this reader fell too far behind (it did not read fast enough)".to_owned()
        }
        (Some(1012), _) => "the broker is restarting".to_owned(),
        (_, "") => "no reason given".to_owned(),
        (_, reason) => crate::sanitize::field(reason, 200).into_owned(),
    };
    format!("the broker ended the stream: {why}")
}

/// What to say when the broker cannot resume after `asked` (`410`, its
/// replay window in `error.details`), and where to go on: the oldest held
/// event after a restart or an eviction (what is still held was not seen),
/// the newest for a cursor from the future.
pub fn gone(asked: Option<&EventId>, window: &Value) -> (String, Option<EventId>) {
    let newest = window["newest_seq"].as_u64().unwrap_or(0);
    let oldest = window["oldest_seq"].as_u64().unwrap_or(1);
    let epoch = window["epoch"].as_str().map(str::to_owned);
    let cursor = asked.map(|a| a.cursor);
    let shown = cursor.map_or("(start)".to_owned(), |s| s.to_string());
    let asked_epoch = asked.and_then(|a| a.epoch.as_deref());
    let (why, next) = if asked_epoch.is_some() && epoch.as_deref() != asked_epoch {
        (
            "the broker restarted without the events this stream had reached (another state dir, or its log was reset): events since were missed"
                .to_owned(),
            oldest.saturating_sub(1),
        )
    } else if cursor.is_some_and(|a| a > newest) {
        (
            format!("#{shown} is newer than the newest event this broker has sent (#{newest}); nothing was missed"),
            newest,
        )
    } else {
        (
            format!("those events are no longer held (the broker holds #{oldest} to #{newest}); events in between were missed"),
            oldest.saturating_sub(1),
        )
    };
    let message = format!("cannot resume after seq {shown}: {why}; continuing after seq {next}");
    (
        message,
        epoch.map(|epoch| EventId {
            epoch: Some(epoch),
            cursor: next,
        }),
    )
}

/// An error body's `code: message`.
pub fn error_message(body: &Value) -> String {
    let e = if body["error"].is_object() {
        &body["error"]
    } else {
        body
    };
    match (e["code"].as_str(), e["message"].as_str()) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        _ => body.to_string(),
    }
}

/// How `tail` prints the projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineMode {
    /// `--tree`: indented plain lines.
    Tree,
    /// `--hud`: HUD activity JSON lines.
    Hud,
}

/// The projection printed line by line (`clawmux tail --tree/--hud`).
#[derive(Debug)]
pub struct LineView {
    mode: LineMode,
    activity: Activity,
    printer: TreePrinter,
}

impl LineView {
    pub fn new(mode: LineMode) -> Self {
        LineView {
            mode,
            activity: Activity::new(),
            printer: TreePrinter::new(),
        }
    }

    /// Applies one event (its name and frame; `replay`: read from the
    /// broker's log, so its arrival time says nothing) and returns the
    /// lines of what it changed, of the runs `keep(run_id, session_key)`
    /// accepts (`tail --run`, `--session`). Every event is applied, so the
    /// runs kept are projected exactly as without a filter.
    pub fn lines(
        &mut self,
        name: &str,
        frame: &Value,
        replay: bool,
        keep: impl Fn(&str, &str) -> bool,
    ) -> Vec<String> {
        let changes = self.activity.apply(Observed {
            name,
            payload: &frame["payload"],
            received_ms: (!replay).then(crate::protocol::now_ms),
        });
        let mut out = Vec::new();
        for change in &changes {
            if !self.kept(change, &keep) {
                continue;
            }
            match self.mode {
                LineMode::Hud => out.push(crate::sanitize::json(&hud_line(change, replay))),
                LineMode::Tree => out.extend(self.printer.lines(change, replay, local_time)),
            }
        }
        out
    }

    /// Whether `keep` accepts the run a change is about; a change about no
    /// run (a reconnect) only without a filter, that is when `keep`
    /// accepts any run.
    fn kept(&self, change: &Change, keep: &impl Fn(&str, &str) -> bool) -> bool {
        let run_id = match change {
            Change::TurnStart { run_id, .. }
            | Change::ThinkStart { run_id, .. }
            | Change::ThinkEnd { run_id, .. }
            | Change::ToolStart { run_id, .. }
            | Change::ToolEnd { run_id, .. }
            | Change::TurnEnd { run_id, .. } => run_id,
            // The run is no longer in the projection: its session is here.
            Change::Truncated {
                run_id,
                session_key,
                ..
            } => return keep(run_id, session_key),
            Change::Received { .. } => return keep("", ""),
        };
        let session = self
            .activity
            .run(run_id)
            .map_or("", |r| r.session_key.as_str());
        keep(run_id, session)
    }

    /// Events were missed: runs whose end may be among them are forgotten.
    pub fn gap(&mut self) {
        self.activity.forget_unfinished();
    }
}

/// `HH:MM:SS.mmm` in local time.
pub fn local_time(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64)
        .map(|t| {
            t.with_timezone(&chrono::Local)
                .format("%H:%M:%S%.3f")
                .to_string()
        })
        .unwrap_or_else(|| "--:--:--.---".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replayed_means_logged_at_or_before_the_newest_cursor_at_open() {
        assert!(is_replayed(&json!({"seq": 5}), Some(5)));
        assert!(!is_replayed(&json!({"seq": 6}), Some(5)));
        assert!(
            !is_replayed(&json!({"event": "agent"}), Some(5)),
            "unlogged: live"
        );
        assert!(!is_replayed(&json!({"seq": 1}), None));
    }

    #[test]
    fn line_view_prints_hud_json_per_change() {
        let mut view = LineView::new(LineMode::Hud);
        let start = json!({"event": "agent", "payload": {"runId": "r1", "ts": 7, "sessionKey": "s",
            "stream": "lifecycle", "data": {"phase": "start"}}});
        let all = |_: &str, _: &str| true;
        let mut lines = view.lines("agent", &start, true, all);
        lines.extend(view.lines("tick", &json!({"payload":{"ts":1}}), false, all));
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line: Value = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(
            (line["type"].clone(), line["event"].clone()),
            (json!("hud"), json!("turn_start"))
        );
        assert_eq!(line["replay"], true);
    }

    #[test]
    fn line_view_prints_only_the_runs_kept() {
        let mut view = LineView::new(LineMode::Tree);
        let start = |run: &str, session: &str| {
            json!({"event": "agent", "payload": {"runId": run, "ts": 7, "sessionKey": session,
                "stream": "lifecycle", "data": {"phase": "start"}}})
        };
        let only_r2 = |run: &str, _: &str| run.starts_with("r2");
        let mut lines = view.lines("agent", &start("r1", "agent:main:main"), false, only_r2);
        lines.extend(view.lines("agent", &start("r2", "agent:main:other"), false, only_r2));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].ends_with("agent:main:other"), "{lines:?}");
        assert!(lines[1].ends_with("run r2 started"), "{lines:?}");
        let in_main = |_: &str, session: &str| session == "agent:main:main";
        let lines = view.lines("agent", &start("r3", "agent:main:main"), false, in_main);
        assert!(lines.iter().all(|l| !l.contains("other")), "{lines:?}");
        assert!(
            lines.last().unwrap().ends_with("run r3 started"),
            "{lines:?}"
        );
    }

    #[test]
    fn a_stream_end_is_said_in_words() {
        assert_eq!(
            stream_ended(r#"{"code":1001,"reason":"going away"}"#),
            "the broker ended the stream: the broker is shutting down or restarting"
        );
        assert!(stream_ended(r#"{"code":1008,"reason":"slow consumer"}"#)
            .contains("fell too far behind"));
        assert_eq!(
            stream_ended(r#"{"code":4000,"reason":"x\u001b]0;t\u0007"}"#),
            "the broker ended the stream: x\\e]0;t\\x07"
        );
        assert!(!stream_ended(r#"{"code":1001,"reason":"going away"}"#).contains('{'));
    }

    #[test]
    fn a_410_is_read_from_error_details_and_a_restart_resumes_at_the_new_logs_start() {
        // The broker's 410 body: the window is under error.details.
        let body = json!({"ok": false, "error": {"code": "studio.replay_unavailable", "message": "gone",
            "details": {"epoch": "e2", "oldest_seq": 1, "newest_seq": 40}}});
        let asked = EventId {
            epoch: Some("e1".into()),
            cursor: 99,
        };
        let (message, next) = gone(Some(&asked), &body["error"]["details"]);
        assert!(
            message.contains("the broker restarted without the events this stream had reached"),
            "{message}"
        );
        assert_eq!(
            next,
            Some(EventId {
                epoch: Some("e2".into()),
                cursor: 0
            }),
            "everything the new broker logged"
        );
        let asked = EventId {
            epoch: Some("e2".into()),
            cursor: 99,
        };
        let (message, next) = gone(Some(&asked), &body["error"]["details"]);
        assert!(message.contains("newer than the newest"), "{message}");
        assert_eq!(next.unwrap().cursor, 40);
        let details = json!({"epoch": "e2", "oldest_seq": 20, "newest_seq": 40});
        let asked = EventId {
            epoch: Some("e2".into()),
            cursor: 5,
        };
        let (message, next) = gone(Some(&asked), &details);
        assert!(message.contains("no longer held"), "{message}");
        assert_eq!(next.unwrap().cursor, 19, "what is still held was not seen");
    }

    #[test]
    fn follow_paths_carry_cursor_epoch_filter_and_the_observer_switch() {
        let how = Follow {
            start: Start::Now,
            events: vec!["chat".into(), "agent".into()],
            observer: false,
        };
        let after = EventId {
            epoch: Some("ab".into()),
            cursor: 5,
        };
        assert_eq!(
            how.path(Some(&after)),
            "/v1/events?after_seq=5&epoch=ab&events=chat%2Cagent"
        );
        assert_eq!(
            Follow {
                events: vec![],
                ..how
            }
            .path(None),
            "/v1/events"
        );
        assert_eq!(Follow::observer().path(None), "/v1/events?tool_events=all");
    }
}
