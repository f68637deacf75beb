//! HTTP routes on the local socket.
//!
//! Every error answer of every endpoint has ONE body shape:
//! `{"ok":false,"error":{"code","message","retryable"?,"retryAfterMs"?,"details"?}}`
//! (the gateway's `ErrorShape` under `error`; endpoint-specific data such as
//! `/v1/events`' replay window goes in `error.details`). `/v1/rpc`'s error
//! answers are gateway `res` frames, which have the same `ok` and `error`
//! (plus `type` and `id`). Built by `respond::error_response` / `respond::shape_response`
//! only; the `503` written before hyper sees a request
//! (`accept::busy_response`) has it too.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::WebSocketStream;

use super::respond::{
    bytes_response, error_body, error_response, full, json_response, socket_policy, Body,
};
use crate::context::Ctx;

/// Paths that speak the gateway protocol over WebSocket (a drop-in for a
/// direct gateway URL, and the Claw3D proxy's path).
fn is_ws_path(path: &str) -> bool {
    matches!(path, "/" | "/ws" | "/api/gateway/ws")
}

/// The plain-HTTP endpoints and the one method each answers.
const HTTP_ENDPOINTS: [(&str, Method); 6] = [
    ("/healthz", Method::GET),
    ("/readyz", Method::GET),
    ("/v1/state", Method::GET),
    ("/v1/events", Method::GET),
    ("/v1/rpc", Method::POST),
    ("/metrics", Method::GET),
];

pub async fn route(req: Request<Incoming>, ctx: Arc<Ctx>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let resp = match (req.method(), path.as_str()) {
        (&Method::GET, p) if is_ws_path(p) => upgrade(req, ctx, Route::Shared),
        (&Method::GET, "/ws/dedicated") => upgrade(req, ctx, Route::Dedicated),
        (&Method::GET, "/v1/state") => super::state::respond(&ctx, socket_policy(&req, &ctx)).await,
        (&Method::GET, "/v1/events") => super::sse::open(&req, &ctx),
        (&Method::GET, "/v1/hud" | "/ws/hud") => super::hud::open(req, &ctx).await,
        (&Method::POST, "/v1/rpc") => super::rpc::respond(req, &ctx).await,
        (&Method::GET, "/metrics") => bytes_response(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            Bytes::from(super::metrics::render(&ctx)),
        ),
        (&Method::GET, "/healthz") => health(&ctx),
        (&Method::GET, "/readyz") => ready(&ctx),
        (m, p) => match HTTP_ENDPOINTS.iter().find(|(path, _)| *path == p) {
            Some((_, allowed)) => {
                let mut resp = error_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method_not_allowed",
                    format!("{p} answers {allowed}, not {m}"),
                );
                if let Ok(v) = header::HeaderValue::from_str(allowed.as_str()) {
                    resp.headers_mut().insert(header::ALLOW, v);
                }
                resp
            }
            None => error_response(
                StatusCode::NOT_FOUND,
                "not_found",
                format!(
                    "no route for {m} {p}; try GET /ws (WebSocket), /healthz, /readyz, /v1/state, /v1/events, /metrics, or POST /v1/rpc"
                ),
            ),
        },
    };
    Ok(resp)
}

/// `GET /healthz`, liveness: `200` whenever the broker answers at all (a
/// supervisor restarts it only when this fails). `ok` is true only while the
/// gateway session is `ready`; `upstream` says the phase and `lastError` why
/// it is not. `lostScopes` is always an array (empty before any session).
fn health(ctx: &Ctx) -> Response<Body> {
    let status = ctx.upstream().status();
    let lost: &[String] = status.hello.as_ref().map_or(&[], |h| &h.lost_scopes);
    json_response(
        StatusCode::OK,
        json!({
            "ok": status.phase == crate::upstream::Phase::Ready,
            "upstream": status.phase.as_str(),
            "clients": ctx.hub.client_count(),
            "lastError": status.last_error.as_ref().map(|e| &e.code),
            "lostScopes": lost,
            "deviceId": status.device_id,
        }),
    )
}

/// `GET /readyz`, readiness: `200 {"ok":true,"upstream":"ready"}` once the
/// gateway session is ready, else `503` with the error a request would get
/// now (`studio.upstream_closed` + `retryAfterMs` while it connects, the
/// rejection while rejected) and `upstream` naming the phase, as on `/healthz`.
fn ready(ctx: &Ctx) -> Response<Body> {
    let status = ctx.upstream().status();
    if status.phase == crate::upstream::Phase::Ready {
        return json_response(StatusCode::OK, json!({"ok": true, "upstream": "ready"}));
    }
    let mut body = error_body(&status.not_ready_error().to_json());
    body["upstream"] = status.phase.as_str().into();
    json_response(StatusCode::SERVICE_UNAVAILABLE, body)
}

fn header_has(req: &Request<Incoming>, name: header::HeaderName, token: &str) -> bool {
    req.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|v| v.trim().eq_ignore_ascii_case(token))
}

/// Which session a WebSocket path gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// The shared upstream session (`/ws`, `/`, `/api/gateway/ws`).
    Shared,
    /// A gateway connection of its own (`/ws/dedicated`).
    Dedicated,
}

/// Answers the WebSocket upgrade and spawns the session once hyper hands
/// over the connection.
fn upgrade(mut req: Request<Incoming>, ctx: Arc<Ctx>, route: Route) -> Response<Body> {
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
    let restarts = match super::ws::Restarts::for_request(req.uri()) {
        Ok(r) => r,
        Err(message) => {
            return error_response(StatusCode::BAD_REQUEST, "bad_query", message);
        }
    };
    let socket = socket_policy(&req, &ctx);
    if route == Route::Dedicated && !super::dedicated::served_on(&socket) {
        return error_response(
            StatusCode::FORBIDDEN,
            crate::protocol::StudioCode::Forbidden.as_str(),
            format!(
                "the socket {:?} limits scopes or methods, and /ws/dedicated relays frames unchecked: use /ws here, or /ws/dedicated on an unrestricted socket",
                socket.name
            ),
        );
    }
    let peer_pid = req.extensions().get::<super::PeerPid>().and_then(|p| p.0);
    let peer_uid = req.extensions().get::<super::PeerPid>().and_then(|p| p.1);
    let conn_fd = req.extensions().get::<super::ConnFd>().copied();
    // A browser (or a proxy for one) sends an Origin: see `dedicated::origin`.
    let browser = req.headers().contains_key(header::ORIGIN);
    let accept = derive_accept_key(key.as_bytes());
    let on_upgrade = hyper::upgrade::on(&mut req);
    let tracker = ctx.tracker.clone();
    tracker.spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let config = super::ws::config(&ctx);
                let budget = super::preconnect::PreconnectBudget::new(
                    ctx.settings.limits.preconnect_max_bytes as u64,
                );
                // Boxed: this task lives as long as the client, and its
                // future is as large as the larger of the two routes (the
                // dedicated route holds a whole gateway handshake).
                match route {
                    Route::Shared => {
                        let io =
                            super::preconnect::Limited::new(TokioIo::new(upgraded), budget.clone())
                                .fragments_in_pieces(ctx.settings.limits.max_frame_bytes);
                        let ws =
                            WebSocketStream::from_raw_socket(io, Role::Server, Some(config)).await;
                        let peer = super::ws::Peer {
                            pid: peer_pid,
                            fd: conn_fd,
                        };
                        super::ws::run(ws, budget, restarts, socket, peer, ctx).await
                    }
                    Route::Dedicated => {
                        let io: Box<dyn super::dedicated::ClientIo> =
                            Box::new(TokioIo::new(upgraded));
                        let io = super::preconnect::Limited::new(io, budget.clone())
                            .fragments_in_pieces(ctx.settings.limits.max_frame_bytes);
                        let ws =
                            WebSocketStream::from_raw_socket(io, Role::Server, Some(config)).await;
                        let client = super::dedicated::Client {
                            uid: peer_uid,
                            browser,
                            fd: conn_fd.map(|fd| fd.0),
                        };
                        Box::pin(super::dedicated::run(ws, budget, client, ctx)).await
                    }
                }
            }
            Err(e) => tracing::debug!("WebSocket upgrade failed: {e}"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept)
        .body(full(Bytes::new()))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}
