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
    let (status, res) = args
        .broker
        .client()
        .json(Method::POST, "/v1/rpc", Some(&body))
        .await?;
    if args.json {
        super::print_line(&res.to_string());
    }
    if res["ok"] == true {
        if !args.json {
            let payload = res.get("payload").cloned().unwrap_or(Value::Null);
            super::print_line(&serde_json::to_string_pretty(&payload).unwrap_or_default());
        }
        return Ok(0);
    }
    // The code, message and details are the gateway's: shown escaped.
    let error = &res["error"];
    let mut message = format!(
        "{}: {}",
        sanitize::field(error["code"].as_str().unwrap_or("error"), 200),
        sanitize::lines(error["message"].as_str().unwrap_or("(no message)"))
    );
    if let Some(ms) = error["retryAfterMs"].as_u64() {
        message.push_str(&format!(" (retry after {ms} ms)"));
    }
    if let Some(details) = error.get("details") {
        message.push_str(&format!(
            " details: {}",
            sanitize::text(&details.to_string())
        ));
    }
    match status {
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => Err(CliError::Usage(message)),
        _ => Err(CliError::Answer(message)),
    }
}
