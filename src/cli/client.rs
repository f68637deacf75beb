//! A minimal HTTP/1.1 client for the broker's unix socket: one connection
//! per request (the commands make one or two), hyper's client connection
//! over a `tokio::net::UnixStream`.
//!
//! Why not `hyperlocal` (the usual crate for this): before sending a byte,
//! the CLI checks on the very connection it will use that the process
//! serving the socket runs as this user (`SO_PEERCRED`, see
//! [`BrokerClient::check_it_is_ours`]). hyperlocal's `UnixConnector` keeps
//! its `UnixStream` private and hyper-util's pooled client never hands it
//! out, so that check would need a second connection (a window for another
//! process to take the path in between) or a connector of our own, which is
//! what the few lines of `send` are. No pool is needed for one or two
//! requests.

use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
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

/// Attempts at connecting when the socket refuses (`ECONNREFUSED`: nobody
/// listens, or a broker is just restarting) or its backlog is full
/// (`EAGAIN`: a burst of clients is connecting): the first, then retries
/// after [`CONNECT_RETRY_FIRST`], doubled each time. All of them together
/// wait about 0.3 s, so a broker that is really gone is reported promptly.
const CONNECT_ATTEMPTS: u32 = 7;
/// The pause before the first retry.
const CONNECT_RETRY_FIRST: Duration = Duration::from_millis(5);

/// Connects with `connect`, retrying a refused or would-block connect
/// ([`CONNECT_ATTEMPTS`]); the last error, and how many attempts were made.
async fn connect_retrying<T, F, Fut>(mut connect: F) -> (std::io::Result<T>, u32)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::io::Result<T>>,
{
    let mut pause = CONNECT_RETRY_FIRST;
    let mut attempt = 1;
    loop {
        match connect().await {
            Err(e)
                if attempt < CONNECT_ATTEMPTS
                    && matches!(
                        e.kind(),
                        ErrorKind::ConnectionRefused | ErrorKind::WouldBlock
                    ) =>
            {
                tokio::time::sleep(pause).await;
                pause *= 2;
                attempt += 1;
            }
            result => return (result, attempt),
        }
    }
}

/// How long `attempts` connects waited between them, in milliseconds.
fn retried_ms(attempts: u32) -> u128 {
    (1..attempts)
        .map(|n| CONNECT_RETRY_FIRST.as_millis() << (n - 1))
        .sum()
}

/// Whether `uid` (the owner of `what`) is this user.
fn ensure_ours(what: &str, uid: u32, me: u32) -> Result<(), String> {
    if uid == me {
        Ok(())
    } else {
        Err(format!(
            "{what} belongs to uid {uid}, not to you (uid {me})"
        ))
    }
}

/// The broker at a socket path.
#[derive(Debug, Clone)]
pub struct BrokerClient {
    socket: PathBuf,
    /// How the path was chosen, said when nothing answers there.
    origin: Option<String>,
}

impl BrokerClient {
    pub fn new(socket: PathBuf) -> Self {
        BrokerClient {
            socket,
            origin: None,
        }
    }

    /// Says how the socket path was chosen (`--socket`, config.toml, the
    /// default with or without `XDG_RUNTIME_DIR`) when nothing answers.
    pub fn with_origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = Some(origin.into());
        self
    }

    /// Nothing answers at the socket: `what` happened; what to do next
    /// names any clawmux socket of this user listening elsewhere (a broker
    /// started with another `XDG_RUNTIME_DIR` or `--socket`).
    fn not_there(&self, what: &str) -> CliError {
        let elsewhere = listening_clawmux_sockets(&self.socket);
        let Some(other) = elsewhere.first() else {
            return self.unreachable(what);
        };
        let dir = other.parent().unwrap_or(Path::new("/"));
        let hint = if other.file_name() == Some(std::ffi::OsStr::new("clawmux.sock")) {
            format!(
                "\n(or `export XDG_RUNTIME_DIR={}` if the broker was started with that)",
                dir.display()
            )
        } else {
            String::new()
        };
        let more = match elsewhere.len() - 1 {
            0 => String::new(),
            n => format!(" ({n} more listening elsewhere)"),
        };
        let mut err = self.unreachable(what);
        if let CliError::Unreachable { next, .. } = &mut err {
            *next = format!(
                "A clawmux socket of yours is listening at {}{more}: use `--socket {}`{hint}.",
                other.display(),
                other.display()
            );
        }
        err
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn unreachable(&self, cause: impl Into<String>) -> CliError {
        let socket = match &self.origin {
            Some(origin) => format!("{} ({origin})", self.socket.display()),
            None => self.socket.display().to_string(),
        };
        CliError::Unreachable {
            socket,
            cause: cause.into(),
            next: super::START_THE_BROKER.to_owned(),
        }
    }

    /// Refuses to send anything to a socket that is not this user's broker:
    /// the socket file and the process serving it (its uid from the kernel,
    /// `SO_PEERCRED`) must both be ours. Another user who got to the socket
    /// path first (e.g. `<tmp>/clawmux-<uid>`) would otherwise receive our
    /// requests, and answer them.
    fn check_it_is_ours(&self, stream: &UnixStream) -> Result<(), CliError> {
        let me = rustix::process::getuid().as_raw();
        let not_ours = |why: String| CliError::NotOurs {
            socket: self.socket.display().to_string(),
            why,
        };
        let file = std::fs::metadata(&self.socket)
            .map_err(|e| self.unreachable(format!("cannot inspect the socket: {e}")))?;
        ensure_ours("the socket file", file.uid(), me).map_err(not_ours)?;
        let peer = stream
            .peer_cred()
            .map_err(|e| not_ours(format!("cannot read who serves it ({e})")))?;
        ensure_ours("the process serving it", peer.uid(), me).map_err(not_ours)
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
        let connect = connect_retrying(|| UnixStream::connect(&self.socket));
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Err(_) => return Err(self.unreachable("timed out connecting")),
            Ok((Err(e), attempts)) => {
                let tried = format!("{attempts} attempts over {} ms", retried_ms(attempts));
                return Err(match e.kind() {
                    ErrorKind::NotFound => self.not_there("no socket there"),
                    ErrorKind::ConnectionRefused => {
                        self.not_there(&format!("nothing is listening (a stale socket?); {tried}"))
                    }
                    ErrorKind::WouldBlock => self.unreachable(format!(
                        "the broker is not accepting connections fast enough (its backlog is full); {tried}"
                    )),
                    ErrorKind::PermissionDenied => self.unreachable("permission denied"),
                    _ => self.unreachable(e.to_string()),
                });
            }
            Ok((Ok(stream), _)) => stream,
        };
        self.check_it_is_ours(&stream)?;
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
                "the connection closed without an answer ({e}): is this another user's socket?"
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
        self.json_with(method, path, &[], body).await
    }

    /// [`Self::json`] with extra request headers.
    pub async fn json_with(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, String)],
        body: Option<&Value>,
    ) -> Result<(StatusCode, Value), CliError> {
        let body = body.map(|b| Bytes::from(b.to_string()));
        let resp = self.send(method, path, headers, body).await?;
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

/// A `clawmux serve --demo` serving on `socket`, if one does: its pid, its
/// upstream phase and the double's version. Known by the command line of
/// the process `/v1/state` names (`/proc/PID/cmdline`, a process of this
/// user: the client checked the socket is ours), so the broker needs no
/// extra field. `None` when nothing (or a broker that is not a demo) answers.
pub async fn running_demo(socket: &Path) -> Option<Value> {
    if !socket.exists() {
        return None;
    }
    let client = BrokerClient::new(socket.to_owned());
    let (status, state) =
        tokio::time::timeout(CONNECT_TIMEOUT, client.json(Method::GET, "/v1/state", None))
            .await
            .ok()?
            .ok()?;
    if status != StatusCode::OK {
        return None;
    }
    let pid = state["broker"]["pid"].as_u64()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let demo = cmdline.split(|b| *b == 0).any(|arg| arg == b"--demo");
    demo.then(|| {
        serde_json::json!({
            "pid": pid,
            "socket": socket.display().to_string(),
            "phase": state["upstream"]["phase"],
            "server_version": state["upstream"]["server_version"],
        })
    })
}

/// The listening unix sockets named `clawmux*.sock` whose file is this
/// user's, other than `except`, from the kernel's table (`/proc/net/unix`:
/// flag `00010000` is a listening socket; the path is the last column).
/// The table has the path a socket was bound at: `serve` binds in a private
/// `.clawmux-bind-*` directory beside the socket and renames it into place,
/// so for those the socket's own directory is searched. Nothing is
/// connected to.
fn listening_clawmux_sockets(except: &Path) -> Vec<PathBuf> {
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return Vec::new();
    };
    let me = rustix::process::getuid().as_raw();
    let named = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("clawmux") && n.ends_with(".sock"))
    };
    let mut candidates = Vec::new();
    for line in table.lines().skip(1) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let (Some(flags), Some(path)) = (cols.get(3), cols.get(7)) else {
            continue;
        };
        if *flags != "00010000" {
            continue;
        }
        let path = Path::new(path);
        let bind_dir = path.parent().filter(|d| {
            d.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".clawmux-bind-"))
        });
        match bind_dir.and_then(Path::parent) {
            Some(dir) => {
                if let Ok(entries) = std::fs::read_dir(dir) {
                    candidates.extend(entries.flatten().map(|e| e.path()).filter(|p| named(p)));
                }
            }
            None if named(path) => candidates.push(path.to_owned()),
            None => {}
        }
    }
    let mut found: Vec<PathBuf> = candidates
        .into_iter()
        .filter(|p| p != except)
        .filter(|p| {
            std::fs::symlink_metadata(p).is_ok_and(|m| {
                use std::os::unix::fs::FileTypeExt;
                m.file_type().is_socket() && m.uid() == me
            })
        })
        .collect();
    found.sort();
    found.dedup();
    // Only where a broker of the user's own would listen: the usual runtime
    // dir first, then this user's home, then the default without
    // XDG_RUNTIME_DIR; another program's or a test's temporary socket is
    // not a suggestion.
    let runtime = PathBuf::from(format!("/run/user/{me}"));
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let fallback = std::env::temp_dir().join(format!("clawmux-{me}"));
    let mut ranked: Vec<(u8, PathBuf)> = found
        .into_iter()
        .filter_map(|p| Some((likely_yours(&p, &runtime, home.as_deref(), &fallback)?, p)))
        .collect();
    ranked.sort_by_key(|(rank, _)| *rank);
    ranked.into_iter().map(|(_, p)| p).collect()
}

/// How likely a listening socket is the user's own broker (lower is
/// likelier), or `None` when it is somewhere only another program or a
/// test would put one.
fn likely_yours(p: &Path, runtime: &Path, home: Option<&Path>, fallback: &Path) -> Option<u8> {
    if p.starts_with(runtime) {
        Some(0)
    } else if home.is_some_and(|h| p.starts_with(h)) {
        Some(1)
    } else if p.parent() == Some(fallback) {
        Some(2)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_socket_where_a_users_broker_listens_is_suggested() {
        let rank = |p: &str| {
            likely_yours(
                Path::new(p),
                Path::new("/run/user/1000"),
                Some(Path::new("/home/u")),
                Path::new("/tmp/clawmux-1000"),
            )
        };
        assert_eq!(rank("/run/user/1000/clawmux.sock"), Some(0));
        assert_eq!(rank("/home/u/run/clawmux-ro.sock"), Some(1));
        assert_eq!(rank("/tmp/clawmux-1000/clawmux.sock"), Some(2));
        assert_eq!(rank("/tmp/.tmpAbC123/clawmux.sock"), None, "a test's");
        assert_eq!(rank("/tmp/clawmux-1001/clawmux.sock"), None);
    }

    #[test]
    fn only_my_own_uid_is_trusted() {
        assert!(ensure_ours("the socket file", 1000, 1000).is_ok());
        let err = ensure_ours("the process serving it", 65534, 1000).unwrap_err();
        assert_eq!(
            err,
            "the process serving it belongs to uid 65534, not to you (uid 1000)"
        );
        assert!(
            ensure_ours("the socket file", 0, 1000).is_err(),
            "not even root's"
        );
    }

    /// A connect refused or would-block is tried again, a few times over a
    /// bounded wait (paused time: the pauses are advanced, not waited).
    #[tokio::test(start_paused = true)]
    async fn a_refused_or_full_connect_is_retried_briefly() {
        let started = tokio::time::Instant::now();
        let mut calls = 0;
        let (result, attempts) = connect_retrying(|| {
            calls += 1;
            let kind = if calls % 2 == 0 {
                ErrorKind::WouldBlock
            } else {
                ErrorKind::ConnectionRefused
            };
            async move { Err::<(), _>(std::io::Error::from(kind)) }
        })
        .await;
        assert!(result.is_err());
        assert_eq!((attempts, calls), (CONNECT_ATTEMPTS, CONNECT_ATTEMPTS));
        let waited = started.elapsed().as_millis();
        assert_eq!(waited, retried_ms(CONNECT_ATTEMPTS));
        assert!(waited < 500, "{waited} ms");
        // A connect that succeeds on a retry is used; other errors are not retried.
        let mut calls = 0;
        let (result, attempts) = connect_retrying(|| {
            calls += 1;
            let ok = calls == 3;
            async move {
                if ok {
                    Ok(7)
                } else {
                    Err(std::io::Error::from(ErrorKind::WouldBlock))
                }
            }
        })
        .await;
        assert_eq!((result.unwrap(), attempts), (7, 3));
        let (result, attempts) =
            connect_retrying(|| async { Err::<(), _>(std::io::Error::from(ErrorKind::NotFound)) })
                .await;
        assert_eq!(
            (result.unwrap_err().kind(), attempts),
            (ErrorKind::NotFound, 1)
        );
    }
}
