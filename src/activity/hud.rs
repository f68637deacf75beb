//! The HUD protocol's wire format (the structured activity feed a webchat
//! HUD panel consumes): each [`Change`] of the projection as one event
//! `{"type":"hud","event":…,"id":<fresh UUID>,"correlationId","parentId",
//! "ts","durationMs","replay"}`. `clawmux tail --hud` prints these and
//! `GET /v1/hud` / `/ws/hud` serve them.
//!
//! - `id` is always a fresh UUID; pairing is by `correlationId`: a turn's
//!   is its run id, a tool call's the provider's tool call id, a thinking
//!   stretch's a UUID made at `think_start` and reused at `think_end`.
//! - `parentId` of thinking and tools is the containing turn's
//!   `correlationId` (the run id).
//! - `durationMs` on ends, when both times are known (the gateway's own
//!   times, or a live event's arrival); `ts` likewise (left out, never made
//!   up, when nothing tells it).
//! - `replay: true` on events projected from the broker's history.
//! - Tool results take the per-tool shapes of the protocol
//!   ([`tool_result`]), derived from what the gateway sent; a field the
//!   gateway gave nothing for is left out.
//!
//! Extensions (fields a HUD consumer may ignore): `sessionKey` on turns;
//! `status` (`ok`/`aborted`/`error`) and `error` on `turn_end`;
//! `parentToolCallId` on a tool call run inside another; `interrupted` on
//! the `tool_end` of a call the run's end cut short (it has no `result`).
//!
//! What the projection drops to stay within its bounds is said with the
//! protocol's own word, `truncated: true`, on an end event, and
//! `truncatedBy` naming the bound: a `turn_end` (and before it a
//! `think_end` and a `tool_end` for what was open in it) with no `status`
//! when it stopped following a run still going (`"runs"`: it keeps 200
//! runs, `"bytes"`: it keeps 1 MiB; the run idle longest went); a
//! `turn_end` with `droppedItems` when the run had more thinking and tool
//! calls than it keeps (`"items"`: 256 a run).

use serde_json::{json, Map, Value};

use super::render::{cut, one_line};
use super::{content_text, Bound, Change, Node, RunStatus, ToolCall};

/// Characters of a `summary`.
const SUMMARY_CHARS: usize = 200;

/// One HUD event for a change.
pub fn hud_event(change: &Change, replay: bool) -> Value {
    let mut v = Map::new();
    let mut put = |k: &str, val: Value| {
        v.insert(k.to_owned(), val);
    };
    put("type", json!("hud"));
    let (event, ts) = match change {
        Change::TurnStart {
            run_id,
            session_key,
            ts,
        } => {
            put("correlationId", json!(run_id));
            put("sessionKey", json!(session_key));
            ("turn_start", *ts)
        }
        Change::TurnEnd {
            run_id,
            session_key,
            ts,
            duration_ms,
            status,
            dropped_items,
            ..
        } => {
            put("correlationId", json!(run_id));
            if let Some(d) = duration_ms {
                put("durationMs", json!(d));
            }
            put("sessionKey", json!(session_key));
            put("status", json!(status.as_str()));
            if let RunStatus::Error(message) = status {
                put("error", json!(message));
            }
            dropped(&mut put, *dropped_items);
            ("turn_end", *ts)
        }
        Change::Truncated {
            run_id,
            session_key,
            node,
            bound,
        } => {
            put("truncated", json!(true));
            put("truncatedBy", json!(bound.as_str()));
            match node {
                Node::Turn { dropped_items } => {
                    put("correlationId", json!(run_id));
                    put("sessionKey", json!(session_key));
                    if *dropped_items > 0 {
                        put("droppedItems", json!(dropped_items));
                    }
                    ("turn_end", None)
                }
                Node::Thinking { correlation_id, .. } => {
                    put("correlationId", json!(correlation_id));
                    put("parentId", json!(run_id));
                    ("think_end", None)
                }
                Node::Tool(call) => {
                    tool_fields(&mut put, run_id, call);
                    ("tool_end", None)
                }
            }
        }
        Change::ThinkStart {
            run_id,
            correlation_id,
            ts,
            ..
        } => {
            put("correlationId", json!(correlation_id));
            put("parentId", json!(run_id));
            ("think_start", *ts)
        }
        Change::ThinkEnd {
            run_id,
            correlation_id,
            ts,
            duration_ms,
            ..
        } => {
            put("correlationId", json!(correlation_id));
            put("parentId", json!(run_id));
            if let Some(d) = duration_ms {
                put("durationMs", json!(d));
            }
            ("think_end", *ts)
        }
        Change::ToolStart { run_id, call } => {
            tool_fields(&mut put, run_id, call);
            if !call.args.is_null() {
                put("args", tool_args(call));
            }
            ("tool_start", call.started_ms)
        }
        Change::ToolEnd { run_id, call } => {
            tool_fields(&mut put, run_id, call);
            if call.interrupted {
                put("interrupted", json!(true));
            } else {
                put("result", tool_result(call));
            }
            if let Some(d) = call.duration_ms(None) {
                put("durationMs", json!(d));
            }
            ("tool_end", call.ended_ms)
        }
        Change::Received {
            subtype,
            label,
            payload,
            ts,
        } => {
            put("subtype", json!(subtype));
            put("label", json!(label));
            if payload.as_object().is_some_and(|p| !p.is_empty()) {
                put("payload", payload.clone());
            }
            ("received", *ts)
        }
    };
    v.insert("event".into(), json!(event));
    v.insert("id".into(), json!(uuid::Uuid::new_v4().to_string()));
    if let Some(ts) = ts {
        v.insert("ts".into(), json!(ts));
    }
    if replay {
        v.insert("replay".into(), json!(true));
    }
    Value::Object(v)
}

/// A run's thinking and tool calls past what the projection keeps.
fn dropped(put: &mut impl FnMut(&str, Value), dropped_items: usize) {
    if dropped_items > 0 {
        put("truncated", json!(true));
        put("truncatedBy", json!(Bound::Items.as_str()));
        put("droppedItems", json!(dropped_items));
    }
}

fn tool_fields(put: &mut impl FnMut(&str, Value), run_id: &str, call: &ToolCall) {
    put("correlationId", json!(call.call_id));
    put("parentId", json!(run_id));
    if let Some(parent) = &call.parent_call_id {
        put("parentToolCallId", json!(parent));
    }
    put("tool", json!(call.name));
}

/// Whether a tool writes files (`write`, `edit`, `append`).
fn is_file_write(tool: &str) -> bool {
    matches!(tool, "write" | "edit" | "append")
}

/// The arguments as the gateway sent them; a file-writing tool's also name
/// its `operation` (the tool's name).
fn tool_args(call: &ToolCall) -> Value {
    let mut args = call.args.clone();
    if is_file_write(&call.name) {
        if let Value::Object(map) = &mut args {
            map.entry("operation")
                .or_insert_with(|| json!(call.name.clone()));
        }
    }
    args
}

/// A path as shown in a viewer: without the OpenClaw state directory
/// (`…/.openclaw/`) it sits in.
pub fn viewer_path(path: &str) -> String {
    match path.find("/.openclaw/") {
        Some(at) => path[at + "/.openclaw/".len()..].to_owned(),
        None => path.to_owned(),
    }
}

/// The result in the protocol's shape for its tool:
///
/// - `read` → `{ok, file:{path, viewerPath}, area?, text, bytes, truncated}`
///   (`area` from `offset`/`limit` when the call gave them);
/// - `write`/`edit`/`append` → `{ok, file, area?, bytes?}` (`write`'s
///   area and bytes from the content it wrote; `edit`'s area from where
///   the gateway says the change starts and the new text's lines
///   ([`edit_area`]); `append`'s line range is not in what the gateway
///   sends);
/// - `exec` → `{ok, exitCode?, stdout, truncated, mentionedPaths?, error?}`
///   (`ok` by [`ToolCall::ok`]: false for a non-zero exit too);
/// - `web_search`/`web_fetch` → `{ok, text, url?, truncated}`;
/// - `browser`/`canvas`/`nodes`/`message`/`sessions_*` → `{ok, summary, raw?}`;
/// - any other tool → `{ok, raw}`.
///
/// `truncated` is the gateway's own flag (`details.truncated`) or that the
/// text was cut here to bound what is kept.
pub fn tool_result(call: &ToolCall) -> Value {
    let ok = call.ok() == Some(true);
    let result = &call.result;
    let details = &result["details"];
    let text = content_text(result);
    // Whether the text is cut: said only where there is a text.
    let truncated = details["truncated"] == true || call.cut;
    let has_text = text.is_some() || details["aggregated"].is_string();
    let mut out = Map::new();
    out.insert("ok".into(), json!(ok));
    let path = call.args["path"]
        .as_str()
        .or(call.args["file_path"].as_str());
    let file = |out: &mut Map<String, Value>| {
        if let Some(path) = path {
            out.insert(
                "file".into(),
                json!({"path": path, "viewerPath": viewer_path(path)}),
            );
        }
    };
    match call.name.as_str() {
        "read" => {
            file(&mut out);
            let offset = call.args["offset"].as_u64();
            let limit = call.args["limit"].as_u64();
            if let (Some(offset), Some(limit)) = (offset, limit) {
                let area = json!({"startLine": offset, "endLine": offset + limit});
                if let Some(Value::Object(f)) = out.get_mut("file") {
                    f.insert("area".into(), area.clone());
                }
                out.insert("area".into(), area);
            }
            let text = text.or_else(|| details["content"].as_str().map(str::to_owned));
            if let Some(text) = text {
                out.insert("text".into(), json!(text));
                let bytes = call.text_bytes.unwrap_or(text.len());
                out.insert("bytes".into(), json!(bytes));
                out.insert("truncated".into(), json!(truncated));
            }
        }
        "write" | "edit" | "append" => {
            file(&mut out);
            let content = call.args["content"].as_str();
            if call.name == "write" && !call.cut {
                if let Some(content) = content {
                    let lines = content.lines().count().max(1);
                    out.insert("area".into(), json!({"startLine": 1, "endLine": lines}));
                }
            }
            if call.name == "edit" && ok {
                if let Some(area) = edit_area(call) {
                    if let Some(Value::Object(f)) = out.get_mut("file") {
                        f.insert("area".into(), area.clone());
                    }
                    out.insert("area".into(), area);
                }
            }
            if call.name != "edit" && !call.cut {
                if let Some(content) = content {
                    out.insert("bytes".into(), json!(content.len()));
                }
            }
        }
        "exec" => {
            if let Some(code) = details["exitCode"].as_i64() {
                out.insert("exitCode".into(), json!(code));
            }
            let stdout = details["aggregated"]
                .as_str()
                .map(str::to_owned)
                .or(text.clone());
            if let Some(stdout) = stdout {
                out.insert("stdout".into(), json!(stdout));
                out.insert("truncated".into(), json!(truncated));
            }
            let paths = mentioned_paths(call.args["command"].as_str().unwrap_or(""));
            if !paths.is_empty() {
                out.insert("mentionedPaths".into(), json!(paths));
            }
            if call.ok() == Some(false) {
                let error = details["exitReason"]
                    .as_str()
                    .map(str::to_owned)
                    .or(text)
                    .filter(|e| !e.is_empty());
                if let Some(error) = error {
                    out.insert("error".into(), json!(error));
                }
            }
        }
        "web_search" | "web_fetch" => {
            if let Some(text) = &text {
                out.insert("text".into(), json!(text));
            }
            if let Some(url) = details["url"].as_str().or(call.args["url"].as_str()) {
                out.insert("url".into(), json!(url));
            }
            if has_text {
                out.insert("truncated".into(), json!(truncated));
            }
        }
        name if matches!(name, "browser" | "canvas" | "nodes" | "message")
            || name.starts_with("sessions_") =>
        {
            let summary = text
                .as_deref()
                .or(call.meta.as_deref())
                .map(|t| cut(&one_line(t.trim()), SUMMARY_CHARS));
            if let Some(summary) = summary {
                out.insert("summary".into(), json!(summary));
            }
            if !details.is_null() {
                out.insert("raw".into(), details.clone());
            }
        }
        _ => {
            if !result.is_null() {
                out.insert("raw".into(), result.clone());
            }
        }
    }
    Value::Object(out)
}

/// The line range of an edit's replaced block in the resulting file (seed
/// 000): it starts at the gateway's `details.firstChangedLine` (else the
/// first added line of `details.diff`, whose lines read `+<n> <text>`)
/// and spans the new text's lines (`newText`, `new_string`, `newString`).
fn edit_area(call: &ToolCall) -> Option<Value> {
    let details = &call.result["details"];
    let start = details["firstChangedLine"].as_u64().or_else(|| {
        details["diff"].as_str()?.lines().find_map(|line| {
            let rest = line.strip_prefix('+')?.trim_start();
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
    })?;
    let new_text = ["newText", "new_string", "newString"]
        .iter()
        .find_map(|k| call.args[*k].as_str());
    let lines = new_text.map_or(1, |t| t.lines().count().max(1)) as u64;
    Some(json!({"startLine": start, "endLine": start + lines - 1}))
}

/// File paths named in a shell command: words with a `/` or a file
/// extension (`src/main.rs`, `/etc/hosts`, `notes.txt`), not options or
/// URLs. A plain scan: the protocol asks for a best-effort list.
pub fn mentioned_paths(command: &str) -> Vec<Value> {
    let mut seen = Vec::new();
    for word in command.split(|c: char| c.is_whitespace() || ";|&<>()'\"`=".contains(c)) {
        let word = word.trim_end_matches([',', ':']);
        if word.is_empty() || word.starts_with('-') || word.contains("://") || word.starts_with('$')
        {
            continue;
        }
        let has_ext = word.rsplit_once('.').is_some_and(|(stem, ext)| {
            !stem.is_empty()
                && (1..=8).contains(&ext.len())
                && ext.chars().all(|c| c.is_ascii_alphanumeric())
                && !ext.chars().all(|c| c.is_ascii_digit())
        });
        if (word.contains('/') || has_ext) && !seen.iter().any(|s: &String| s == word) {
            seen.push(word.to_owned());
        }
    }
    seen.into_iter()
        .map(|p| json!({"path": p, "viewerPath": viewer_path(&p)}))
        .collect()
}
