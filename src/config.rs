//! Settings: where the broker listens, which gateway it talks to, with what
//! credential, and every limit it enforces.
//!
//! Every bound the broker enforces is a named field of [`Limits`] with its
//! default and what happens at the limit written next to it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::protocol::{ErrorShape, StudioCode};

/// The default gateway URL (the gateway's default port on loopback).
pub const DEFAULT_GATEWAY_URL: &str = "ws://localhost:18789";

/// What to do when no token is found anywhere: write clawmux's own token
/// file, privately (the file `serve` and `doctor` read by default).
pub const NO_TOKEN_ADVICE: &str = "no gateway token: write the gateway's token (its gateway.auth.token) to ~/.config/clawmux/gateway-token with `install -d -m 700 ~/.config/clawmux && (umask 077; printf '%s' 'TOKEN' > ~/.config/clawmux/gateway-token)`, or use --token-file or CLAWMUX_GATEWAY_TOKEN; or connect with your own auth";

/// A secret (token or password). It cannot be printed by accident: `Debug`
/// and `Display` show `<redacted>`; only [`Secret::expose`] reveals it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Per-client and broker-wide bounds.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A local client must send its `connect` within this time after the
    /// WebSocket opens, else it is closed `1008 connect timeout`. Default 10 s.
    pub connect_timeout: Duration,
    /// How long a local `connect` waits for the upstream session to become
    /// ready before it is answered with the upstream's last error. Default 10 s.
    pub connect_wait: Duration,
    /// A request without an answer after this long is answered
    /// `studio.request_timeout` (and its late answer discarded). Default 30 s.
    pub request_timeout: Duration,
    /// An `agent` request that was `accepted` waits this long for its final
    /// answer, since runs last longer than ordinary requests. Default 10 min.
    pub run_timeout: Duration,
    /// Largest frame accepted before `connect` (the gateway's pre-auth cap);
    /// larger closes `1009 frame too large`. Default 64 KiB.
    pub preconnect_max_bytes: usize,
    /// Largest frame accepted after `connect`; also advertised as
    /// `policy.maxPayload` (never above the gateway's). Larger closes
    /// `1009 frame too large`. Default 25 MiB.
    pub max_frame_bytes: usize,
    /// Queue bytes above which droppable events (`tick`, `presence`,
    /// `heartbeat`, chat deltas) are dropped for that client, consuming a seq.
    /// Default 1 MiB.
    pub queue_soft_bytes: usize,
    /// Queue bytes a client may fall behind by: a frame that would take its
    /// queue past this closes it `1008 slow consumer`. Default 50 MiB, the
    /// gateway's own `maxBufferedBytes` (and raised to the gateway's
    /// advertised value when that is larger): a client that reads is never
    /// cut off sooner than a direct connection. At least 2 × `max_frame_bytes`,
    /// so a client one maximal frame behind still gets the next one.
    pub queue_hard_bytes: usize,
    /// A client with a backlog whose writer made no progress (wrote no batch
    /// of up to 256 KiB) for this long is closed `1008 slow consumer`: the
    /// measure of a client that does not read. Default 10 s.
    pub slow_grace: Duration,
    /// Queued bytes broker-wide: each event counted once however many queues
    /// share it, plus each client's own frames (and what HUD streams'
    /// projections keep). Over this, clients are closed `1008 slow consumer`
    /// until the total is back under it, the one that has gone longest
    /// without reading first (a reader behind for a moment goes after every
    /// client that stopped reading). At least `queue_hard_bytes`. Default
    /// 256 MiB.
    pub queue_total_bytes: usize,
    /// Connected local clients at most; one more gets `studio.too_many_clients`
    /// and close 1013. Default 1024.
    pub max_clients: usize,
    /// Requests in flight per client at most; one more is answered
    /// `studio.too_many_requests`. Default 256.
    pub max_inflight: usize,
    /// Frames per second a client may send on average; a frame beyond the
    /// rate (after the burst) is answered `studio.too_many_requests` with
    /// `retryAfterMs` and not forwarded. Default 10,000.
    pub request_rate: u32,
    /// Frames a client may send at once above the rate. Default 20,000.
    pub request_burst: u32,
    /// Events the replay log keeps for `/v1/events` resumption; a cursor
    /// older than the oldest kept event gets `410 studio.replay_unavailable`
    /// (the client reloads `/v1/state`). Default 10,000.
    pub replay_max_events: usize,
    /// Encoded bytes the replay log keeps at most (the oldest events are
    /// evicted first, same answer as above). Default 16 MiB.
    pub replay_max_bytes: usize,
    /// Keep the replay log on disk under the state dir (the device
    /// identity's, `replay-<socket hash>.jsonl`), so cursors and history
    /// survive a broker restart. Off, or without a state dir, history ends
    /// at each restart (cursors still never repeat). Default on.
    pub replay_persist: bool,
    /// An idle `/v1/events` stream gets a `: keep-alive` comment this often,
    /// so proxies and client timeouts do not cut it. Default 15 s.
    pub sse_keepalive: Duration,

    // --- The accept path (local connections before any protocol) ---
    /// Local connections (plain HTTP, `/v1/events` streams, WebSockets before
    /// and after `connect`) open at once at most. One more is accepted,
    /// answered `503` with `studio.too_many_clients` and closed at once,
    /// without reading its request. `None` (the default) means
    /// `max_clients` + [`CONNECTION_HEADROOM`]. The broker lowers it further
    /// when the open-file limit cannot hold it (see `local::fdlimit`).
    pub max_connections: Option<usize>,
    /// A connection must send a complete request head (request line and
    /// headers) within this time, and an idle keep-alive connection its next
    /// one; otherwise it is closed without an answer, so a client that
    /// trickles bytes cannot hold a connection slot. Default 10 s.
    pub header_read_timeout: Duration,
    /// Connections on `/ws/dedicated` open at once at most: each one is a
    /// connection of its own to the gateway (and two file descriptors here).
    /// One more is closed at once `1013` with a reason naming this limit,
    /// before anything is sent to the gateway. Default 64.
    pub max_dedicated: usize,
    /// The kernel's send buffer for each accepted local connection
    /// (`SO_SNDBUF`; Linux doubles it): how much a client that does not
    /// read holds in the kernel beside its queue. `0` (the default): the
    /// kernel's own (`net.core.wmem_default`).
    pub send_buffer_bytes: usize,

    // --- Upstream connections opened for local clients ---
    /// Gateway connections one local peer (one uid, as the kernel reports
    /// it) may cause to be opened per second on average (`/ws/dedicated`
    /// today); one more is answered `studio.too_many_requests` with
    /// `retryAfterMs` and nothing is opened. Default 2.
    pub upstream_open_rate: u32,
    /// Such opens one peer may make at once above its rate. Default 10.
    pub upstream_open_burst: u32,
    /// The same for every peer together: the most gateway connections per
    /// second local clients can make the broker open. Default 10.
    pub upstream_open_rate_total: u32,
    /// Opens all peers together may make at once above the total rate.
    /// Default 30.
    pub upstream_open_burst_total: u32,
}

/// Connections allowed beyond `max_clients` when `max_connections` is not
/// set: room for `/healthz`, `/v1/rpc` and `clawmux status` while every
/// client slot is taken.
pub const CONNECTION_HEADROOM: usize = 64;

impl Limits {
    /// The cap on open local connections: `max_connections`, else
    /// `max_clients` + [`CONNECTION_HEADROOM`].
    pub fn max_connections(&self) -> usize {
        self.max_connections
            .unwrap_or_else(|| self.max_clients.saturating_add(CONNECTION_HEADROOM))
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connect_timeout: Duration::from_secs(10),
            connect_wait: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            run_timeout: Duration::from_secs(600),
            preconnect_max_bytes: 64 * 1024,
            max_frame_bytes: 25 * 1024 * 1024,
            queue_soft_bytes: 1024 * 1024,
            queue_hard_bytes: 50 * 1024 * 1024,
            slow_grace: Duration::from_secs(10),
            queue_total_bytes: 256 * 1024 * 1024,
            max_clients: 1024,
            max_inflight: 256,
            request_rate: 10_000,
            request_burst: 20_000,
            replay_max_events: 10_000,
            replay_max_bytes: 16 * 1024 * 1024,
            replay_persist: true,
            sse_keepalive: Duration::from_secs(15),
            max_connections: None,
            header_read_timeout: Duration::from_secs(10),
            max_dedicated: 64,
            send_buffer_bytes: 0,
            upstream_open_rate: 2,
            upstream_open_burst: 10,
            upstream_open_rate_total: 10,
            upstream_open_burst_total: 30,
        }
    }
}

impl Limits {
    /// Checks that the queue limits agree with each other and with the
    /// frame size the broker advertises (`maxPayload`): a frame a client is
    /// told it may receive must reach it while it reads. The message says
    /// which setting to change.
    pub fn check_queues(&self) -> Result<(), String> {
        if self.queue_soft_bytes > self.queue_hard_bytes {
            return Err(format!(
                "queue_soft_bytes ({}) is above queue_hard_bytes ({})",
                self.queue_soft_bytes, self.queue_hard_bytes
            ));
        }
        let needed = self.max_frame_bytes.saturating_mul(2);
        if self.queue_hard_bytes < needed {
            return Err(format!(
                "queue_hard_bytes ({}) must be at least 2 × max_frame_bytes ({needed}), \
                 or a client one frame behind would be cut off: raise it or lower max_frame_bytes",
                self.queue_hard_bytes
            ));
        }
        if self.queue_total_bytes < self.queue_hard_bytes {
            return Err(format!(
                "queue_total_bytes ({}) is below queue_hard_bytes ({})",
                self.queue_total_bytes, self.queue_hard_bytes
            ));
        }
        Ok(())
    }
}

/// How the one upstream connection is opened and re-opened.
#[derive(Debug, Clone)]
pub struct UpstreamOptions {
    /// Time allowed from opening the socket to `hello-ok`; past it the
    /// attempt fails `studio.upstream_timeout`. Default 10 s.
    pub handshake_timeout: Duration,
    /// First reconnect delay, doubled per failure. Default 1 s.
    pub backoff_initial: Duration,
    /// Reconnect delay ceiling; also the delay after a rejected connect
    /// (auth, pairing), so a wrong token never becomes a tight loop. Default 30 s.
    pub backoff_max: Duration,
    /// A write to the gateway that does not complete within this ends the
    /// session (the broker reconnects): a gateway that stops reading must not
    /// freeze the broker. Default 10 s.
    pub write_timeout: Duration,
    /// Largest frame accepted from the gateway; a larger one ends the session
    /// (reconnect). Default 50 MiB: twice the gateway's own `maxPayload`
    /// (25 MiB), since an event wraps a payload that was itself that large.
    pub max_frame_bytes: usize,
    /// Dial this unix socket instead of the URL's host (the URL still names
    /// the WebSocket path and `Host`). Only `serve --demo` sets it, for its
    /// built-in gateway double, so the demo opens no TCP port. Default: none.
    pub unix_socket: Option<PathBuf>,
    /// The state dir holding the broker's device key and the device tokens
    /// gateways minted for it (created 0700, files 0600). `None` turns
    /// device identity off (`--no-device-identity`): the broker connects
    /// with its token alone. Default: [`default_state_dir`].
    pub device_identity: Option<PathBuf>,
    /// The `Origin` header `/ws/dedicated` sends the gateway for a browser
    /// client (`[upstream] dedicated_origin`). Default: derived from the
    /// gateway URL ([`derived_origin`]).
    pub dedicated_origin: DedicatedOrigin,
    /// `SO_SNDBUF` of the gateway socket, in bytes: how much the kernel
    /// holds for a gateway that stops reading. `None` (the default, and the
    /// only value the settings offer) keeps the kernel's own sizing; a test
    /// that must fill the buffers sets it, so it decides by a figure it
    /// controls rather than by this machine's defaults.
    pub send_buffer_bytes: Option<usize>,
}

impl Default for UpstreamOptions {
    fn default() -> Self {
        UpstreamOptions {
            handshake_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            write_timeout: Duration::from_secs(10),
            max_frame_bytes: 50 * 1024 * 1024,
            unix_socket: None,
            device_identity: default_state_dir(),
            dedicated_origin: DedicatedOrigin::Derived,
            send_buffer_bytes: None,
        }
    }
}

/// The `Origin` header `/ws/dedicated` sends the gateway for a browser
/// client (a Control UI or webchat page), as Claw3D's studio proxy sends
/// one for its browser page: the gateway refuses those clients without one
/// (`CONTROL_UI_ORIGIN_NOT_ALLOWED`, close 1008).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DedicatedOrigin {
    /// [`derived_origin`] of the gateway URL (the default).
    #[default]
    Derived,
    /// This origin (`scheme://host[:port]`), as configured: for a gateway on
    /// another host, one listed in its `gateway.controlUi.allowedOrigins`.
    Fixed(String),
    /// No `Origin` header, for any client (`dedicated_origin = ""`).
    Off,
}

impl DedicatedOrigin {
    /// Parses the configured value: `""` turns the header off; anything
    /// else must be an `http://` or `https://` origin (no path, query or
    /// credentials). The error says what is wrong, for the settings error.
    pub fn parse(value: &str) -> Result<DedicatedOrigin, String> {
        let value = value.trim();
        if value.is_empty() {
            return Ok(DedicatedOrigin::Off);
        }
        let bad = |why: &str| {
            format!("upstream.dedicated_origin {value:?} {why}: write scheme://host[:port], e.g. http://localhost:18789, or \"\" for none")
        };
        let uri: http::Uri = value.parse().map_err(|_| bad("is not a URL"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return Err(bad("is not an http:// or https:// origin"));
        }
        let Some(authority) = uri.authority() else {
            return Err(bad("has no host"));
        };
        if authority.as_str().contains('@') || authority.host().is_empty() {
            return Err(bad("has no host or carries credentials"));
        }
        if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
            return Err(bad("has a path or query (an origin has none)"));
        }
        Ok(DedicatedOrigin::Fixed(
            value.trim_end_matches('/').to_owned(),
        ))
    }

    /// The header value for a gateway at `url`, or `None` for none.
    pub fn for_url(&self, url: &str) -> Option<String> {
        match self {
            DedicatedOrigin::Derived => derived_origin(url),
            DedicatedOrigin::Fixed(origin) => Some(origin.clone()),
            DedicatedOrigin::Off => None,
        }
    }
}

/// The default `Origin` for browser clients of `/ws/dedicated`, derived from
/// the gateway URL as Claw3D's proxy derives it (`resolveOriginForUpstream`
/// in `server/gateway-proxy.js`): `ws:` → `http:`, `wss:` → `https:`, the
/// URL's host and port, a loopback address (`127.0.0.1`, `::1`, `0.0.0.0`)
/// written `localhost`. One difference: for a URL whose host is already
/// `localhost` the origin says `127.0.0.1`. The Origin must not equal the
/// `Host` the broker sends: the gateway takes such an Origin for a page it
/// served itself and refuses a Control UI of another build ("protocol
/// mismatch: Control UI updated", measured against gateway 2026.9.6, as for
/// `ws://127.0.0.1:P` with `http://127.0.0.1:P`); any loopback Origin is
/// accepted for a client on loopback. `None` for a URL that cannot be parsed.
pub fn derived_origin(url: &str) -> Option<String> {
    let uri: http::Uri = url.trim().parse().ok()?;
    let scheme = match uri.scheme_str()? {
        "ws" => "http",
        "wss" => "https",
        _ => return None,
    };
    let host = uri.host()?;
    let host = match host.trim_start_matches('[').trim_end_matches(']') {
        "127.0.0.1" | "::1" | "0.0.0.0" => "localhost",
        h if h.eq_ignore_ascii_case("localhost") => "127.0.0.1",
        _ => host,
    };
    Some(match uri.port_u16() {
        Some(port) => format!("{scheme}://{host}:{port}"),
        None => format!("{scheme}://{host}"),
    })
}

/// How the broker checks a `wss://` gateway's certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// The pinned SHA-256 fingerprint of the gateway's certificate (64
    /// lowercase hex digits). With a pin, a certificate is accepted exactly
    /// when its fingerprint matches, whoever issued it and whatever name it
    /// carries (as OpenClaw's own clients do); without one, the system's
    /// trust store and [`TlsSettings::ca_file`] decide, with the host name checked.
    pub fingerprint: Option<String>,
    /// PEM file of extra CA certificates trusted beside the system's store
    /// (a private CA's root).
    pub ca_file: Option<PathBuf>,
}

/// Everything `serve` needs, resolved from flags and environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The unix socket the broker listens on.
    pub socket_path: PathBuf,
    /// The gateway WebSocket URL (validated when the connector starts, so a
    /// bad value becomes `studio.gateway_url_*` for clients, not a crash).
    pub gateway_url: String,
    /// The host credential injected into the upstream `connect`.
    pub token: Option<Secret>,
    /// A gateway password (`auth.password`), sent beside or instead of the
    /// token for a gateway in password mode.
    pub password: Option<Secret>,
    /// How a `wss://` gateway's certificate is checked.
    pub tls: TlsSettings,
    /// OpenClaw's break-glass `OPENCLAW_ALLOW_INSECURE_PRIVATE_WS=1`: plaintext
    /// `ws://` is also allowed to host names (not only to private addresses).
    pub allow_insecure_private_ws: bool,
    pub limits: Limits,
    pub upstream: UpstreamOptions,
    /// Further sockets with their policies (`[[sockets]]` in config.toml);
    /// the main socket has no ceiling.
    pub sockets: Vec<crate::policy::SocketPolicy>,
    /// The settings could not be loaded: the broker serves, and every local
    /// connect is answered with this `studio.settings_load_failed`.
    pub load_error: Option<ErrorShape>,
    /// Settings files discovery passed over because they point at this
    /// broker, each in one sentence naming what was used instead (shown by
    /// `clawmux status` and `doctor`).
    pub discovery: Vec<String>,
}

impl Settings {
    /// Settings with defaults for everything but the socket path.
    pub fn new(socket_path: impl Into<PathBuf>) -> Self {
        Settings {
            socket_path: socket_path.into(),
            gateway_url: DEFAULT_GATEWAY_URL.into(),
            token: None,
            password: None,
            tls: TlsSettings::default(),
            allow_insecure_private_ws: false,
            limits: Limits::default(),
            upstream: UpstreamOptions::default(),
            sockets: Vec::new(),
            load_error: None,
            discovery: Vec::new(),
        }
    }

    /// Every socket this broker serves: the main one and each `[[sockets]]`
    /// entry. A gateway URL naming one of them is this broker, not a gateway.
    pub fn own_socket_paths(&self) -> Vec<PathBuf> {
        std::iter::once(self.socket_path.clone())
            .chain(self.sockets.iter().map(|s| s.path.clone()))
            .collect()
    }
}

/// Checks a gateway URL: empty → `studio.gateway_url_missing`, not a
/// `ws://`/`wss://` URL with a host → `studio.gateway_url_invalid`.
pub fn validate_gateway_url(url: &str) -> Result<(), ErrorShape> {
    let url = url.trim();
    if url.is_empty() {
        return Err(ErrorShape::studio(
            StudioCode::GatewayUrlMissing,
            "the gateway URL is empty: set --gateway-url or CLAWMUX_GATEWAY_URL (e.g. ws://localhost:18789)",
        ));
    }
    let rest = url
        .strip_prefix("ws://")
        .or_else(|| url.strip_prefix("wss://"));
    let host_ok = rest.is_some_and(|r| {
        let authority = r.split(['/', '?', '#']).next().unwrap_or("");
        !authority.is_empty() && !authority.contains(char::is_whitespace)
    });
    if !host_ok {
        return Err(ErrorShape::studio(
            StudioCode::GatewayUrlInvalid,
            format!(
                "the gateway URL {:?} is not a ws:// or wss:// URL: set --gateway-url or CLAWMUX_GATEWAY_URL to e.g. ws://localhost:18789",
                redact_url(url)
            ),
        ));
    }
    Ok(())
}

/// The gateway URL without `user:password@` or a query (either may carry a
/// credential).
pub fn redact_url(url: &str) -> String {
    let url = url.split(['?', '#']).next().unwrap_or_default();
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let host = authority.rsplit('@').next().unwrap_or_default();
            format!("{scheme}://{host}{path}")
        }
        None => url.to_owned(),
    }
}

/// The default socket path: `$XDG_RUNTIME_DIR/clawmux.sock`, else
/// `<tmp>/clawmux-<uid>/clawmux.sock` (that directory is created 0700).
pub fn default_socket_path() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() && Path::new(&dir).is_absolute() => {
            PathBuf::from(dir).join("clawmux.sock")
        }
        _ => std::env::temp_dir()
            .join(format!("clawmux-{}", rustix::process::getuid().as_raw()))
            .join("clawmux.sock"),
    }
}

/// The broker's state dir: `$XDG_STATE_HOME/clawmux`, else
/// `~/.local/state/clawmux`; `None` when neither variable gives an absolute path.
pub fn default_state_dir() -> Option<PathBuf> {
    let absolute = |var: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_STATE_HOME")
        .map(|d| d.join("clawmux"))
        .or_else(|| absolute("HOME").map(|h| h.join(".local/state/clawmux")))
}

/// Reads a token file: trimmed, non-empty; a regular file of at most
/// [`crate::files::SECRET_MAX_BYTES`]. The error names the file, never its contents.
pub fn read_token_file(path: &Path) -> Result<Secret, String> {
    let text = crate::files::read_string(path, crate::files::SECRET_MAX_BYTES)
        .map_err(|e| format!("token file: {e}"))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!("token file {} is empty", path.display()));
    }
    Ok(Secret::new(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?} {s}"), "<redacted> <redacted>");
        let settings = Settings {
            token: Some(s),
            ..Settings::new("/tmp/x.sock")
        };
        assert!(!format!("{settings:?}").contains("hunter2"));
    }

    #[test]
    fn dedicated_origin_is_derived_from_the_gateway_url() {
        let d = |u: &str| derived_origin(u);
        // Claw3D's rule: loopback addresses become `localhost`.
        assert_eq!(
            d("ws://127.0.0.1:18789").as_deref(),
            Some("http://localhost:18789")
        );
        assert_eq!(
            d("ws://[::1]:18789/ws").as_deref(),
            Some("http://localhost:18789")
        );
        assert_eq!(
            d("ws://0.0.0.0:18789").as_deref(),
            Some("http://localhost:18789")
        );
        // Never the Host header itself (the gateway's own-page build check).
        assert_eq!(
            d("ws://localhost:18789").as_deref(),
            Some("http://127.0.0.1:18789")
        );
        assert_eq!(
            d("wss://gw.example/ws").as_deref(),
            Some("https://gw.example")
        );
        assert_eq!(
            d("wss://gw.example:8443").as_deref(),
            Some("https://gw.example:8443")
        );
        assert_eq!(d("not a url"), None);
        assert_eq!(d("http://localhost:1"), None);
        let o = DedicatedOrigin::default();
        assert_eq!(
            o.for_url("ws://127.0.0.1:1").as_deref(),
            Some("http://localhost:1")
        );
        assert_eq!(DedicatedOrigin::Off.for_url("ws://127.0.0.1:1"), None);
    }

    #[test]
    fn dedicated_origin_settings() {
        let p = DedicatedOrigin::parse;
        assert_eq!(p(""), Ok(DedicatedOrigin::Off));
        assert_eq!(
            p("http://localhost:3000/"),
            Ok(DedicatedOrigin::Fixed("http://localhost:3000".into()))
        );
        assert_eq!(
            p("https://claw3d.example"),
            Ok(DedicatedOrigin::Fixed("https://claw3d.example".into()))
        );
        for bad in [
            "localhost:3000",
            "ws://localhost",
            "http://localhost/ui",
            "http://u:p@h",
            "http://h?x=1",
        ] {
            let e = p(bad).unwrap_err();
            assert!(e.contains("upstream.dedicated_origin"), "{bad}: {e}");
        }
    }

    #[test]
    fn gateway_urls() {
        assert!(validate_gateway_url("ws://localhost:18789").is_ok());
        assert!(validate_gateway_url("wss://gw.example/ws").is_ok());
        let code = |u: &str| validate_gateway_url(u).unwrap_err().code;
        assert_eq!(code(""), "studio.gateway_url_missing");
        assert_eq!(code("  "), "studio.gateway_url_missing");
        assert_eq!(code("http://localhost:18789"), "studio.gateway_url_invalid");
        assert_eq!(code("ws://"), "studio.gateway_url_invalid");
        assert_eq!(code("localhost:18789"), "studio.gateway_url_invalid");
    }
}
