//! `clawmux call METHOD [PARAMS_JSON]`: one gateway request through `/v1/rpc`.

use clap::Args;
use http::{Method, StatusCode};
use serde_json::{json, Value};

use super::{BrokerArgs, CliError};
use crate::sanitize;

#[derive(Args, Debug)]
pub struct CallArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Gateway method, e.g. health, status, sessions.list, chat.history.
    pub method: String,
    /// Params as JSON, e.g. '{"sessionKey":"agent:main:main"}' [default: none].
    pub params: Option<String>,
    /// Print the whole `res` frame as JSON (also on errors) instead of the payload.
    #[arg(long)]
    pub json: bool,
    /// Wait for the final answer of a method that answers twice (`agent`).
    #[arg(long)]
    pub expect_final: bool,
    /// Act with only these scopes (comma-separated, e.g. operator.read or just read), never more than the socket allows [default: all the broker's session holds].
    #[arg(long, value_delimiter = ',', value_name = "SCOPES")]
    pub scopes: Option<Vec<String>>,
}

/// `read` means `operator.read`, `talk.secrets` `operator.talk.secrets`;
/// a name that is no operator scope is refused with the valid ones.
fn scope_name(s: &str) -> Result<String, CliError> {
    use crate::policy::scopes::ALL;
    let s = s.trim();
    let full = if s.starts_with("operator.") {
        s.to_owned()
    } else {
        format!("operator.{s}")
    };
    if ALL.contains(&full.as_str()) {
        return Ok(full);
    }
    let short: Vec<&str> = ALL
        .iter()
        .map(|a| a.trim_start_matches("operator."))
        .collect();
    Err(CliError::Usage(format!(
        "--scopes: {} is not a scope; valid scopes: {} (each also as operator.<name>)",
        sanitize::quoted(s),
        short.join(", ")
    )))
}

/// Prints the payload (pretty JSON) and exits 0 on `ok`; prints the error
/// and exits 1 on an error answer; 2 for bad input, 3 if the broker is down.
pub async fn run(args: CallArgs) -> Result<u8, CliError> {
    let params = match args.params.as_deref() {
        None => None,
        Some(text) => Some(serde_json::from_str::<Value>(text).map_err(|e| {
            CliError::Usage(format!(
                "PARAMS_JSON is not valid JSON ({e}); e.g. '{{\"sessionKey\":\"agent:main:main\"}}'"
            ))
        })?),
    };
    let mut body = json!({"method": args.method});
    if let Some(params) = params {
        body["params"] = params;
    }
    if args.expect_final {
        body["expectFinal"] = json!(true);
    }
    let client = args.broker.client();
    let (status, res) = match &args.scopes {
        None => client.json(Method::POST, "/v1/rpc", Some(&body)).await?,
        Some(scopes) => {
            let scopes = scopes
                .iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| scope_name(s))
                .collect::<Result<Vec<String>, _>>()?;
            // The broker narrows this request to these scopes (`X-Clawmux-Scopes`).
            let header = [(crate::protocol::SCOPES_HEADER, scopes.join(","))];
            client
                .json_with(Method::POST, "/v1/rpc", &header, Some(&body))
                .await?
        }
    };
    if args.json {
        super::print_line(&sanitize::json(&res));
    }
    if res["ok"] == true {
        if !args.json {
            let payload = res.get("payload").cloned().unwrap_or(Value::Null);
            super::print_line(&sanitize::json_pretty(&payload));
        }
        return Ok(0);
    }
    // What happened first, then the code and the short details on a second
    // line; the whole answer is JSON with `--json`. The code, message and
    // details are the gateway's: shown escaped.
    let error = &res["error"];
    let mut message =
        sanitize::lines(error["message"].as_str().unwrap_or("(no message)")).into_owned();
    if let Some(hint) = unknown_method_hint(&client, &args.method).await {
        message.push_str(&hint);
    }
    let mut notes =
        vec![sanitize::field(error["code"].as_str().unwrap_or("error"), 200).into_owned()];
    if let Some(ms) = error["retryAfterMs"].as_u64() {
        notes.push(format!("retry after {:.1} s", ms as f64 / 1000.0));
    }
    if let Some(details) = error.get("details") {
        let (short, more) = detail_notes(details);
        notes.extend(short);
        if more && !args.json {
            notes.push("`--json` prints the whole answer".to_owned());
        }
    }
    message.push_str(&format!("\n({})", notes.join("; ")));
    match status {
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => Err(CliError::Usage(message)),
        _ => Err(CliError::Answer(message)),
    }
}

/// Most details shown on an error's second line.
const DETAIL_NOTES: usize = 4;
/// Longest string detail shown there.
const DETAIL_CHARS: usize = 60;

/// An error's details as short `key value` notes (flags, numbers, short
/// strings, at most [`DETAIL_NOTES`]), and whether anything was left out
/// (nested objects, long text): a person reads the notes, a program reads
/// `--json`.
fn detail_notes(details: &Value) -> (Vec<String>, bool) {
    let Some(map) = details.as_object() else {
        return (Vec::new(), !details.is_null());
    };
    let mut notes = Vec::new();
    let mut more = false;
    for (key, value) in map {
        let shown = match value {
            Value::Bool(_) | Value::Number(_) => Some(value.to_string()),
            Value::String(s) if key != "message" && s.chars().count() <= DETAIL_CHARS => {
                Some(sanitize::text(s).into_owned())
            }
            Value::Null => None,
            _ => {
                more = true;
                None
            }
        };
        if let Some(shown) = shown {
            if notes.len() == DETAIL_NOTES {
                more = true;
                break;
            }
            notes.push(format!("{} {shown}", sanitize::field(key, DETAIL_CHARS)));
        }
    }
    (notes, more)
}

/// When `method` is not one the gateway announced (`hello-ok.features.methods`,
/// from `/v1/state`): says so and names the nearest known ones.
async fn unknown_method_hint(client: &super::BrokerClient, method: &str) -> Option<String> {
    let (_, state) = client.json(Method::GET, "/v1/state", None).await.ok()?;
    let known: Vec<&str> = state["upstream"]["methods"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    if known.contains(&method) {
        return None;
    }
    let near: Vec<String> = nearest(method, &known)
        .into_iter()
        .map(|m| crate::sanitize::field(m, 80).into_owned())
        .collect();
    let method = crate::sanitize::Shown(method);
    Some(if near.is_empty() {
        format!("; `{method}` is not a method the gateway announced (`/v1/state` lists them under upstream.methods)")
    } else {
        format!(
            "; `{method}` is not a method the gateway announced; did you mean {}?",
            near.join(", ")
        )
    })
}

/// Up to three known names nearest to `wanted`: a small edit distance, or
/// a close Jaro-Winkler similarity (as clap's own suggestions use), best first.
pub fn nearest<'a>(wanted: &str, known: &[&'a str]) -> Vec<&'a str> {
    let mut scored: Vec<(f64, &str)> = known
        .iter()
        .filter_map(|k| {
            let edits = strsim::damerau_levenshtein(wanted, k);
            let similar = strsim::jaro_winkler(wanted, k);
            (edits <= 2 || similar >= 0.9).then_some((similar - edits as f64, *k))
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    scored.into_iter().take(3).map(|(_, k)| k).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_are_short_notes_and_nested_ones_point_to_json() {
        let (notes, more) = detail_notes(&serde_json::json!({"attempt": 2, "sent": false}));
        assert_eq!(notes, ["attempt 2", "sent false"]);
        assert!(!more);
        let (notes, more) = detail_notes(&serde_json::json!({
            "code": "INVALID_REQUEST", "details": {"authReason": "token_mismatch"},
            "message": "unauthorized: gateway token mismatch"}));
        assert_eq!(notes, ["code INVALID_REQUEST"]);
        assert!(more, "the nested details are left to --json");
    }

    #[test]
    fn nearest_methods_are_suggested() {
        let known = [
            "health",
            "status",
            "chat.send",
            "chat.history",
            "sessions.list",
        ];
        assert_eq!(nearest("helth", &known), ["health"]);
        assert_eq!(nearest("chat.sned", &known), ["chat.send"]);
        assert_eq!(nearest("sessions.lst", &known), ["sessions.list"]);
        assert!(nearest("zzzzzz", &known).is_empty());
    }

    #[test]
    fn short_scope_names_mean_operator_scopes() {
        let name = |s: &str| scope_name(s).ok();
        assert_eq!(name("read").as_deref(), Some("operator.read"));
        assert_eq!(name(" operator.admin ").as_deref(), Some("operator.admin"));
        assert_eq!(
            name("talk.secrets").as_deref(),
            Some("operator.talk.secrets")
        );
        for bad in ["banana", "operator.banana", "node.read"] {
            match scope_name(bad) {
                Err(CliError::Usage(m)) => assert!(
                    m.contains("valid scopes: read, write, admin") && m.contains("sessions.write"),
                    "{m}"
                ),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
