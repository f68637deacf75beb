//! Settings resolution (design §7): where the gateway URL, the token and the
//! limits come from, with each value's source kept for `clawmux doctor`.
//!
//! Precedence, highest first: flags > `CLAWMUX_*` environment >
//! `$CREDENTIALS_DIRECTORY/gateway-token` (token only) > `config.toml` >
//! `~/.config/clawmux/gateway-token` (token only) >
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

use serde_json::Value;

use crate::config::{self, Secret, Settings, DEFAULT_GATEWAY_URL};
use crate::protocol::{ErrorShape, StudioCode};

mod file;
mod limits;
mod own_socket;

use self::file::*;
use self::limits::{apply_limits, socket_policies};
pub use self::own_socket::{own_socket_named, socket_path_in_url};
use self::own_socket::{passed_over_note, self_url_refused};

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
    /// Settings files passed over because they point at this broker, in
    /// words (also in `settings.discovery` for `clawmux status`).
    pub discovery: Vec<String>,
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

/// Claw3D studio's settings file: `<stateDir>/claw3d/settings.json`.
pub fn claw3d_settings_path(env: &Env) -> PathBuf {
    openclaw_state_dir(env).join("claw3d/settings.json")
}

/// OpenClaw's config file: `OPENCLAW_CONFIG_PATH`, else `<stateDir>/openclaw.json`.
pub fn openclaw_config_path(env: &Env) -> PathBuf {
    env.get("OPENCLAW_CONFIG_PATH")
        .map(|p| env.expand(p))
        .unwrap_or_else(|| openclaw_state_dir(env).join("openclaw.json"))
}

/// A front end's JSON settings file (JSON5 for OpenClaw's), read and parsed
/// as discovery reads it; `Ok(None)` when it does not exist.
pub fn read_front_end_file(path: &Path, json5: bool) -> Result<Option<Value>, ErrorShape> {
    read_optional(path)?
        .map(|text| parse_json_like(path, &text, json5))
        .transpose()
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

/// clawmux's own token file, read when no flag, variable, credential or
/// config.toml key names a token: `$XDG_CONFIG_HOME/clawmux/gateway-token`
/// (`~/.config/…`), the file the README has you write and the service's
/// `LoadCredential=` reads. The same checks as `--token-file` apply.
pub fn default_token_file(env: &Env) -> Option<PathBuf> {
    let base = env
        .get("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| env.home().map(|h| h.join(".config")))?;
    Some(base.join("clawmux").join(crate::systemd::TOKEN_CREDENTIAL))
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
    let path = config_file.clone().unwrap_or_default();
    settings.sockets = socket_policies(&settings.socket_path, &file.sockets, env)
        .map_err(|why| load_failed(&path, why))?;
    let own_sockets = settings.own_socket_paths();

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
    if let Some((u, source)) = &url {
        if let Some(mine) = own_socket_named(u, &own_sockets) {
            return Err(self_url_refused(u, source, mine));
        }
    }
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
        } else if let Some(p) = default_token_file(env).filter(|p| p.exists()) {
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
    // A file whose URL names one of this broker's sockets describes no
    // gateway: neither its URL nor its credentials are used.
    let state_dir = openclaw_state_dir(env);
    let mut passed_over: Vec<(&'static str, PathBuf, PathBuf)> = Vec::new();
    if url.is_none() || token.is_none() {
        let path = claw3d_settings_path(env);
        if let Some(text) = read_optional(&path)? {
            let v = parse_json_like(&path, &text, false)?;
            let mine = str_at(&v, "/gateway/url").and_then(|u| own_socket_named(u, &own_sockets));
            if let Some(mine) = mine {
                passed_over.push(("Claw3D's", path.clone(), mine.to_path_buf()));
            } else if url.is_none() {
                if let Some(u) = str_at(&v, "/gateway/url").filter(|u| !u.is_empty()) {
                    url = Some((u.to_owned(), Source::File(path.clone())));
                }
            }
            if mine.is_none() && token.is_none() && file_token_allowed(&url, &path) {
                if let Some(t) = str_at(&v, "/gateway/token").filter(|t| !t.is_empty()) {
                    check_secret_file(&path, &mut warnings);
                    token = Some((Secret::new(t), Source::File(path.clone())));
                }
            }
        }
    }
    if url.is_none() || token.is_none() {
        let path = openclaw_config_path(env);
        let v = match read_optional(&path)? {
            Some(text) => parse_json_like(&path, &text, true)?,
            None => Value::Null,
        };
        let key = |k: &'static str| Source::FileKey(path.clone(), k);
        let mut remote_mode = str_at(&v, "/gateway/mode") == Some("remote");
        if let Some(mine) = non_empty(str_at(&v, "/gateway/remote/url"))
            .filter(|_| remote_mode)
            .and_then(|u| own_socket_named(u, &own_sockets))
        {
            // Its remote gateway is this broker: OpenClaw's local gateway
            // (and its `gateway.auth`) is the one left to try.
            passed_over.push(("OpenClaw's", path.clone(), mine.to_path_buf()));
            remote_mode = false;
        }
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
    let discovery: Vec<String> = passed_over
        .iter()
        .map(|(whose, file, mine)| passed_over_note(whose, file, mine, &gateway_url, &url_source))
        .collect();
    for note in &discovery {
        tracing::info!("{note}");
    }
    settings.discovery = discovery.clone();
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
        password_source,
        tls_fingerprint_source,
        tls_ca_file_source,
        socket_source,
        config_file,
        openclaw_state_dir: state_dir,
        warnings,
        discovery,
    })
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

    /// The token file the README writes is read when nothing ranked above
    /// it names a token, and it outranks Claw3D's and OpenClaw's files.
    #[test]
    fn the_default_token_file_is_read_below_the_brokers_own_sources() {
        use std::os::unix::fs::PermissionsExt;
        let home = tempfile::tempdir().unwrap();
        let dir = home.path().join(".config/clawmux");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("gateway-token");
        std::fs::write(&file, "file-token\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let claw3d = home.path().join(".openclaw/claw3d");
        std::fs::create_dir_all(&claw3d).unwrap();
        std::fs::write(
            claw3d.join("settings.json"),
            r#"{"gateway":{"url":"ws://localhost:1","token":"claw3d-token"}}"#,
        )
        .unwrap();
        let env = |extra: &[(&str, &str)]| Env {
            vars: [("HOME", home.path().to_str().unwrap())]
                .iter()
                .chain(extra)
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let token = |r: &Resolved| r.settings.token.as_ref().unwrap().expose().to_owned();
        let r = resolve(&Overrides::default(), &env(&[])).unwrap();
        assert_eq!(token(&r), "file-token");
        assert_eq!(r.token_source, Some(Source::File(file.clone())));
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        let r = resolve(
            &Overrides::default(),
            &env(&[("CLAWMUX_GATEWAY_TOKEN", "env")]),
        )
        .unwrap();
        assert_eq!(token(&r), "env");
        std::fs::write(dir.join("config.toml"), "[gateway]\ntoken = \"toml\"\n").unwrap();
        std::fs::set_permissions(
            dir.join("config.toml"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        assert_eq!(
            token(&resolve(&Overrides::default(), &env(&[])).unwrap()),
            "toml"
        );
        std::fs::remove_file(dir.join("config.toml")).unwrap();
        // Readable by others: used, with the same warning as --token-file.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let r = resolve(&Overrides::default(), &env(&[])).unwrap();
        assert_eq!(token(&r), "file-token");
        assert!(
            r.warnings.iter().any(|w| w.contains("chmod 600")),
            "{:?}",
            r.warnings
        );
        // Without the file, Claw3D's token is next.
        std::fs::remove_file(&file).unwrap();
        assert_eq!(
            token(&resolve(&Overrides::default(), &env(&[])).unwrap()),
            "claw3d-token"
        );
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

    /// A wrong value names the key, what was expected and what was found,
    /// in words; a syntax error says where; a misspelt table header gets
    /// its real name. Never a value of a key that holds a secret.
    #[test]
    fn config_errors_are_in_the_users_words() {
        let why = |text: &str| {
            parse_toml(Path::new("/c.toml"), text)
                .unwrap_err()
                .message
                .trim_start_matches("cannot load settings from /c.toml: ")
                .trim_end_matches("; fix or remove the file")
                .to_owned()
        };
        assert_eq!(
            why("[limits]\nmax_clients = \"abc\"\n"),
            "limits.max_clients at line 2 column 15: expected a whole number (0 or more), found \"abc\""
        );
        assert_eq!(
            why("[limits]\nmax_clients = -1\n"),
            "limits.max_clients at line 2 column 15: expected a whole number (0 or more), found -1"
        );
        assert_eq!(
            why("[limits]\nrequest_rate = 99999999999\n"),
            "limits.request_rate at line 2 column 16: expected a whole number from 0 to 4294967295, found 99999999999"
        );
        assert_eq!(
            why("[limits]\nreplay_persist = 1\n"),
            "limits.replay_persist at line 2 column 18: expected true or false, found 1"
        );
        assert_eq!(
            why("[gateway]\ntoken = 12345\n"),
            "gateway.token at line 2 column 9: expected text in quotes, found something else"
        );
        assert_eq!(
            why("[limits\nmax_clients = 1\n"),
            "TOML syntax error at line 1 column 8: a table header has no closing `]` (write e.g. `[limits]`)"
        );
        assert_eq!(
            why("[[sockets]]\nname = \"a\"\n"),
            "sockets needs the key `path` at line 1 column 1"
        );
        let e = why("[limts]\nmax_clients = 1\n");
        assert!(
            e.starts_with("unknown table `[limts]` at line 1 column 2 (did you mean `[limits]`?"),
            "{e}"
        );
        let e = why("[gatewy]\nurl = \"ws://x\"\n");
        assert!(e.contains("did you mean `[gateway]`?"), "{e}");
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
