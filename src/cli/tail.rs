//! `clawmux tail`: follows `/v1/events`, one readable line per event.
//!
//! It follows with the one follower `top` uses too ([`super::watch::follow_with`]):
//! when the stream drops it reconnects and resumes right after the last
//! cursor seen, so nothing is lost or printed twice. If the broker cannot
//! replay from there (it restarted, or the gap outgrew its replay window)
//! the broker answers 410; tail says so on stderr and goes on with the
//! oldest event the broker still holds (after a restart: everything the new
//! broker logged). Gaps the broker reports inside a stream (`clawmux.gap`:
//! an upstream reconnect, or events this stream fell behind on) are said on
//! stderr too. `--tree`/`--hud` print the activity projection
//! ([`crate::activity`]) instead of events.

use std::collections::VecDeque;
use std::io::Write;
use std::time::Duration;

use clap::Args;
use http::Method;
use serde_json::Value;

use super::style::Paint;
use super::watch::{error_message, follow_with, Feed, Follow, LineMode, LineView, Start};
use super::{BrokerArgs, CliError};
use crate::activity::message_text;
use crate::hub::replay::EventId;
use crate::sharing::SessionDefaults;
/// Longest text preview on a line.
const PREVIEW_CHARS: usize = 60;
/// With `-n`/`--since`, the replayed events are held back until the last one
/// the broker held at the start arrives; if it never does (it was filtered
/// or dropped), what is held is printed after this long without an event.
const BACKLOG_IDLE_FLUSH: Duration = Duration::from_millis(500);
/// Events the broker itself adds (`/v1/events` always accepts them).
const BROKER_EVENTS: [&str; 1] = ["clawmux.upstream"];

#[derive(Args, Debug)]
pub struct TailArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Only these events (comma-separated gateway event names), e.g. chat,agent; an unknown name is an error listing the known ones.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub events: Vec<String>,
    /// Start right after this event (replaying what the broker still holds) instead of now:
    /// a cursor as in the stream's `id:` lines and /v1/state's `newest_seq`. Cursors survive
    /// broker restarts (an old `EPOCH:SEQ` id is still accepted).
    #[arg(long, value_name = "SEQ", conflicts_with_all = ["lines", "since"])]
    pub after: Option<EventId>,
    /// First print the last N matching events the broker still holds, then follow.
    #[arg(short = 'n', long = "lines", value_name = "N")]
    pub lines: Option<usize>,
    /// First print the held events of the last DURATION (`90s`, `5m`, `2h`) or since a time (`2026-11-23T10:00:00Z`), then follow.
    #[arg(long, value_name = "DURATION|TIME", value_parser = parse_since)]
    pub since: Option<u64>,
    /// Only events of this session (`agent:main:main`, or `main` / a bare key of the default agent).
    #[arg(long, value_name = "KEY")]
    pub session: Option<String>,
    /// Only events of this run (its runId, or a prefix of it), its tool calls included where the socket allows observers; also with --tree and --hud.
    #[arg(long, value_name = "RUN_ID")]
    pub run: Option<String>,
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

/// `--since`: a duration back from now, or an RFC 3339 time; as Unix ms.
fn parse_since(text: &str) -> Result<u64, String> {
    let now = std::time::SystemTime::now();
    let at = match humantime::parse_duration(text.trim()) {
        Ok(ago) => now.checked_sub(ago).ok_or("--since is too far back")?,
        Err(_) => humantime::parse_rfc3339_weak(text.trim()).map_err(|_| {
            format!("--since takes a duration (90s, 5m, 2h) or a time (2026-11-23T10:00:00Z), not {text:?}")
        })?,
    };
    Ok(at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64))
}

/// Which events are printed (`--events`, `--session`, `--run`), applied to
/// every event, replayed or live.
#[derive(Debug, Default)]
pub struct Filter {
    pub events: Vec<String>,
    /// Canonical session key.
    pub session: Option<String>,
    pub run: Option<String>,
    pub defaults: SessionDefaults,
}

impl Filter {
    pub fn matches(&self, name: &str, payload: &Value) -> bool {
        if !self.events.is_empty() && !self.events.iter().any(|e| e == name) {
            return false;
        }
        if let Some(want) = &self.session {
            let key = payload["sessionKey"].as_str();
            if key.map(|k| self.defaults.canonical(k)).as_deref() != Some(want) {
                return false;
            }
        }
        if let Some(want) = &self.run {
            if !payload["runId"]
                .as_str()
                .is_some_and(|r| r.starts_with(want.as_str()))
            {
                return false;
            }
        }
        true
    }

    /// Whether the lines of `tail --tree/--hud` about this run are printed
    /// (`--run`, `--session`; `--events` decides which events the
    /// projection sees, not which runs are shown). A change about no run
    /// (`run_id` empty: a reconnect) only without either filter.
    pub fn matches_run(&self, run_id: &str, session_key: &str) -> bool {
        if let Some(want) = &self.session {
            if session_key.is_empty() || self.defaults.canonical(session_key) != *want {
                return false;
            }
        }
        match &self.run {
            Some(want) => !run_id.is_empty() && run_id.starts_with(want.as_str()),
            None => true,
        }
    }
}

/// Unknown `--events` names, checked against the names the gateway announced
/// (`/v1/state` `upstream.events`) and the broker's own.
fn unknown_events(wanted: &[String], announced: &[&str]) -> Result<(), String> {
    let unknown: Vec<&str> = wanted
        .iter()
        .map(String::as_str)
        .filter(|w| !announced.contains(w) && !BROKER_EVENTS.contains(w))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let mut valid: Vec<&str> = announced.iter().copied().chain(BROKER_EVENTS).collect();
    valid.sort_unstable();
    valid.dedup();
    Err(format!(
        "unknown event name{} {}; the gateway and the broker send: {}",
        if unknown.len() > 1 { "s" } else { "" },
        unknown.join(", "),
        valid.join(", ")
    ))
}

/// Replayed events held back before printing (`-n`, `--since`).
struct Backlog {
    /// The newest cursor when tail started: events up to it are the backlog.
    end: u64,
    last: Option<usize>,
    since_ms: Option<u64>,
    held: VecDeque<String>,
}

impl Backlog {
    fn hold(&mut self, line: String, ts_ms: Option<u64>) {
        if let (Some(since), Some(ts)) = (self.since_ms, ts_ms) {
            if ts < since {
                return;
            }
        } else if self.since_ms.is_some() && self.held.is_empty() {
            // No time on this event: kept only once a newer one qualified.
            return;
        }
        self.held.push_back(line);
        if let Some(n) = self.last {
            while self.held.len() > n {
                self.held.pop_front();
            }
        }
    }
}

/// Runs until interrupted (or stdout closes). Fails at once only when the
/// broker is unreachable at the start, or refuses the request as malformed.
pub async fn run(args: TailArgs) -> Result<u8, CliError> {
    let client = args.broker.client();
    let out_paint = if args.json {
        Paint::plain()
    } else {
        Paint::stdout()
    };
    let err_paint = Paint::stderr();
    let note = |text: &str| {
        eprintln!(
            "{} {}",
            err_paint.warn("clawmux tail:"),
            crate::sanitize::text(text)
        )
    };
    // Also says at once when there is no broker.
    let state = running_state(&client).await?;
    if !args.events.is_empty() {
        match state["upstream"]["events"].as_array() {
            Some(names) => {
                let names: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
                unknown_events(&args.events, &names).map_err(CliError::Usage)?;
            }
            None => {
                note("the gateway session is not ready, so --events names cannot be checked yet")
            }
        }
    }
    let defaults = SessionDefaults::from_snapshot(&state["snapshot"]);
    let filter = Filter {
        events: args.events.clone(),
        session: args.session.as_deref().map(|k| defaults.canonical(k)),
        run: args.run.clone(),
        defaults,
    };
    let epoch_now = || state["epoch"].as_str().map(str::to_owned);
    let mut backlog = None;
    let start = match args.after.clone() {
        // The broker resumes no cursor without its life; a bare one typed
        // by the user means the running broker's.
        Some(EventId { epoch, cursor }) => Start::After(EventId {
            epoch: epoch.or_else(epoch_now),
            cursor,
        }),
        None if args.lines.is_some() || args.since.is_some() => {
            let end = state["newest_seq"].as_u64().unwrap_or(0);
            backlog = Some(Backlog {
                end,
                last: args.lines,
                since_ms: args.since,
                held: VecDeque::new(),
            });
            Start::After(EventId {
                epoch: epoch_now(),
                cursor: state["oldest_seq"]
                    .as_u64()
                    .unwrap_or(1)
                    .saturating_sub(1)
                    .min(end),
            })
        }
        None => Start::Now,
    };
    // --tree/--hud: the activity projection (crate::activity) prints instead.
    let mut activity = match (args.tree, args.hud) {
        (true, _) => Some(LineView::new(LineMode::Tree)),
        (_, true) => Some(LineView::new(LineMode::Hud)),
        _ => None,
    };
    let how = Follow {
        start,
        // Filtered here when a backlog is held (its last event must be seen).
        events: match backlog {
            Some(_) => Vec::new(),
            None => args.events.clone(),
        },
        // A run's tool calls are targeted events: `--run` asks for every
        // one (then filters by run) where this socket lets the CLI observe
        // (`/v1/state` shows `runs` only there).
        observer: activity.is_some() || (args.run.is_some() && !state["runs"].is_null()),
    };
    let (tx, mut feed) = tokio::sync::mpsc::channel(FEED_CHANNEL);
    let follower = tokio::spawn(follow_with(client.clone(), how, tx));
    let _stop = AbortOnDrop(follower);
    let mut connected_before = false;
    // What tail last said about a lost stream (each attempt while the
    // broker is away says the same: once is enough).
    let mut lost_said: Option<String> = None;
    let mut stdout = std::io::stdout();
    let closed = output_closed();
    tokio::pin!(closed);
    loop {
        let next = tokio::select! {
            biased;
            // Nobody reads any more (piped into `head`, which has its
            // lines): a quiet stream would not learn it by writing.
            () = &mut closed => return Ok(0),
            next = async {
                match &backlog {
                    Some(_) => tokio::time::timeout(BACKLOG_IDLE_FLUSH, feed.recv()).await.ok(),
                    None => Some(feed.recv().await),
                }
            } => next,
        };
        let next = match next {
            Some(next) => next,
            None => {
                // Nothing for a while: what is held is all there is.
                if flush(&mut stdout, backlog.take()).is_err() {
                    return Ok(0);
                }
                continue;
            }
        };
        let Some(next) = next else { return Ok(0) };
        let (name, frame, replay, seq, data) = match next {
            Feed::Failed(e) => return Err(e),
            Feed::Connected { after, .. } => {
                if connected_before {
                    note(&format!(
                        "reconnected; resuming after seq {}",
                        after.unwrap_or(0)
                    ));
                }
                connected_before = true;
                lost_said = None;
                if backlog
                    .as_ref()
                    .is_some_and(|b| after.unwrap_or(0) >= b.end)
                {
                    backlog = None; // nothing was held: the stream starts live
                }
                continue;
            }
            Feed::Lost(why) => {
                if lost_said.as_deref() != Some(why.as_str()) {
                    note(&format!(
                        "{why} ({}); reconnecting…",
                        client.socket().display()
                    ));
                    lost_said = Some(why);
                }
                continue;
            }
            Feed::Missed(what) => {
                note(&what);
                if let Some(view) = activity.as_mut() {
                    view.gap();
                }
                continue;
            }
            Feed::Event {
                name,
                frame,
                replay,
                seq,
                data,
            } => (name, frame, replay, seq, data),
        };
        let lines = match activity.as_mut() {
            Some(view) => view.lines(&name, &frame, replay, |run, session| {
                filter.matches_run(run, session)
            }),
            None => {
                // Every record of a plain stream is logged: it has a cursor.
                let Some(seq) = seq else { continue };
                let line = filter.matches(&name, &frame["payload"]).then(|| {
                    if args.json {
                        // The record as the broker sent it, C1 and bidi
                        // characters escaped.
                        match crate::sanitize::json_text(&data) {
                            std::borrow::Cow::Borrowed(_) => data,
                            std::borrow::Cow::Owned(escaped) => escaped,
                        }
                    } else {
                        format_line_styled(
                            seq,
                            &name,
                            &frame,
                            crate::protocol::now_ms(),
                            &out_paint,
                        )
                    }
                });
                line.into_iter().collect()
            }
        };
        if let Some(b) = &mut backlog {
            for line in lines {
                b.hold(line, event_time_ms(&frame["payload"]));
            }
            if seq.is_some_and(|seq| seq >= b.end) && flush(&mut stdout, backlog.take()).is_err() {
                return Ok(0);
            }
            continue;
        }
        for line in lines {
            if writeln!(stdout, "{line}").is_err() {
                return Ok(0); // stdout closed (e.g. piped into `head`)
            }
        }
        if stdout.flush().is_err() {
            return Ok(0);
        }
    }
}

/// Resolves once nobody reads this process's standard output any more:
/// the reader of its pipe closed it (as `head` does once it has its
/// lines) or its terminal hung up, whether or not anything is being
/// written. Never resolves where that cannot be told (a file).
///
/// A thread waits in `poll(2)` with no events asked: the kernel reports
/// `POLLERR`/`POLLHUP` regardless, and nothing else wakes it. Tokio's
/// reactor cannot wait for these alone on a descriptor it does not own
/// (stdout may be a file, which epoll refuses), hence the thread.
fn output_closed() -> impl std::future::Future<Output = ()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let watch = move || {
        let out = std::io::stdout();
        let mut fds = [rustix::event::PollFd::new(
            &out,
            rustix::event::PollFlags::empty(),
        )];
        loop {
            match rustix::event::poll(&mut fds, None) {
                Ok(_)
                    if fds[0].revents().intersects(
                        rustix::event::PollFlags::ERR | rustix::event::PollFlags::HUP,
                    ) =>
                {
                    let _ = tx.send(());
                    return;
                }
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
        }
    };
    let spawned = std::thread::Builder::new()
        .name("tail-output".into())
        .spawn(watch);
    async move {
        // No thread, or it could not wait: never resolves.
        if spawned.is_err() || rx.await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Events waiting between the follower and the output.
const FEED_CHANNEL: usize = 4096;

/// Stops the follower when tail returns.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Prints what a backlog held.
fn flush(out: &mut impl Write, backlog: Option<Backlog>) -> std::io::Result<()> {
    for line in backlog.map(|b| b.held).unwrap_or_default() {
        writeln!(out, "{line}")?;
    }
    out.flush()
}

/// An event's own time, when it has one.
fn event_time_ms(payload: &Value) -> Option<u64> {
    payload["ts"]
        .as_u64()
        .or_else(|| payload["message"]["timestamp"].as_u64())
}

/// The running broker's `/v1/state`.
async fn running_state(client: &super::client::BrokerClient) -> Result<Value, CliError> {
    let (status, state) = client.json(Method::GET, "/v1/state", None).await?;
    match state["epoch"].as_str() {
        Some(_) if status.is_success() => Ok(state),
        _ => Err(CliError::Answer(format!(
            "the broker answered {status} without an epoch: {}",
            error_message(&state)
        ))),
    }
}

/// One line: local time, cursor, event name, and what the event is about.
pub fn format_line(seq: u64, name: &str, frame: &Value, now_ms: u64) -> String {
    format_line_styled(seq, name, frame, now_ms, &Paint::plain())
}

/// [`format_line`] with colour: time and cursor (`#N`) dimmed, the event name bold
/// (errors red, broker events yellow).
pub fn format_line_styled(
    seq: u64,
    name: &str,
    frame: &Value,
    now_ms: u64,
    paint: &Paint,
) -> String {
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
    let padded = format!("{:<16}", crate::sanitize::text(name));
    let name_style = if payload["state"] == "error" {
        paint.bad(&padded)
    } else if name.starts_with("clawmux.") || name == "shutdown" {
        paint.warn(&padded)
    } else {
        paint.strong(&padded)
    };
    let line = format!(
        "{} {} {name_style} {}",
        paint.dim(&time),
        // Labelled: the event's cursor, what `--after` takes back.
        paint.dim(&format!("#{seq}")),
        // Session keys, run ids, texts, tool names: the gateway's strings.
        crate::sanitize::text(&describe(name, payload))
    );
    line.trim_end().to_owned()
}

fn describe(name: &str, p: &Value) -> String {
    let run = || {
        let mut parts = Vec::new();
        if let Some(run) = p["runId"].as_str() {
            // Whole: a prefix makes `run-<time>` ids look alike.
            parts.push(format!("run={run}"));
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
                "assistant" | "thinking" => d["delta"]
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
        "shutdown" => {
            let reason = p["reason"].as_str().unwrap_or("");
            match p["restartExpectedMs"].as_u64() {
                Some(ms) => format!("{reason} (restart expected in {ms} ms)"),
                None => reason.to_owned(),
            }
        }
        _ if p.is_null() => String::new(),
        _ => compact(p),
    }
}

/// A quoted one-line preview (escaped: [`crate::sanitize::preview`]);
/// `tail_end` keeps the end of a cumulative text.
pub(crate) fn preview(text: &str, tail_end: bool) -> String {
    let keep = match tail_end {
        true => crate::sanitize::Keep::End,
        false => crate::sanitize::Keep::Start,
    };
    crate::sanitize::preview(text, PREVIEW_CHARS, keep)
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
                r#" #45 chat             run=7d7b1f2c-1111 session=agent:main:main delta "Hello there""#
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
    fn tree_lines_are_kept_by_run_prefix_and_session() {
        let filter = Filter {
            session: Some("agent:main:main".into()),
            run: Some("run-1795431470".into()),
            ..Filter::default()
        };
        assert!(filter.matches_run("run-1795431470344", "agent:main:main"));
        assert!(!filter.matches_run("run-1795431469879", "agent:main:main"));
        assert!(!filter.matches_run("run-1795431470344", "agent:main:other"));
        assert!(!filter.matches_run("", ""), "a reconnect is about no run");
        assert!(Filter::default().matches_run("", ""));
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
    fn a_shutdown_without_a_restart_hint_says_no_null() {
        let f = json!({"payload":{"reason":"gateway stopping"}});
        let line = format_line(5, "shutdown", &f, 0);
        assert!(line.ends_with("gateway stopping"), "{line}");
        assert!(!line.contains("null"), "{line}");
        let f = json!({"payload":{"reason":"update","restartExpectedMs":1500}});
        assert!(format_line(6, "shutdown", &f, 0).ends_with("update (restart expected in 1500 ms)"));
    }

    #[test]
    fn unknown_event_names_are_refused_with_the_known_ones() {
        assert!(unknown_events(
            &["chat".into(), "clawmux.upstream".into()],
            &["chat", "tick"]
        )
        .is_ok());
        let e = unknown_events(&["chta".into()], &["chat", "tick"]).unwrap_err();
        assert_eq!(
            e,
            "unknown event name chta; the gateway and the broker send: chat, clawmux.upstream, tick"
        );
    }

    #[test]
    fn filters_by_session_in_canonical_form_and_by_run_prefix() {
        let f = Filter {
            session: Some("agent:main:main".into()),
            run: Some("abc".into()),
            ..Filter::default()
        };
        assert!(f.matches("chat", &json!({"sessionKey":"main","runId":"abcdef"})));
        assert!(!f.matches(
            "chat",
            &json!({"sessionKey":"agent:main:side","runId":"abcdef"})
        ));
        assert!(!f.matches("chat", &json!({"sessionKey":"main","runId":"xyz"})));
        assert!(!f.matches("tick", &json!({})));
    }

    #[test]
    fn since_takes_a_duration_or_a_time() {
        let now = crate::protocol::now_ms();
        let ago = parse_since("5m").unwrap();
        assert!(now - ago >= 299_000 && now - ago <= 301_000 + 5_000);
        assert_eq!(parse_since("1970-01-01T00:00:01Z").unwrap(), 1000);
        assert!(parse_since("soon").is_err());
    }

    #[test]
    fn thinking_deltas_read_as_text_like_assistant_deltas() {
        let thinking = json!({"payload":{"runId":"r1","stream":"thinking","ts":1,
            "data":{"text":"Let me check","delta":" check"}}});
        let line = format_line(7, "agent", &thinking, 0);
        assert!(
            line.ends_with(r#"run=r1 stream=thinking " check""#),
            "{line}"
        );
        let assistant = json!({"payload":{"runId":"r1","stream":"assistant","ts":1,
            "data":{"text":"Hi there","delta":" there"}}});
        let line = format_line(8, "agent", &assistant, 0);
        assert!(
            line.ends_with(r#"run=r1 stream=assistant " there""#),
            "{line}"
        );
    }
}
