//! Post-handshake request handling: role and scope checks
//! (gateway-protocol.md §4.1) and the methods the double implements.
//!
//! Authorization runs before the handler lookup, as in the real
//! `server-methods.ts`: a method the table does not list is admin-only, so an
//! unknown method reads "missing scope: operator.admin" to a non-admin and
//! "unknown method: X" to an admin.

use std::sync::Arc;

use serde_json::{json, Value};

use super::runs::{self, RunKind, RunRecord, RunScript};
use super::state::{lock, now_ms, res_frame, Inner, Session};

/// Methods this double answers, advertised in `hello-ok.features.methods`.
pub(crate) const IMPLEMENTED_METHODS: &[&str] = &[
    "health",
    "status",
    "system-presence",
    "last-heartbeat",
    "models.list",
    "agents.list",
    "config.get",
    "chat.history",
    "chat.send",
    "chat.abort",
    "chat.inject",
    "agent",
    "sessions.list",
    "sessions.subscribe",
    "sessions.unsubscribe",
    "sessions.messages.subscribe",
    "sessions.messages.unsubscribe",
];

/// Event names advertised in `hello-ok.features.events` (§3.1).
pub(crate) const GATEWAY_EVENTS: &[&str] = &[
    "connect.challenge",
    "agent",
    "chat",
    "session.message",
    "session.tool",
    "sessions.changed",
    "presence",
    "tick",
    "talk.mode",
    "shutdown",
    "health",
    "heartbeat",
    "cron",
    "node.pair.requested",
    "node.pair.resolved",
    "node.invoke.request",
    "device.pair.requested",
    "device.pair.resolved",
    "voicewake.changed",
    "exec.approval.requested",
    "exec.approval.resolved",
    "update.available",
];

/// Methods only a `role:"node"` connection may call.
const NODE_ONLY_METHODS: &[&str] = &[
    "node.invoke.result",
    "node.event",
    "node.pending.pull",
    "node.pending.ack",
    "node.pending.drain",
    "node.canvas.capability.refresh",
    "skills.bins",
];

/// Read-level methods of `method-scopes.ts` (satisfied by read or write).
const READ_METHODS: &[&str] = &[
    "status",
    "chat.history",
    "sessions.list",
    "sessions.preview",
    "sessions.get",
    "sessions.resolve",
    "sessions.usage",
    "sessions.subscribe",
    "sessions.unsubscribe",
    "sessions.messages.subscribe",
    "sessions.messages.unsubscribe",
    "config.get",
    "config.schema.lookup",
    "agents.list",
    "models.list",
    "agent.identity.get",
    "tools.catalog",
    "skills.status",
    "cron.list",
    "system-presence",
    "last-heartbeat",
    "node.list",
];

/// Write-level methods.
const WRITE_METHODS: &[&str] = &[
    "chat.send",
    "chat.abort",
    "sessions.create",
    "sessions.send",
    "sessions.steer",
    "sessions.abort",
    "agent",
    "agent.wait",
    "wake",
    "send",
];

const ADMIN: &str = "operator.admin";

/// The scope a (non-health, operator) method requires.
fn required_scope(method: &str) -> &'static str {
    if READ_METHODS.contains(&method) || method.starts_with("sessions.usage") {
        "operator.read"
    } else if WRITE_METHODS.contains(&method) {
        "operator.write"
    } else if method == "exec.approval.resolve" {
        "operator.approvals"
    } else if ["device.pair.", "node.pair.", "device.token."]
        .iter()
        .any(|p| method.starts_with(p))
    {
        "operator.pairing"
    } else {
        ADMIN
    }
}

fn error(code: &str, message: impl Into<String>) -> Value {
    json!({ "code": code, "message": message.into() })
}

fn invalid(message: impl Into<String>) -> Value {
    error("INVALID_REQUEST", message)
}

/// Role and scope check; `Err` is the error shape to answer with.
fn authorize(method: &str, session: &Session) -> Result<(), Value> {
    if method == "health" {
        return Ok(());
    }
    let node_only = NODE_ONLY_METHODS.contains(&method);
    if node_only != (session.role == "node") {
        return Err(invalid(format!("unauthorized role: {}", session.role)));
    }
    if session.role == "node" || session.has_scope(ADMIN) {
        return Ok(());
    }
    let needed = required_scope(method);
    let satisfied = match needed {
        "operator.read" => {
            session.has_scope("operator.read") || session.has_scope("operator.write")
        }
        other => session.has_scope(other),
    };
    if satisfied {
        return Ok(());
    }
    // The [new] shape, as a 2026.9.6 gateway sends it (v3.24 used
    // INVALID_REQUEST without details).
    let mut e = error("FORBIDDEN", format!("missing scope: {needed}"));
    e["details"] =
        json!({ "code": "MISSING_SCOPE", "missingScope": needed, "requiredScopes": [needed] });
    Err(e)
}

/// Queues a `res` for `conn` (nothing while the `silent` fault is on).
pub(crate) fn respond(inner: &Inner, conn: u64, id: &Value, result: Result<Value, Value>) {
    if inner.faults().silent {
        return;
    }
    inner.send_frame(conn, res_frame(id, result.as_ref()));
}

/// Ajv-style check that `params` is an object carrying string `fields`.
fn require_strings<'a>(
    method: &str,
    params: &'a Value,
    fields: &[&str],
) -> Result<Vec<&'a str>, Value> {
    if !params.is_object() {
        return Err(invalid(format!("invalid {method} params: must be object")));
    }
    fields
        .iter()
        .map(|f| match params.get(*f) {
            None => Err(invalid(format!(
                "invalid {method} params: must have required property '{f}'"
            ))),
            Some(v) => v.as_str().ok_or_else(|| {
                invalid(format!("invalid {method} params: at /{f}: must be string"))
            }),
        })
        .collect()
}

/// The per-request view handlers get.
struct Request<'a> {
    inner: &'a Arc<Inner>,
    conn: u64,
    session: &'a Session,
    id: &'a Value,
    params: &'a Value,
}

/// Handles one post-handshake request of connection `conn`.
pub(crate) fn handle_request(
    inner: &Arc<Inner>,
    conn: u64,
    session: &Session,
    id: &Value,
    method: &str,
    params: &Value,
) {
    if let Err(e) = authorize(method, session) {
        return respond(inner, conn, id, Err(e));
    }
    if inner.cfg.without_methods.iter().any(|m| m == method) {
        return respond(
            inner,
            conn,
            id,
            Err(invalid(format!("unknown method: {method}"))),
        );
    }
    let req = Request {
        inner,
        conn,
        session,
        id,
        params,
    };
    let result = match method {
        "health" => Ok(health_summary(inner)),
        "status" => Ok(status(inner, session)),
        "system-presence" => Ok(Value::Array(inner.presence_list())),
        "last-heartbeat" => Ok(Value::Null),
        "models.list" => Ok(json!({ "models": [] })),
        "agents.list" => Ok(json!({
            "defaultId": "main", "mainKey": "main", "scope": "per-sender",
            "agents": [{ "id": "main", "name": "main" }],
        })),
        "config.get" => Ok(json!({
            "path": "mock://openclaw.json", "exists": true, "valid": true,
            "config": { "gateway": { "mode": "local" } },
        })),
        "chat.history" => chat_history(&req),
        "chat.send" => return start_run(&req, RunStart::ChatSend),
        "agent" => return start_run(&req, RunStart::Agent),
        "chat.abort" => chat_abort(&req),
        "chat.inject" => chat_inject(&req),
        "sessions.list" => Ok(sessions_list(inner)),
        "sessions.subscribe" | "sessions.unsubscribe" => {
            let on = method == "sessions.subscribe";
            if let Some(entry) = lock(&inner.conns).get_mut(&conn) {
                entry.sessions_subscribed = on;
            }
            Ok(json!({ "subscribed": on }))
        }
        "sessions.messages.subscribe" | "sessions.messages.unsubscribe" => {
            message_subscription(&req, method)
        }
        m if NODE_ONLY_METHODS.contains(&m) => Ok(json!({ "ok": true })),
        other => Err(invalid(format!("unknown method: {other}"))),
    };
    respond(inner, conn, id, result);
}

/// A small health summary in the shape of the real `HealthSummary`.
pub(crate) fn health_summary(inner: &Inner) -> Value {
    let count = lock(&inner.chats).history.len();
    json!({
        "ok": true, "ts": now_ms(), "durationMs": 0,
        "channels": {}, "channelOrder": [], "channelLabels": {},
        "heartbeatSeconds": 0, "defaultAgentId": "main",
        "agents": [{ "agentId": "main", "isDefault": true, "heartbeat": { "enabled": false },
                     "sessions": { "count": count } }],
        "sessions": { "path": "mock://sessions.json", "count": count, "recent": [] },
    })
}

/// Like the gateway's, tailored to the caller's scopes: only an
/// `operator.admin` connection gets the session store paths and the recent
/// sessions (the real gateway redacts them for the others).
fn status(inner: &Inner, session: &Session) -> Value {
    let (open, ready) = inner.counts();
    let count = lock(&inner.chats).history.len();
    let mut status = json!({
        "ts": now_ms(),
        "runtimeVersion": inner.cfg.server_version,
        "uptimeMs": inner.started.elapsed().as_millis() as u64,
        "connections": { "open": open, "ready": ready },
        "heartbeat": { "defaultAgentId": "main", "agents": [] },
        "sessions": { "count": count, "defaults": { "model": null, "contextTokens": null } },
        "channelSummary": [],
    });
    if session.has_scope("operator.admin") {
        status["sessions"]["paths"] = json!(["mock://agents/main/sessions/sessions.json"]);
        status["sessions"]["recent"] = json!([]);
    }
    status
}

fn chat_history(req: &Request<'_>) -> Result<Value, Value> {
    let key = require_strings("chat.history", req.params, &["sessionKey"])?[0];
    let limit = req
        .params
        .get("limit")
        .and_then(Value::as_u64)
        .unwrap_or(200)
        .min(1000) as usize;
    let chats = lock(&req.inner.chats);
    let canonical = runs::canonical_session_key(key);
    let all = chats
        .history
        .get(&canonical)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let messages = &all[all.len().saturating_sub(limit)..];
    Ok(
        json!({ "sessionKey": key, "sessionId": format!("mock-{canonical}"), "messages": messages,
               "thinkingLevel": "off" }),
    )
}

#[derive(Clone, Copy, PartialEq)]
enum RunStart {
    ChatSend,
    Agent,
}

/// `chat.send` and `agent`: ack, then the scripted event stream (and for
/// `agent`, a second response when the run ends).
fn start_run(req: &Request<'_>, kind: RunStart) {
    let (method, fields): (&str, &[&str]) = match kind {
        RunStart::ChatSend => ("chat.send", &["sessionKey", "message", "idempotencyKey"]),
        RunStart::Agent => ("agent", &["message", "idempotencyKey"]),
    };
    let (message, idem, session_key) = match require_strings(method, req.params, fields) {
        Ok(v) if kind == RunStart::ChatSend => (v[1], v[2], runs::canonical_session_key(v[0])),
        Ok(v) => {
            let key = req
                .params
                .get("sessionKey")
                .and_then(Value::as_str)
                .unwrap_or("main");
            (v[0], v[1], runs::canonical_session_key(key))
        }
        Err(e) => return respond(req.inner, req.conn, req.id, Err(e)),
    };
    let run_key = match kind {
        RunStart::ChatSend => format!("chat:{idem}"),
        RunStart::Agent => format!("agent:{idem}"),
    };
    let record = RunRecord {
        run_id: idem.to_string(),
        session_key: session_key.clone(),
        owner_conn: Some(req.conn),
        owner_device: req.session.device_id.clone(),
        active: true,
        kind: match kind {
            RunStart::ChatSend => RunKind::Chat,
            RunStart::Agent => RunKind::Agent {
                conn: req.conn,
                request_id: req.id.clone(),
            },
        },
    };
    if let Some(existing) = runs::try_register(req.inner, &run_key, record) {
        let status = if existing.active { "in_flight" } else { "ok" };
        return respond(
            req.inner,
            req.conn,
            req.id,
            Ok(json!({ "runId": existing.run_id, "status": status })),
        );
    }
    let ack = match kind {
        RunStart::ChatSend => json!({ "runId": idem, "status": "started" }),
        RunStart::Agent => {
            json!({ "runId": idem, "agentId": "main", "status": "accepted", "acceptedAt": now_ms() })
        }
    };
    respond(req.inner, req.conn, req.id, Ok(ack));
    runs::record_user_message(req.inner, &session_key, message);
    let wants_tools = req.session.caps.iter().any(|c| c == "tool-events");
    let script = RunScript {
        run_id: idem.to_string(),
        session_key,
        reply: format!("Echo: {message}"),
        tool_recipient: wants_tools.then_some(req.conn),
        step_delay: req.inner.cfg.run_step_delay,
    };
    runs::spawn_play(req.inner, run_key, script);
}

fn chat_abort(req: &Request<'_>) -> Result<Value, Value> {
    let key = require_strings("chat.abort", req.params, &["sessionKey"])?[0];
    let run_id = req.params.get("runId").and_then(Value::as_str);
    let aborted = runs::abort_runs(
        req.inner,
        &runs::canonical_session_key(key),
        run_id,
        req.conn,
        req.session.device_id.as_deref(),
        req.session.has_scope(ADMIN),
    );
    Ok(json!({ "ok": true, "aborted": !aborted.is_empty(), "runIds": aborted }))
}

/// `chat.inject` (admin): append an assistant message without a run.
fn chat_inject(req: &Request<'_>) -> Result<Value, Value> {
    let fields = require_strings("chat.inject", req.params, &["sessionKey", "message"])?;
    let (key, text) = (runs::canonical_session_key(fields[0]), fields[1]);
    let message = runs::text_message("assistant", text);
    lock(&req.inner.chats)
        .history
        .entry(key.clone())
        .or_default()
        .push(message.clone());
    let payload = runs::session_message_payload(&key, &message);
    runs::emit_session_message(req.inner, &key, &payload);
    Ok(json!({ "ok": true, "messageId": uuid::Uuid::new_v4().to_string() }))
}

fn sessions_list(inner: &Inner) -> Value {
    let chats = lock(&inner.chats);
    let mut keys: Vec<(&String, i64)> = chats
        .history
        .keys()
        .map(|k| (k, chats.updated_at.get(k).copied().unwrap_or(0)))
        .collect();
    keys.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let main = "agent:main:main".to_string();
    if !chats.history.contains_key(&main) {
        keys.push((&main, 0));
    }
    let sessions: Vec<Value> = keys
        .iter()
        .map(|(key, updated)| {
            json!({ "key": key, "kind": "direct", "sessionId": format!("mock-{key}"),
                    "updatedAt": if *updated > 0 { json!(updated) } else { Value::Null } })
        })
        .collect();
    json!({
        "ts": now_ms(), "path": "mock://sessions.json", "count": sessions.len(),
        "defaults": { "modelProvider": null, "model": null, "contextTokens": null },
        "sessions": sessions,
    })
}

fn message_subscription(req: &Request<'_>, method: &str) -> Result<Value, Value> {
    let key = require_strings(method, req.params, &["key"])?[0];
    let on = method == "sessions.messages.subscribe";
    // Subscriptions are keyed by the canonical session key (§4.2).
    let canonical = runs::canonical_session_key(key);
    if let Some(entry) = lock(&req.inner.conns).get_mut(&req.conn) {
        if on {
            entry.message_keys.insert(canonical);
        } else {
            entry.message_keys.remove(&canonical);
        }
    }
    Ok(json!({ "subscribed": on, "key": key }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(role: &str, scopes: &[&str]) -> Session {
        Session {
            role: role.into(),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            caps: vec![],
            device_id: None,
            presence: Value::Null,
        }
    }

    #[test]
    fn scope_table() {
        let read = session("operator", &["operator.read"]);
        let write = session("operator", &["operator.write"]);
        let none = session("operator", &[]);
        assert!(authorize("health", &none).is_ok());
        assert!(authorize("status", &read).is_ok());
        assert!(authorize("status", &write).is_ok());
        assert_eq!(
            authorize("status", &none).unwrap_err()["message"],
            "missing scope: operator.read"
        );
        assert_eq!(
            authorize("chat.send", &read).unwrap_err()["message"],
            "missing scope: operator.write"
        );
        assert_eq!(
            authorize("chat.inject", &write).unwrap_err()["message"],
            "missing scope: operator.admin"
        );
        assert_eq!(
            authorize("node.event", &write).unwrap_err()["message"],
            "unauthorized role: operator"
        );
        let node = session("node", &[]);
        assert!(authorize("node.event", &node).is_ok());
        assert_eq!(
            authorize("status", &node).unwrap_err()["message"],
            "unauthorized role: node"
        );
    }
}
