//! A mock model provider: an OpenAI-compatible HTTP server on loopback, so a
//! real OpenClaw Gateway can run model turns without a network.
//!
//! It answers `GET /v1/models` and `POST /v1/chat/completions` (a whole
//! `chat.completion`, or `text/event-stream` chunks ending in `data: [DONE]`
//! when the request says `stream:true`). Its answers are deterministic, so two
//! runs of the same scenario produce the same transcript:
//!
//! - the last message (but for the context a gateway appends as user
//!   messages) is the k-th tool result of this turn → the call
//!   `ProviderConfig::then_tools[k-1]` while there is one (and it is
//!   offered), else [`ProviderConfig::after_tool_reply`];
//! - a user message of this turn (after the last assistant message) contains
//!   [`ProviderConfig::tool_trigger`] and the
//!   request offers the tool [`ProviderConfig::tool_name`] (else the first
//!   tool offered) → one tool call with [`ProviderConfig::tool_arguments`];
//! - anything else → [`ProviderConfig::reply`].
//!
//! Point a gateway at it with [`MockProvider::gateway_provider`] under
//! `models.providers.<name>` and `agents.defaults.model.primary =
//! "<name>/<model>"` (see `shared/peers/README.md`).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use clawmux_mock::provider::{MockProvider, ProviderConfig};
//! let p = MockProvider::start(ProviderConfig::default()).await?;
//! println!("baseUrl {}", p.base_url());
//! # Ok(()) }
//! ```

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Largest request body read (a gateway's prompt with its tool schemas is a
/// few hundred KiB); a bigger one is answered `413` and not parsed.
pub const MAX_REQUEST_BYTES: usize = 8 << 20;

/// Requests kept for [`MockProvider::requests`]; older ones are dropped
/// first, so a long run cannot grow memory without bound.
pub const MAX_RECORDED_REQUESTS: usize = 256;

/// What the provider says; `Default` is the scripted behaviour described in
/// the module docs.
#[derive(Clone, Debug)]
pub struct ProviderConfig {
    /// The one model listed and accepted (`id` in `/v1/models`).
    pub model: String,
    /// The answer to an ordinary prompt.
    pub reply: String,
    /// A user message containing this asks for a tool call.
    pub tool_trigger: String,
    /// The tool to call when the request offers it (else the first offered).
    pub tool_name: Option<String>,
    /// The call's `arguments` (a JSON object).
    pub tool_arguments: Value,
    /// Further calls, one per step: after the k-th tool result of a turn
    /// the model calls `then_tools[k-1]` (name, arguments), so one run can
    /// use several tools in turn (a tool not offered ends the chain).
    pub then_tools: Vec<(String, Value)>,
    /// The answer once the last tool result came back.
    pub after_tool_reply: String,
    /// Stream text in pieces of at most this many characters.
    pub chunk_chars: usize,
}

impl Default for ProviderConfig {
    fn default() -> Self {
        ProviderConfig {
            model: "echo".into(),
            reply: "Hello from the mock provider.".into(),
            tool_trigger: "[[use-a-tool]]".into(),
            tool_name: None,
            tool_arguments: json!({}),
            then_tools: Vec::new(),
            after_tool_reply: "The tool answered; done.".into(),
            chunk_chars: 8,
        }
    }
}

/// What one completion says.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    Text(String),
    ToolCall {
        id: String,
        name: String,
        arguments: String,
    },
}

/// The scripted answer to a `chat/completions` request body (pure).
pub fn reply_for(cfg: &ProviderConfig, request: &Value) -> Reply {
    let messages = request["messages"].as_array().cloned().unwrap_or_default();
    let offered: Vec<&str> = request["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default();
    // A real gateway appends context as user messages after a tool result:
    // the model answers a tool result when the last message other than
    // those is one, and no user message since asks for a tool again.
    let asked_again = messages
        .iter()
        .rev()
        .take_while(|m| m["role"] == "user")
        .any(|m| text_of(&m["content"]).contains(&cfg.tool_trigger));
    let after_result = messages
        .iter()
        .rev()
        .find(|m| m["role"] != "user")
        .is_some_and(|m| m["role"] == "tool");
    if after_result && !asked_again {
        // Tool results since this turn's last text answer: the step the
        // chain is at.
        let done = messages
            .iter()
            .rev()
            .take_while(|m| !(m["role"] == "assistant" && m["tool_calls"].is_null()))
            .filter(|m| m["role"] == "tool")
            .count();
        return match cfg.then_tools.get(done.saturating_sub(1)) {
            Some((name, args)) if offered.contains(&name.as_str()) => Reply::ToolCall {
                id: format!("call_mock_{}", messages.len()),
                name: name.clone(),
                arguments: args.to_string(),
            },
            _ => Reply::Text(cfg.after_tool_reply.clone()),
        };
    }
    // This turn's user messages: those after the last assistant message (a
    // gateway may append context messages after the prompt itself).
    let asked = messages
        .iter()
        .rev()
        .take_while(|m| m["role"] != "assistant")
        .any(|m| m["role"] == "user" && text_of(&m["content"]).contains(&cfg.tool_trigger));
    let tool = match &cfg.tool_name {
        Some(name) if offered.contains(&name.as_str()) => Some(name.as_str()),
        _ => offered.first().copied(),
    };
    match (asked, tool) {
        (true, Some(name)) => Reply::ToolCall {
            // Deterministic: the same scenario gives the same id.
            id: format!("call_mock_{}", messages.len()),
            name: name.to_owned(),
            arguments: cfg.tool_arguments.to_string(),
        },
        _ => Reply::Text(cfg.reply.clone()),
    }
}

/// A message `content`: a string, or an array of `{type:"text", text}` parts.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A running provider; dropping it stops the server.
pub struct MockProvider {
    addr: SocketAddr,
    cfg: ProviderConfig,
    requests: Arc<Mutex<Vec<Value>>>,
    task: JoinHandle<()>,
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MockProvider {
    /// Listens on `127.0.0.1:<free port>`.
    pub async fn start(cfg: ProviderConfig) -> io::Result<MockProvider> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let requests = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(cfg.clone());
        let recorded = Arc::clone(&requests);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let cfg = Arc::clone(&shared);
                let recorded = Arc::clone(&recorded);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        serve(Arc::clone(&cfg), Arc::clone(&recorded), req)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(MockProvider {
            addr,
            cfg,
            requests,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT/v1`, the provider's `baseUrl`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The `chat/completions` request bodies received, oldest first (at most
    /// [`MAX_RECORDED_REQUESTS`]).
    pub fn requests(&self) -> Vec<Value> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The block for the gateway's `models.providers.<name>`.
    pub fn gateway_provider(&self) -> Value {
        json!({
            "baseUrl": self.base_url(),
            "apiKey": "mock-key",
            "api": "openai-completions",
            "models": [{
                "id": self.cfg.model, "name": "Mock echo", "reasoning": false, "input": ["text"],
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                "contextWindow": 128000, "maxTokens": 4096
            }]
        })
    }
}

type Body = Full<Bytes>;

async fn serve(
    cfg: Arc<ProviderConfig>,
    recorded: Arc<Mutex<Vec<Value>>>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    Ok(match (req.method().clone(), path.as_str()) {
        (Method::GET, "/v1/models") => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [
                {"id": cfg.model, "object": "model", "created": 0, "owned_by": "clawmux-mock"}
            ]}),
        ),
        (Method::POST, "/v1/chat/completions") => {
            let body = match Limited::new(req.into_body(), MAX_REQUEST_BYTES)
                .collect()
                .await
            {
                Ok(b) => b.to_bytes(),
                Err(_) => return Ok(error(StatusCode::PAYLOAD_TOO_LARGE, "request too large")),
            };
            let Ok(request) = serde_json::from_slice::<Value>(&body) else {
                return Ok(error(StatusCode::BAD_REQUEST, "body is not JSON"));
            };
            if let Ok(mut r) = recorded.lock() {
                if r.len() >= MAX_RECORDED_REQUESTS {
                    r.remove(0);
                }
                r.push(request.clone());
            }
            let reply = reply_for(&cfg, &request);
            if request["stream"] == true {
                sse_response(&cfg, &reply)
            } else {
                json_response(StatusCode::OK, &completion(&cfg, &reply))
            }
        }
        _ => error(StatusCode::NOT_FOUND, "no such route"),
    })
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())))
        .expect("static response parts are valid")
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": "invalid_request_error"}}),
    )
}

const USAGE: fn() -> Value =
    || json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15});

/// A whole (non-streamed) `chat.completion`.
fn completion(cfg: &ProviderConfig, reply: &Reply) -> Value {
    let (message, finish) = match reply {
        Reply::Text(text) => (json!({"role": "assistant", "content": text}), "stop"),
        Reply::ToolCall {
            id,
            name,
            arguments,
        } => (
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ]}),
            "tool_calls",
        ),
    };
    json!({
        "id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": cfg.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": USAGE(),
    })
}

/// The reply as `chat.completion.chunk` server-sent events.
fn sse_response(cfg: &ProviderConfig, reply: &Reply) -> Response<Body> {
    let chunk = |delta: Value, finish: Value| {
        json!({
            "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0,
            "model": cfg.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    let finish = match reply {
        Reply::Text(text) => {
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(cfg.chunk_chars.max(1)) {
                let piece: String = piece.iter().collect();
                events.push(chunk(json!({"content": piece}), Value::Null));
            }
            "stop"
        }
        Reply::ToolCall {
            id,
            name,
            arguments,
        } => {
            events.push(chunk(
                json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}]}),
                Value::Null,
            ));
            "tool_calls"
        }
    };
    let mut last = chunk(json!({}), json!(finish));
    last["usage"] = USAGE();
    events.push(last);
    let mut body = String::new();
    for e in events {
        body.push_str(&format!("data: {e}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    const WAIT: std::time::Duration = std::time::Duration::from_secs(5);

    /// One HTTP/1.1 exchange with `Connection: close`: (status, body).
    async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(WAIT, s.read_to_string(&mut out))
            .await
            .expect("answer in time")
            .unwrap();
        let status = out[9..12].parse().unwrap();
        let body = out.split_once("\r\n\r\n").unwrap().1.to_owned();
        (status, body)
    }

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "read", "parameters": {}}},
               {"type": "function", "function": {"name": "session_status", "parameters": {}}}])
    }

    #[test]
    fn scripted_replies() {
        let mut cfg = ProviderConfig::default();
        let plain = json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools()});
        assert_eq!(reply_for(&cfg, &plain), Reply::Text(cfg.reply.clone()));
        let ask = json!({"messages": [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "please [[use-a-tool]] now"}]},
            {"role": "user", "content": "context the gateway appends"}],
            "tools": tools()});
        let Reply::ToolCall { name, id, .. } = reply_for(&cfg, &ask) else {
            panic!("a tool call")
        };
        assert_eq!((name.as_str(), id.as_str()), ("read", "call_mock_3"));
        cfg.tool_name = Some("session_status".into());
        assert!(
            matches!(reply_for(&cfg, &ask), Reply::ToolCall { name, .. } if name == "session_status")
        );
        cfg.tool_name = Some("not-offered".into());
        assert!(matches!(reply_for(&cfg, &ask), Reply::ToolCall { name, .. } if name == "read"));
        // An earlier turn's trigger does not ask again.
        let earlier = json!({"messages": [{"role": "user", "content": "[[use-a-tool]]"},
            {"role": "assistant", "content": "done"}, {"role": "user", "content": "hi"}],
            "tools": tools()});
        assert_eq!(reply_for(&cfg, &earlier), Reply::Text(cfg.reply.clone()));
        // No tools offered: a text answer, never a call to a missing tool.
        let bare = json!({"messages": [{"role": "user", "content": "[[use-a-tool]]"}]});
        assert_eq!(reply_for(&cfg, &bare), Reply::Text(cfg.reply.clone()));
        let after = json!({"messages": [{"role": "user", "content": "[[use-a-tool]]"},
            {"role": "assistant", "tool_calls": []}, {"role": "tool", "content": "42"}],
            "tools": tools()});
        assert_eq!(
            reply_for(&cfg, &after),
            Reply::Text(cfg.after_tool_reply.clone())
        );
        // A chain: after the first result the next tool, after the last the answer.
        cfg.then_tools = vec![("session_status".into(), json!({"x": 1}))];
        let Reply::ToolCall {
            name, arguments, ..
        } = reply_for(&cfg, &after)
        else {
            panic!("the chain's next call")
        };
        assert_eq!(
            (name.as_str(), arguments.as_str()),
            ("session_status", "{\"x\":1}")
        );
        let twice = json!({"messages": [{"role": "user", "content": "[[use-a-tool]]"},
            {"role": "assistant", "tool_calls": []}, {"role": "tool", "content": "42"},
            {"role": "assistant", "tool_calls": []}, {"role": "tool", "content": "43"}],
            "tools": tools()});
        assert_eq!(
            reply_for(&cfg, &twice),
            Reply::Text(cfg.after_tool_reply.clone())
        );
        // The context a real gateway appends after a tool result.
        let mut with_context = after.clone();
        with_context["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "user", "content": [{"type": "text", "text": "context"}]}));
        assert!(
            matches!(reply_for(&cfg, &with_context), Reply::ToolCall { name, .. } if name == "session_status")
        );
        cfg.then_tools = vec![("not-offered".into(), json!({}))];
        assert_eq!(reply_for(&cfg, &after), Reply::Text(cfg.after_tool_reply));
    }

    #[tokio::test]
    async fn serves_models_and_completions() {
        let p = MockProvider::start(ProviderConfig::default())
            .await
            .unwrap();
        assert!(p.base_url().starts_with("http://127.0.0.1:"));
        assert_eq!(p.gateway_provider()["models"][0]["id"], "echo");

        let (status, body) = http(p.addr(), "GET", "/v1/models", "").await;
        assert_eq!(status, 200);
        let models: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(models["data"][0]["id"], "echo");

        let req = json!({"model": "echo", "messages": [{"role": "user", "content": "hi"}]});
        let (status, body) = http(p.addr(), "POST", "/v1/chat/completions", &req.to_string()).await;
        assert_eq!(status, 200);
        let done: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            done["choices"][0]["message"]["content"],
            "Hello from the mock provider."
        );
        assert_eq!(p.requests().len(), 1);

        // Streamed: chunks that add up to the reply, then [DONE].
        let req = json!({"model": "echo", "stream": true,
            "messages": [{"role": "user", "content": "hi"}]});
        let (_, body) = http(p.addr(), "POST", "/v1/chat/completions", &req.to_string()).await;
        let datas: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(datas.last(), Some(&"[DONE]"));
        let chunks: Vec<Value> = datas[..datas.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "Hello from the mock provider.");
        assert!(chunks.len() > 3, "streamed in pieces: {body}");
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "stop"
        );

        // Streamed tool call.
        let req = json!({"model": "echo", "stream": true, "tools": tools(),
            "messages": [{"role": "user", "content": "[[use-a-tool]]"}]});
        let (_, body) = http(p.addr(), "POST", "/v1/chat/completions", &req.to_string()).await;
        assert!(body.contains(r#""name":"read""#), "{body}");
        assert!(body.contains(r#""finish_reason":"tool_calls""#), "{body}");
    }

    #[tokio::test]
    async fn bad_requests_get_clear_errors() {
        let p = MockProvider::start(ProviderConfig::default())
            .await
            .unwrap();
        let (status, body) = http(p.addr(), "POST", "/v1/chat/completions", "not json").await;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("body is not JSON"));
        let (status, _) = http(p.addr(), "GET", "/v1/nothing", "").await;
        assert_eq!(status, 404);
        assert!(p.requests().is_empty(), "nothing unparseable is recorded");
    }
}
