//! A minimal HTTP/1.1 client for the broker's unix socket: one connection
//! per request (the commands make one or two), hyper's client connection
//! over a `tokio::net::UnixStream`.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

use super::CliError;

/// How long opening the socket and the HTTP handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The broker at a socket path.
#[derive(Debug, Clone)]
pub struct BrokerClient {
    socket: PathBuf,
}

impl BrokerClient {
    pub fn new(socket: PathBuf) -> Self {
        BrokerClient { socket }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn unreachable(&self, cause: impl Into<String>) -> CliError {
        CliError::Unreachable {
            socket: self.socket.display().to_string(),
            cause: cause.into(),
        }
    }

    /// Sends one request; the response body is left to the caller to read
    /// (whole, or as a stream for `/v1/events`).
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &[(&str, String)],
        body: Option<Bytes>,
    ) -> Result<Response<Incoming>, CliError> {
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(&self.socket))
            .await
        {
            Err(_) => return Err(self.unreachable("timed out connecting")),
            Ok(Err(e)) => {
                return Err(self.unreachable(match e.kind() {
                    ErrorKind::NotFound => "no socket there (is the broker running?)".to_owned(),
                    ErrorKind::ConnectionRefused => {
                        "nothing is listening (a stale socket?)".to_owned()
                    }
                    ErrorKind::PermissionDenied => "permission denied".to_owned(),
                    _ => e.to_string(),
                }))
            }
            Ok(Ok(stream)) => stream,
        };
        let (mut sender, conn) = tokio::time::timeout(
            CONNECT_TIMEOUT,
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream)),
        )
        .await
        .map_err(|_| self.unreachable("timed out in the HTTP handshake"))?
        .map_err(|e| self.unreachable(e.to_string()))?;
        tokio::spawn(async move {
            // Ends when the response (or its stream) is done or dropped.
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path_and_query)
            .header(header::HOST, "localhost");
        for (name, value) in headers {
            req = req.header(*name, value);
        }
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| CliError::Usage(format!("cannot build the request: {e}")))?;
        sender.send_request(req).await.map_err(|e| {
            // The broker drops connections from other users before answering.
            self.unreachable(format!(
                "the connection closed without an answer ({e}); is this another user's socket?"
            ))
        })
    }

    /// A request whose answer is one JSON document: (status, document).
    pub async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Value), CliError> {
        let body = body.map(|b| Bytes::from(b.to_string()));
        let resp = self.send(method, path, &[], body).await?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| CliError::Answer(format!("the broker's answer was cut off: {e}")))?
            .to_bytes();
        let value = serde_json::from_slice(&bytes).map_err(|e| {
            CliError::Answer(format!(
                "the broker answered {status} with something that is not JSON ({e})"
            ))
        })?;
        Ok((status, value))
    }
}
