//! HTTP API helpers for the tests of `/v1/state`, `/v1/events`, `/v1/rpc`
//! and `/metrics`: plain requests over the unix socket and a small
//! Server-Sent Events reader that also shows comments (keep-alives). Every
//! wait is bounded by `PATIENCE`. Included with `#[path]` next to `support`.

#![allow(dead_code)]

use std::path::Path;

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

use crate::support::PATIENCE;

/// One HTTP request over the socket: (status, headers, body).
pub async fn request(
    socket: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, HeaderMap, hyper::Response<Incoming>) {
    let stream = UnixStream::connect(socket).await.expect("socket accepts");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("http handshake");
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body)))
        .expect("request");
    let resp = tokio::time::timeout(PATIENCE, sender.send_request(req))
        .await
        .expect("answer in time")
        .expect("http response");
    (resp.status().as_u16(), resp.headers().clone(), resp)
}

/// A request whose whole body is read: (status, headers, text).
pub async fn request_text(
    socket: &Path,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, HeaderMap, String) {
    let (status, headers, resp) = request(socket, method, path, &[], body).await;
    let bytes = tokio::time::timeout(PATIENCE, resp.into_body().collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    (
        status,
        headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

/// `POST /v1/rpc` with `body`: (status, answer as JSON).
pub async fn rpc(socket: &Path, body: &str) -> (u16, Value) {
    let (status, _, text) = request_text(socket, "POST", "/v1/rpc", body.as_bytes()).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("JSON answer: {text}"));
    (status, v)
}

/// `GET /v1/state`.
pub async fn state(socket: &Path) -> Value {
    let (status, _, text) = request_text(socket, "GET", "/v1/state", b"").await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("state is JSON")
}

/// What an SSE stream carried.
#[derive(Debug, Clone)]
pub enum Item {
    Comment(String),
    /// `id` is the cursor and `epoch` the broker life of `id: <epoch>:<cursor>`
    /// (empty when the id is a bare cursor).
    Event {
        id: u64,
        epoch: String,
        name: String,
        data: Value,
    },
    /// Anything else (e.g. `retry:`, or the broker's `clawmux.close`).
    Other(String),
}

/// An open `/v1/events` stream.
pub struct Sse {
    pub headers: HeaderMap,
    body: Incoming,
    buf: String,
}

/// Opens `/v1/events…`; `Err((status, body))` when it is not a stream.
pub async fn open_events(
    socket: &Path,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Sse, (u16, Value)> {
    let (status, hdrs, resp) = request(socket, "GET", path, headers, b"").await;
    if status != 200 {
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        return Err((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ));
    }
    assert_eq!(hdrs["content-type"], "text/event-stream");
    Ok(Sse {
        headers: hdrs,
        body: resp.into_body(),
        buf: String::new(),
    })
}

impl Sse {
    /// The next record (blank-line separated), comments included.
    pub async fn next_item(&mut self) -> Item {
        self.next_item_within(PATIENCE).await
    }

    /// [`Sse::next_item`] waiting up to `wait` for each frame (a real
    /// gateway's model turn can be quiet for longer than `PATIENCE`).
    pub async fn next_item_within(&mut self, wait: std::time::Duration) -> Item {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let record: String = self.buf.drain(..end + 2).collect();
                return parse_record(record.trim_end());
            }
            let frame = tokio::time::timeout(wait, self.body.frame())
                .await
                .expect("an SSE record within the patience window")
                .expect("the stream is still open")
                .expect("body frame");
            if let Ok(data) = frame.into_data() {
                self.buf
                    .push_str(std::str::from_utf8(&data).expect("UTF-8"));
            }
        }
    }

    /// The next record, or `None` once the response ended (or broke).
    pub async fn next_item_or_end(&mut self, wait: std::time::Duration) -> Option<Item> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let record: String = self.buf.drain(..end + 2).collect();
                return Some(parse_record(record.trim_end()));
            }
            let frame = tokio::time::timeout(wait, self.body.frame())
                .await
                .expect("an SSE record or the end within the patience window");
            match frame {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf
                            .push_str(std::str::from_utf8(&data).expect("UTF-8"));
                    }
                }
                None | Some(Err(_)) => return None,
            }
        }
    }

    /// The next event, skipping comments and other records.
    pub async fn next_event(&mut self) -> (u64, String, Value) {
        loop {
            if let Item::Event { id, name, data, .. } = self.next_item().await {
                return (id, name, data);
            }
        }
    }

    /// Events up to and including cursor `last`.
    pub async fn events_through(&mut self, last: u64) -> Vec<(u64, String, Value)> {
        let mut out = Vec::new();
        loop {
            let e = self.next_event().await;
            let id = e.0;
            out.push(e);
            if id >= last {
                return out;
            }
        }
    }
}

fn parse_record(record: &str) -> Item {
    if record.lines().all(|l| l.starts_with(':')) {
        return Item::Comment(record.to_owned());
    }
    let (mut id, mut epoch, mut name, mut data) = (None, String::new(), None, None);
    for line in record.lines() {
        if let Some(v) = line.strip_prefix("id: ") {
            let (life, cursor) = v.rsplit_once(':').unwrap_or(("", v));
            epoch = life.to_owned();
            id = cursor.parse::<u64>().ok();
        } else if let Some(v) = line.strip_prefix("event: ") {
            name = Some(v.to_owned());
        } else if let Some(v) = line.strip_prefix("data: ") {
            assert!(data.is_none(), "one data line per record: {record}");
            data = Some(serde_json::from_str::<Value>(v).expect("data is one JSON line"));
        }
    }
    match (id, name, data) {
        (Some(id), Some(name), Some(data)) => Item::Event {
            id,
            epoch,
            name,
            data,
        },
        _ => Item::Other(record.to_owned()),
    }
}

/// Waits until the broker's replay log has handed out cursor `seq`.
pub async fn wait_newest_seq(socket: &Path, seq: u64) -> Value {
    crate::support::eventually_async(&format!("newest_seq {seq}"), || async {
        let s = state(socket).await;
        if s["newest_seq"].as_u64().unwrap_or(0) >= seq {
            Ok(s)
        } else {
            Err(s)
        }
    })
    .await
}

/// Waits until the broker's upstream session is ready (the harness returns
/// as soon as the socket accepts; the session opens in the background).
pub async fn until_ready(socket: &Path) -> Value {
    crate::support::eventually_async("the upstream session ready", || async {
        let s = state(socket).await;
        if s["upstream"]["phase"] == "ready" {
            Ok(s)
        } else {
            Err(s)
        }
    })
    .await
}
