//! The HUD's `received` changes: things the broker saw happen at once (a
//! message sent, an abort, a session reset, the upstream back after an
//! outage) rather than parts of a run.

use serde_json::{json, Value};

use super::{message_text, render, Activity, Change};

impl Activity {
    /// `clawmux.upstream`: the gateway session is back after an outage.
    /// What happened meanwhile is unknown: runs not seen ending are forgotten.
    pub(super) fn upstream(&mut self, p: &Value, at: Option<u64>) -> Vec<Change> {
        if p["phase"] != "ready" || p["reason"] != "reconnected" {
            return Vec::new();
        }
        self.forget_unfinished();
        let mut payload = json!({});
        if let Some(v) = p["serverVersion"].as_str() {
            payload["serverVersion"] = json!(v);
        }
        vec![Change::Received {
            subtype: "reconnect",
            label: "reconnected — the gateway session is back".into(),
            payload,
            ts: at,
        }]
    }

    /// A request the broker sent to the gateway (`method`, `params`), at
    /// `at`: the HUD's `received` events for a message sent (`chat.send`,
    /// with a preview), an abort (`chat.abort`, `/stop`) and a session
    /// reset (`sessions.reset`, `/new`, `/reset`). Other requests change
    /// nothing.
    pub fn apply_request(&mut self, method: &str, params: &Value, at: u64) -> Vec<Change> {
        let session = params["sessionKey"].as_str().or(params["key"].as_str());
        let with_session = |mut payload: Value| {
            if let Some(key) = session {
                payload["sessionKey"] = json!(key);
            }
            payload
        };
        let received = |subtype, label: &str, payload| {
            vec![Change::Received {
                subtype,
                label: label.to_owned(),
                payload,
                ts: Some(at),
            }]
        };
        match method {
            "chat.send" => {
                let text = match &params["message"] {
                    Value::String(s) => s.clone(),
                    other => message_text(other).unwrap_or_default(),
                };
                let command = text.trim().to_ascii_lowercase();
                if command == "/new" || command == "/reset" {
                    return received(
                        "new_session",
                        &format!("{command} received — resetting session"),
                        with_session(json!({})),
                    );
                }
                if command == "/stop" {
                    return received(
                        "stop",
                        "stop received — aborting turn",
                        with_session(json!({})),
                    );
                }
                let preview = render::cut(&render::one_line(&text), render::PREVIEW_CHARS);
                received(
                    "message",
                    "message received",
                    with_session(json!({"preview": preview})),
                )
            }
            "chat.abort" => {
                let mut payload = with_session(json!({}));
                if let Some(run) = params["runId"].as_str() {
                    payload["runId"] = json!(run);
                }
                received("stop", "stop received — aborting turn", payload)
            }
            "sessions.reset" => {
                let mut payload = with_session(json!({}));
                if let Some(reason) = params["reason"].as_str() {
                    payload["reason"] = json!(reason);
                }
                received(
                    "new_session",
                    "session reset received — resetting session",
                    payload,
                )
            }
            _ => Vec::new(),
        }
    }
}
