//! Session keys as the gateway resolves them, so the broker compares the
//! session a request names with the sessions its clients' runs live in the
//! way the gateway will, not by spelling.
//!
//! Read from gateway 2026.9.6: `src/gateway/session-store-key.ts`
//! (`resolveSessionStoreKey`, which `chat.abort`, `chat.send` and the
//! `sessions.*` methods resolve a key through),
//! `src/sessions/session-key-utils.ts` (`parseAgentSessionKey`,
//! `normalizeSessionKeyPreservingOpaquePeerIds`),
//! `src/routing/session-key.ts` (`normalizeAgentId`, `normalizeMainKey`)
//! and `src/config/sessions/main-session.ts`
//! (`canonicalizeMainSessionAlias`). What the gateway does:
//!
//! - it trims and lowercases the key (`MAIN`, `AGENT:MAIN:MAIN` and
//!   `agent:Main:main` are one session);
//! - `main` (or the configured main key) is the default agent's main
//!   session, and so are `agent:<id>:main` and `agent:main:<main key>`
//!   aliases of it;
//! - it reads an agent-scoped key's parts without empty segments, but keeps
//!   the key itself as written (lowercased): `agent::main:main` and
//!   `agent:main:main:` are sessions of their own, not the main session
//!   (a `chat.abort` or `/stop` on them stops nothing in `agent:main:main`);
//! - any other key is scoped to the default agent (`x` → `agent:main:x`);
//!   `global` and `unknown` stay as they are.
//!
//! Where the gateway keeps an opaque peer id's case (Signal groups, Matrix
//! rooms), the broker lowercases anyway: two keys it takes for one session
//! are then at worst two sessions at the gateway, and the ownership rule
//! errs towards refusing.

use super::SessionDefaults;

/// The default agent id (`DEFAULT_AGENT_ID`).
const DEFAULT_AGENT: &str = "main";

/// The key `raw` resolves to at the gateway ([`crate::sharing::SessionDefaults`]
/// carries what its `hello-ok` said about its configuration).
pub fn resolve(raw: &str, d: &SessionDefaults) -> String {
    resolve_for_agent(raw, None, d)
}

/// [`resolve`] for a request that names its agent (`agentId`, the
/// gateway's `storeAgentId`): a key not scoped to an agent is that agent's.
pub fn resolve_for_agent(raw: &str, agent_id: Option<&str>, d: &SessionDefaults) -> String {
    let raw = raw.trim();
    if raw.is_empty() {
        return String::new();
    }
    let lower = raw.to_lowercase();
    if lower == "global" || lower == "unknown" {
        return lower;
    }
    let main_key = normalize_main_key(&d.main_key);
    let store_agent = agent_id.map(normalize_agent_id);
    let default_agent = normalize_agent_id(&d.default_agent_id);
    if let Some((agent, rest)) = parse_agent_key(&lower) {
        let agent = normalize_agent_id(agent);
        // `resolveParsedSessionStoreKey`: `agent:main:main` on a gateway
        // with no agent named `main` is the default agent's.
        let owner = store_agent.clone().unwrap_or_else(|| default_agent.clone());
        let (agent, key) = if agent == DEFAULT_AGENT
            && owner != DEFAULT_AGENT
            && (rest == "main" || rest == main_key)
        {
            (owner.clone(), format!("agent:{owner}:{rest}"))
        } else {
            (agent, lower.clone())
        };
        return main_alias(&key, &agent, &main_key, d);
    }
    if lower == "main" || lower == main_key {
        return match store_agent {
            Some(agent) if agent != default_agent => format!("agent:{agent}:{main_key}"),
            _ => d.main_session_key.to_lowercase(),
        };
    }
    if lower.starts_with("agent:") {
        // A malformed agent key (`agent:x`): kept as written.
        return lower;
    }
    format!("agent:{}:{lower}", store_agent.unwrap_or(default_agent))
}

/// The main session of `agent_id` (an `agent` request without a
/// `sessionKey` runs there; without an `agentId` too, in the default
/// agent's main session).
pub fn agent_main(agent_id: Option<&str>, d: &SessionDefaults) -> String {
    match agent_id.map(str::trim).filter(|a| !a.is_empty()) {
        None => resolve("main", d),
        Some(agent) => resolve(
            &format!(
                "agent:{}:{}",
                normalize_agent_id(agent),
                normalize_main_key(&d.main_key)
            ),
            d,
        ),
    }
}

/// `parseAgentSessionKey`: `agent:<id>:<rest…>`, read without empty parts.
fn parse_agent_key(lower: &str) -> Option<(&str, String)> {
    let mut parts = lower.split(':').filter(|p| !p.is_empty());
    if parts.next()? != "agent" {
        return None;
    }
    let agent = parts.next()?.trim();
    let rest: Vec<&str> = parts.collect();
    if agent.is_empty() || rest.is_empty() {
        return None;
    }
    Some((agent, rest.join(":")))
}

/// `canonicalizeMainSessionAlias`: the spellings of an agent's main session.
fn main_alias(key: &str, agent: &str, main_key: &str, d: &SessionDefaults) -> String {
    let aliases = [
        format!("agent:{agent}:{main_key}"),
        format!("agent:{agent}:main"),
        format!("agent:{DEFAULT_AGENT}:{main_key}"),
        format!("agent:{DEFAULT_AGENT}:main"),
    ];
    if !aliases.iter().any(|a| a == key) {
        return key.to_owned();
    }
    let main = format!("agent:{agent}:{main_key}");
    // The default agent's main session is whatever the gateway named it
    // (`global` under a global session scope).
    if main
        == format!(
            "agent:{}:{main_key}",
            normalize_agent_id(&d.default_agent_id)
        )
    {
        d.main_session_key.to_lowercase()
    } else {
        main
    }
}

/// `normalizeMainKey`.
fn normalize_main_key(key: &str) -> String {
    match key.trim() {
        "" => "main".into(),
        k => k.to_lowercase(),
    }
}

/// `normalizeAgentId`: ids of `[a-z0-9][a-z0-9_-]{0,63}` lowercased, any
/// other with its runs of other characters as `-`, cut to 64.
fn normalize_agent_id(id: &str) -> String {
    let id = id.trim().to_lowercase();
    let mut out = String::with_capacity(id.len());
    let mut in_invalid = false;
    for c in id.chars() {
        let ok = c.is_ascii_alphanumeric() || c == '_' || c == '-';
        if ok {
            out.push(c);
        } else if !in_invalid {
            out.push('-');
        }
        in_invalid = !ok;
    }
    let valid =
        id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric()) && id.len() <= 64 && out == id;
    if valid {
        return id;
    }
    let cut: String = out.trim_matches('-').chars().take(64).collect();
    if cut.is_empty() {
        DEFAULT_AGENT.into()
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d() -> SessionDefaults {
        SessionDefaults::default()
    }

    #[test]
    fn spellings_of_the_main_session_the_gateway_merges() {
        for key in [
            "main",
            "MAIN",
            " main ",
            "agent:main:main",
            "AGENT:MAIN:MAIN",
            "agent:Main:main",
            "Agent:main:MAIN",
        ] {
            assert_eq!(resolve(key, &d()), "agent:main:main", "{key:?}");
        }
    }

    #[test]
    fn spellings_the_gateway_keeps_apart() {
        // Empty segments are dropped when the key is parsed, not from the
        // key the gateway stores and aborts by.
        assert_eq!(resolve("agent::main:main", &d()), "agent::main:main");
        assert_eq!(resolve("agent:main:main:", &d()), "agent:main:main:");
        assert_eq!(resolve("agent:main", &d()), "agent:main");
        assert_eq!(resolve("agent:ops:main", &d()), "agent:ops:main");
        assert_eq!(resolve("Work", &d()), "agent:main:work");
        assert_eq!(resolve("GLOBAL", &d()), "global");
        assert_eq!(resolve("", &d()), "");
    }

    #[test]
    fn a_configured_main_key_and_default_agent() {
        let d = SessionDefaults {
            default_agent_id: "Ops".into(),
            main_key: "work".into(),
            main_session_key: "agent:ops:work".into(),
        };
        for key in [
            "main",
            "work",
            "agent:ops:main",
            "agent:ops:work",
            "agent:main:main",
            "agent:main:work",
        ] {
            assert_eq!(resolve(key, &d), "agent:ops:work", "{key:?}");
        }
        assert_eq!(resolve("x", &d), "agent:ops:x");
        assert_eq!(agent_main(None, &d), "agent:ops:work");
        assert_eq!(agent_main(Some("Dev"), &d), "agent:dev:work");
        assert_eq!(resolve_for_agent("main", Some("dev"), &d), "agent:dev:work");
        assert_eq!(resolve_for_agent("x", Some("dev"), &d), "agent:dev:x");
        assert_eq!(resolve_for_agent("main", Some("ops"), &d), "agent:ops:work");
    }

    #[test]
    fn agent_ids_as_the_gateway_normalizes_them() {
        assert_eq!(normalize_agent_id("Main"), "main");
        assert_eq!(normalize_agent_id("my agent!"), "my-agent");
        assert_eq!(normalize_agent_id("--"), "main");
        assert_eq!(agent_main(None, &d()), "agent:main:main");
        assert_eq!(agent_main(Some(" "), &d()), "agent:main:main");
    }
}
