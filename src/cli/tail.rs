//! `clawmux tail`: follows `/v1/events`, one readable line per event.
//!
//! It remembers the id of the last event it printed (`<epoch>:<cursor>`:
//! the broker life and the cursor). When the stream drops it reconnects and
//! resumes right after that cursor of that life, so nothing is lost or
//! printed twice. If the broker cannot replay from there (it restarted, or
//! the gap outgrew its replay window) the broker answers 410; tail says so on
//! stderr and goes on from the newest event. Gaps the broker reports inside
//! a stream (`clawmux.gap`: an upstream reconnect, or events this stream
//! fell behind on) are said on stderr too.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;

use super::watch::{LineMode, LineView};
use super::{BrokerArgs, CliError};
use crate::hub::replay::EventId;
use crate::local::sse::{AFTER_SEQ_HEADER, EPOCH_HEADER, NEWEST_SEQ_HEADER};

/// Reconnect delays while the broker is away.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Longest text preview on a line.
const PREVIEW_CHARS: usize = 60;

#[derive(Args, Debug)]
pub struct TailArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Only these events (comma-separated gateway event names), e.g. chat,agent.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub events: Vec<String>,
    /// Start right after this event (replaying what the broker still holds) instead of now:
    /// an id as `EPOCH:SEQ`, or a bare SEQ of the running broker's life.
    #[arg(long, value_name = "[EPOCH:]SEQ")]
    pub after: Option<EventId>,
    /// Print each event's gateway frame as one JSON line (its `seq` is the broker cursor).
    #[arg(long)]
    pub json: bool,
    /// Print the activity tree (runs, thinking, tool calls, ends) as indented lines; sees every tool call.
    #[arg(long, conflicts_with_all = ["json", "hud"])]
    pub tree: bool,
    /// Print the activity as HUD JSON lines (turn/think/tool start and end); sees every tool call.
    #[arg(long, conflicts_with_all = ["json"])]
    pub hud: bool,
}

/// Where the next stream should start.
#[derive(Debug, Default)]
struct Cursor {
    after: Option<u64>,
    epoch: Option<String>,
}

impl Cursor {
    fn path(&self, events: &[String]) -> String {
        let mut query = Vec::new();
        if let Some(after) = self.after {
            query.push(("after_seq", after.to_string()));
        }
        if let Some(epoch) = &self.epoch {
            query.push(("epoch", epoch.clone()));
        }
        if !events.is_empty() {
            query.push(("events", events.join(",")));
        }
        match serde_urlencoded::to_string(&query) {
            Ok(q) if !q.is_empty() => format!("/v1/events?{q}"),
            _ => "/v1/events".to_owned(),
        }
    }
}

/// Runs until interrupted (or stdout closes). Fails at once only when the
/// broker is unreachable at the start, or refuses the request as malformed.
pub async fn run(args: TailArgs) -> Result<u8, CliError> {
    let client = args.broker.client();
    let mut cursor = match args.after {
        Some(EventId {
            epoch: Some(epoch),
            cursor,
        }) => Cursor {
            after: Some(cursor),
            epoch: Some(epoch),
        },
        // The broker resumes no cursor without its life; a bare one typed
        // by the user means the running broker's, so ask which that is.
        Some(EventId {
            epoch: None,
            cursor,
        }) => Cursor {
            after: Some(cursor),
            epoch: Some(running_epoch(&client).await?),
        },
        None => Cursor::default(),
    };
    let mut connected_before = false;
    let mut backoff = BACKOFF_MIN;
    // --tree/--hud: the activity projection (crate::activity) prints instead.
    let mut activity = match (args.tree, args.hud) {
        (true, _) => Some(LineView::new(LineMode::Tree)),
        (_, true) => Some(LineView::new(LineMode::Hud)),
        _ => None,
    };
    loop {
        let mut path = cursor.path(&args.events);
        if activity.is_some() {
            let sep = if path.contains('?') { '&' } else { '?' };
            path = format!("{path}{sep}{}", super::watch::OBSERVER_QUERY);
        }
        let resp = match client.send(Method::GET, &path, &[], None).await {
            Ok(resp) => resp,
            Err(e @ CliError::Unreachable { .. }) if !connected_before => return Err(e),
            Err(CliError::Unreachable { .. }) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
            Err(e) => return Err(e),
        };
        let status = resp.status();
        if status != StatusCode::OK {
            let body = resp.into_body().collect().await.map(|b| b.to_bytes());
            let body: Value = body
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null);
            match status {
                StatusCode::GONE => {
                    eprintln!(
                        "clawmux tail: cannot resume after seq {}: {}; events in between were missed, continuing from seq {}",
                        cursor.after.map_or("(start)".to_owned(), |s| s.to_string()),
                        if body["epoch"].as_str() != cursor.epoch.as_deref() && cursor.epoch.is_some() {
                            "the broker restarted"
                        } else {
                            "the broker cannot replay from there"
                        },
                        body["newest_seq"]
                    );
                    cursor = Cursor {
                        after: body["newest_seq"].as_u64(),
                        epoch: body["epoch"].as_str().map(str::to_owned),
                    };
                    continue;
                }
                StatusCode::BAD_REQUEST => {
                    return Err(CliError::Usage(error_message(&body)));
                }
                _ => {
                    return Err(CliError::Answer(format!(
                        "the broker answered {status}: {}",
                        error_message(&body)
                    )))
                }
            }
        }
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        cursor.epoch = header(EPOCH_HEADER);
        let newest_at_open = header(NEWEST_SEQ_HEADER).and_then(|v| v.parse().ok());
        if let Some(after) = header(AFTER_SEQ_HEADER).and_then(|v| v.parse().ok()) {
            cursor.after = Some(after);
        }
        if connected_before {
            eprintln!(
                "clawmux tail: reconnected; resuming after seq {}",
                cursor.after.unwrap_or(0)
            );
        }
        connected_before = true;
        backoff = BACKOFF_MIN;
        let mut events = resp.into_body().into_data_stream().eventsource();
        let mut stdout = std::io::stdout();
        while let Some(Ok(event)) = events.next().await {
            match event.event.as_str() {
                "clawmux.close" => {
                    eprintln!("clawmux tail: the broker ended the stream: {}", event.data);
                    break;
                }
                "clawmux.gap" => {
                    let gap: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
                    eprintln!(
                        "clawmux tail: events after seq {} and before seq {} were not delivered (an upstream gap or reconnect, or this stream fell behind)",
                        gap["after"], gap["next"]
                    );
                    continue;
                }
                _ => {}
            }
            if let Some(view) = activity.as_mut() {
                // Tool-stream records have no id of their own (not in the log).
                let frame: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
                if let Some(seq) = frame["seq"].as_u64() {
                    cursor.after = Some(seq);
                }
                let replay = super::watch::is_replayed(&frame, newest_at_open);
                if view
                    .feed(&event.event, &event.data, replay, &mut stdout)
                    .is_err()
                {
                    return Ok(0); // stdout closed
                }
                continue;
            }
            let Ok(id) = event.id.parse::<EventId>() else {
                continue;
            };
            let seq = id.cursor;
            cursor.after = Some(seq);
            if id.epoch.is_some() {
                cursor.epoch = id.epoch;
            }
            let line = if args.json {
                event.data
            } else {
                let frame: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
                format_line(seq, &event.event, &frame, crate::protocol::now_ms())
            };
            if writeln!(stdout, "{line}")
                .and_then(|()| stdout.flush())
                .is_err()
            {
                return Ok(0); // stdout closed (e.g. piped into `head`)
            }
        }
        eprintln!(
            "clawmux tail: lost the stream from {}; reconnecting…",
            client.socket().display()
        );
    }
}

/// The running broker's life (`epoch` of `/v1/state`).
async fn running_epoch(client: &super::client::BrokerClient) -> Result<String, CliError> {
    let (status, state) = client.json(Method::GET, "/v1/state", None).await?;
    match state["epoch"].as_str() {
        Some(epoch) if status.is_success() => Ok(epoch.to_owned()),
        _ => Err(CliError::Answer(format!(
            "the broker answered {status} without an epoch: {}",
            error_message(&state)
        ))),
    }
}

fn error_message(body: &Value) -> String {
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

/// One line: local time, cursor, event name, and what the event is about.
pub fn format_line(seq: u64, name: &str, frame: &Value, now_ms: u64) -> String {
    let payload = &frame["payload"];
    let ts = payload["ts"]
        .as_i64()
        .or_else(|| payload["message"]["timestamp"].as_i64())
        .unwrap_or(now_ms as i64);
    let time = chrono::DateTime::from_timestamp_millis(ts)
        .map(|t| {
            t.with_timezone(&chrono::Local)
                .format("%H:%M:%S%.3f")
                .to_string()
        })
        .unwrap_or_else(|| "--:--:--.---".into());
    let line = format!("{time} {seq:>7} {name:<16} {}", describe(name, payload));
    line.trim_end().to_owned()
}

fn describe(name: &str, p: &Value) -> String {
    let run = || {
        let mut parts = Vec::new();
        if let Some(run) = p["runId"].as_str() {
            parts.push(format!("run={}", run.chars().take(8).collect::<String>()));
        }
        if let Some(session) = p["sessionKey"].as_str() {
            parts.push(format!("session={session}"));
        }
        parts
    };
    match name {
        "chat" => {
            let mut parts = run();
            let state = p["state"].as_str().unwrap_or("?");
            parts.push(state.to_owned());
            let text = match state {
                "delta" => p["deltaText"]
                    .as_str()
                    .map(|d| preview(d, false))
                    .or_else(|| message_text(&p["message"]).map(|t| preview(&t, true))),
                "error" => p["errorMessage"].as_str().map(|e| preview(e, false)),
                _ => message_text(&p["message"]).map(|t| preview(&t, false)),
            };
            parts.extend(text);
            parts.join(" ")
        }
        "agent" => {
            let mut parts = run();
            let stream = p["stream"].as_str().unwrap_or("?");
            parts.push(format!("stream={stream}"));
            let d = &p["data"];
            let detail = match stream {
                "assistant" => d["delta"]
                    .as_str()
                    .map(|t| preview(t, false))
                    .or_else(|| d["text"].as_str().map(|t| preview(t, true))),
                "lifecycle" => d["phase"].as_str().map(str::to_owned),
                "tool" => Some(format!(
                    "{} {}",
                    d["name"].as_str().unwrap_or("?"),
                    d["phase"].as_str().unwrap_or("")
                )),
                _ => (!d.is_null()).then(|| compact(d)),
            };
            parts.extend(detail);
            parts.join(" ")
        }
        "presence" => format!("{} entries", p["presence"].as_array().map_or(0, Vec::len)),
        "tick" => String::new(),
        "clawmux.upstream" => format!(
            "phase={} {}",
            p["phase"].as_str().unwrap_or("?"),
            p["reason"].as_str().unwrap_or("")
        ),
        "shutdown" => format!(
            "{} (restart expected in {} ms)",
            p["reason"].as_str().unwrap_or(""),
            p["restartExpectedMs"]
        ),
        _ if p.is_null() => String::new(),
        _ => compact(p),
    }
}

/// The text of a chat message (`content` as a string or as text parts).
fn message_text(message: &Value) -> Option<String> {
    match &message["content"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let text: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
            (!text.is_empty()).then_some(text)
        }
        _ => None,
    }
}

/// A quoted one-line preview; `tail_end` keeps the end of a cumulative text.
fn preview(text: &str, tail_end: bool) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let n = flat.chars().count();
    let cut = if n <= PREVIEW_CHARS {
        flat
    } else if tail_end {
        let tail: String = flat.chars().skip(n - PREVIEW_CHARS).collect();
        format!("…{tail}")
    } else {
        let head: String = flat.chars().take(PREVIEW_CHARS).collect();
        format!("{head}…")
    };
    format!("{cut:?}")
}

fn compact(v: &Value) -> String {
    let text = v.to_string();
    if text.chars().count() <= 100 {
        text
    } else {
        format!("{}…", text.chars().take(100).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_and_agent_lines_show_run_session_and_text() {
        let chat = json!({"type":"event","event":"chat","payload":{
            "runId":"7d7b1f2c-1111","sessionKey":"agent:main:main","state":"delta",
            "deltaText":"Hello\nthere","message":{"content":[{"type":"text","text":"Hello"}],"timestamp":0}}});
        let line = format_line(45, "chat", &chat, 0);
        assert!(
            line.ends_with(
                r#"45 chat             run=7d7b1f2c session=agent:main:main delta "Hello there""#
            ),
            "{line}"
        );
        let agent = json!({"payload":{"runId":"r1","stream":"assistant","ts":1,"data":{"text":"x".repeat(100)}}});
        let line = format_line(3, "agent", &agent, 0);
        assert!(line.contains("run=r1 stream=assistant \"…xxxx"), "{line}");
        let tool = json!({"payload":{"runId":"r1","stream":"tool","data":{"name":"exec","phase":"start"}}});
        assert!(format_line(4, "agent", &tool, 0).ends_with("stream=tool exec start"));
    }

    #[test]
    fn other_events_are_compact() {
        let up = json!({"payload":{"phase":"backoff","reason":"gateway closed"}});
        assert!(
            format_line(1, "clawmux.upstream", &up, 0).ends_with("phase=backoff gateway closed")
        );
        let p = json!({"payload":{"presence":[1,2,3]}});
        assert!(format_line(2, "presence", &p, 0).ends_with("presence         3 entries"));
        let other = json!({"payload":{"a":1}});
        assert!(format_line(9, "cron", &other, 0).ends_with(r#"{"a":1}"#));
    }

    #[test]
    fn after_takes_an_event_id_with_or_without_its_broker_life() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cmd {
            #[command(flatten)]
            tail: TailArgs,
        }
        let after = |arg: &str| Cmd::try_parse_from(["tail", "--after", arg]).map(|c| c.tail.after);
        assert_eq!(
            after("5f0c:12").unwrap(),
            Some(EventId {
                epoch: Some("5f0c".into()),
                cursor: 12
            })
        );
        assert_eq!(after("12").unwrap().unwrap().epoch, None);
        assert!(after("5f0c:").is_err());
    }

    #[test]
    fn resume_paths_carry_cursor_epoch_and_filter() {
        let c = Cursor {
            after: Some(5),
            epoch: Some("ab".into()),
        };
        assert_eq!(
            c.path(&["chat".into(), "agent".into()]),
            "/v1/events?after_seq=5&epoch=ab&events=chat%2Cagent"
        );
        assert_eq!(Cursor::default().path(&[]), "/v1/events");
    }
}
