//! Settings resolution (design §7): where the gateway URL, the token and the
//! limits come from, with each value's source kept for `clawmux doctor`.
//!
//! Precedence, highest first: flags > `CLAWMUX_*` environment >
//! `$CREDENTIALS_DIRECTORY/gateway-token` (token only) > `config.toml` >
//! Claw3D studio settings (`<stateDir>/claw3d/settings.json`) > OpenClaw's
//! own config (`<stateDir>/openclaw.json`, JSON5, plus `OPENCLAW_GATEWAY_PORT`
//! / `OPENCLAW_GATEWAY_TOKEN`) > defaults.
//!
//! The password (`auth.password`), the TLS pin (`--tls-fingerprint`) and the
//! CA file follow the same order. From OpenClaw's config: with
//! `gateway.mode: "remote"`, `gateway.remote.url` with `.token`, `.password`
//! and `.tlsFingerprint`; with `gateway.tls.enabled`, `wss://localhost:<port>`
//! pinned to the gateway's own certificate (`gateway.tls.certPath`, else
//! `<stateDir>/gateway/tls/gateway-cert.pem`), as OpenClaw's local commands do.
//! Credentials and pins in those files go only to the gateway they describe.
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
    /// `--tls-fingerprint`: the gateway certificate's SHA-256 (any format
    /// OpenClaw accepts).
    pub tls_fingerprint: Option<String>,
    /// `--tls-ca-file`: extra trusted CA certificates (PEM).
    pub tls_ca_file: Option<PathBuf>,
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
    /// A key of a settings file (e.g. `gateway.remote.url` of openclaw.json).
    FileKey(PathBuf, &'static str),
    /// Derived from the certificate of a local gateway with `gateway.tls.enabled`.
    Certificate(PathBuf),
    Default,
}

impl Source {
    /// The settings file this value came from, if any.
    fn file(&self) -> Option<&Path> {
        match self {
            Source::File(p) | Source::FileKey(p, _) => Some(p),
            _ => None,
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag(name) => write!(f, "flag {name}"),
            Source::Env(name) => write!(f, "environment {name}"),
            Source::File(path) => write!(f, "{}", path.display()),
            Source::FileKey(path, key) => write!(f, "{} ({key})", path.display()),
            Source::Certificate(path) => write!(f, "the certificate {}", path.display()),
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
    pub password_source: Option<Source>,
    pub tls_fingerprint_source: Option<Source>,
    pub tls_ca_file_source: Option<Source>,
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
    /// Further sockets, each with its own policy (`[[sockets]]`).
    #[serde(default)]
    sockets: Vec<SocketSection>,
}

/// One `[[sockets]]` entry: a further socket whose clients get at most
/// this policy.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SocketSection {
    name: String,
    path: PathBuf,
    /// Octal, as a string (`"0660"`); default 0600.
    mode: Option<String>,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    gids: Vec<u32>,
    scopes: Option<Vec<String>>,
    #[serde(default)]
    allow_methods: Vec<String>,
    #[serde(default)]
    deny_methods: Vec<String>,
    /// Observer powers (the request tap, `tool_events=all`); default off.
    #[serde(default)]
    observe: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GatewaySection {
    url: Option<String>,
    token: Option<String>,
    token_file: Option<PathBuf>,
    password: Option<String>,
    tls_fingerprint: Option<String>,
    tls_ca_file: Option<PathBuf>,
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
    replay_persist: Option<bool>,
    sse_keepalive_ms: Option<u64>,
    max_connections: Option<usize>,
    header_read_timeout_ms: Option<u64>,
    max_dedicated: Option<usize>,
    upstream_open_rate: Option<u32>,
    upstream_open_burst: Option<u32>,
    upstream_open_rate_total: Option<u32>,
    upstream_open_burst_total: Option<u32>,
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
    dedicated_origin: Option<String>,
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

/// Reads a settings file: `None` when it does not exist. Only a regular
/// file of at most [`crate::files::CONFIG_MAX_BYTES`] is read (a FIFO or
/// `/dev/zero` is refused at once).
fn read_optional(path: &Path) -> Result<Option<String>, ErrorShape> {
    crate::files::read_optional_string(path, crate::files::CONFIG_MAX_BYTES)
        .map_err(|e| load_failed(path, e))
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
        let message = e.message().trim();
        let why = match unknown_key(message) {
            Some((key, valid)) => format!("{key}{at}{valid}"),
            None => format!("{}{at}", scrub(message)),
        };
        load_failed(path, why)
    })
}

/// Every key config.toml takes, as `(shown, spellings)`: `[gateway] url` is
/// also matched as `url`, `gateway_url` and `gateway.url`, so a key put in
/// the wrong table or with its table glued on still finds its real name.
/// Read from the structs themselves (serde names the valid keys when it
/// refuses one), so the list cannot drift from what is parsed.
fn config_keys() -> Vec<(String, Vec<String>)> {
    const PROBE: &str = "__clawmux_probe__";
    fn fields<T: serde::de::DeserializeOwned>() -> Vec<String> {
        let probe = format!("{PROBE} = 0");
        match toml::from_str::<T>(&probe) {
            Err(e) => e
                .message()
                .split('`')
                .skip(3)
                .step_by(2)
                .map(str::to_owned)
                .collect(),
            Ok(_) => Vec::new(),
        }
    }
    let mut keys = Vec::new();
    let tables = [
        ("gateway", "[gateway]", fields::<GatewaySection>()),
        ("limits", "[limits]", fields::<LimitsSection>()),
        ("upstream", "[upstream]", fields::<UpstreamSection>()),
        ("sockets", "[[sockets]]", fields::<SocketSection>()),
    ];
    for top in fields::<ConfigFile>() {
        if !tables.iter().any(|(name, _, _)| *name == top) {
            keys.push((top.clone(), vec![top]));
        }
    }
    for (name, shown, table) in tables {
        for key in table {
            keys.push((
                format!("{shown} {key}"),
                vec![
                    key.clone(),
                    format!("{name}_{key}"),
                    format!("{name}.{key}"),
                ],
            ));
        }
    }
    keys
}

/// The known key nearest to `wanted` (a small edit distance, or a close
/// Jaro-Winkler similarity, as `call`'s method suggestions use), if any.
fn nearest_config_key(wanted: &str) -> Option<String> {
    let wanted = wanted.to_ascii_lowercase().replace('-', "_");
    config_keys()
        .into_iter()
        .filter_map(|(shown, spellings)| {
            spellings
                .iter()
                .filter_map(|k| {
                    let edits = strsim::damerau_levenshtein(&wanted, k);
                    let similar = strsim::jaro_winkler(&wanted, k);
                    (edits <= 2 || similar >= 0.9).then_some(similar - edits as f64)
                })
                .max_by(f64::total_cmp)
                .map(|score| (score, shown))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, shown)| shown)
}

/// serde's "unknown field `x`, expected one of `a`, `b`" as a message that
/// names the key, then (after the position the caller puts between) the
/// nearest known key and the valid ones. Key names are not secrets, but a
/// "key" that does not look like one (a pasted token?) is still hidden.
fn unknown_key(message: &str) -> Option<(String, String)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let looks_like_a_key = key.len() <= 64
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    let key = if looks_like_a_key { key } else { "…" };
    let valid: Vec<&str> = rest.split('`').skip(1).step_by(2).collect();
    let near = looks_like_a_key
        .then(|| nearest_config_key(key))
        .flatten()
        .map(|k| format!("did you mean `{k}`? "))
        .unwrap_or_default();
    Some((
        format!("unknown key `{key}`"),
        if valid.is_empty() {
            format!(" ({near}this table takes no keys)")
        } else {
            format!(" ({near}valid keys here: {})", valid.join(", "))
        },
    ))
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
        Some((_, src)) if src.file() == Some(file) => true,
        Some((u, _)) => is_loopback_url(u),
    }
}

/// A pin as given (`sha256:`, hex, colon pairs), normalized; anything else
/// is a settings error naming where it came from.
fn pin_from(raw: &str, source: Source) -> Result<(String, Source), ErrorShape> {
    crate::upstream::tls::normalize_fingerprint(raw)
        .map(|pin| (pin, source.clone()))
        .ok_or_else(|| {
            ErrorShape::studio(
                StudioCode::SettingsLoadFailed,
                format!(
                    "the TLS fingerprint from {source} is not a SHA-256 certificate fingerprint \
                     (64 hex digits, optionally colon-separated, optionally prefixed sha256:)"
                ),
            )
        })
}

/// The trimmed value; `None` when absent or blank (blank means unset in every settings file).
fn non_empty(v: Option<&str>) -> Option<&str> {
    v.map(str::trim).filter(|v| !v.is_empty())
}

/// The port OpenClaw's gateway listens on unless told otherwise.
const OPENCLAW_DEFAULT_PORT: u16 = 18789;

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

/// clawmux's own config.toml: --config, CLAWMUX_CONFIG, else
/// $XDG_CONFIG_HOME/clawmux/config.toml (`~/.config/…`).
pub fn config_file_path(over: &Overrides, env: &Env) -> Option<PathBuf> {
    over.config
        .clone()
        .or_else(|| env.get("CLAWMUX_CONFIG").map(|p| env.expand(p)))
        .or_else(|| {
            let base = env
                .get("XDG_CONFIG_HOME")
                .map(PathBuf::from)
                .or_else(|| env.home().map(|h| h.join(".config")))?;
            Some(base.join("clawmux/config.toml"))
        })
}

/// Resolves every setting. `Err` is a `studio.settings_load_failed` (or an
/// unusable token file); the caller keeps serving and reports it to clients.
pub fn resolve(over: &Overrides, env: &Env) -> Result<Resolved, ErrorShape> {
    let mut warnings = Vec::new();
    let config_path = config_file_path(over, env);
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

    // The password, the certificate pin and the CA file from the broker's own sources.
    let mut password: Option<(Secret, Source)> = None;
    if let Some(p) = env.get("CLAWMUX_GATEWAY_PASSWORD") {
        password = Some((Secret::new(p), Source::Env("CLAWMUX_GATEWAY_PASSWORD")));
    } else if let Some(p) = non_empty(file.gateway.password.as_deref()) {
        if let Some(path) = &config_file {
            check_secret_file(path, &mut warnings);
        }
        password = Some((Secret::new(p), file_src()));
    }
    let mut pin = if let Some(f) = &over.tls_fingerprint {
        Some(pin_from(f, Source::Flag("--tls-fingerprint"))?)
    } else if let Some(f) = env.get("CLAWMUX_TLS_FINGERPRINT") {
        Some(pin_from(f, Source::Env("CLAWMUX_TLS_FINGERPRINT"))?)
    } else if let Some(f) = non_empty(file.gateway.tls_fingerprint.as_deref()) {
        Some(pin_from(f, file_src())?)
    } else {
        None
    };
    let ca_file = over
        .tls_ca_file
        .clone()
        .map(|p| (p, Source::Flag("--tls-ca-file")))
        .or_else(|| {
            env.get("CLAWMUX_TLS_CA_FILE")
                .map(|p| (env.expand(p), Source::Env("CLAWMUX_TLS_CA_FILE")))
        })
        .or_else(|| {
            file.gateway
                .tls_ca_file
                .as_ref()
                .map(|p| (env.expand(&p.to_string_lossy()), file_src()))
        });

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
        let key = |k: &'static str| Source::FileKey(path.clone(), k);
        let remote_mode = str_at(&v, "/gateway/mode") == Some("remote");
        let tls_enabled = v.pointer("/gateway/tls/enabled").and_then(Value::as_bool) == Some(true);
        // Where the URL taken from this file points: the remote gateway, or
        // the local one with its own TLS.
        let mut url_from_remote = false;
        let mut url_local_tls = false;
        if url.is_none() {
            let remote_url = non_empty(str_at(&v, "/gateway/remote/url")).filter(|_| remote_mode);
            if let Some(u) = remote_url {
                url = Some((u.to_owned(), key("gateway.remote.url")));
                url_from_remote = true;
            } else {
                if remote_mode {
                    warnings.push(format!(
                        "{}: gateway.mode is \"remote\" but gateway.remote.url is missing: using the local gateway; set gateway.remote.url",
                        path.display()
                    ));
                }
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
                    })
                    .or_else(|| {
                        tls_enabled
                            .then(|| (Some(OPENCLAW_DEFAULT_PORT), key("gateway.tls.enabled")))
                    });
                if let Some((port, source)) = port {
                    let port = port.ok_or_else(|| {
                        ErrorShape::studio(
                            StudioCode::SettingsLoadFailed,
                            format!(
                                "the gateway port from {source} is not a port number (1-65535)"
                            ),
                        )
                    })?;
                    let scheme = if tls_enabled { "wss" } else { "ws" };
                    url = Some((format!("{scheme}://localhost:{port}"), source));
                    url_local_tls = tls_enabled;
                }
            }
        }
        let allowed = file_token_allowed(&url, &path);
        // `gateway.remote.*` credentials go to the remote URL, and to a
        // loopback URL (an SSH tunnel) only when `gateway.auth.*` has none,
        // as OpenClaw's local commands use them.
        let local_or_remote = |local: &str, remote: &'static str, remote_key: &'static str| {
            if url_from_remote {
                non_empty(str_at(&v, remote)).map(|t| (Secret::new(t), key(remote_key)))
            } else {
                non_empty(str_at(&v, local))
                    .map(|t| (Secret::new(t), Source::File(path.clone())))
                    .or_else(|| {
                        non_empty(str_at(&v, remote))
                            .filter(|_| remote_mode)
                            .map(|t| (Secret::new(t), key(remote_key)))
                    })
            }
        };
        if token.is_none() && allowed {
            if let Some(t) = env.get("OPENCLAW_GATEWAY_TOKEN") {
                token = Some((Secret::new(t), Source::Env("OPENCLAW_GATEWAY_TOKEN")));
            } else if let Some(found) = local_or_remote(
                "/gateway/auth/token",
                "/gateway/remote/token",
                "gateway.remote.token",
            ) {
                token = Some(found);
            }
        }
        if password.is_none() && allowed {
            if let Some(p) = env.get("OPENCLAW_GATEWAY_PASSWORD") {
                password = Some((Secret::new(p), Source::Env("OPENCLAW_GATEWAY_PASSWORD")));
            } else if let Some(found) = local_or_remote(
                "/gateway/auth/password",
                "/gateway/remote/password",
                "gateway.remote.password",
            ) {
                password = Some(found);
            }
        }
        if pin.is_none() && url_from_remote {
            if let Some(f) = non_empty(str_at(&v, "/gateway/remote/tlsFingerprint")) {
                pin = Some(pin_from(f, key("gateway.remote.tlsFingerprint"))?);
            }
        }
        if pin.is_none() && url_local_tls {
            let cert = non_empty(str_at(&v, "/gateway/tls/certPath"))
                .map(|p| env.expand(p))
                .unwrap_or_else(|| state_dir.join("gateway/tls/gateway-cert.pem"));
            match crate::upstream::tls::certificate_file_fingerprint(&cert) {
                Ok((_, fp)) => {
                    pin = Some(pin_from(&fp, Source::Certificate(cert))?);
                }
                // As OpenClaw: no certificate, no implicit pin; the normal trust checks apply.
                Err(why) => warnings.push(format!(
                    "{why}: the local gateway has gateway.tls.enabled but no certificate pin could be derived \
                     (start the gateway once to generate its certificate, or set --tls-fingerprint)"
                )),
            }
        }
    }
    let (gateway_url, url_source) =
        url.unwrap_or_else(|| (DEFAULT_GATEWAY_URL.to_owned(), Source::Default));
    settings.gateway_url = gateway_url;
    let token_source = token.as_ref().map(|(_, s)| s.clone());
    settings.token = token.map(|(t, _)| t);
    let password_source = password.as_ref().map(|(_, s)| s.clone());
    settings.password = password.map(|(p, _)| p);
    let tls_fingerprint_source = pin.as_ref().map(|(_, s)| s.clone());
    settings.tls.fingerprint = pin.map(|(p, _)| p);
    let tls_ca_file_source = ca_file.as_ref().map(|(_, s)| s.clone());
    settings.tls.ca_file = ca_file.map(|(p, _)| p);
    settings.allow_insecure_private_ws = env
        .vars
        .get(crate::upstream::tls::BREAK_GLASS_ENV)
        .is_some_and(|v| v == "1");

    let path = config_file.clone().unwrap_or_default();
    apply_limits(&mut settings, &file).map_err(|why| load_failed(&path, why))?;
    settings.sockets = socket_policies(&settings.socket_path, &file.sockets, env)
        .map_err(|why| load_failed(&path, why))?;
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
        password_source,
        tls_fingerprint_source,
        tls_ca_file_source,
        socket_source,
        config_file,
        openclaw_state_dir: state_dir,
        warnings,
    })
}

/// The `[[sockets]]` entries as policies; the error names the entry.
fn socket_policies(
    main: &Path,
    sections: &[SocketSection],
    env: &Env,
) -> Result<Vec<crate::policy::SocketPolicy>, String> {
    use crate::policy::{scopes, Grant, MethodFilter, SocketPolicy};
    let mut out: Vec<SocketPolicy> = Vec::new();
    for (i, s) in sections.iter().enumerate() {
        let at = format!("sockets[{i}]");
        let name = s.name.trim();
        if name.is_empty()
            || name == "default"
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "{at}.name must be a name of letters, digits, '-', '_' or '.' (not \"default\")"
            ));
        }
        let path = env.expand(&s.path.to_string_lossy());
        if !path.is_absolute() {
            return Err(format!("{at}.path must be an absolute path"));
        }
        if path == main || out.iter().any(|o| o.path == path || o.name == name) {
            return Err(format!(
                "{at}: another socket already has this name or path"
            ));
        }
        let mode = match &s.mode {
            None => 0o600,
            Some(m) => match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
                Ok(m) if m & !0o777 == 0 && m & 0o600 == 0o600 => m,
                _ => return Err(format!("{at}.mode must be octal permissions such as \"0660\", readable and writable by the owner")),
            },
        };
        if mode & 0o007 != 0 && s.uids.is_empty() && s.gids.is_empty() {
            // Harmless (peer credentials decide), but a sign of a mistake.
            tracing::debug!(
                socket = name,
                "mode lets everyone reach the socket; only the owner is admitted"
            );
        }
        let known = |v: &str| v.starts_with("operator.");
        let granted = match &s.scopes {
            None => None,
            Some(list) => {
                if let Some(bad) = list.iter().find(|v| !known(v)) {
                    return Err(format!(
                        "{at}.scopes: {bad:?} is not an operator scope (e.g. {}, {})",
                        scopes::READ,
                        scopes::WRITE
                    ));
                }
                Some(Grant::new(list))
            }
        };
        out.push(SocketPolicy {
            name: name.to_owned(),
            path,
            mode,
            uids: s.uids.clone(),
            gids: s.gids.clone(),
            scopes: granted,
            methods: MethodFilter {
                allow: s.allow_methods.clone(),
                deny: s.deny_methods.clone(),
            },
            observe: s.observe,
        });
    }
    Ok(out)
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
        replay_persist,
        sse_keepalive_ms,
        max_connections,
        header_read_timeout_ms,
        max_dedicated,
        upstream_open_rate,
        upstream_open_burst,
        upstream_open_rate_total,
        upstream_open_burst_total,
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
        lim.replay_persist,
        "limits",
        replay_persist,
        |_: &str, v: bool| { Ok::<_, String>(v) }
    );
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
    set!(
        lim.upstream_open_rate,
        "limits",
        upstream_open_rate,
        positive
    );
    set!(
        lim.upstream_open_burst,
        "limits",
        upstream_open_burst,
        positive
    );
    set!(
        lim.upstream_open_rate_total,
        "limits",
        upstream_open_rate_total,
        positive
    );
    set!(
        lim.upstream_open_burst_total,
        "limits",
        upstream_open_burst_total,
        positive
    );
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
    if let Some(v) = &file.upstream.dedicated_origin {
        up.dedicated_origin = crate::config::DedicatedOrigin::parse(v)?;
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
    fn an_unknown_key_is_named_with_the_valid_ones() {
        let joined = |m: &str| unknown_key(m).map(|(a, b)| a + &b);
        assert_eq!(
            joined("unknown field `sockt`, expected one of `socket`, `gateway`").unwrap(),
            "unknown key `sockt` (did you mean `socket`? valid keys here: socket, gateway)"
        );
        assert_eq!(
            joined("unknown field `s3cret token!`, expected `url`").unwrap(),
            "unknown key `…` (valid keys here: url)"
        );
        assert!(unknown_key("invalid type: string \"x\", expected u64").is_none());
    }

    #[test]
    fn a_misplaced_or_misspelt_key_gets_its_real_name() {
        assert_eq!(
            nearest_config_key("gatway_url").as_deref(),
            Some("[gateway] url")
        );
        assert_eq!(
            nearest_config_key("gateway_url").as_deref(),
            Some("[gateway] url")
        );
        assert_eq!(
            nearest_config_key("tokn_file").as_deref(),
            Some("[gateway] token_file")
        );
        assert_eq!(
            nearest_config_key("max_client").as_deref(),
            Some("[limits] max_clients")
        );
        assert_eq!(nearest_config_key("sockte").as_deref(), Some("socket"));
        assert_eq!(nearest_config_key("completely_unrelated_words"), None);
        let text = "gatway_url = \"ws://x\"\n";
        let e = parse_toml(Path::new("/c.toml"), text).unwrap_err();
        assert_eq!(
            e.message,
            "cannot load settings from /c.toml: unknown key `gatway_url` at line 1 column 1 (did you mean `[gateway] url`? valid keys here: socket, gateway, limits, upstream, sockets); fix or remove the file"
        );
    }

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

    /// Resolves with `toml` as the config file and the main socket at
    /// `/run/x/main.sock`.
    fn resolve_with(toml: &str) -> Result<Resolved, ErrorShape> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, toml).unwrap();
        let over = Overrides {
            config: Some(path),
            socket: Some("/run/x/main.sock".into()),
            ..Overrides::default()
        };
        resolve(&over, &Env::default())
    }

    /// An absurd or zero duration or count in config.toml is a settings
    /// error naming the key, not a panic on the first request.
    #[test]
    fn absurd_limits_name_their_key() {
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

    /// `[upstream] dedicated_origin`: an origin, `""` for none, or a
    /// settings error naming the key.
    #[test]
    fn the_dedicated_origin_is_read_and_checked() {
        use crate::config::DedicatedOrigin;
        let origin = |toml: &str| resolve_with(toml).map(|r| r.settings.upstream.dedicated_origin);
        assert_eq!(origin("").unwrap(), DedicatedOrigin::Derived);
        assert_eq!(
            origin("[upstream]\ndedicated_origin = \"http://localhost:3000\"\n").unwrap(),
            DedicatedOrigin::Fixed("http://localhost:3000".into())
        );
        assert_eq!(
            origin("[upstream]\ndedicated_origin = \"\"\n").unwrap(),
            DedicatedOrigin::Off
        );
        let err = origin("[upstream]\ndedicated_origin = \"localhost\"\n").unwrap_err();
        assert_eq!(err.code, "studio.settings_load_failed");
        assert!(
            err.message.contains("upstream.dedicated_origin"),
            "{}",
            err.message
        );
    }

    /// `[[sockets]]` entries become policies; a bad one names itself.
    #[test]
    fn policy_sockets_are_read_and_checked() {
        let ok = resolve_with(
            "[[sockets]]\nname = \"ro\"\npath = \"/run/x/ro.sock\"\nmode = \"0660\"\ngids = [50]\nscopes = [\"operator.read\"]\ndeny_methods = [\"config.*\"]\n",
        )
        .unwrap();
        let p = &ok.settings.sockets[0];
        assert_eq!(
            (p.name.as_str(), p.mode, p.gids.as_slice()),
            ("ro", 0o660, &[50][..])
        );
        assert_eq!(p.scopes, Some(crate::policy::Grant::new(["operator.read"])));
        assert!(!p.methods.allows("config.get") && p.methods.allows("status"));
        for (toml, says) in [
            ("[[sockets]]\nname = \"a\"\npath = \"rel.sock\"\n", "sockets[0].path"),
            ("[[sockets]]\nname = \"a\"\npath = \"/a.sock\"\nmode = \"0400\"\n", "sockets[0].mode"),
            ("[[sockets]]\nname = \"a\"\npath = \"/a.sock\"\nscopes = [\"admin\"]\n", "sockets[0].scopes"),
            ("[[sockets]]\nname = \"default\"\npath = \"/a.sock\"\n", "sockets[0].name"),
            ("[[sockets]]\nname = \"a\"\npath = \"/run/x/main.sock\"\n", "sockets[0]"),
            (
                "[[sockets]]\nname = \"a\"\npath = \"/a.sock\"\n[[sockets]]\nname = \"a\"\npath = \"/b.sock\"\n",
                "sockets[1]",
            ),
        ] {
            let err = resolve_with(toml).unwrap_err();
            assert!(err.message.contains(says), "{toml}: {}", err.message);
        }
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
