//! Which scope a gateway method needs, checked before a request is forwarded
//! (the broker's own session holds every scope, so the gateway cannot tell
//! one local client from another: the broker must).
//!
//! The table is the gateway's own (`gateway-methods.tsv`, extracted from
//! openclaw 2026.9.6 `src/gateway/methods/core-descriptors.ts` by
//! `tools/extract-gateway-policy.mjs`); the rules around it follow
//! `src/gateway/server-methods.ts` (`authorizeGatewayMethod`) and
//! `src/gateway/method-scopes.ts`, in the same order:
//! `health` is open; node-only methods answer `unauthorized role: operator`;
//! `operator.admin` allows everything; a table scope, a reserved admin
//! prefix (`config.`, `exec.approvals.`, `wizard.`, `update.`), or a scope
//! decided from the params for the `dynamic` methods; anything unknown needs
//! `operator.admin` (the gateway's fail-closed rule).

use std::collections::HashMap;
use std::sync::OnceLock;

use serde_json::{json, Value};

use super::scopes::{self, Grant};
use crate::protocol::ErrorShape;

/// The gateway's method table (method, tab, scope), one line each.
const TABLE: &str = include_str!("gateway-methods.tsv");

/// The gateway version the table was taken from.
pub const TABLE_VERSION: &str = "2026.9.6";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Scope(&'static str),
    Node,
    Dynamic,
}

fn table() -> &'static HashMap<&'static str, Rule> {
    static TABLE_MAP: OnceLock<HashMap<&'static str, Rule>> = OnceLock::new();
    TABLE_MAP.get_or_init(|| {
        TABLE
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| l.split_once('\t'))
            .map(|(method, scope)| {
                let rule = match scope.trim() {
                    "node" => Rule::Node,
                    "dynamic" => Rule::Dynamic,
                    s => Rule::Scope(s),
                };
                (method, rule)
            })
            .collect()
    })
}

/// Session methods a client holding only `operator.sessions.read` may call
/// (`src/shared/session-method-scopes-base.ts`, `SESSION_READ_METHODS`).
const SESSION_READ_METHODS: [&str; 20] = [
    "sessions.list",
    "sessions.subscribe",
    "sessions.messages.subscribe",
    "sessions.messages.unsubscribe",
    "sessions.viewers.set",
    "sessions.preview",
    "sessions.describe",
    "sessions.branches.list",
    "sessions.get",
    "sessions.resolve",
    "sessions.search",
    "sessions.files.list",
    "sessions.files.get",
    "sessions.setInvolvement",
    "chat.history",
    "chat.startup",
    "chat.metadata",
    "chat.message.get",
    "session.members.list",
    "session.members.listEvidence",
];

/// Session methods a client holding only `operator.sessions.write` may call
/// (`SESSION_WRITE_METHODS`), unless their params need admin.
const SESSION_WRITE_METHODS: [&str; 18] = [
    "question.request",
    "question.waitAnswer",
    "question.resolve",
    "question.get",
    "question.list",
    "chat.send",
    "chat.abort",
    "sessions.create",
    "sessions.patch",
    "sessions.patchMany",
    "sessions.delete",
    "sessions.fork",
    "sessions.recover",
    "sessions.send",
    "sessions.steer",
    "sessions.abort",
    "sessions.goal.update",
    "sessions.goal.clear",
];

/// Node commands that need admin through `node.invoke`
/// (`NODE_ADMIN_ONLY_INVOKE_COMMANDS`, `src/gateway/node-commands.ts`).
const NODE_ADMIN_ONLY_COMMANDS: [&str; 4] = [
    "browser.proxy",
    "browser.proxy.upload.v1",
    "fs.listDir",
    "terminal.upload",
];

/// Is `method` one only `role: "node"` connections may call?
pub fn is_node_only(method: &str) -> bool {
    table().get(method) == Some(&Rule::Node)
}

/// Is `method` in the gateway's table at all?
pub fn is_known(method: &str) -> bool {
    table().contains_key(method)
}

/// Checks one request against a client's grant. `Err` is the gateway's own
/// answer: `INVALID_REQUEST` "unauthorized role: operator" for node-only
/// methods, `FORBIDDEN` "missing scope: X" (details `MISSING_SCOPE`) for
/// the rest.
pub fn authorize(
    method: &str,
    params: Option<&serde_json::value::RawValue>,
    grant: &Grant,
) -> Result<(), ErrorShape> {
    let parsed = params
        .filter(|_| reads_params(method))
        .and_then(|p| serde_json::from_str(p.get()).ok())
        .unwrap_or(Value::Null);
    authorize_parsed(method, &parsed, grant)
}

/// Methods that stop or redirect a run (the gateway's method table:
/// `chat.abort {sessionKey, runId?}`, `sessions.abort {key, runId?}`,
/// `sessions.steer {key, message}`): every local client shares the broker's
/// connection and device, so the gateway's own owner check cannot tell
/// them apart, and the broker applies it (a run another local client
/// started may be stopped only by that client or an admin).
pub const ABORT_LIKE: [&str; 3] = ["chat.abort", "sessions.abort", "sessions.steer"];

/// Whether the scope `method` needs depends on its params (they are then
/// parsed once, by the caller, and given to [`authorize_parsed`]).
pub fn reads_params(method: &str) -> bool {
    table().get(method) == Some(&Rule::Dynamic) || SESSION_WRITE_METHODS.contains(&method)
}

/// [`authorize`] with the params already parsed (`Null` when absent, or
/// when [`reads_params`] is false: they are not read then).
pub fn authorize_parsed(method: &str, params: &Value, grant: &Grant) -> Result<(), ErrorShape> {
    if method == "health" {
        return Ok(());
    }
    let rule = table().get(method).copied();
    if rule == Some(Rule::Node) {
        return Err(ErrorShape::invalid_request("unauthorized role: operator"));
    }
    if matches!(
        method,
        "device.scopes.requestUpgrade" | "device.scopes.waitUpgrade"
    ) || grant.is_admin()
    {
        return Ok(());
    }
    let session_scope = session_scope(method, params);
    match rule {
        Some(Rule::Dynamic) => {
            let required = dynamic_scopes(method, params);
            match required.iter().find(|s| !grant.satisfies(s)) {
                None => Ok(()),
                Some(missing) => check_required(missing, grant, session_scope, method, &required),
            }
        }
        Some(Rule::Scope(scope)) => check_required(scope, grant, session_scope, method, &[scope]),
        Some(Rule::Node) => unreachable!("answered above"),
        // Not in the table: the reserved admin prefixes (`config.`,
        // `exec.approvals.`, `wizard.`, `update.`) and every unknown method
        // (plugin methods included: their declared scope is not visible to
        // clients) need admin, the gateway's fail-closed rule.
        None => check_required(
            scopes::ADMIN,
            grant,
            session_scope,
            method,
            &[scopes::ADMIN],
        ),
    }
}

/// `authorizeOperatorScopesForRequiredScope`: the scope itself, or the
/// narrower session scope for the session methods that accept one.
fn check_required(
    required: &str,
    grant: &Grant,
    session_scope: Option<&'static str>,
    method: &str,
    all_required: &[&str],
) -> Result<(), ErrorShape> {
    if grant.satisfies(required) {
        return Ok(());
    }
    let via_session_scope = match session_scope {
        Some(s @ scopes::SESSIONS_READ) => required == scopes::READ && grant.satisfies(s),
        Some(s @ scopes::SESSIONS_WRITE) => {
            (required == scopes::WRITE
                || (required == scopes::QUESTIONS && method.starts_with("question.")))
                && grant.satisfies(s)
        }
        _ => false,
    };
    if via_session_scope {
        return Ok(());
    }
    Err(missing_scope(required, all_required))
}

/// The gateway's missing-scope answer (`missingScopeErrorShape`).
pub fn missing_scope(missing: &str, required: &[&str]) -> ErrorShape {
    let required: Vec<&str> = if required.is_empty() {
        vec![missing]
    } else {
        required.to_vec()
    };
    ErrorShape {
        code: "FORBIDDEN".into(),
        message: format!("missing scope: {missing}"),
        details: None,
        retryable: None,
        retry_after_ms: None,
    }
    .with_details(json!({
        "code": "MISSING_SCOPE",
        "missingScope": missing,
        "requiredScopes": required,
    }))
}

/// `resolveSessionMethodScope`.
fn session_scope(method: &str, params: &Value) -> Option<&'static str> {
    if SESSION_READ_METHODS.contains(&method) {
        return Some(scopes::SESSIONS_READ);
    }
    if SESSION_WRITE_METHODS.contains(&method)
        && session_mutation_scope(method, params) != Some(scopes::ADMIN)
    {
        return Some(scopes::SESSIONS_WRITE);
    }
    None
}

fn is_incognito_key(v: Option<&Value>) -> bool {
    // `isIncognitoSessionKey`: keys of incognito sessions carry this marker.
    v.and_then(Value::as_str)
        .is_some_and(|k| k.split(':').any(|part| part == "incognito"))
}

/// `resolveBaseSessionMutationRequiredScope` and the dynamic session rules.
fn session_mutation_scope(method: &str, params: &Value) -> Option<&'static str> {
    let obj = params.as_object();
    let has = |k: &str| obj.is_some_and(|o| o.contains_key(k));
    let full = |v: Option<&Value>| v.and_then(|p| p.get("permissionMode")) == Some(&json!("full"));
    match method {
        "sessions.recover" => Some(scopes::WRITE),
        "sessions.create" => {
            let Some(o) = obj else {
                return Some(scopes::WRITE);
            };
            let admin = o.get("incognito") == Some(&Value::Bool(true))
                || is_incognito_key(o.get("key"))
                || is_incognito_key(o.get("parentSessionKey"))
                || has("execNode")
                || has("toolOverrides")
                || full(Some(params));
            Some(if admin { scopes::ADMIN } else { scopes::WRITE })
        }
        "sessions.patch" => {
            let Some(o) = obj else {
                return Some(scopes::WRITE);
            };
            if full(Some(params)) || has("sandboxMode") {
                return Some(scopes::ADMIN);
            }
            const ENVELOPE: [&str; 6] = [
                "key",
                "agentId",
                "expectedSessionId",
                "expectedLifecycleRevision",
                "expectedPermissionMode",
                "expectedMarkedUnreadAt",
            ];
            let ok = o.keys().all(|k| {
                ENVELOPE.contains(&k.as_str()) || PATCH_WRITE_FIELDS.contains(&k.as_str())
            });
            Some(if ok { scopes::WRITE } else { scopes::ADMIN })
        }
        "sessions.patchMany" => {
            let Some(patch) = obj.and_then(|o| o.get("patch")).and_then(Value::as_object) else {
                return Some(scopes::WRITE);
            };
            if patch.get("permissionMode") == Some(&json!("full"))
                || patch.contains_key("sandboxMode")
            {
                return Some(scopes::ADMIN);
            }
            let ok = patch
                .keys()
                .all(|k| PATCH_WRITE_FIELDS.contains(&k.as_str()));
            Some(if ok { scopes::WRITE } else { scopes::ADMIN })
        }
        "sessions.delete" => {
            let Some(o) = obj.filter(|o| o.get("archivedOnly") == Some(&Value::Bool(true))) else {
                return Some(scopes::ADMIN);
            };
            const FIELDS: [&str; 5] = [
                "key",
                "agentId",
                "deleteTranscript",
                "expectedSessionId",
                "archivedOnly",
            ];
            let ok = o.keys().all(|k| FIELDS.contains(&k.as_str()));
            Some(if ok { scopes::WRITE } else { scopes::ADMIN })
        }
        "sessions.dispatch" => {
            let device = has("deviceId")
                || obj.and_then(|o| o.get("autoDevice")) == Some(&Value::Bool(true));
            Some(if device { scopes::WRITE } else { scopes::ADMIN })
        }
        "sessions.move" => {
            let profile = params.pointer("/target/kind") == Some(&json!("profile"));
            Some(if profile {
                scopes::ADMIN
            } else {
                scopes::WRITE
            })
        }
        _ => None,
    }
}

/// `SESSIONS_PATCH_WRITE_SCOPE_MUTATIONS`: fields write may patch.
const PATCH_WRITE_FIELDS: [&str; 15] = [
    "label",
    "autoLabel",
    "icon",
    "color",
    "category",
    "boardFace",
    "boardPresentation",
    "pinned",
    "archived",
    "unread",
    "model",
    "agentRuntime",
    "thinkingLevel",
    "fastMode",
    "permissionMode",
];

/// `resolveDynamicLeastPrivilegeOperatorScopesForMethod`.
fn dynamic_scopes(method: &str, params: &Value) -> Vec<&'static str> {
    let get = |k: &str| params.as_object().and_then(|o| o.get(k));
    match method {
        "agent" => {
            let reset = get("message").and_then(Value::as_str).is_some_and(|m| {
                let m = m.to_ascii_lowercase();
                ["/new", "/reset"].iter().any(|c| {
                    m.strip_prefix(c).is_some_and(|rest| {
                        rest.is_empty() || rest.starts_with(char::is_whitespace)
                    })
                })
            });
            vec![if reset { scopes::ADMIN } else { scopes::WRITE }]
        }
        "node.invoke" => {
            let admin = get("command")
                .and_then(Value::as_str)
                .is_some_and(|c| NODE_ADMIN_ONLY_COMMANDS.contains(&c));
            vec![if admin { scopes::ADMIN } else { scopes::WRITE }]
        }
        "talk.config" => {
            if get("includeSecrets") == Some(&Value::Bool(true)) {
                vec![scopes::READ, scopes::TALK_SECRETS]
            } else {
                vec![scopes::READ]
            }
        }
        "environments.list" => {
            let runtime = get("runtimeId")
                .and_then(Value::as_str)
                .is_some_and(|r| !r.is_empty());
            vec![if runtime { scopes::WRITE } else { scopes::READ }]
        }
        "channels.pairing.approve" => {
            if get("bootstrapCommandOwner") == Some(&Value::Bool(true)) {
                vec![scopes::PAIRING, scopes::ADMIN]
            } else {
                vec![scopes::PAIRING]
            }
        }
        "fs.listDir" => vec![if get("nodeId").is_some() {
            scopes::ADMIN
        } else {
            scopes::WRITE
        }],
        // Which scopes a plugin's session action needs is in the gateway's
        // plugin registry, which clients cannot see: the CLI's own fallback
        // for an unknown action is every operator scope, i.e. admin.
        "plugins.sessionAction" => vec![scopes::ADMIN],
        m if m.starts_with("sessions.") => {
            vec![session_mutation_scope(m, params).unwrap_or(scopes::WRITE)]
        }
        _ => vec![scopes::WRITE],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(s: &[&str]) -> Grant {
        Grant::new(s.iter().copied())
    }

    fn authorize(method: &str, params: &Value, grant: &Grant) -> Result<(), ErrorShape> {
        let raw = serde_json::value::to_raw_value(params).unwrap();
        super::authorize(method, Some(&raw), grant)
    }

    fn code(r: Result<(), ErrorShape>) -> String {
        match r {
            Ok(()) => "ok".into(),
            Err(e) => format!("{} {}", e.code, e.message),
        }
    }

    #[test]
    fn the_table_is_the_gateways() {
        assert_eq!(table().len(), 482, "gateway 2026.9.6 has 482 core methods");
        assert_eq!(table()["status"], Rule::Scope("operator.read"));
        assert_eq!(table()["config.patch"], Rule::Scope("operator.admin"));
        assert_eq!(table()["chat.send"], Rule::Scope("operator.write"));
        assert!(is_node_only("node.invoke.result") && is_node_only("skills.bins"));
        assert!(!is_node_only("node.invoke") && !is_node_only("status"));
    }

    #[test]
    fn every_method_class_is_allowed_or_refused_as_the_table_says() {
        let read = g(&[scopes::READ]);
        let none = Grant::none();
        let p = json!({});
        assert_eq!(code(authorize("health", &p, &none)), "ok");
        assert_eq!(code(authorize("status", &p, &read)), "ok");
        assert_eq!(
            code(authorize("status", &p, &none)),
            "FORBIDDEN missing scope: operator.read"
        );
        assert_eq!(
            code(authorize("config.patch", &p, &read)),
            "FORBIDDEN missing scope: operator.admin"
        );
        assert_eq!(
            code(authorize("chat.send", &p, &read)),
            "FORBIDDEN missing scope: operator.write"
        );
        assert_eq!(code(authorize("chat.send", &p, &g(&[scopes::WRITE]))), "ok");
        assert_eq!(
            code(authorize("node.invoke.result", &p, &g(&[scopes::ADMIN]))),
            "INVALID_REQUEST unauthorized role: operator"
        );
        // Unknown methods and reserved prefixes need admin.
        assert_eq!(
            code(authorize("no.such.method", &p, &g(&[scopes::WRITE]))),
            "FORBIDDEN missing scope: operator.admin"
        );
        assert_eq!(
            code(authorize("no.such.method", &p, &g(&[scopes::ADMIN]))),
            "ok"
        );
        assert_eq!(
            code(authorize("wizard.future", &p, &g(&[scopes::WRITE]))),
            "FORBIDDEN missing scope: operator.admin"
        );
        // Approvals, pairing, talk.
        let approvals = table()
            .iter()
            .find(|(_, r)| **r == Rule::Scope(scopes::APPROVALS))
            .map(|(m, _)| *m)
            .unwrap();
        assert_eq!(
            code(authorize(approvals, &p, &g(&[scopes::WRITE]))),
            "FORBIDDEN missing scope: operator.approvals"
        );
        assert_eq!(
            code(authorize(approvals, &p, &g(&[scopes::APPROVALS]))),
            "ok"
        );
        // The details name the scope, as the gateway's do.
        let e = authorize("config.get", &p, &none).unwrap_err();
        assert_eq!(
            e.details,
            Some(
                json!({"code": "MISSING_SCOPE", "missingScope": "operator.read",
                "requiredScopes": ["operator.read"]})
            )
        );
    }

    /// What the least-privilege page says of the config methods is the
    /// gateway's table: reading needs read, changing needs admin.
    #[test]
    fn the_least_privilege_page_says_what_the_config_methods_need() {
        let page = include_str!("../../docs/src/least-privilege.md");
        let page = page.split_whitespace().collect::<Vec<_>>().join(" ");
        let read = ["config.get", "config.schema", "config.schema.lookup"];
        let admin = [
            "config.set",
            "config.patch",
            "config.apply",
            "config.openFile",
        ];
        let listed = |names: &[&str]| {
            names
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (names, scope) in [(&read[..], scopes::READ), (&admin[..], scopes::ADMIN)] {
            for m in names {
                assert_eq!(table().get(m), Some(&Rule::Scope(scope)), "{m}");
            }
            let said = format!("`{scope}` ({})", listed(names));
            assert!(page.contains(&said), "the page says {said}");
        }
    }

    #[test]
    fn dynamic_methods_decide_from_params() {
        let write = g(&[scopes::WRITE]);
        let agent = |m: &str| authorize("agent", &json!({"message": m}), &write);
        assert_eq!(code(agent("hello")), "ok");
        assert_eq!(
            code(agent("/new")),
            "FORBIDDEN missing scope: operator.admin"
        );
        assert_eq!(
            code(agent("/Reset now")),
            "FORBIDDEN missing scope: operator.admin"
        );
        assert_eq!(code(agent("/newline")), "ok");
        let patch = |p: Value| code(authorize("sessions.patch", &p, &write));
        assert_eq!(patch(json!({"key": "main", "label": "x"})), "ok");
        assert_eq!(
            patch(json!({"key": "main", "sandboxMode": "off"})),
            "FORBIDDEN missing scope: operator.admin"
        );
        assert_eq!(
            code(authorize("sessions.delete", &json!({"key": "k"}), &write)),
            "FORBIDDEN missing scope: operator.admin"
        );
        assert_eq!(
            code(authorize(
                "sessions.delete",
                &json!({"key": "k", "archivedOnly": true}),
                &write
            )),
            "ok"
        );
        assert_eq!(
            code(authorize(
                "talk.config",
                &json!({"includeSecrets": true}),
                &g(&[scopes::READ])
            )),
            "FORBIDDEN missing scope: operator.talk.secrets"
        );
        assert_eq!(
            code(authorize(
                "node.invoke",
                &json!({"command": "fs.listDir"}),
                &write
            )),
            "FORBIDDEN missing scope: operator.admin"
        );
    }

    #[test]
    fn session_scopes_reach_only_session_methods() {
        let sread = g(&[scopes::SESSIONS_READ]);
        assert_eq!(code(authorize("sessions.list", &json!({}), &sread)), "ok");
        assert_eq!(code(authorize("chat.history", &json!({}), &sread)), "ok");
        assert_eq!(
            code(authorize("status", &json!({}), &sread)),
            "FORBIDDEN missing scope: operator.read"
        );
        let swrite = g(&[scopes::SESSIONS_WRITE]);
        assert_eq!(code(authorize("chat.send", &json!({}), &swrite)), "ok");
        assert_eq!(
            code(authorize("sessions.delete", &json!({"key": "k"}), &swrite)),
            "FORBIDDEN missing scope: operator.admin"
        );
    }
}
