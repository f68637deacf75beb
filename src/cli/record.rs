//! `clawmux record`: follows a running broker and writes what the gateway
//! session carries as a recording (JSON Lines, the format of
//! [`clawmux_mock::recording`], README "Record and replay"), for
//! `clawmux mock-gateway --replay` and `clawmux serve --demo --replay`.
//!
//! It reads `GET /v1/events?tap=1`: the broker's events with their cursors,
//! a first `clawmux.hello` record (the gateway's `hello-ok`), and the
//! broker-side request tap ([`crate::tap`]): every request sent to the
//! gateway through the broker (any client's) with its answers, and the
//! events the broker delivers only to some clients. Each line is written
//! with one `write` and flushed, so the file is valid after Ctrl-C (an
//! `end` line is added then) and at worst loses a last partial line if the
//! recorder is killed. Secrets are redacted ([`crate::tap::redact`]) by the
//! broker and again here.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use clawmux_mock::recording::{FORMAT, VERSION};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};

use super::{BrokerArgs, CliError};
use crate::hub::replay::EventId;
use crate::local::sse::AFTER_SEQ_HEADER;
use crate::protocol::now_ms;
use crate::tap::redact;

/// Room kept under `--max-bytes` for the closing `end` line.
const END_LINE_RESERVE: u64 = 96;

#[derive(Args, Debug)]
pub struct RecordArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Write the recording here (a new 0600 file, replacing a regular one; a symbolic link is refused) [default: stdout].
    #[arg(long, short = 'o', value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Only these events (comma-separated gateway event names), e.g. chat,agent; gaps are always kept.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub events: Vec<String>,
    /// Also record every request sent to the gateway through the broker (any client's) and its answers.
    #[arg(long)]
    pub requests: bool,
    /// Stop (exit 0, with a last `end` line) before the recording would grow past this many bytes.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1024..))]
    pub max_bytes: Option<u64>,
}

/// Where lines go: one `write` per line, flushed.
struct Sink {
    out: Box<dyn Write + Send>,
    written: u64,
    max: Option<u64>,
}

/// Why a line was not written.
enum Full {
    /// `--max-bytes` reached (the `end` line was written).
    Limit,
}

impl Sink {
    fn open(path: Option<&PathBuf>, max: Option<u64>) -> Result<Sink, CliError> {
        let out: Box<dyn Write + Send> = match path {
            None => Box::new(std::io::stdout()),
            Some(p) if p.as_os_str() == "-" => Box::new(std::io::stdout()),
            // A new 0600 file moved into place (the recording holds the
            // session's traffic, so it is the owner's only); a symbolic
            // link there is refused, never written through.
            Some(p) => Box::new(
                crate::private_files::create_private(p)
                    .map_err(|e| CliError::Usage(e.to_string()))?,
            ),
        };
        Ok(Sink {
            out,
            written: 0,
            max,
        })
    }

    fn raw(&mut self, line: &Value) -> Result<(), CliError> {
        // Read with `cat` or `tail -f` too: C1 and bidi characters escaped.
        let mut text = crate::sanitize::json(line);
        text.push('\n');
        self.out
            .write_all(text.as_bytes())
            .and_then(|()| self.out.flush())
            .map_err(|e| CliError::Answer(format!("cannot write the recording: {e}")))?;
        self.written += text.len() as u64;
        Ok(())
    }

    /// Writes one line, unless it would pass `--max-bytes`: then the `end`
    /// line is written instead.
    fn line(&mut self, line: &Value) -> Result<Result<(), Full>, CliError> {
        if let Some(max) = self.max {
            let len = crate::sanitize::json(line).len() as u64 + 1;
            if self.written + len + END_LINE_RESERVE > max {
                self.end("max-bytes")?;
                return Ok(Err(Full::Limit));
            }
        }
        self.raw(line).map(Ok)
    }

    fn end(&mut self, why: &str) -> Result<(), CliError> {
        self.raw(&json!({"ms": now_ms(), "end": why}))
    }
}

/// What ended a recording.
enum Stop {
    Signal,
    Limit,
    StreamEnded(String),
}

pub async fn run(args: RecordArgs) -> Result<u8, CliError> {
    // Watched from the start, so a signal right after "recording" is seen.
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| CliError::Answer(format!("cannot watch for Ctrl-C: {e}")))?;
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| CliError::Answer(format!("cannot watch for SIGTERM: {e}")))?;
    let client = args.broker.client();
    let (status, state) = client.json(Method::GET, "/v1/state", None).await?;
    if status != StatusCode::OK {
        return Err(CliError::Answer(format!(
            "the broker answered /v1/state with {status}"
        )));
    }
    let mut query = vec![("tap", "1".to_owned())];
    if !args.events.is_empty() {
        query.push(("events", args.events.join(",")));
    }
    let path = format!(
        "/v1/events?{}",
        serde_urlencoded::to_string(&query).unwrap_or_default()
    );
    let resp = client.send(Method::GET, &path, &[], None).await?;
    if resp.status() != StatusCode::OK {
        let status = resp.status();
        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
        let text = body
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        return Err(CliError::Answer(format!(
            "the broker refused the event stream ({status}): {}",
            crate::sanitize::text(&text)
        )));
    }
    let after_seq: Option<u64> = resp
        .headers()
        .get(AFTER_SEQ_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut records = resp.into_body().into_data_stream().eventsource();
    let hello =
        match records.next().await {
            Some(Ok(e)) if e.event == "clawmux.hello" => {
                serde_json::from_str::<Value>(&e.data).unwrap_or(Value::Null)
            }
            _ => return Err(CliError::Answer(
                "the broker did not send its clawmux.hello record; is it older than this clawmux?"
                    .into(),
            )),
        };
    let Some(mut hello_payload) = hello.get("hello").filter(|h| h.is_object()).cloned() else {
        return Err(CliError::Answer(format!(
            "the broker has no gateway session now (phase {}); record once `clawmux status` says ready",
            crate::sanitize::text(hello["phase"].as_str().unwrap_or("unknown"))
        )));
    };
    redact(&mut hello_payload);
    let started_ms = now_ms();
    let header = json!({
        "format": FORMAT,
        "version": VERSION,
        "gateway_version": hello["server_version"],
        "broker_version": state.pointer("/broker/version"),
        "protocol": hello["protocol"],
        "started_at": chrono::DateTime::<chrono::Utc>::from_timestamp_millis(started_ms as i64)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
        "started_ms": started_ms,
        "epoch": state["epoch"],
        "after_seq": after_seq,
        "events": (!args.events.is_empty()).then_some(&args.events),
        "requests": args.requests,
        "hello": hello_payload,
    });
    let mut sink = Sink::open(args.out.as_ref(), args.max_bytes)?;
    if let Some(max) = args.max_bytes {
        let need = header.to_string().len() as u64 + 1 + END_LINE_RESERVE;
        if need > max {
            return Err(CliError::Usage(format!(
                "--max-bytes {max} is too small: the header alone needs {need} bytes"
            )));
        }
    }
    sink.raw(&header)?;
    eprintln!(
        "clawmux record: recording {} (gateway {}); Ctrl-C to stop",
        args.out
            .as_ref()
            .map_or("to stdout".to_owned(), |p| p.display().to_string()),
        crate::sanitize::field(hello["server_version"].as_str().unwrap_or("?"), 100)
    );

    let stop = loop {
        let record = tokio::select! {
            _ = int.recv() => break Stop::Signal,
            _ = term.recv() => break Stop::Signal,
            record = records.next() => record,
        };
        let record = match record {
            None => break Stop::StreamEnded("the broker closed the stream".into()),
            Some(Err(e)) => break Stop::StreamEnded(format!("the stream broke: {e}")),
            Some(Ok(record)) => record,
        };
        let Some(line) = to_line(&record, &args) else {
            if record.event == "clawmux.close" {
                break Stop::StreamEnded(super::watch::stream_ended(&record.data));
            }
            continue;
        };
        if let Err(Full::Limit) = sink.line(&line)? {
            break Stop::Limit;
        }
    };
    match stop {
        Stop::Signal => {
            sink.end("interrupted")?;
            eprintln!("clawmux record: stopped; {} bytes", sink.written);
            Ok(0)
        }
        Stop::Limit => {
            eprintln!(
                "clawmux record: stopped at --max-bytes; {} bytes",
                sink.written
            );
            Ok(0)
        }
        Stop::StreamEnded(why) => {
            sink.end(&why)?;
            Err(CliError::Answer(format!("recording ended: {why}")))
        }
    }
}

/// The recording line for one SSE record, if it is recorded.
fn to_line(record: &eventsource_stream::Event, args: &RecordArgs) -> Option<Value> {
    let data: Value = serde_json::from_str(&record.data).ok()?;
    let ms = now_ms();
    match record.event.as_str() {
        "clawmux.gap" => Some(json!({"ms": ms, "dir": "in", "gap": data})),
        "clawmux.close" | "clawmux.hello" => None,
        "clawmux.tap" => {
            let mut frame = data.get("frame")?.clone();
            let dir = data.get("dir")?.as_str()?;
            match frame.get("type").and_then(Value::as_str) {
                Some("event") => {
                    let name = frame.get("event").and_then(Value::as_str)?;
                    if !args.events.is_empty() && !args.events.iter().any(|e| e == name) {
                        return None;
                    }
                    if let Some(map) = frame.as_object_mut() {
                        map.remove("seq");
                    }
                }
                Some("req" | "res") if args.requests => {}
                _ => return None,
            }
            redact(&mut frame);
            Some(json!({"ms": ms, "dir": dir, "frame": frame}))
        }
        // The broker's own events (`clawmux.upstream`) are not the gateway's.
        name if name.starts_with("clawmux.") => None,
        _ => {
            let cursor = record.id.parse::<EventId>().ok()?.cursor;
            let mut frame = data;
            if let Some(map) = frame.as_object_mut() {
                map.remove("seq");
            }
            redact(&mut frame);
            Some(json!({"ms": ms, "dir": "in", "cursor": cursor, "frame": frame}))
        }
    }
}
