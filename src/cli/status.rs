//! `clawmux status`: a human summary of `/v1/state` (`--json` for the document).

use clap::Args;
use http::Method;
use serde_json::Value;
use std::borrow::Cow;

use super::{BrokerArgs, CliError, EXIT_ERROR_ANSWER};

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Print the raw `/v1/state` JSON document instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// Exit 0 when the upstream session is ready, 1 when the broker runs but
/// the session is not (so `clawmux status && …` waits for a usable broker).
pub async fn run(args: StatusArgs) -> Result<u8, CliError> {
    let client = args.broker.client();
    let (status, mut state) = client.json(Method::GET, "/v1/state", None).await?;
    if !status.is_success() {
        return Err(CliError::Answer(format!(
            "the broker answered {status}: {}",
            crate::sanitize::text(&state.to_string())
        )));
    }
    if args.json {
        super::print_line(&crate::sanitize::json_pretty(&state));
    } else {
        if super::client::running_demo(client.socket()).await.is_some() {
            // The URL of the demo's double names no gateway a person could reach.
            state["upstream"]["demo"] = Value::Bool(true);
        }
        print!("{}", render_styled(&state, &super::style::Paint::stdout()));
    }
    Ok(if state["upstream"]["phase"] == "ready" {
        0
    } else {
        EXIT_ERROR_ANSWER
    })
}

/// Longest value shown on a line (a gateway's error message, a URL...).
const FIELD_CHARS: usize = 300;

/// Longest error message shown; a longer one is cut at a word, with `…`.
const ERROR_CHARS: usize = 1000;
/// The error is wrapped to this many columns, its label included.
const WRAP_COLUMNS: usize = 100;
/// The label column (`error     `): continuation lines are indented by it.
const LABEL_COLUMNS: usize = 11;

/// `s` cut to at most `max` characters at a space, with `…` when cut.
fn cut_at_word(s: &str, max: usize) -> Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => Cow::Borrowed(s),
        Some((at, _)) => {
            let head = &s[..at];
            let head = head.rfind(' ').map_or(head, |sp| &head[..sp]);
            Cow::Owned(format!("{head}…"))
        }
    }
}

/// `s` in lines of at most `width` characters, broken at spaces (a longer
/// word stays whole on its own line).
fn wrap(s: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for word in s.split_whitespace() {
        let len = current.chars().count();
        if len > 0 && len + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(word);
    }
    lines.push(current);
    lines
}

/// A string of the state, escaped ([`crate::sanitize`]): most of them
/// come from the gateway or from clients.
fn text(v: &Value) -> Cow<'_, str> {
    crate::sanitize::field(v.as_str().unwrap_or("?"), FIELD_CHARS)
}

fn list(v: &Value) -> String {
    v.as_array()
        .map(|a| a.iter().map(text).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The summary, one labelled line per topic.
pub fn render(state: &Value) -> String {
    render_styled(state, &super::style::Paint::plain())
}

/// [`render`] with colour: labels bold, the phase green/yellow/red, errors red.
pub fn render_styled(state: &Value, paint: &super::style::Paint) -> String {
    let mut out = String::new();
    let mut line = |label: &str, value: String| {
        out.push_str(&format!(
            "{} {value}\n",
            paint.strong(&format!("{label:<10}"))
        ));
    };
    let b = &state["broker"];
    line(
        "broker",
        format!(
            "clawmux {} (pid {}) on {}",
            text(&b["version"]),
            b["pid"],
            text(&b["socket"])
        ),
    );
    let up = &state["upstream"];
    let gateway = match up["demo"] == true {
        true => Cow::Borrowed("the built-in demo gateway (`serve --demo`)"),
        false => text(&up["url"]),
    };
    let mut upstream = format!("{} {gateway}", paint.phase(&text(&up["phase"])));
    if let Some(version) = up["server_version"].as_str() {
        upstream.push_str(&format!(
            ", gateway {} (protocol {})",
            crate::sanitize::field(version, FIELD_CHARS),
            crate::sanitize::text(&up["protocol"].to_string())
        ));
    }
    upstream.push_str(&format!(
        ", session {}, {} reconnects",
        up["session"], up["reconnects"]
    ));
    line("upstream", upstream);
    for note in up["discovery"].as_array().into_iter().flatten() {
        line("discovery", text(note).into_owned());
    }
    if up["scopes"].is_array() {
        let mut scopes = list(&up["scopes"]);
        if up["lost_scopes"].as_array().is_some_and(|l| !l.is_empty()) {
            scopes.push_str(&paint.warn(&format!(
                "  (NOT granted: {}; some methods will fail)",
                list(&up["lost_scopes"])
            )));
        }
        line("scopes", scopes);
    }
    if up["last_error"].is_object() {
        // What happened, whole and wrapped at words; then the code (for a
        // search or a bug report) and when the broker tries again.
        let e = &up["last_error"];
        let message = crate::sanitize::text(e["message"].as_str().unwrap_or("?"));
        let mut after = text(&e["code"]).into_owned();
        if let Some(ms) = up["retry_after_ms"].as_u64() {
            after.push_str(&format!("; next try in {:.1} s", ms as f64 / 1000.0));
        }
        let words = format!("{} ({after})", cut_at_word(&message, ERROR_CHARS));
        let wrapped =
            wrap(&words, WRAP_COLUMNS - LABEL_COLUMNS).join(&format!("\n{:LABEL_COLUMNS$}", ""));
        line("error", paint.bad(&wrapped));
    }
    let snap = &state["snapshot"];
    if snap.is_object() {
        let presence = snap["presence"].as_array().map_or(0, Vec::len);
        let mut gw = format!("{presence} presence entries");
        if let Some(agent) = snap["sessionDefaults"]["defaultAgentId"].as_str() {
            gw.push_str(&format!(
                ", default agent {}",
                crate::sanitize::field(agent, FIELD_CHARS)
            ));
        }
        if let Some(key) = snap["sessionDefaults"]["mainSessionKey"].as_str() {
            gw.push_str(&format!(
                ", main session {}",
                crate::sanitize::field(key, FIELD_CHARS)
            ));
        }
        line("gateway", gw);
    }
    let clients = state["clients"].as_array().cloned().unwrap_or_default();
    let count = |kind: &str| clients.iter().filter(|c| c["kind"] == kind).count();
    let sum = |key: &str| clients.iter().filter_map(|c| c[key].as_u64()).sum::<u64>();
    let (ws, sse) = (count("ws"), count("sse"));
    let connected = match (ws, sse) {
        (0, 0) => "none connected".to_owned(),
        _ => format!(
            "{} connected ({} over WebSocket, {} reading the event stream)",
            ws + sse,
            ws,
            sse
        ),
    };
    line(
        "clients",
        format!(
            "{connected}; {} bytes queued, {} events dropped; {} requests pending",
            sum("queue_bytes"),
            sum("drops"),
            state["requests_pending"]
        ),
    );
    let (oldest, newest) = (state["oldest_seq"].as_u64(), state["newest_seq"].as_u64());
    let held = match (oldest, newest) {
        (Some(o), Some(n)) if o <= n => format!("#{o} to #{n} kept for clients that resume"),
        _ => "none kept yet".to_owned(),
    };
    line("events", format!("newest #{}, {held}", state["newest_seq"]));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn summary_names_phase_scopes_errors_and_cursor() {
        let state = json!({
            "epoch": "abc", "newest_seq": 42, "oldest_seq": 1,
            "broker": {"version": "0.1.0", "pid": 7, "socket": "/run/c.sock"},
            "upstream": {"phase": "backoff", "url": "ws://localhost:18789", "session": 2,
                "server_version": null, "protocol": null, "scopes": ["operator.read"],
                "lost_scopes": ["operator.admin"], "reconnects": 1,
                "last_error": {"code": "studio.upstream_error", "message": "refused"},
                "retry_after_ms": 1500},
            "snapshot": {"presence": [{}, {}], "stateVersion": {"presence": 3, "health": 4},
                "sessionDefaults": {"defaultAgentId": "main"}},
            "clients": [{"kind": "ws", "queue_bytes": 10, "drops": 2}, {"kind": "sse", "queue_bytes": 0, "drops": 0}],
            "requests_pending": 0,
        });
        let text = render(&state);
        assert!(
            text.contains("upstream   backoff ws://localhost:18789"),
            "{text}"
        );
        assert!(text.contains("NOT granted: operator.admin"), "{text}");
        assert!(
            text.contains("refused (studio.upstream_error; next try in 1.5 s)"),
            "{text}"
        );
        assert!(text.contains("2 presence entries"), "{text}");
        let mut demo = state.clone();
        demo["upstream"]["demo"] = json!(true);
        let shown = render(&demo);
        assert!(
            shown
                .contains("upstream   backoff the built-in demo gateway (`serve --demo`), session")
                && !shown.contains("ws://"),
            "{shown}"
        );
        assert!(
            text.contains("2 connected (1 over WebSocket, 1 reading the event stream); 10 bytes queued, 2 events dropped"),
            "{text}"
        );
        assert!(
            text.contains("newest #42, #1 to #42 kept for clients that resume"),
            "{text}"
        );
        assert!(!text.contains("epoch") && !text.contains("abc"), "{text}");
    }

    #[test]
    fn a_long_error_is_shown_whole_wrapped_at_words_without_internal_words() {
        let message = "check clawmux's gateway token: unauthorized: gateway token mismatch (provide gateway auth token); the gateway refused the broker's connect; check the token (gateway.auth.token in the gateway's openclaw.json) (ignore the gateway's recommendedNextStep \"retry_with_device_token\": it is meant for a paired client app; the broker needs the right shared token)";
        let state = json!({
            "epoch": "abc", "newest_seq": 0, "oldest_seq": null,
            "broker": {"version": "0.1.0", "pid": 7, "socket": "/run/c.sock"},
            "upstream": {"phase": "rejected", "url": "ws://localhost:18789", "session": 0,
                "reconnects": 0, "retry_after_ms": 28000,
                "last_error": {"code": "studio.upstream_rejected", "message": message}},
            "snapshot": {"presence": [], "stateVersion": {"presence": 3, "health": 4}},
            "clients": [], "requests_pending": 0,
        });
        let text = render(&state);
        let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            joined.contains("the broker needs the right shared token) (studio.upstream_rejected; next try in 28.0 s)"),
            "{text}"
        );
        assert!(!text.contains('…'), "{text}");
        for l in text.lines() {
            assert!(l.chars().count() <= WRAP_COLUMNS, "{l}");
        }
        assert!(!text.contains("..="), "{text}");
        assert!(!text.contains("stateVersion"), "{text}");
        assert!(text.contains("newest #0, none kept yet"), "{text}");
        assert!(text.contains("clients    none connected;"), "{text}");
    }

    #[test]
    fn gateway_strings_are_shown_escaped() {
        let osc = "\x1b]0;pwned\x07";
        let state = json!({
            "upstream": {"phase": format!("ready{osc}"), "url": "ws://x",
                "server_version": format!("9\u{202e}{osc}"), "scopes": [format!("a\u{9b}")],
                "last_error": {"code": format!("E{osc}"), "message": format!("m\u{2066}{osc}")}},
            "snapshot": {"sessionDefaults": {"mainSessionKey": format!("k{osc}")}},
        });
        let text = render(&state);
        assert!(
            !text
                .chars()
                .any(|c| (c.is_control() && c != '\n') || matches!(c, '\u{202e}' | '\u{2066}')),
            "{text:?}"
        );
        for want in [
            "gateway 9\\u{202e}\\e]0;pwned\\x07",
            "m\\u{2066}\\e]0;pwned\\x07 (E\\e]0;pwned\\x07)",
            "main session k\\e]0;",
            "a\\u{9b}",
        ] {
            assert!(text.contains(want), "{want:?} in {text}");
        }
    }
}
