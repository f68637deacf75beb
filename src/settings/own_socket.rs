//! Discovery never loops: a URL that names one of the broker's own sockets
//! is not a gateway.
//!
//! Front ends wired to clawmux (Claw3D's `settings.json`, most often) hold a
//! unix-socket URL in the very field clawmux reads to discover the gateway.
//! Such a URL is recognised in every form a client takes: Node's `ws`
//! (`ws+unix:///run/clawmux.sock:/ws`, and with a host, which `ws` ignores:
//! `ws+unix://localhost/run/clawmux.sock:/ws`), without a request path, with
//! the socket path percent-encoded as the host (`http+unix://%2Frun%2F…`), or
//! as `unix:/path`. Paths are compared after lexical clean-up (`//`, `.`,
//! `..`, a trailing `/`, relative to the working directory) and, when both
//! exist, as the same file (a symlink or a bind mount names the same socket).

use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use super::Source;
use crate::protocol::{ErrorShape, StudioCode};

/// The URL schemes that name a unix socket rather than a host.
const UNIX_SCHEMES: &[&str] = &["ws+unix", "wss+unix", "http+unix", "https+unix", "unix"];

/// The unix socket path a URL names, or `None` for a URL that names a host
/// (`ws://`, `wss://`) or nothing.
pub fn socket_path_in_url(url: &str) -> Option<PathBuf> {
    let url = url.trim();
    let (scheme, rest) = url.split_once(':')?;
    if !UNIX_SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) {
        return None;
    }
    let path = match rest.strip_prefix("//") {
        Some(after) => {
            let (authority, path) = after.split_at(after.find('/').unwrap_or(after.len()));
            let host = percent_decode(authority);
            if host.starts_with('/') {
                // The socket path as the host (`http+unix://%2Frun%2Fx.sock/ws`).
                return Some(PathBuf::from(host));
            }
            path
        }
        None => rest,
    };
    // As Node's `ws`: the socket path is the URL's path up to the first `:`
    // (the request path follows it); a query or fragment is not part of it.
    let socket = path.split(':').next().unwrap_or_default();
    let socket = socket.split(['?', '#']).next().unwrap_or_default();
    (!socket.is_empty()).then(|| PathBuf::from(socket))
}

/// The one of `own` that `url` names, if any.
pub fn own_socket_named<'a>(url: &str, own: &'a [PathBuf]) -> Option<&'a Path> {
    let named = socket_path_in_url(url)?;
    own.iter()
        .find(|mine| same_socket(&named, mine))
        .map(PathBuf::as_path)
}

/// Whether two socket paths name the same socket: the same path once
/// cleaned up, or the same file on disk.
fn same_socket(a: &Path, b: &Path) -> bool {
    let (ca, cb) = (clean(a), clean(b));
    if ca == cb {
        return true;
    }
    if let (Ok(ra), Ok(rb)) = (std::fs::canonicalize(&ca), std::fs::canonicalize(&cb)) {
        if ra == rb {
            return true;
        }
    }
    match (std::fs::metadata(&ca), std::fs::metadata(&cb)) {
        (Ok(ma), Ok(mb)) => ma.dev() == mb.dev() && ma.ino() == mb.ino(),
        _ => false,
    }
}

/// The path made absolute (against the working directory) with `.`, `..`,
/// repeated and trailing separators removed, without touching the disk.
fn clean(path: &Path) -> PathBuf {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(path)
    };
    let mut out = PathBuf::from("/");
    for part in absolute.components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// `%XX` escapes decoded (an invalid one is kept as written).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A configured gateway URL (flag, environment, config.toml) that names one
/// of this broker's sockets: the broker would be its own gateway.
pub(super) fn self_url_refused(url: &str, source: &Source, mine: &Path) -> ErrorShape {
    ErrorShape::studio(
        StudioCode::GatewayUrlInvalid,
        format!(
            "the gateway URL from {source} ({}) points at this broker's own socket {}: \
             clawmux cannot be its own gateway; set it to the gateway's ws:// or wss:// URL \
             (e.g. ws://localhost:18789)",
            crate::sanitize::field(&crate::config::redact_url(url), 300),
            mine.display()
        ),
    )
}

/// What discovery says about a settings file it passed over: whose file,
/// which socket it names, and what was used instead.
pub(super) fn passed_over_note(
    whose: &str,
    file: &Path,
    mine: &Path,
    used_url: &str,
    used: &Source,
) -> String {
    let instead = match used {
        Source::Default => format!("using the default {used_url}"),
        Source::File(p) | Source::FileKey(p, _) => match p.file_name() {
            Some(name) => format!("using {} ({})", name.to_string_lossy(), p.display()),
            None => format!("using {}", p.display()),
        },
        other => format!("using {other}"),
    };
    format!(
        "{whose} {} points at this broker ({}); {instead}",
        file.file_name().map_or_else(
            || file.display().to_string(),
            |n| n.to_string_lossy().into_owned()
        ),
        mine.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_url_form_names_its_socket() {
        let own = [
            PathBuf::from("/run/user/1000/clawmux.sock"),
            PathBuf::from("/run/user/1000/ro.sock"),
        ];
        for url in [
            "ws+unix:///run/user/1000/clawmux.sock:/ws",
            "ws+unix://localhost/run/user/1000/clawmux.sock:/ws",
            "ws+unix://localhost/run/user/1000/clawmux.sock:/api/gateway/ws",
            "WS+UNIX://LOCALHOST/run/user/1000/clawmux.sock:/ws?restarts=mirror",
            "ws+unix:///run/user/1000/clawmux.sock",
            "ws+unix:///run/user/1000/clawmux.sock/",
            "ws+unix:///run/user/1000/clawmux.sock/:/ws",
            "ws+unix:////run//user/1000/./clawmux.sock:/ws",
            "ws+unix:///run/user/1000/x/../clawmux.sock:/ws",
            "wss+unix:///run/user/1000/clawmux.sock:/ws",
            "http+unix://%2Frun%2Fuser%2F1000%2Fclawmux.sock/ws",
            "unix:/run/user/1000/clawmux.sock",
            "unix:///run/user/1000/clawmux.sock",
            "  ws+unix://localhost/run/user/1000/clawmux.sock:/ws  ",
        ] {
            assert_eq!(own_socket_named(url, &own), Some(own[0].as_path()), "{url}");
        }
        assert_eq!(
            own_socket_named("ws+unix://localhost/run/user/1000/ro.sock:/ws", &own),
            Some(own[1].as_path())
        );
        for url in [
            "ws://localhost:18789",
            "wss://gw.example/run/user/1000/clawmux.sock",
            "ws+unix:///run/user/1000/other.sock:/ws",
            "ws+unix://localhost/run/user/1000/clawmux.sock.old:/ws",
            "ws+unix://",
            "",
        ] {
            assert_eq!(own_socket_named(url, &own), None, "{url}");
        }
    }

    #[test]
    fn a_relative_or_symlinked_path_names_the_same_socket() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("clawmux.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&real).unwrap();
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let own = [real.clone()];
        let url = format!("ws+unix://localhost{}:/ws", link.display());
        assert_eq!(own_socket_named(&url, &own), Some(real.as_path()));
        let cwd = std::env::current_dir().unwrap();
        let relative = pathdiff(&real, &cwd);
        let url = format!("ws+unix:{}:/ws", relative.display());
        assert_eq!(own_socket_named(&url, &own), Some(real.as_path()), "{url}");
    }

    /// `path` relative to `base` (both absolute), with `..` as needed.
    fn pathdiff(path: &Path, base: &Path) -> PathBuf {
        let (p, b): (Vec<_>, Vec<_>) = (path.components().collect(), base.components().collect());
        let common = p.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let mut out = PathBuf::new();
        for _ in common..b.len() {
            out.push("..");
        }
        for c in &p[common..] {
            out.push(c);
        }
        out
    }
}
