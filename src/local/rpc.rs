//! `POST /v1/rpc`: one gateway request over plain HTTP, for curl and scripts.
//!
//! The HTTP request becomes a throwaway hub [`Client`](crate::hub::Client)
//! of kind `rpc`, registered with the dispatcher like any WebSocket
//! requester, and the answer lands in its queue. It is never admitted to the
//! hub, so it gets no events. Every `/v1/rpc` request spends one in-flight
//! budget shared by all of them (`max_inflight`), so opening more HTTP
//! requests cannot bypass the cap. The body of every answer is a gateway
//! `res` frame.
//!
//! Status codes: 200 whenever the gateway answered (`ok` true or false: the
//! request itself went through); 400 bad input (not JSON, unknown fields,
//! `connect`); 413 body over `max_frame_bytes`; 429 too many requests;
//! 503 upstream session not ready or lost (`studio.upstream_closed` and
//! friends, with `retryAfterMs`); 504 `studio.request_timeout`.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::respond::{bytes_response, Body};
use crate::context::Ctx;
use crate::hub::{ClientKind, Outgoing};
use crate::protocol::frames::{encode_res_error, payload_status};
use crate::protocol::{ErrorShape, StudioCode};

/// The request body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RpcRequest {
    method: String,
    #[serde(default)]
    params: Option<Box<RawValue>>,
    /// Echoed as the answer's `id`; `"http"` when absent.
    #[serde(default)]
    id: Option<String>,
    /// Wait for the final answer of a two-answer method (`agent` answers
    /// `accepted` first), as the gateway client's `expectFinal` does.
    #[serde(default, rename = "expectFinal")]
    expect_final: bool,
}

/// Why the body was refused before anything was sent upstream.
#[derive(Debug, thiserror::Error)]
enum BadRpc {
    #[error("the request body is larger than {0} bytes (max_frame_bytes)")]
    TooLarge(usize),
    #[error("cannot read the request body: {0}")]
    Unreadable(String),
    #[error("invalid JSON body: {0}; expected {{\"method\": \"health\", \"params\": {{…}}}}")]
    BadJson(String),
    #[error("method must be a non-empty string")]
    NoMethod,
    #[error(
        "connect is handled by the broker, which owns the gateway session; send other methods"
    )]
    Connect,
}

impl BadRpc {
    fn status(&self) -> StatusCode {
        match self {
            BadRpc::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

pub async fn respond(req: Request<Incoming>, ctx: &Arc<Ctx>) -> Response<Body> {
    let access = super::respond::http_access(&req, ctx);
    let rpc = match read_request(req, ctx.settings.limits.max_frame_bytes).await {
        Ok(rpc) => rpc,
        Err(bad) => {
            let error = ErrorShape::invalid_request(bad.to_string());
            return res_response(bad.status(), encode_res_error("http", &error));
        }
    };
    let id = rpc.id.as_deref().unwrap_or("http");
    match call(ctx, &rpc, id, access).await {
        Ok(frame) => res_response(status_of(&frame), frame),
        Err(error) => res_response(status_of_code(&error.code), encode_res_error(id, &error)),
    }
}

async fn read_request(req: Request<Incoming>, max_bytes: usize) -> Result<RpcRequest, BadRpc> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > max_bytes) {
        return Err(BadRpc::TooLarge(max_bytes));
    }
    let body = Limited::new(req.into_body(), max_bytes)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                BadRpc::TooLarge(max_bytes)
            } else {
                BadRpc::Unreadable(e.to_string())
            }
        })?
        .to_bytes();
    let rpc: RpcRequest =
        serde_json::from_slice(&body).map_err(|e| BadRpc::BadJson(e.to_string()))?;
    if rpc.method.is_empty() {
        return Err(BadRpc::NoMethod);
    }
    if rpc.method == "connect" {
        return Err(BadRpc::Connect);
    }
    Ok(rpc)
}

/// Sends the request upstream and waits for its (final) answer frame. The
/// registration releases what the request held however this ends
/// (answered, or dropped because the HTTP client went away).
async fn call(
    ctx: &Arc<Ctx>,
    rpc: &RpcRequest,
    id: &str,
    access: crate::policy::Access,
) -> Result<Bytes, ErrorShape> {
    if rpc.method.starts_with("sessions.") && rpc.method.ends_with("subscribe") {
        return Err(ErrorShape::invalid_request(
            "subscriptions belong to a connection: use the WebSocket (/ws) or /v1/events",
        ));
    }
    let registration = ctx
        .dispatcher
        .register_rpc(ctx.hub.new_client_of_kind(ClientKind::Rpc));
    registration.client().set_access(access);
    ctx.dispatcher.dispatch(
        registration.member(),
        id,
        &rpc.method,
        rpc.params.as_deref(),
    )?;
    let client = registration.client();
    loop {
        let batch = tokio::select! {
            batch = client.next_batch() => batch,
            _ = ctx.cancel.cancelled() => {
                // Dispatched: it may have been written.
                return Err(ErrorShape::studio(StudioCode::UpstreamClosed, "the broker is shutting down").with_sent(true));
            }
        };
        for item in batch {
            if let Outgoing::Frame(frame) = item {
                if !rpc.expect_final || !is_interim(&frame) {
                    return Ok(frame);
                }
            }
        }
    }
}

/// `agent`'s first answer (`ok` with `status: "accepted"`).
fn is_interim(frame: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Res<'a> {
        #[serde(default)]
        ok: bool,
        #[serde(borrow, default)]
        payload: Option<&'a RawValue>,
    }
    serde_json::from_slice::<Res>(frame)
        .is_ok_and(|r| r.ok && payload_status(r.payload).as_deref() == Some("accepted"))
}

/// 200 for any gateway answer; a broker (`studio.*`) error maps to its status.
fn status_of(frame: &[u8]) -> StatusCode {
    #[derive(Deserialize)]
    struct Res {
        #[serde(default)]
        error: Option<ErrorCode>,
    }
    #[derive(Deserialize)]
    struct ErrorCode {
        #[serde(default)]
        code: String,
    }
    match serde_json::from_slice::<Res>(frame) {
        Ok(Res { error: Some(e) }) => status_of_code(&e.code),
        _ => StatusCode::OK,
    }
}

fn status_of_code(code: &str) -> StatusCode {
    match code {
        "studio.request_timeout" => StatusCode::GATEWAY_TIMEOUT,
        "studio.too_many_requests" => StatusCode::TOO_MANY_REQUESTS,
        "studio.forbidden" => StatusCode::FORBIDDEN,
        c if c.starts_with("studio.") => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::OK,
    }
}

fn res_response(status: StatusCode, frame: Bytes) -> Response<Body> {
    bytes_response(status, "application/json", frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(
            status_of(br#"{"type":"res","id":"h","ok":true}"#),
            StatusCode::OK
        );
        assert_eq!(
            status_of(br#"{"type":"res","id":"h","ok":false,"error":{"code":"INVALID_REQUEST","message":"x"}}"#),
            StatusCode::OK
        );
        assert_eq!(
            status_of(br#"{"ok":false,"error":{"code":"studio.upstream_closed","message":"x"}}"#),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            status_of_code("studio.request_timeout"),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert!(is_interim(
            br#"{"ok":true,"payload":{"status":"accepted"}}"#
        ));
        assert!(!is_interim(br#"{"ok":true,"payload":{"status":"ok"}}"#));
    }
}
