//! Operator scopes and how they imply one another, as the gateway decides
//! (openclaw 2026.9.6, `src/shared/operator-scope-compat.ts`).

use serde::Serialize;

pub const ADMIN: &str = "operator.admin";
pub const READ: &str = "operator.read";
pub const WRITE: &str = "operator.write";
pub const APPROVALS: &str = "operator.approvals";
pub const PAIRING: &str = "operator.pairing";
pub const QUESTIONS: &str = "operator.questions";
pub const TALK: &str = "operator.talk";
pub const TALK_SECRETS: &str = "operator.talk.secrets";
pub const SESSIONS_READ: &str = "operator.sessions.read";
pub const SESSIONS_WRITE: &str = "operator.sessions.write";

/// Every operator scope the gateway knows, for naming the valid ones when
/// a person types another.
pub const ALL: [&str; 10] = [
    READ,
    WRITE,
    ADMIN,
    APPROVALS,
    PAIRING,
    QUESTIONS,
    TALK,
    TALK_SECRETS,
    SESSIONS_READ,
    SESSIONS_WRITE,
];

/// The operator scopes the broker asks the gateway for on its main session
/// (the full set, so that local clients can do whatever a direct operator
/// connection could), in the order the gateway lists them.
pub const REQUESTED_SCOPES: [&str; 5] = [ADMIN, READ, WRITE, APPROVALS, PAIRING];

/// `operatorScopeSatisfied`: does `granted` cover `required`? Admin covers
/// every operator scope; write covers read, talk, sessions.read and
/// sessions.write; read or sessions.write cover sessions.read. Non-operator
/// scopes are never satisfied.
pub fn satisfied(required: &str, granted: &[String]) -> bool {
    if !required.starts_with("operator.") {
        return false;
    }
    let has = |s: &str| granted.iter().any(|g| g == s);
    has(required)
        || has(ADMIN)
        || (matches!(required, READ | TALK | SESSIONS_READ | SESSIONS_WRITE) && has(WRITE))
        || (required == SESSIONS_READ && (has(READ) || has(SESSIONS_WRITE)))
}

/// Operator scopes as a set, one bit for each of [`ALL`]: a grant's is
/// worked out once, with the gateway's implications, so that a fan-out
/// checks a client's scopes for an event with one `&`, not a comparison of
/// strings per client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ScopeSet(u16);

impl ScopeSet {
    /// `scope` alone (nothing, for a scope that is not one of [`ALL`]).
    pub const fn of(scope: &str) -> ScopeSet {
        let mut i = 0;
        while i < ALL.len() {
            if same(ALL[i], scope) {
                return ScopeSet(1 << i);
            }
            i += 1;
        }
        ScopeSet(0)
    }

    /// What meets `required`, as [`Grant::covers`] sets are asked: the
    /// scope itself, or for an operator scope that is not one of [`ALL`]
    /// (newer than this table) admin alone, which covers every operator
    /// scope ([`satisfied`]); nothing meets a non-operator scope.
    pub fn needed(required: &str) -> ScopeSet {
        match ScopeSet::of(required) {
            ScopeSet(0) if required.starts_with("operator.") => ScopeSet::of(ADMIN),
            set => set,
        }
    }

    pub const fn with(self, other: ScopeSet) -> ScopeSet {
        ScopeSet(self.0 | other.0)
    }

    /// Whether the two share a scope.
    pub fn meets(self, other: ScopeSet) -> bool {
        self.0 & other.0 != 0
    }

    /// Every scope of [`ALL`] that `granted` satisfies: [`satisfied`]'s
    /// implications applied to the set (a grant is made for every client
    /// taken over inside a handover's pause, so each scope granted is
    /// looked up once, not each implication searched for).
    fn satisfied_by(granted: &[String]) -> ScopeSet {
        const EVERY: ScopeSet = ScopeSet((1 << ALL.len()) - 1);
        const BY_WRITE: ScopeSet = ScopeSet::of(READ)
            .with(ScopeSet::of(TALK))
            .with(ScopeSet::of(SESSIONS_READ))
            .with(ScopeSet::of(SESSIONS_WRITE));
        const BY_READ: ScopeSet = ScopeSet::of(READ).with(ScopeSet::of(SESSIONS_WRITE));
        const BY_ADMIN: ScopeSet = ScopeSet::of(ADMIN);
        const WRITES: ScopeSet = ScopeSet::of(WRITE);
        const READS_SESSIONS: ScopeSet = ScopeSet::of(SESSIONS_READ);
        let has = granted
            .iter()
            .fold(ScopeSet(0), |set, g| set.with(ScopeSet::of(g)));
        if has.meets(BY_ADMIN) {
            return EVERY;
        }
        let mut set = has;
        if has.meets(WRITES) {
            set = set.with(BY_WRITE);
        }
        if has.meets(BY_READ) {
            set = set.with(READS_SESSIONS);
        }
        set
    }
}

/// `a == b`, in a `const fn`.
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The scopes a local client holds: what it asked for, narrowed by every
/// ceiling above it (the broker's session, the socket's policy).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct Grant {
    scopes: Vec<String>,
    /// What `scopes` satisfy (derived from them).
    #[serde(skip)]
    covers: ScopeSet,
}

impl Grant {
    /// Exactly these scopes (trimmed, sorted, without duplicates or blanks).
    pub fn new<S: AsRef<str>>(scopes: impl IntoIterator<Item = S>) -> Grant {
        let mut v: Vec<String> = scopes
            .into_iter()
            .map(|s| s.as_ref().trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        v.sort();
        v.dedup();
        Grant {
            covers: ScopeSet::satisfied_by(&v),
            scopes: v,
        }
    }

    /// No scopes at all (only `health` and the open events).
    pub fn none() -> Grant {
        Grant::default()
    }

    pub fn scopes(&self) -> &[String] {
        &self.scopes
    }

    /// The operator scopes this grant satisfies.
    pub fn covers(&self) -> ScopeSet {
        self.covers
    }

    /// The granted scopes as the gateway lists them in `hello-ok.auth`: in
    /// the order the client asked for them (the gateway keeps that order),
    /// then any granted only by implication.
    pub fn in_order_of(&self, requested: &[String]) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in requested.iter().map(|s| s.trim()) {
            if self.scopes.iter().any(|g| g == s) && !out.iter().any(|o| o == s) {
                out.push(s.to_owned());
            }
        }
        for g in &self.scopes {
            if !out.contains(g) {
                out.push(g.clone());
            }
        }
        out
    }

    pub fn satisfies(&self, required: &str) -> bool {
        satisfied(required, &self.scopes)
    }

    pub fn is_admin(&self) -> bool {
        self.scopes.iter().any(|s| s == ADMIN)
    }

    /// `intersectOperatorScopes`: the requested scopes the ceiling covers,
    /// plus what both imply (a ceiling of `operator.write` turns a request
    /// for `operator.admin` into nothing, a request for `operator.read` into
    /// `operator.read`; a request for `operator.write` under a ceiling of
    /// `operator.sessions.write` keeps `operator.sessions.write`).
    pub fn within(&self, ceiling: &Grant) -> Grant {
        if self.scopes.iter().all(|s| ceiling.satisfies(s)) {
            return self.clone();
        }
        let mut out: Vec<String> = self
            .scopes
            .iter()
            .chain(ceiling.scopes.iter())
            .filter(|s| self.satisfies(s) && ceiling.satisfies(s))
            .cloned()
            .collect();
        for implied in [SESSIONS_WRITE, SESSIONS_READ] {
            if self.satisfies(implied) && ceiling.satisfies(implied) && !satisfied(implied, &out) {
                out.push(implied.to_owned());
            }
        }
        Grant::new(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(s: &[&str]) -> Grant {
        Grant::new(s.iter().copied())
    }

    #[test]
    fn implication_follows_the_gateway() {
        let write = g(&[WRITE]);
        assert!(write.satisfies(READ) && write.satisfies(TALK));
        assert!(write.satisfies(SESSIONS_READ) && write.satisfies(SESSIONS_WRITE));
        assert!(!write.satisfies(APPROVALS) && !write.satisfies(ADMIN));
        assert!(g(&[READ]).satisfies(SESSIONS_READ));
        assert!(!g(&[SESSIONS_READ]).satisfies(READ));
        assert!(g(&[SESSIONS_WRITE]).satisfies(SESSIONS_READ));
        assert!(g(&[ADMIN]).satisfies(PAIRING) && g(&[ADMIN]).satisfies(TALK_SECRETS));
        assert!(
            !g(&[ADMIN]).satisfies("node.whatever"),
            "operator scopes only"
        );
        assert!(!Grant::none().satisfies(READ));
    }

    /// A grant's set says what `satisfied` says, for every operator scope
    /// and every combination of them granted.
    #[test]
    fn a_grants_set_is_what_it_satisfies() {
        for combination in 0..1u32 << ALL.len() {
            let granted: Vec<&str> = (0..ALL.len())
                .filter(|i| combination & 1 << i != 0)
                .map(|i| ALL[i])
                .collect();
            let grant = g(&granted);
            for required in ALL {
                assert_eq!(
                    grant.covers().meets(ScopeSet::of(required)),
                    grant.satisfies(required),
                    "{granted:?} and {required}"
                );
            }
        }
        assert_eq!(ScopeSet::of("node.x"), ScopeSet::default());
        assert!(!g(&["node.x", "operator.unknown"])
            .covers()
            .meets(ScopeSet(u16::MAX)));
    }

    #[test]
    fn shown_in_the_order_asked() {
        let asked: Vec<String> = [WRITE, READ, "node.x", WRITE].map(String::from).to_vec();
        let grant = Grant::new(&asked).within(&g(&[ADMIN]));
        assert_eq!(
            grant.in_order_of(&asked),
            vec![WRITE.to_string(), READ.to_string()]
        );
    }

    #[test]
    fn intersection_keeps_what_both_sides_cover() {
        let full = g(&[ADMIN, READ, WRITE, APPROVALS, PAIRING]);
        // Asked for less than the ceiling: exactly what was asked.
        assert_eq!(g(&[READ]).within(&full), g(&[READ]));
        assert_eq!(g(&[ADMIN]).within(&full), g(&[ADMIN]));
        // Asked for more than the ceiling: only the covered part.
        assert_eq!(g(&[ADMIN, READ]).within(&g(&[READ])), g(&[READ]));
        assert_eq!(g(&[ADMIN]).within(&g(&[READ])), g(&[READ]));
        assert_eq!(
            g(&[WRITE, PAIRING]).within(&g(&[READ, PAIRING])),
            g(&[PAIRING, READ])
        );
        // What only an implication shares is kept by name.
        assert_eq!(
            g(&[WRITE]).within(&g(&[SESSIONS_WRITE])),
            g(&[SESSIONS_WRITE])
        );
        // Nothing asked, nothing granted; nothing allowed, nothing granted.
        assert_eq!(Grant::none().within(&full), Grant::none());
        assert_eq!(g(&[READ]).within(&Grant::none()), Grant::none());
        // Unknown or foreign scopes never pass a ceiling.
        assert_eq!(g(&["node.x"]).within(&full), Grant::none());
    }
}
