//! Which scope a client needs to receive a gateway event: the gateway applies
//! these guards per connection (openclaw 2026.9.6,
//! `src/gateway/server-broadcast-scopes.ts`); the broker's one connection
//! passes them all, so the broker applies them per local client.

use super::scopes::{self, Grant, ScopeSet};

/// What an event needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// Every connection (`tick`, `health`, `shutdown`, …) and the broker's
    /// own `clawmux.*` events.
    Open,
    /// This scope (with the gateway's implications).
    Scope(&'static str),
    /// Either of two scopes.
    Either(&'static str, &'static str),
}

impl Guard {
    pub fn allows(self, grant: &Grant) -> bool {
        self.need().allows(grant)
    }

    /// The guard as a set of scopes, to ask of many clients.
    pub fn need(self) -> Need {
        Need(match self {
            Guard::Open => None,
            Guard::Scope(s) => Some(ScopeSet::needed(s)),
            Guard::Either(a, b) => Some(ScopeSet::needed(a).with(ScopeSet::needed(b))),
        })
    }
}

/// A [`Guard`] worked out once for an event: any one of these scopes (or
/// none at all) lets a client receive it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need(Option<ScopeSet>);

impl Need {
    pub fn allows(self, grant: &Grant) -> bool {
        self.0.is_none_or(|any| grant.covers().meets(any))
    }
}

const OPEN: [&str; 6] = [
    "tick",
    "health",
    "heartbeat",
    "shutdown",
    "gateway.suspension",
    "update.available",
];

const READ: [&str; 37] = [
    "agent",
    "chat",
    "chat.send_timing",
    "chat.side_result",
    "cron",
    "presence",
    "sessions.changed",
    "session.message",
    "session.tool",
    "session.observer",
    "session.operation",
    "session.sharing",
    "session.sharing.evidence",
    "session.suggestion",
    "session.typing",
    "sessions.catalog.host",
    "config.changed",
    "users.prefs.changed",
    "mentions.changed",
    "skills.changed",
    "plugins.changed",
    "plugins.controlUi.changed",
    "controlUi.sessionPullRequests.changed",
    "voicewake.changed",
    "voicewake.routing.changed",
    "node.presence",
    "node.hostStats",
    "node.runnerInventory.changed",
    "talk.event",
    "task",
    "task.suggestion",
    "board.changed",
    "board.command",
    "progressCard.changed",
    "ui.command",
    "portal.changed",
    "chat.metadata.changed",
];

const APPROVALS: [&str; 7] = [
    "exec.approval.requested",
    "exec.approval.resolved",
    "plugin.approval.requested",
    "plugin.approval.resolved",
    "openclaw.approval.requested",
    "openclaw.approval.resolved",
    "session.approval",
];

const QUESTIONS: [&str; 2] = ["question.requested", "question.resolved"];

const PAIRING: [&str; 7] = [
    "device.pair.changed",
    "device.pair.requested",
    "device.pair.resolved",
    "device.pair.setup.completed",
    "device.pair.setup.deliveryUncertain",
    "node.pair.requested",
    "node.pair.resolved",
];

const TALK: [&str; 2] = ["talk.mode", "talk.voice.change"];

const ADMIN: [&str; 4] = [
    "update.run.changed",
    "plugins.install.progress",
    "terminal.data",
    "terminal.exit",
];

/// The guard for an event name.
pub fn guard(event: &str) -> Guard {
    if OPEN.contains(&event) || event.starts_with("clawmux.") {
        Guard::Open
    } else if event == "chat.metadata.changed" {
        Guard::Either(scopes::READ, scopes::SESSIONS_READ)
    } else if READ.contains(&event) {
        Guard::Scope(scopes::READ)
    } else if APPROVALS.contains(&event) {
        Guard::Scope(scopes::APPROVALS)
    } else if QUESTIONS.contains(&event) {
        Guard::Scope(scopes::QUESTIONS)
    } else if PAIRING.contains(&event) {
        Guard::Scope(scopes::PAIRING)
    } else if TALK.contains(&event) {
        Guard::Scope(scopes::TALK)
    } else if ADMIN.contains(&event) {
        Guard::Scope(scopes::ADMIN)
    } else if event.starts_with("plugin.") {
        // Plugin events without an entry: write (the plugin's declared
        // scope is not visible to clients).
        Guard::Scope(scopes::WRITE)
    } else {
        // The gateway drops events it has no rule for, so one that reaches
        // the broker comes from a gateway newer than this table: only
        // clients with admin get it (fail-closed, but not lost).
        Guard::Scope(scopes::ADMIN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_follow_the_gateway() {
        let read = Grant::new([scopes::READ]);
        let sread = Grant::new([scopes::SESSIONS_READ]);
        let none = Grant::none();
        assert!(guard("tick").allows(&none) && guard("shutdown").allows(&none));
        assert!(
            guard("clawmux.upstream").allows(&none),
            "the broker's own events"
        );
        assert!(!guard("chat").allows(&none) && guard("chat").allows(&read));
        assert!(guard("chat.metadata.changed").allows(&sread));
        assert!(!guard("chat").allows(&sread));
        assert!(!guard("exec.approval.requested").allows(&read));
        assert!(guard("exec.approval.requested").allows(&Grant::new([scopes::APPROVALS])));
        assert!(!guard("device.pair.requested").allows(&read));
        assert!(guard("device.pair.requested").allows(&Grant::new([scopes::PAIRING])));
        assert!(!guard("terminal.data").allows(&Grant::new([scopes::WRITE])));
        assert!(guard("terminal.data").allows(&Grant::new([scopes::ADMIN])));
        assert!(guard("talk.mode").allows(&Grant::new([scopes::WRITE])));
        assert!(guard("plugin.anything").allows(&Grant::new([scopes::WRITE])));
        assert_eq!(guard("test.unknown"), Guard::Scope(scopes::ADMIN));
    }

    /// A guard's set says what the gateway's rule says, for every event of
    /// the tables and for a scope this table does not know: admin meets
    /// every operator scope, and a grant of exactly the scope meets it.
    #[test]
    fn every_guard_is_met_as_the_gateway_says() {
        let admin = Grant::new([scopes::ADMIN]);
        let tables = [
            &OPEN[..],
            &READ,
            &APPROVALS,
            &QUESTIONS,
            &PAIRING,
            &TALK,
            &ADMIN,
        ];
        for event in tables
            .concat()
            .into_iter()
            .chain(["plugin.x", "test.unknown"])
        {
            let g = guard(event);
            assert!(g.allows(&admin), "{event}: admin gets every event");
            if let Guard::Scope(s) = g {
                assert!(
                    g.allows(&Grant::new([s])),
                    "{event}: its own scope meets it"
                );
            }
        }
        let newer = Guard::Scope("operator.newer");
        assert!(
            newer.allows(&admin),
            "admin covers an operator scope newer than the table"
        );
        assert!(!newer.allows(&Grant::new([scopes::WRITE])));
        assert!(
            !Guard::Scope("node.thing").allows(&admin),
            "not an operator scope"
        );
    }
}
