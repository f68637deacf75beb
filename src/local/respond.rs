//! What every HTTP route answers with: the body type, JSON and error
//! responses, and who a request acts as (its socket's policy and the
//! scopes it may use). Below the routes (`http.rs` dispatches to them; they
//! all import this), so no route imports the router file.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::json;

use crate::context::Ctx;
use crate::policy::SocketPolicy;
use crate::protocol::ErrorShape;

/// Every response body: whole (JSON documents) or streamed (`/v1/events`).
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// A body sent in one piece.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}

/// A response with a body in one piece.
pub fn bytes_response(status: StatusCode, content_type: &str, body: Bytes) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-store")
        .body(full(body))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

pub fn json_response(status: StatusCode, body: serde_json::Value) -> Response<Body> {
    bytes_response(status, "application/json", Bytes::from(body.to_string()))
}

/// An error answer with just a code and a message (see the module docs for the shape).
pub fn error_response(status: StatusCode, code: &str, message: String) -> Response<Body> {
    json_response(
        status,
        error_body(&json!({"code": code, "message": message})),
    )
}

/// An error answer carrying a whole [`ErrorShape`] (retry hints, details).
pub fn shape_response(status: StatusCode, error: &ErrorShape) -> Response<Body> {
    json_response(status, error_body(&error.to_json()))
}

/// The one error body: `{"ok":false,"error":<ErrorShape>}`.
pub fn error_body(error: &serde_json::Value) -> serde_json::Value {
    json!({"ok": false, "error": error})
}

/// The policy of the socket a request came in on (the accept loop puts it
/// in the request's extensions; the main socket's when absent).
pub(crate) fn socket_policy(req: &Request<Incoming>, ctx: &Ctx) -> Arc<SocketPolicy> {
    req.extensions()
        .get::<Arc<SocketPolicy>>()
        .cloned()
        .unwrap_or_else(|| Arc::new(SocketPolicy::main(ctx.settings.socket_path.clone())))
}

pub use crate::protocol::SCOPES_HEADER;

/// What an HTTP caller (`/v1/rpc`, `/v1/events`) may do: its socket's
/// ceiling over the broker's session, narrowed by [`SCOPES_HEADER`] when
/// present.
pub(crate) fn http_access(req: &Request<Incoming>, ctx: &Ctx) -> crate::policy::Access {
    use crate::policy::{Access, Grant};
    let socket = socket_policy(req, ctx);
    let session = ctx.upstream().status().hello.map_or_else(
        || Grant::new(crate::policy::scopes::REQUESTED_SCOPES),
        |h| Grant::new(&h.scopes),
    );
    let mut grant = socket.ceiling(&session);
    if let Some(asked) = req
        .headers()
        .get(SCOPES_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        grant = Grant::new(asked.split([',', ' '])).within(&grant);
    }
    Access { grant, socket }
}

/// A `text/event-stream` response of `chunks`: never cached, and the
/// connection closes with the stream (a stream ends only when the broker
/// ends it — slow consumer, shutdown — and a reader blocked on it must
/// see EOF).
/// Its chunks count in `budget` until hyper has written them, and hyper
/// holds a bounded amount of them ([`super::stream_body`]).
pub fn event_stream_response(
    chunks: impl futures_util::Stream<Item = Bytes> + Send + 'static,
    budget: &Arc<crate::hub::QueueBudget>,
) -> Response<Body> {
    event_stream_response_watched(chunks, budget).0
}

/// [`event_stream_response`], and a watch on what hyper has written of it.
pub fn event_stream_response_watched(
    chunks: impl futures_util::Stream<Item = Bytes> + Send + 'static,
    budget: &Arc<crate::hub::QueueBudget>,
) -> (Response<Body>, super::stream_body::Drained) {
    use futures_util::StreamExt;
    let counted = super::stream_body::Counted::new(chunks, Arc::clone(budget));
    let drained = counted.drained();
    let body = http_body_util::StreamBody::new(
        counted.map(|chunk| Ok::<_, Infallible>(hyper::body::Frame::data(chunk))),
    )
    .boxed_unsync();
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    headers.insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    (resp, drained)
}
