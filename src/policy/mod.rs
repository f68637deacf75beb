//! Least privilege: each local client holds the authority it asked for,
//! within what the broker's session holds and what its socket allows.
//!
//! - [`scopes`]: operator scopes and their implications ([`Grant`]).
//! - [`methods`]: which scope each gateway method needs (the gateway's own
//!   table), checked before a request is forwarded.
//! - [`events`]: which scope each event needs, checked per client.
//! - [`stop`]: the chat messages the gateway reads as "stop this session's
//!   runs" (the abort ownership rule applies to them).
//! - [`SocketPolicy`]: what every client of one socket gets at most (scopes,
//!   method allow/deny lists, which users may connect).

pub mod events;
pub mod methods;
pub mod scopes;
pub mod stop;

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::protocol::ErrorShape;
pub use scopes::Grant;

/// The policy of one listening socket.
#[derive(Debug, Clone, PartialEq)]
pub struct SocketPolicy {
    /// `default` for the main socket, else the configured name (also the
    /// systemd `FileDescriptorName=` that socket activation passes it by).
    pub name: String,
    pub path: PathBuf,
    /// The socket file's mode (the main socket is always 0600).
    pub mode: u32,
    /// Users (besides the broker's own) whose connections are admitted.
    pub uids: Vec<u32>,
    /// Groups whose members' connections are admitted (by the peer's
    /// primary group, as the kernel reports it).
    pub gids: Vec<u32>,
    /// At most these scopes for every client; `None` = no ceiling beyond
    /// the broker's session.
    pub scopes: Option<Grant>,
    pub methods: MethodFilter,
    /// Observer powers: the request tap (`/v1/events?tap=1`, every client's
    /// requests and answers) and every client's tool-stream events
    /// (`tool_events=all`), and the HUD. On for the main socket; off unless
    /// set (`observe = true`) on every `[[sockets]]` entry — never derived
    /// from `operator.admin` (before: a socket with only `allow_methods`
    /// granted admin, and so the tap, to another user).
    pub observe: bool,
}

impl SocketPolicy {
    /// The main socket: the owner only, no ceiling, every method.
    pub fn main(path: PathBuf) -> SocketPolicy {
        SocketPolicy {
            name: "default".into(),
            path,
            mode: 0o600,
            uids: Vec::new(),
            gids: Vec::new(),
            scopes: None,
            methods: MethodFilter::default(),
            observe: true,
        }
    }

    /// Whether this is the main socket (owner only, no policy).
    pub fn is_main(&self) -> bool {
        self.name == "default"
    }

    /// May a peer with these credentials connect? The broker's own user
    /// always may (it could read the broker's token anyway).
    pub fn admits(&self, uid: u32, gid: u32, me: u32) -> bool {
        uid == me || self.uids.contains(&uid) || self.gids.contains(&gid)
    }

    /// The ceiling this socket puts on `session` (the broker's scopes).
    pub fn ceiling(&self, session: &Grant) -> Grant {
        match &self.scopes {
            Some(s) => s.within(session),
            None => session.clone(),
        }
    }
}

/// Method allow/deny lists. A pattern is a method name or a prefix ending in
/// `*` (`config.*`); deny wins; an empty allow list allows every method.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MethodFilter {
    pub allow: Vec<String>,
    pub deny: Vec<String>,
}

impl MethodFilter {
    fn matches(pattern: &str, method: &str) -> bool {
        match pattern.strip_suffix('*') {
            Some(prefix) => method.starts_with(prefix),
            None => pattern == method,
        }
    }

    pub fn allows(&self, method: &str) -> bool {
        !self.deny.iter().any(|p| Self::matches(p, method))
            && (self.allow.is_empty() || self.allow.iter().any(|p| Self::matches(p, method)))
    }
}

/// What one local client may do: its scopes and its socket's method lists.
#[derive(Debug, Clone)]
pub struct Access {
    pub grant: Grant,
    pub socket: Arc<SocketPolicy>,
}

impl Access {
    /// Every operator scope on the main socket (the broker's own tools and tests).
    pub fn unrestricted() -> Access {
        Access {
            grant: Grant::new(scopes::REQUESTED_SCOPES),
            socket: Arc::new(SocketPolicy::main(PathBuf::new())),
        }
    }

    /// Checks a request before it is forwarded; `Err` is the answer.
    pub fn check(
        &self,
        method: &str,
        params: Option<&serde_json::value::RawValue>,
    ) -> Result<(), ErrorShape> {
        self.check_socket(method)?;
        methods::authorize(method, params, &self.grant)
    }

    /// [`Access::check`] with the params parsed already (`Null` when
    /// absent; only read when [`methods::reads_params`] says so).
    pub fn check_parsed(&self, method: &str, params: &Value) -> Result<(), ErrorShape> {
        self.check_socket(method)?;
        methods::authorize_parsed(method, params, &self.grant)
    }

    fn check_socket(&self, method: &str) -> Result<(), ErrorShape> {
        if !self.socket.methods.allows(method) {
            return Err(ErrorShape {
                code: "FORBIDDEN".into(),
                message: format!(
                    "method not allowed on this socket: {method} (clawmux socket policy {:?})",
                    self.socket.name
                ),
                details: Some(json!({"code": "METHOD_NOT_ALLOWED", "socket": self.socket.name})),
                retryable: None,
                retry_after_ms: None,
            });
        }
        Ok(())
    }
}

/// Whether a client may observe other clients: the request tap,
/// `tool_events=all`, the HUD. Its socket's `observe` switch decides
/// ([`SocketPolicy::observe`]); the tap also needs `operator.admin`, as it
/// always did.
pub fn may_observe(access: &Access) -> bool {
    access.socket.observe
}

/// Parses `scopes` from a client (a list of strings), ignoring non-strings.
pub fn requested_scopes(v: Option<&Value>) -> Grant {
    Grant::new(
        v.and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_lists_deny_first_then_allow() {
        let f = MethodFilter {
            allow: vec!["status".into(), "sessions.*".into()],
            deny: vec!["sessions.delete".into()],
        };
        assert!(f.allows("status") && f.allows("sessions.list"));
        assert!(!f.allows("sessions.delete") && !f.allows("config.get"));
        assert!(MethodFilter::default().allows("anything"));
    }

    #[test]
    fn sockets_admit_their_users() {
        let mut p = SocketPolicy::main("/x".into());
        assert!(p.admits(1000, 1000, 1000) && !p.admits(1001, 1001, 1000));
        p.uids = vec![1001];
        p.gids = vec![50];
        assert!(p.admits(1001, 1, 1000) && p.admits(1002, 50, 1000));
        assert!(!p.admits(1003, 1, 1000));
    }
}
