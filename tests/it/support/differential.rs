//! Differential testing against the real gateway: a WebSocket client over
//! TCP (direct) or the broker's unix socket, a transcript of every frame a
//! scenario produced, the normalisation of volatile values, and the diff of
//! two transcripts. Include with `#[path = "support/differential.rs"]`.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// Any byte stream a WebSocket can run over (TCP, unix socket).
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// What a connection read.
#[derive(Debug, Clone)]
pub enum Frame {
    Json(Value),
    Close(u16, String),
    Eof,
}

/// A WebSocket client that keeps every frame it reads, in order.
pub struct Conn {
    ws: WebSocketStream<Box<dyn Io>>,
    /// Every frame read so far (responses, events, the close).
    pub log: Vec<Value>,
    /// Frames read but not yet consumed by a wait.
    unread: Vec<Value>,
}

fn ws_config() -> tokio_tungstenite::tungstenite::protocol::WebSocketConfig {
    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_frame_size(Some(64 << 20))
        .max_message_size(Some(64 << 20))
}

impl Conn {
    pub async fn tcp(port: u16, path: &str) -> Conn {
        let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("gateway accepts");
        Conn::over(Box::new(s), &format!("ws://127.0.0.1:{port}{path}")).await
    }

    pub async fn unix(socket: &Path, path: &str) -> Conn {
        let s = tokio::net::UnixStream::connect(socket)
            .await
            .expect("broker accepts");
        Conn::over(Box::new(s), &format!("ws://localhost{path}")).await
    }

    async fn over(io: Box<dyn Io>, url: &str) -> Conn {
        let (ws, _) = tokio::time::timeout(
            Duration::from_secs(10),
            tokio_tungstenite::client_async_with_config(url, io, Some(ws_config())),
        )
        .await
        .expect("upgrade in time")
        .expect("upgrade");
        Conn {
            ws,
            log: Vec::new(),
            unread: Vec::new(),
        }
    }

    /// Forgets frames read but not waited for.
    pub fn forget_unread(&mut self) {
        self.unread.clear();
    }

    pub async fn send(&mut self, v: &Value) {
        self.ws
            .send(Message::text(v.to_string()))
            .await
            .expect("send");
    }

    pub async fn send_text(&mut self, t: &str) {
        self.ws.send(Message::text(t)).await.expect("send");
    }

    pub async fn close(&mut self) {
        let _ = self.ws.close(None).await;
    }

    /// Starts a close with this code and reason.
    pub async fn close_with(
        &mut self,
        frame: tokio_tungstenite::tungstenite::protocol::CloseFrame,
    ) {
        let _ = self.ws.close(Some(frame)).await;
    }

    /// The next frame from the socket (not from `unread`), or `None` when
    /// nothing came within `wait`. Closes and EOF are logged as
    /// `{"close": code, "reason": …}`.
    pub async fn read(&mut self, wait: Duration) -> Option<Frame> {
        loop {
            let msg = tokio::time::timeout(wait, self.ws.next()).await.ok()?;
            let frame = match msg {
                Some(Ok(Message::Text(t))) => {
                    Frame::Json(serde_json::from_str(t.as_str()).expect("JSON frames"))
                }
                Some(Ok(Message::Close(f))) => match f {
                    Some(f) => Frame::Close(u16::from(f.code), f.reason.as_str().to_owned()),
                    None => Frame::Close(1005, String::new()),
                },
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => Frame::Eof,
            };
            match &frame {
                Frame::Json(v) => self.log.push(v.clone()),
                Frame::Close(c, r) => self.log.push(json!({"close": c, "reason": r})),
                Frame::Eof => self.log.push(json!({"eof": true})),
            }
            return Some(frame);
        }
    }

    /// Reads (keeping everything in `log`) until a frame matches `want`.
    pub async fn until(
        &mut self,
        wait: Duration,
        what: &str,
        want: impl Fn(&Value) -> bool,
    ) -> Value {
        if let Some(i) = self.unread.iter().position(&want) {
            return self.unread.remove(i);
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.read(left).await {
                Some(Frame::Json(v)) if want(&v) => return v,
                Some(Frame::Json(v)) => self.unread.push(v),
                other => panic!(
                    "no {what} within {wait:?}: {other:?}; last frames {:?}",
                    last(&self.log)
                ),
            }
        }
    }

    /// The `res` with `id`.
    pub async fn response(&mut self, id: &str, wait: Duration) -> Value {
        self.until(wait, &format!("response {id}"), |v| {
            v["type"] == "res" && v["id"] == id
        })
        .await
    }

    /// Reads until the close frame (or EOF): (code, reason).
    pub async fn closed(&mut self, wait: Duration) -> (u16, String) {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.read(left).await {
                Some(Frame::Json(v)) => self.unread.push(v),
                Some(Frame::Close(c, r)) => return (c, r),
                Some(Frame::Eof) => return (1006, String::new()),
                None => panic!("no close within {wait:?}"),
            }
        }
    }

    /// Reads whatever arrives until nothing (but `ignore`d events) has come
    /// for `quiet`, at most `max`: the end of a scenario has no event to
    /// await, only the absence of more.
    pub async fn settle(&mut self, quiet: Duration, max: Duration, ignore: &[&str]) {
        let deadline = tokio::time::Instant::now() + max;
        let mut last_relevant = tokio::time::Instant::now();
        while tokio::time::Instant::now() < deadline {
            let left =
                (last_relevant + quiet).saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return;
            }
            match self.read(left).await {
                Some(Frame::Json(v)) => {
                    if !ignore.iter().any(|n| v["event"] == *n) {
                        last_relevant = tokio::time::Instant::now();
                    }
                }
                Some(_) => return,
                None => return,
            }
        }
    }
}

fn last(log: &[Value]) -> Vec<String> {
    log.iter()
        .rev()
        .take(5)
        .map(|v| v.to_string().chars().take(300).collect())
        .collect()
}

/// Replaces the values that change from run to run (identifiers minted per
/// connection or run, clocks, measured durations) by placeholders, so two
/// runs of one scenario can be compared. Only volatile values: every rule
/// says why the value differs between two identical runs.
pub struct Normalizer {
    /// Literal strings replaced everywhere (inside longer strings too), e.g.
    /// the run's own tag in session keys, ports, state dirs.
    pub literals: Vec<(String, String)>,
}

/// Keys whose values are clocks or measurements: they differ in every run.
const CLOCK_KEYS: &[&str] = &[
    "ts",
    "timestamp",
    "createdAt",
    "updatedAt",
    "startedAt",
    "endedAt",
    "lastActivityAt",
    "lastMessageAt",
    "recordTime",
    "receivedAt",
    "sentAt",
    "durationMs",
    "uptimeMs",
    "elapsedMs",
    "ageMs",
    "intervalMs",
    "delayP99Ms",
    "delayMaxMs",
    "utilization",
    "cpuCoreRatio",
    "mainThreadCoreRatio",
    "hostUtilization",
    "workerCoreRatio",
    "otherThreadsCoreRatio",
    "degradedSinceMs",
    "issuedAtMs",
    "expiresAtMs",
    "lastSeenAt",
    "sinceMs",
    "mtimeMs",
    "mtime",
    "generatedAt",
    "runtimeMs",
    "connectLatencyMs",
    "age",
];

/// Keys whose whole value is a live measurement of the gateway process
/// (event-loop delay and CPU shares, sampled when asked) or of the work in
/// flight gateway-wide at that instant: `status`'s `shutdownBudget`
/// counts every other connection's request still running
/// (`getActiveGatewayRootWorkCount({ excludeCurrent: true })`), and a
/// differential run asks both sides at once, so each may count the other.
const MEASURED_KEYS: &[&str] = &["eventLoop", "processMemory", "activeWork", "writeCustody"];

/// `(parent, key)` pairs minted per run where the key alone is too common
/// a name: a transcript's storage id.
const MINTED_CHILDREN: &[(&str, &str)] = &[("transcriptPosition", "source")];

/// Keys whose values are identifiers minted per connection, process or run.
const MINTED_KEYS: &[&str] = &[
    "connId",
    "bootId",
    "sessionId",
    "itemId",
    "instanceId",
    "nonce",
    // Positions in a growing log / transcript (byte offsets, opaque tokens).
    "cursor",
    "deltaCursor",
];

impl Normalizer {
    pub fn normalize(&self, v: &Value) -> Value {
        self.walk(v, None, None)
    }

    fn walk(&self, v: &Value, parent: Option<&str>, key: Option<&str>) -> Value {
        if let (Some(p), Some(k)) = (parent, key) {
            if MINTED_CHILDREN.contains(&(p, k)) && !v.is_object() && !v.is_array() {
                return json!(format!("<{p}.{k}>"));
            }
        }
        if let Some(k) = key {
            if CLOCK_KEYS.contains(&k) && !v.is_null() && !v.is_object() && !v.is_array() {
                return json!(format!("<{k}>"));
            }
            if MEASURED_KEYS.contains(&k) {
                return json!(format!("<{k}>"));
            }
            if MINTED_KEYS.contains(&k) && !v.is_null() && !v.is_object() && !v.is_array() {
                return json!(format!("<{k}>"));
            }
        }
        match v {
            Value::Object(m) => {
                let mut out = Map::new();
                for (k, v) in m {
                    out.insert(self.string(k), self.walk(v, key, Some(k)));
                }
                Value::Object(out)
            }
            Value::Array(a) => Value::Array(a.iter().map(|v| self.walk(v, key, None)).collect()),
            Value::String(s) => Value::String(self.string(s)),
            Value::Number(n) => match n.as_u64() {
                // An epoch-ms clock value under a key not listed above.
                Some(ms) if (1_700_000_000_000..2_100_000_000_000).contains(&ms) => {
                    json!("<epoch-ms>")
                }
                _ => v.clone(),
            },
            _ => v.clone(),
        }
    }

    fn string(&self, s: &str) -> String {
        let mut s = s.to_owned();
        for (from, to) in &self.literals {
            if !from.is_empty() && s.contains(from.as_str()) {
                s = s.replace(from.as_str(), to);
            }
        }
        mask_iso_times(&mask_capability(&mask_uuids(&s)))
    }
}

/// An ISO-8601 UTC time (`2026-11-23T10:49:53.793Z`) is a clock reading.
pub fn mask_iso_times(s: &str) -> String {
    let b = s.as_bytes();
    let shape = |i: usize| -> Option<usize> {
        let d = |j: usize| b.get(i + j).is_some_and(u8::is_ascii_digit);
        let c = |j: usize, ch: u8| b.get(i + j) == Some(&ch);
        let head = (0..4).all(d)
            && c(4, b'-')
            && d(5)
            && d(6)
            && c(7, b'-')
            && d(8)
            && d(9)
            && c(10, b'T')
            && d(11)
            && d(12)
            && c(13, b':')
            && d(14)
            && d(15)
            && c(16, b':')
            && d(17)
            && d(18);
        if !head {
            return None;
        }
        let mut end = 19;
        if c(end, b'.') {
            end += 1;
            while d(end) {
                end += 1;
            }
        }
        c(end, b'Z').then_some(end + 1)
    };
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if let Some(len) = shape(i) {
            out.push_str("<iso-time>");
            i += len;
        } else {
            let ch = s[i..].chars().next().expect("in bounds");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// The capability in a plugin-surface URL (`…/__openclaw__/cap/<token>`) is
/// minted per connection.
pub fn mask_capability(s: &str) -> String {
    const MARK: &str = "/__openclaw__/cap/";
    match s.find(MARK) {
        Some(i) => {
            let start = i + MARK.len();
            let end = s[start..].find('/').map_or(s.len(), |e| start + e);
            format!("{}<capability>{}", &s[..start], &s[end..])
        }
        None => s.to_owned(),
    }
}

/// Every UUID (8-4-4-4-12 hex) in `s` becomes `<uuid>`: minted per run.
pub fn mask_uuids(s: &str) -> String {
    let b = s.as_bytes();
    if b.len() < 36 {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if i + 36 <= b.len() && is_uuid(&b[i..i + 36]) {
            out.push_str("<uuid>");
            i += 36;
        } else {
            let ch = s[i..].chars().next().expect("in bounds");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_uuid(b: &[u8]) -> bool {
    b.iter().enumerate().all(|(i, c)| match i {
        8 | 13 | 18 | 23 => *c == b'-',
        _ => c.is_ascii_hexdigit(),
    })
}

/// One intended difference: a row of the README table "Differences from a
/// direct connection", and the JSON places it covers (`/`-separated paths
/// inside a frame, `*` matching any one segment), compared on neither side.
pub struct Allowed {
    /// The README row (its first cell, verbatim).
    pub row: &'static str,
    /// Which frames: a step label prefix ("" = every step).
    pub step: &'static str,
    pub paths: &'static [&'static str],
}

/// Removes the allowed paths from a frame; returns whether any was there.
pub fn strip(v: &mut Value, path: &str) -> bool {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    strip_segs(v, &segs)
}

fn strip_segs(v: &mut Value, segs: &[&str]) -> bool {
    let Some((first, rest)) = segs.split_first() else {
        return false;
    };
    if rest.is_empty() {
        return match v {
            Value::Object(m) if *first == "*" => {
                let had = !m.is_empty();
                m.clear();
                had
            }
            Value::Object(m) => m.remove(*first).is_some(),
            _ => false,
        };
    }
    match v {
        Value::Object(m) if *first == "*" => {
            m.values_mut().fold(false, |a, c| strip_segs(c, rest) | a)
        }
        Value::Object(m) => m.get_mut(*first).is_some_and(|c| strip_segs(c, rest)),
        Value::Array(a) if *first == "*" => {
            a.iter_mut().fold(false, |acc, c| strip_segs(c, rest) | acc)
        }
        _ => false,
    }
}

/// A labelled transcript: every step's frames, normalised.
pub type Transcript = BTreeMap<String, Vec<Value>>;

/// The differences between two transcripts, step by step: responses and
/// closes in order, events as a multiset (two subscriptions' events
/// interleave differently from run to run).
pub fn diff(direct: &Transcript, broker: &Transcript) -> Vec<String> {
    let mut out = Vec::new();
    let steps: std::collections::BTreeSet<&String> = direct.keys().chain(broker.keys()).collect();
    let mut phases: BTreeMap<String, (Vec<String>, Vec<String>)> = BTreeMap::new();
    for step in steps {
        let empty = Vec::new();
        let d = direct.get(step).unwrap_or(&empty);
        let b = broker.get(step).unwrap_or(&empty);
        let (d_res, d_ev) = split(d);
        let (b_res, b_ev) = split(b);
        if d_res != b_res {
            for p in differing_paths(&json!(d_res), &json!(b_res), "") {
                out.push(format!("{step}: response {p}"));
            }
        }
        let phase = phases.entry(step.chars().take(1).collect()).or_default();
        phase.0.extend(d_ev.iter().map(|v| v.to_string()));
        phase.1.extend(b_ev.iter().map(|v| v.to_string()));
    }
    for (phase, (mut d_ev, mut b_ev)) in phases {
        let step = format!("phase {phase}");
        d_ev.sort();
        b_ev.sort();
        if d_ev != b_ev {
            let only_d: Vec<&String> = d_ev.iter().filter(|e| !b_ev.contains(e)).collect();
            let only_b: Vec<&String> = b_ev.iter().filter(|e| !d_ev.contains(e)).collect();
            out.push(format!(
                "{step}: events differ ({} direct, {} broker)\n  direct only: {}\n  broker only: {}",
                d_ev.len(),
                b_ev.len(),
                cut(&format!("{only_d:?}"), 3000),
                cut(&format!("{only_b:?}"), 3000)
            ));
        }
    }
    out
}

/// The JSON paths where `a` and `b` differ, with both values (cut short).
pub fn differing_paths(a: &Value, b: &Value, at: &str) -> Vec<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter()
                .flat_map(|k| {
                    differing_paths(
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                        &format!("{at}/{k}"),
                    )
                })
                .collect()
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .flat_map(|(i, (p, q))| differing_paths(p, q, &format!("{at}/{i}")))
            .collect(),
        _ if a == b => Vec::new(),
        _ => vec![format!(
            "{at}: direct {} / broker {}",
            cut(&a.to_string(), 300),
            cut(&b.to_string(), 300)
        )],
    }
}

fn split(frames: &[Value]) -> (Vec<Value>, Vec<Value>) {
    frames.iter().cloned().partition(|v| v["type"] != "event")
}

fn cut(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_owned();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// A test-only TCP relay: `127.0.0.1:<port>` → the broker's unix socket
/// (the `openclaw` CLI accepts only `ws:`/`wss:` URLs). Stops when dropped.
pub struct Relay {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub async fn start(socket: &Path) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("relay binds");
        let port = listener.local_addr().unwrap().port();
        let socket = socket.to_owned();
        let task = tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let socket = socket.clone();
                tokio::spawn(async move {
                    if let Ok(mut unix) = tokio::net::UnixStream::connect(&socket).await {
                        let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                    }
                });
            }
        });
        Relay { port, task }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_only_volatile_values() {
        let n = Normalizer {
            literals: vec![("diff-direct".into(), "<tag>".into())],
        };
        let v = json!({"ts": 1795430309497u64, "runId": "diff-direct-1", "ok": true,
            "id": "0f8fad5b-d9cb-469f-a165-70867728950e", "count": 3,
            "nested": [{"connId": "x", "at": 1795430309497u64}]});
        assert_eq!(
            n.normalize(&v),
            json!({"ts": "<ts>", "runId": "<tag>-1", "ok": true, "id": "<uuid>", "count": 3,
                "nested": [{"connId": "<connId>", "at": "<epoch-ms>"}]})
        );
        let mut f = json!({"payload": {"auth": {"a": 1, "b": 2}, "x": [{"y": 1, "z": 2}]}});
        assert!(strip(&mut f, "payload/auth/a"));
        assert!(strip(&mut f, "payload/x/*/z"));
        assert!(!strip(&mut f, "payload/none"));
        assert_eq!(f, json!({"payload": {"auth": {"b": 2}, "x": [{"y": 1}]}}));
        // Work in flight gateway-wide is a reading, not a difference: the
        // direct side may count the broker's concurrent call (CI once did).
        let status = |root: u64| {
            json!({"shutdownBudget": {"activeWork": {"rootRequests": root, "cronRuns": 0},
                "writeCustody": [], "graceMs": 5000}})
        };
        assert_eq!(n.normalize(&status(1)), n.normalize(&status(0)));
        assert_eq!(n.normalize(&status(0))["shutdownBudget"]["graceMs"], 5000);
    }
}
