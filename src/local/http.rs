//! HTTP routes on the local socket.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

use crate::broker::Ctx;

pub type Body = Full<Bytes>;

fn json_response(status: StatusCode, body: serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap_or_default()
}

fn error_response(status: StatusCode, code: &str, message: String) -> Response<Body> {
    json_response(
        status,
        json!({"ok": false, "error": {"code": code, "message": message}}),
    )
}

/// Paths that speak the gateway protocol over WebSocket (a drop-in for a
/// direct gateway URL, and the Claw3D proxy's path).
fn is_ws_path(path: &str) -> bool {
    matches!(path, "/" | "/ws" | "/api/gateway/ws")
}

pub async fn route(
    req: Request<Incoming>,
    ctx: Arc<Ctx>,
) -> Result<Response<Body>, std::convert::Infallible> {
    let path = req.uri().path().to_owned();
    let resp = match (req.method(), path.as_str()) {
        (&Method::GET, p) if is_ws_path(p) => upgrade(req, ctx),
        (&Method::GET, "/healthz") => {
            let status = ctx.upstream.status();
            json_response(
                StatusCode::OK,
                json!({
                    "ok": true,
                    "upstream": status.phase.as_str(),
                    "clients": ctx.hub.client_count(),
                    "lastError": status.last_error.as_ref().map(|e| &e.code),
                    "lostScopes": status.hello.as_ref().map(|h| &h.lost_scopes),
                    "deviceId": status.device_id,
                }),
            )
        }
        (m, p) => error_response(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route for {m} {p}; WebSocket: GET /ws, health: GET /healthz"),
        ),
    };
    Ok(resp)
}

fn header_has(req: &Request<Incoming>, name: header::HeaderName, token: &str) -> bool {
    req.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|v| v.trim().eq_ignore_ascii_case(token))
}

/// Answers the WebSocket upgrade and spawns the session once hyper hands
/// over the connection.
fn upgrade(mut req: Request<Incoming>, ctx: Arc<Ctx>) -> Response<Body> {
    let key = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned();
    let is_upgrade = header_has(&req, header::CONNECTION, "upgrade")
        && header_has(&req, header::UPGRADE, "websocket");
    let (Some(key), true) = (key, is_upgrade) else {
        return error_response(
            StatusCode::UPGRADE_REQUIRED,
            "upgrade_required",
            "this path speaks the gateway WebSocket protocol; connect with a WebSocket client"
                .into(),
        );
    };
    if req
        .headers()
        .get(header::SEC_WEBSOCKET_VERSION)
        .map(|v| v.as_bytes())
        != Some(b"13")
    {
        return error_response(
            StatusCode::BAD_REQUEST,
            "bad_websocket_version",
            "Sec-WebSocket-Version must be 13".into(),
        );
    }
    let accept = derive_accept_key(key.as_bytes());
    let on_upgrade = hyper::upgrade::on(&mut req);
    let tracker = ctx.tracker.clone();
    tracker.spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let config = WebSocketConfig::default()
                    .max_message_size(Some(ctx.settings.limits.max_frame_bytes))
                    .max_frame_size(Some(ctx.settings.limits.max_frame_bytes));
                let ws = WebSocketStream::from_raw_socket(
                    TokioIo::new(upgraded),
                    Role::Server,
                    Some(config),
                )
                .await;
                super::ws::run(ws, ctx).await;
            }
            Err(e) => tracing::debug!("WebSocket upgrade failed: {e}"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept)
        .body(Full::new(Bytes::new()))
        .unwrap_or_default()
}
