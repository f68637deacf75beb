//! The front ends on this machine that talk to a gateway, and where each one
//! points: at this broker, at the gateway the broker uses, or elsewhere.
//!
//! Two files decide that: Claw3D studio's `settings.json` (its server-side
//! proxy reads `gateway.url`) and OpenClaw's `openclaw.json` (its CLI and TUI
//! use `gateway.remote.url` in remote mode, else the local gateway's port).
//! `clawmux doctor` reports them; `clawmux setup claw3d` rewires the first.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::settings::{self, Env, Resolved};

pub mod setup;

/// Where a front end's gateway URL leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PointsAt {
    /// One of this broker's sockets (the named one).
    ThisBroker(PathBuf),
    /// The gateway this broker uses.
    TheGateway,
    /// Somewhere else (another gateway, another broker).
    Elsewhere,
}

impl PointsAt {
    fn words(&self) -> &'static str {
        match self {
            PointsAt::ThisBroker(_) => "this broker",
            PointsAt::TheGateway => "the gateway",
            PointsAt::Elsewhere => "elsewhere",
        }
    }
}

/// One front end's settings file as found.
#[derive(Debug, Clone)]
pub struct FrontEnd {
    /// `Claw3D` or `OpenClaw`.
    pub name: &'static str,
    pub file: PathBuf,
    /// The URL it connects to (`None` when the file names none).
    pub url: Option<String>,
    pub points_at: Option<PointsAt>,
    /// The file exists but cannot be read or parsed (the reason, no contents).
    pub error: Option<String>,
}

/// The front ends whose settings files exist, given the broker's resolved
/// settings (its sockets and its gateway URL).
pub fn found(resolved: &Resolved, env: &Env) -> Vec<FrontEnd> {
    let own = resolved.settings.own_socket_paths();
    let gateway = &resolved.settings.gateway_url;
    let mut out = Vec::new();
    let classify = |url: &str| {
        Some(match settings::own_socket_named(url, &own) {
            Some(mine) => PointsAt::ThisBroker(mine.to_path_buf()),
            None if same_gateway(url, gateway) => PointsAt::TheGateway,
            None => PointsAt::Elsewhere,
        })
    };
    let claw3d = settings::claw3d_settings_path(env);
    if let Some(entry) = read(&claw3d, false, |v| {
        // Claw3D's own default when the field is blank (server/studio-settings.js).
        text_at(v, "/gateway/url").unwrap_or_else(|| crate::config::DEFAULT_GATEWAY_URL.into())
    }) {
        out.push(finish("Claw3D", claw3d, entry, classify));
    }
    let openclaw = settings::openclaw_config_path(env);
    if let Some(entry) = read(&openclaw, true, openclaw_url) {
        out.push(finish("OpenClaw", openclaw, entry, classify));
    }
    out
}

/// The URL OpenClaw's own clients use with this config: the remote URL in
/// remote mode, else the local gateway on its port.
fn openclaw_url(v: &Value) -> String {
    let remote = text_at(v, "/gateway/mode").is_some_and(|m| m == "remote");
    if let Some(url) = text_at(v, "/gateway/remote/url").filter(|_| remote) {
        return url;
    }
    let tls = v.pointer("/gateway/tls/enabled").and_then(Value::as_bool) == Some(true);
    let port = v
        .pointer("/gateway/port")
        .and_then(Value::as_u64)
        .unwrap_or(18789);
    format!("{}://localhost:{port}", if tls { "wss" } else { "ws" })
}

fn text_at(v: &Value, pointer: &str) -> Option<String> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// `None`: no such file. `Some(Ok(url))` or `Some(Err(why))`.
fn read(
    path: &Path,
    json5: bool,
    url: impl Fn(&Value) -> String,
) -> Option<Result<String, String>> {
    match settings::read_front_end_file(path, json5) {
        Ok(None) => None,
        Ok(Some(v)) => Some(Ok(url(&v))),
        Err(e) => Some(Err(e.message)),
    }
}

fn finish(
    name: &'static str,
    file: PathBuf,
    entry: Result<String, String>,
    classify: impl Fn(&str) -> Option<PointsAt>,
) -> FrontEnd {
    match entry {
        Ok(url) => FrontEnd {
            name,
            file,
            points_at: classify(&url),
            url: Some(url),
            error: None,
        },
        Err(why) => FrontEnd {
            name,
            file,
            url: None,
            points_at: None,
            error: Some(why),
        },
    }
}

/// Whether two gateway URLs name the same gateway: the same scheme, host
/// and port, loopback names counted as one, a trailing `/` ignored.
fn same_gateway(a: &str, b: &str) -> bool {
    fn key(url: &str) -> Option<(String, String, String)> {
        let url = crate::config::redact_url(url.trim());
        let (scheme, rest) = url.split_once("://")?;
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
                (h.to_owned(), p.to_owned())
            }
            _ => (authority.to_owned(), String::new()),
        };
        let host = host.to_ascii_lowercase();
        let host = match host.as_str() {
            "127.0.0.1" | "[::1]" | "::1" | "localhost" => "localhost".to_owned(),
            _ => host,
        };
        let scheme = scheme.to_ascii_lowercase();
        let port = if port.is_empty() {
            if scheme == "wss" { "443" } else { "80" }.to_owned()
        } else {
            port
        };
        Some((
            scheme,
            format!("{host}:{port}"),
            path.trim_end_matches('/').to_owned(),
        ))
    }
    key(a).is_some() && key(a) == key(b)
}

/// The front ends as a document (URLs without credentials) for `doctor`.
pub fn to_json(front_ends: &[FrontEnd]) -> Value {
    Value::Array(
        front_ends
            .iter()
            .map(|f| {
                json!({
                    "name": f.name,
                    "file": f.file.display().to_string(),
                    "url": f.url.as_deref().map(crate::config::redact_url),
                    "points_at": f.points_at.as_ref().map(PointsAt::words),
                    "socket": match &f.points_at {
                        Some(PointsAt::ThisBroker(p)) => Some(p.display().to_string()),
                        _ => None,
                    },
                    "error": f.error,
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateways_compare_by_scheme_host_and_port() {
        assert!(same_gateway(
            "ws://localhost:18789",
            "ws://127.0.0.1:18789/"
        ));
        assert!(same_gateway("wss://GW.example", "wss://gw.example:443"));
        assert!(!same_gateway(
            "ws://localhost:18789",
            "ws://localhost:18790"
        ));
        assert!(!same_gateway(
            "ws://localhost:18789",
            "wss://localhost:18789"
        ));
        assert!(!same_gateway(
            "ws+unix:///x.sock:/ws",
            "ws://localhost:18789"
        ));
    }

    #[test]
    fn openclaw_clients_use_the_remote_url_only_in_remote_mode() {
        let v = json!({"gateway": {"port": 1234, "remote": {"url": "wss://far"}}});
        assert_eq!(openclaw_url(&v), "ws://localhost:1234");
        let v = json!({"gateway": {"mode": "remote", "remote": {"url": "wss://far"}}});
        assert_eq!(openclaw_url(&v), "wss://far");
        let v = json!({"gateway": {"tls": {"enabled": true}}});
        assert_eq!(openclaw_url(&v), "wss://localhost:18789");
    }
}
