//! What `clawmux top` and `clawmux tail --tree/--hud` share: following the
//! broker's events as an observer (`/v1/events?tool_events=all`, resuming
//! across disconnects and broker restarts), and the line renderings of the
//! [`crate::activity`] projection.

use std::io::Write;
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
use crate::activity::{Activity, Observed};
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
    /// A gateway event: its name, its frame, whether it was replayed.
    Event {
        name: String,
        frame: Value,
        replay: bool,
    },
    /// Connected (again): the broker life the stream belongs to.
    Connected { epoch: String },
    /// The broker is not answering; the follower keeps trying.
    Lost(String),
    /// Events were missed (a gap, or a resume the broker could not serve).
    Missed(String),
}

/// Follows `/v1/events` as an observer until `tx` closes, starting with
/// what the broker's replay log still holds (so a dashboard opens on recent
/// activity), resuming after each disconnect from the last cursor seen, and
/// from the newest event when the broker cannot replay (it restarted).
pub async fn follow(client: BrokerClient, tx: mpsc::Sender<Feed>) {
    let mut after: Option<EventId> = None;
    let mut backoff = BACKOFF_MIN;
    let mut from_window_start = true;
    loop {
        if from_window_start {
            // Start at the oldest event the log holds.
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
        let mut query = vec![OBSERVER_QUERY.to_owned()];
        if let Some(EventId { epoch, cursor }) = &after {
            query.push(format!("after_seq={cursor}"));
            if let Some(epoch) = epoch {
                query.push(format!("epoch={epoch}"));
            }
        }
        let path = format!("/v1/events?{}", query.join("&"));
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
        if status == StatusCode::GONE {
            let body = resp.into_body().collect().await.map(|b| b.to_bytes());
            let body: Value = body
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null);
            // Another broker life: everything in its log is new to us.
            let restarted =
                body["epoch"].as_str() != after.as_ref().and_then(|a| a.epoch.as_deref());
            let cursor = if restarted {
                body["oldest_seq"].as_u64().unwrap_or(1).saturating_sub(1)
            } else {
                body["newest_seq"].as_u64().unwrap_or(0)
            };
            after = body["epoch"].as_str().map(|epoch| EventId {
                epoch: Some(epoch.to_owned()),
                cursor,
            });
            let what = if restarted {
                "the broker restarted; events in between were missed"
            } else {
                "the broker could not replay from the last event seen; continuing from now"
            };
            if tx.send(Feed::Missed(what.into())).await.is_err() {
                return;
            }
            continue;
        }
        if status != StatusCode::OK {
            let _ = tx
                .send(Feed::Lost(format!("the broker answered {status}")))
                .await;
            tokio::time::sleep(BACKOFF_MAX).await;
            continue;
        }
        backoff = BACKOFF_MIN;
        let epoch = header(EPOCH_HEADER).unwrap_or_default();
        let newest = header(NEWEST_SEQ_HEADER).and_then(|v| v.parse().ok());
        if let Some(cursor) = header(AFTER_SEQ_HEADER).and_then(|v| v.parse().ok()) {
            after = Some(EventId {
                epoch: Some(epoch.clone()),
                cursor,
            });
        }
        if tx.send(Feed::Connected { epoch }).await.is_err() {
            return;
        }
        let mut events = resp.into_body().into_data_stream().eventsource();
        while let Some(Ok(event)) = events.next().await {
            match event.event.as_str() {
                "clawmux.close" => break,
                "clawmux.gap" => {
                    let what = "some events were not delivered (an upstream reconnect, or this view fell behind)";
                    if tx.send(Feed::Missed(what.into())).await.is_err() {
                        return;
                    }
                    continue;
                }
                _ => {}
            }
            let frame: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
            if let Some(seq) = frame["seq"].as_u64() {
                if let Some(a) = after.as_mut() {
                    a.cursor = seq;
                }
            }
            let replay = is_replayed(&frame, newest);
            let feed = Feed::Event {
                name: event.event,
                frame,
                replay,
            };
            if tx.send(feed).await.is_err() {
                return;
            }
        }
        if tx
            .send(Feed::Lost("lost the event stream; reconnecting".into()))
            .await
            .is_err()
        {
            return;
        }
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

    /// Applies one event (its SSE name and `data`) and writes what it
    /// changed. An error is the output's (e.g. a closed pipe).
    pub fn feed(
        &mut self,
        name: &str,
        data: &str,
        replay: bool,
        out: &mut impl Write,
    ) -> std::io::Result<()> {
        let frame: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        let changes = self.activity.apply(Observed {
            name,
            payload: &frame["payload"],
            received_ms: crate::protocol::now_ms(),
        });
        for change in &changes {
            match self.mode {
                LineMode::Hud => writeln!(out, "{}", hud_line(change, replay))?,
                LineMode::Tree => {
                    for line in self.printer.lines(change, replay, local_time) {
                        writeln!(out, "{line}")?;
                    }
                }
            }
        }
        if !changes.is_empty() {
            out.flush()?;
        }
        Ok(())
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
        let mut out = Vec::new();
        let start = json!({"event": "agent", "payload": {"runId": "r1", "ts": 7, "sessionKey": "s",
            "stream": "lifecycle", "data": {"phase": "start"}}});
        view.feed("agent", &start.to_string(), true, &mut out)
            .unwrap();
        view.feed("tick", r#"{"payload":{"ts":1}}"#, false, &mut out)
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert_eq!(lines[0]["type"], "turn_start");
        assert_eq!(lines[0]["replay"], true);
    }
}
