//! Settings resolution (design §7): where the gateway URL, the token and the
//! limits come from, with each value's source kept for `clawmux doctor`.
//!
//! Precedence, highest first: flags > `CLAWMUX_*` environment >
//! `$CREDENTIALS_DIRECTORY/gateway-token` (token only) > `config.toml` >
//! Claw3D studio settings (`<stateDir>/claw3d/settings.json`) > OpenClaw's
//! own config (`<stateDir>/openclaw.json`, JSON5, plus `OPENCLAW_GATEWAY_PORT`
//! / `OPENCLAW_GATEWAY_TOKEN`) > defaults.
//!
//! Files are read only when a higher source has not already decided, except
//! `config.toml`, which also holds the limits. A file that exists but cannot
//! be read or parsed is a `studio.settings_load_failed` naming the file and
//! the position — never its contents, which may hold a token.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::config::{self, Secret, Settings, DEFAULT_GATEWAY_URL};
use crate::protocol::{ErrorShape, StudioCode};

/// What the command line said (flags only; the environment is read here so
/// that each value's source can be told apart).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub socket: Option<PathBuf>,
    pub gateway_url: Option<String>,
    pub token: Option<Secret>,
    pub token_file: Option<PathBuf>,
    pub config: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub no_device_identity: bool,
}

/// The process environment as the resolver sees it (a map, so tests can
/// give their own without touching the real one).
#[derive(Debug, Clone, Default)]
pub struct Env {
    pub vars: HashMap<String, String>,
}

impl Env {
    pub fn from_process() -> Self {
        Env {
            vars: std::env::vars().collect(),
        }
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.vars
            .get(key)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    }

    fn home(&self) -> Option<PathBuf> {
        self.get("HOME").map(PathBuf::from)
    }

    fn expand(&self, path: &str) -> PathBuf {
        match (path.strip_prefix("~/"), self.home()) {
            (Some(rest), Some(home)) => home.join(rest),
            _ if path == "~" => self.home().unwrap_or_else(|| PathBuf::from(path)),
            _ => PathBuf::from(path),
        }
    }
}

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag(&'static str),
    Env(&'static str),
    File(PathBuf),
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag(name) => write!(f, "flag {name}"),
            Source::Env(name) => write!(f, "environment {name}"),
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// Resolved settings and where each came from.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub settings: Settings,
    pub url_source: Source,
    pub token_source: Option<Source>,
    pub socket_source: Source,
    /// The config file that was read, if any.
    pub config_file: Option<PathBuf>,
    /// OpenClaw's state dir (where Claw3D and OpenClaw settings live).
    pub openclaw_state_dir: PathBuf,
    /// Things worth fixing that do not stop the broker (e.g. a token file
    /// other users can read).
    pub warnings: Vec<String>,
}

/// `config.toml`. Unknown keys are errors, so a typo is reported, not ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    socket: Option<PathBuf>,
    #[serde(default)]
    gateway: GatewaySection,
    #[serde(default)]
    limits: LimitsSection,
    #[serde(default)]
    upstream: UpstreamSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GatewaySection {
    url: Option<String>,
    token: Option<String>,
    token_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsSection {
    connect_timeout_ms: Option<u64>,
    connect_wait_ms: Option<u64>,
    request_timeout_ms: Option<u64>,
    run_timeout_ms: Option<u64>,
    preconnect_max_bytes: Option<usize>,
    max_frame_bytes: Option<usize>,
    queue_soft_bytes: Option<usize>,
    queue_hard_bytes: Option<usize>,
    slow_grace_ms: Option<u64>,
    queue_total_bytes: Option<usize>,
    max_clients: Option<usize>,
    max_inflight: Option<usize>,
    request_rate: Option<u32>,
    request_burst: Option<u32>,
    replay_max_events: Option<usize>,
    replay_max_bytes: Option<usize>,
    sse_keepalive_ms: Option<u64>,
    max_connections: Option<usize>,
    header_read_timeout_ms: Option<u64>,
    max_dedicated: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamSection {
    handshake_timeout_ms: Option<u64>,
    backoff_initial_ms: Option<u64>,
    backoff_max_ms: Option<u64>,
    write_timeout_ms: Option<u64>,
    max_frame_bytes: Option<usize>,
    device_identity: Option<bool>,
    state_dir: Option<PathBuf>,
}

fn load_failed(path: &Path, why: impl std::fmt::Display) -> ErrorShape {
    ErrorShape::studio(
        StudioCode::SettingsLoadFailed,
        format!(
            "cannot load settings from {}: {why}; fix or remove the file",
            path.display()
        ),
    )
}

/// Reads a settings file: `None` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, ErrorShape> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(load_failed(path, e)),
    }
}

/// Blanks quoted text in a parser message: serde messages can quote the
/// offending value, and that value may be a token.
fn scrub(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut quoted = false;
    for c in message.chars() {
        if c == '"' || c == '`' {
            if !quoted {
                out.push_str("\"…\"");
            }
            quoted = !quoted;
        } else if !quoted {
            out.push(c);
        }
    }
    out
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

fn parse_toml(path: &Path, text: &str) -> Result<ConfigFile, ErrorShape> {
    toml::from_str(text).map_err(|e| {
        let at = e
            .span()
            .map(|s| {
                let (l, c) = line_col(text, s.start);
                format!(" at line {l} column {c}")
            })
            .unwrap_or_default();
        load_failed(path, format!("{}{at}", scrub(e.message().trim())))
    })
}

/// JSON (Claw3D) or JSON5 (OpenClaw) into a `Value`; errors carry only the position.
fn parse_json_like(path: &Path, text: &str, json5: bool) -> Result<Value, ErrorShape> {
    if json5 {
        json5::from_str::<Value>(text).map_err(|e| match e {
            json5::Error::Message {
                location: Some(l), ..
            } => load_failed(
                path,
                format!("JSON5 syntax error at line {} column {}", l.line, l.column),
            ),
            json5::Error::Message { .. } => load_failed(path, "not valid JSON5"),
        })
    } else {
        serde_json::from_str::<Value>(text).map_err(|e| {
            load_failed(
                path,
                format!(
                    "JSON syntax error at line {} column {}",
                    e.line(),
                    e.column()
                ),
            )
        })
    }
}

/// Whether a `ws://`/`wss://` URL points at this machine.
fn is_loopback_url(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit('@').next().unwrap_or_default();
    let host = if let Some(v6) = host_port.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        host_port.split(':').next().unwrap_or_default()
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A token found in Claw3D's or OpenClaw's files belongs to the gateway those
/// files describe: it is used only when the URL came from the same file, or
/// points at this machine (never sent to a remote gateway set elsewhere).
fn file_token_allowed(url: &Option<(String, Source)>, file: &Path) -> bool {
    match url {
        None => true,
        Some((_, Source::File(p))) if p == file => true,
        Some((u, _)) => is_loopback_url(u),
    }
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> Option<&'a str> {
    v.pointer(pointer).and_then(Value::as_str).map(str::trim)
}

/// OpenClaw's state dir: `OPENCLAW_STATE_DIR` (or the legacy overrides),
/// else `~/.openclaw` if it exists, else an existing legacy dir, else `~/.openclaw`.
pub fn openclaw_state_dir(env: &Env) -> PathBuf {
    for key in [
        "OPENCLAW_STATE_DIR",
        "MOLTBOT_STATE_DIR",
        "CLAWDBOT_STATE_DIR",
    ] {
        if let Some(v) = env.get(key) {
            return env.expand(v);
        }
    }
    let home = env.home().unwrap_or_else(std::env::temp_dir);
    let primary = home.join(".openclaw");
    if primary.is_dir() {
        return primary;
    }
    for legacy in [".clawdbot", ".moltbot", ".moldbot"] {
        let dir = home.join(legacy);
        if dir.is_dir() {
            return dir;
        }
    }
    primary
}

/// Warns when a file holding a secret can be read by other users.
fn check_secret_file(path: &Path, warnings: &mut Vec<String>) {
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.mode() & 0o077 != 0 {
            let w = format!(
                "{} holds a secret and other users can read it (mode {:o}): chmod 600 it",
                path.display(),
                meta.mode() & 0o777
            );
            tracing::warn!("{w}");
            warnings.push(w);
        }
    }
}

fn token_from_file(path: &Path, warnings: &mut Vec<String>) -> Result<Secret, ErrorShape> {
    check_secret_file(path, warnings);
    config::read_token_file(path).map_err(|why| {
        ErrorShape::studio(
            StudioCode::SettingsLoadFailed,
            format!("{why}; fix the file or point to another one"),
        )
    })
}

/// Resolves every setting. `Err` is a `studio.settings_load_failed` (or an
/// unusable token file); the caller keeps serving and reports it to clients.
pub fn resolve(over: &Overrides, env: &Env) -> Result<Resolved, ErrorShape> {
    let mut warnings = Vec::new();
    // config.toml: --config, CLAWMUX_CONFIG, else $XDG_CONFIG_HOME/clawmux/config.toml.
    let config_path = over
        .config
        .clone()
        .or_else(|| env.get("CLAWMUX_CONFIG").map(|p| env.expand(p)))
        .or_else(|| {
            let base = env
                .get("XDG_CONFIG_HOME")
                .map(PathBuf::from)
                .or_else(|| env.home().map(|h| h.join(".config")))?;
            Some(base.join("clawmux/config.toml"))
        });
    let explicit_config = over.config.is_some() || env.get("CLAWMUX_CONFIG").is_some();
    let mut file = ConfigFile::default();
    let mut config_file = None;
    if let Some(path) = &config_path {
        match read_optional(path)? {
            Some(text) => {
                file = parse_toml(path, &text)?;
                config_file = Some(path.clone());
            }
            None if explicit_config => return Err(load_failed(path, "no such file")),
            None => {}
        }
    }
    let file_src = || Source::File(config_file.clone().unwrap_or_default());

    // Socket.
    let (socket_path, socket_source) = if let Some(s) = &over.socket {
        (s.clone(), Source::Flag("--socket"))
    } else if let Some(s) = env.get("CLAWMUX_SOCKET") {
        (env.expand(s), Source::Env("CLAWMUX_SOCKET"))
    } else if let Some(s) = &file.socket {
        (env.expand(&s.to_string_lossy()), file_src())
    } else {
        (config::default_socket_path(), Source::Default)
    };
    let mut settings = Settings::new(socket_path);

    // URL and token from the broker's own sources.
    let mut url: Option<(String, Source)> = over
        .gateway_url
        .clone()
        .map(|u| (u, Source::Flag("--gateway-url")))
        .or_else(|| {
            env.vars
                .get("CLAWMUX_GATEWAY_URL")
                .map(|u| (u.trim().to_owned(), Source::Env("CLAWMUX_GATEWAY_URL")))
        })
        .or_else(|| file.gateway.url.clone().map(|u| (u, file_src())));
    let mut token: Option<(Secret, Source)> = None;
    if let Some(t) = &over.token {
        token = Some((t.clone(), Source::Flag("--token")));
    } else if let Some(p) = &over.token_file {
        token = Some((token_from_file(p, &mut warnings)?, Source::File(p.clone())));
    } else if let Some(t) = env.get("CLAWMUX_GATEWAY_TOKEN") {
        token = Some((Secret::new(t), Source::Env("CLAWMUX_GATEWAY_TOKEN")));
    } else if let Some(p) = env.get("CLAWMUX_GATEWAY_TOKEN_FILE").map(|p| env.expand(p)) {
        token = Some((token_from_file(&p, &mut warnings)?, Source::File(p)));
    } else if let Some(dir) = env.get("CREDENTIALS_DIRECTORY") {
        let p = Path::new(dir).join(crate::systemd::TOKEN_CREDENTIAL);
        if p.exists() {
            token = Some((token_from_file(&p, &mut warnings)?, Source::File(p)));
        }
    }
    if token.is_none() {
        if let Some(t) = file
            .gateway
            .token
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty())
        {
            if let Some(path) = &config_file {
                check_secret_file(path, &mut warnings);
            }
            token = Some((Secret::new(t), file_src()));
        } else if let Some(p) = &file.gateway.token_file {
            let p = env.expand(&p.to_string_lossy());
            token = Some((token_from_file(&p, &mut warnings)?, Source::File(p)));
        }
    }

    // Claw3D studio settings, then OpenClaw's own config, only if still needed.
    let state_dir = openclaw_state_dir(env);
    if url.is_none() || token.is_none() {
        let path = state_dir.join("claw3d/settings.json");
        if let Some(text) = read_optional(&path)? {
            let v = parse_json_like(&path, &text, false)?;
            if url.is_none() {
                if let Some(u) = str_at(&v, "/gateway/url").filter(|u| !u.is_empty()) {
                    url = Some((u.to_owned(), Source::File(path.clone())));
                }
            }
            if token.is_none() && file_token_allowed(&url, &path) {
                if let Some(t) = str_at(&v, "/gateway/token").filter(|t| !t.is_empty()) {
                    check_secret_file(&path, &mut warnings);
                    token = Some((Secret::new(t), Source::File(path.clone())));
                }
            }
        }
    }
    if url.is_none() || token.is_none() {
        let path = env
            .get("OPENCLAW_CONFIG_PATH")
            .map(|p| env.expand(p))
            .unwrap_or_else(|| state_dir.join("openclaw.json"));
        let v = match read_optional(&path)? {
            Some(text) => parse_json_like(&path, &text, true)?,
            None => Value::Null,
        };
        if url.is_none() {
            let port = env
                .get("OPENCLAW_GATEWAY_PORT")
                .map(|p| (p.parse::<u16>().ok(), Source::Env("OPENCLAW_GATEWAY_PORT")))
                .or_else(|| {
                    v.pointer("/gateway/port").map(|p| {
                        (
                            p.as_u64().and_then(|p| u16::try_from(p).ok()),
                            Source::File(path.clone()),
                        )
                    })
                });
            if let Some((port, source)) = port {
                let port = port.ok_or_else(|| {
                    ErrorShape::studio(
                        StudioCode::SettingsLoadFailed,
                        format!("the gateway port from {source} is not a port number (1-65535)"),
                    )
                })?;
                url = Some((format!("ws://localhost:{port}"), source));
            }
        }
        if token.is_none() && file_token_allowed(&url, &path) {
            if let Some(t) = env.get("OPENCLAW_GATEWAY_TOKEN") {
                token = Some((Secret::new(t), Source::Env("OPENCLAW_GATEWAY_TOKEN")));
            } else if let Some(t) = str_at(&v, "/gateway/auth/token").filter(|t| !t.is_empty()) {
                token = Some((Secret::new(t), Source::File(path.clone())));
            }
        }
    }
    let (gateway_url, url_source) =
        url.unwrap_or_else(|| (DEFAULT_GATEWAY_URL.to_owned(), Source::Default));
    settings.gateway_url = gateway_url;
    let token_source = token.as_ref().map(|(_, s)| s.clone());
    settings.token = token.map(|(t, _)| t);

    let path = config_file.clone().unwrap_or_default();
    apply_limits(&mut settings, &file).map_err(|why| load_failed(&path, why))?;
    let up = &file.upstream;
    if let Some(dir) = over
        .state_dir
        .clone()
        .or_else(|| env.get("CLAWMUX_STATE_DIR").map(|d| env.expand(d)))
        .or_else(|| {
            up.state_dir
                .as_ref()
                .map(|d| env.expand(&d.to_string_lossy()))
        })
    {
        settings.upstream.device_identity = Some(dir);
    }
    if over.no_device_identity || up.device_identity == Some(false) {
        settings.upstream.device_identity = None;
    }
    Ok(Resolved {
        settings,
        url_source,
        token_source,
        socket_source,
        config_file,
        openclaw_state_dir: state_dir,
        warnings,
    })
}

/// Copies the `[limits]` and `[upstream]` values of `config.toml` into the
/// settings, each checked ([`crate::bounds`]); the error names the key.
fn apply_limits(settings: &mut Settings, file: &ConfigFile) -> Result<(), String> {
    use crate::bounds::{duration_ms, positive, Zero};
    let l = &file.limits;
    let lim = &mut settings.limits;
    // `set!(field, value, check)`: a present value, checked, replaces the default.
    macro_rules! set {
        ($target:expr, $section:literal, $key:ident, $check:expr) => {
            if let Some(v) = $key {
                let check = $check;
                $target = check(concat!($section, ".", stringify!($key)), v)?;
            }
        };
    }
    let ms = |zero| move |name: &str, v| duration_ms(name, v, zero);
    let LimitsSection {
        connect_timeout_ms,
        connect_wait_ms,
        request_timeout_ms,
        run_timeout_ms,
        preconnect_max_bytes,
        max_frame_bytes,
        queue_soft_bytes,
        queue_hard_bytes,
        slow_grace_ms,
        queue_total_bytes,
        max_clients,
        max_inflight,
        request_rate,
        request_burst,
        replay_max_events,
        replay_max_bytes,
        sse_keepalive_ms,
        max_connections,
        header_read_timeout_ms,
        max_dedicated,
    } = *l;
    let any = |_: &str, v| Ok::<_, String>(v);
    set!(
        lim.connect_timeout,
        "limits",
        connect_timeout_ms,
        ms(Zero::Refused)
    );
    set!(
        lim.connect_wait,
        "limits",
        connect_wait_ms,
        ms(Zero::Allowed)
    );
    set!(
        lim.request_timeout,
        "limits",
        request_timeout_ms,
        ms(Zero::Refused)
    );
    set!(lim.run_timeout, "limits", run_timeout_ms, ms(Zero::Refused));
    set!(
        lim.preconnect_max_bytes,
        "limits",
        preconnect_max_bytes,
        positive
    );
    set!(lim.max_frame_bytes, "limits", max_frame_bytes, positive);
    set!(lim.queue_soft_bytes, "limits", queue_soft_bytes, positive);
    set!(lim.queue_hard_bytes, "limits", queue_hard_bytes, positive);
    set!(lim.slow_grace, "limits", slow_grace_ms, ms(Zero::Allowed));
    set!(lim.queue_total_bytes, "limits", queue_total_bytes, positive);
    set!(lim.max_clients, "limits", max_clients, positive);
    set!(lim.max_inflight, "limits", max_inflight, positive);
    set!(lim.request_rate, "limits", request_rate, positive);
    set!(lim.request_burst, "limits", request_burst, positive);
    set!(lim.replay_max_events, "limits", replay_max_events, any);
    set!(lim.replay_max_bytes, "limits", replay_max_bytes, any);
    set!(
        lim.sse_keepalive,
        "limits",
        sse_keepalive_ms,
        ms(Zero::Refused)
    );
    set!(lim.max_connections, "limits", max_connections, |n, v| {
        positive(n, v).map(Some)
    });
    set!(
        lim.header_read_timeout,
        "limits",
        header_read_timeout_ms,
        ms(Zero::Refused)
    );
    set!(lim.max_dedicated, "limits", max_dedicated, positive);
    let UpstreamSection {
        handshake_timeout_ms,
        backoff_initial_ms,
        backoff_max_ms,
        write_timeout_ms,
        max_frame_bytes: upstream_max_frame_bytes,
        ..
    } = file.upstream;
    let up = &mut settings.upstream;
    set!(
        up.handshake_timeout,
        "upstream",
        handshake_timeout_ms,
        ms(Zero::Refused)
    );
    set!(
        up.backoff_initial,
        "upstream",
        backoff_initial_ms,
        ms(Zero::Refused)
    );
    set!(
        up.backoff_max,
        "upstream",
        backoff_max_ms,
        ms(Zero::Refused)
    );
    set!(
        up.write_timeout,
        "upstream",
        write_timeout_ms,
        ms(Zero::Refused)
    );
    if let Some(v) = upstream_max_frame_bytes {
        up.max_frame_bytes = positive("upstream.max_frame_bytes", v)?;
    }
    Ok(())
}

/// A short, non-reversible fingerprint of a secret for display:
/// `sha256:` and the first 4 hex characters of its SHA-256.
pub fn fingerprint(secret: &Secret) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(secret.expose().as_bytes());
    let hex: String = digest.iter().take(2).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrub_hides_quoted_values() {
        assert_eq!(
            scrub(r#"invalid type: string "s3cret", expected u64"#),
            r#"invalid type: string "…", expected u64"#
        );
    }

    #[test]
    fn loopback_urls() {
        for u in [
            "ws://localhost:18789",
            "ws://127.0.0.1:1/x",
            "wss://[::1]:2",
            "ws://u:p@LOCALHOST",
        ] {
            assert!(is_loopback_url(u), "{u}");
        }
        for u in [
            "wss://gw.example",
            "ws://10.0.0.2:18789",
            "ws://localhost.evil.example",
        ] {
            assert!(!is_loopback_url(u), "{u}");
        }
    }

    /// An absurd or zero duration or count in config.toml is a settings
    /// error naming the key, not a panic on the first request.
    #[test]
    fn absurd_limits_name_their_key() {
        let resolve_with = |toml: &str| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("config.toml");
            std::fs::write(&path, toml).unwrap();
            let over = Overrides {
                config: Some(path),
                socket: Some(dir.path().join("s.sock")),
                ..Overrides::default()
            };
            resolve(&over, &Env::default())
        };
        for (toml, key) in [
            (
                "[limits]\nrequest_timeout_ms = 18446744073709551615\n",
                "limits.request_timeout_ms",
            ),
            (
                "[limits]\nconnect_wait_ms = 86400001\n",
                "limits.connect_wait_ms",
            ),
            (
                "[limits]\nsse_keepalive_ms = 0\n",
                "limits.sse_keepalive_ms",
            ),
            ("[limits]\nmax_clients = 0\n", "limits.max_clients"),
            (
                "[limits]\nheader_read_timeout_ms = 0\n",
                "limits.header_read_timeout_ms",
            ),
            (
                "[upstream]\nbackoff_max_ms = 18446744073709551615\n",
                "upstream.backoff_max_ms",
            ),
        ] {
            let err = resolve_with(toml).unwrap_err();
            assert_eq!(err.code, "studio.settings_load_failed");
            assert!(err.message.contains(key), "{toml}: {}", err.message);
        }
        let ok = resolve_with("[limits]\nconnect_wait_ms = 0\nmax_connections = 7\n").unwrap();
        assert_eq!(ok.settings.limits.connect_wait, std::time::Duration::ZERO);
        assert_eq!(ok.settings.limits.max_connections(), 7);
    }

    #[test]
    fn line_and_column() {
        assert_eq!(line_col("a\nbc\nd", 4), (2, 3));
        assert_eq!(line_col("abc", 0), (1, 1));
    }

    #[test]
    fn fingerprints_are_short_and_stable() {
        let f = fingerprint(&Secret::new("test-token"));
        assert!(f.starts_with("sha256:") && f.len() == 11, "{f}");
        assert_eq!(f, fingerprint(&Secret::new("test-token")));
        assert!(!f.contains("test"));
    }
}
