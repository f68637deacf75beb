//! `serve --demo`'s own terminal: one line per agent run the broker fans out,
//! so a newcomer sees the broker at work without opening a second terminal.
//!
//! It is an ordinary `/v1/events` client of the broker it runs in (filtered
//! to `chat`), so `clawmux status` counts it as one `sse` client.

use std::io::Write;
use std::path::PathBuf;

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;

use super::{BrokerClient, CliError};

/// Follows the broker's chat events and writes one line per finished run
/// (`final`, `error` or `aborted`) until the stream ends.
pub async fn narrate(socket: PathBuf, out: &mut (impl Write + Send)) -> Result<(), CliError> {
    let client = BrokerClient::new(socket);
    let resp = client
        .send(Method::GET, "/v1/events?events=chat", &[], None)
        .await?;
    if resp.status() != StatusCode::OK {
        return Err(CliError::Answer(format!(
            "/v1/events answered {}",
            resp.status()
        )));
    }
    let mut events = resp.into_body().into_data_stream().eventsource();
    while let Some(Ok(event)) = events.next().await {
        if event.event != "chat" {
            continue;
        }
        let frame: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        if let Some(line) = run_line(&frame["payload"]) {
            let _ = writeln!(out, "{line}");
        }
    }
    Ok(())
}

/// The line for a chat event that ends a run; `None` for deltas.
pub fn run_line(p: &Value) -> Option<String> {
    let state = p["state"].as_str()?;
    if state == "delta" {
        return None;
    }
    // Every field is the gateway's (or a recording's): shown escaped.
    let run: String = p["runId"].as_str().unwrap_or("?").chars().take(8).collect();
    let run = crate::sanitize::text(&run);
    let session = crate::sanitize::text(p["sessionKey"].as_str().unwrap_or("?"));
    let what = match state {
        "final" => format!(
            "answered {}",
            crate::activity::message_text(&p["message"])
                .map(|t| super::tail::preview(&t, false))
                .unwrap_or_else(|| "(no text)".into())
        ),
        "error" => format!(
            "failed: {}",
            crate::sanitize::text(p["errorMessage"].as_str().unwrap_or("(no message)"))
        ),
        other => crate::sanitize::text(other).into_owned(),
    };
    Some(format!("clawmux demo: run {run} on {session} {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_line_per_finished_run() {
        let fin = json!({"runId":"5e8cdc96-aaaa","sessionKey":"agent:main:main","state":"final",
            "message":{"content":[{"type":"text","text":"Hello from the mock gateway"}]}});
        assert_eq!(
            run_line(&fin).unwrap(),
            r#"clawmux demo: run 5e8cdc96 on agent:main:main answered "Hello from the mock gateway""#
        );
        assert!(run_line(&json!({"state":"delta"})).is_none());
    }

    #[test]
    fn the_gateways_fields_are_shown_escaped() {
        let err = json!({"runId":"\u{1b}[8mabcd","sessionKey":"main\u{202e}x","state":"error",
            "errorMessage":"bad\u{9b}2J"});
        assert_eq!(
            run_line(&err).unwrap(),
            "clawmux demo: run \\e[8mabcd on main\\u{202e}x failed: bad\\u{9b}2J"
        );
        let odd = json!({"runId":"r","sessionKey":"s","state":"\u{1b}]0;x\u{7}"});
        assert_eq!(
            run_line(&odd).unwrap(),
            "clawmux demo: run r on s \\e]0;x\\x07"
        );
    }
}
