//! The new instance's half of a handover: what a start takes over
//! ([`take`]: a `SIGUSR2` upgrade's, which waits for this one's answers
//! on the control socket, or systemd's store), and the end of an upgrade
//! once the broker serves behind its closed gate ([`commit`]). After an
//! upgrade nothing moved is touched before the commit, not even the
//! socket files, however this start fails.

use std::time::Duration;

use super::upgrade::{Predecessor, RELEASE_MARGIN, SERVE_TIMEOUT};
use super::{Inherited, Source, Taken};
use crate::gate::Gate;
use crate::test_hook::{fails_at, hold_at, UPGRADE_FAULT};

/// What a start takes over, and how it goes on.
#[derive(Debug)]
pub struct Start {
    /// Closed after a `SIGUSR2` upgrade until the old instance commits
    /// (every moved socket and the accept loops wait at it); open otherwise.
    pub gate: Gate,
    /// The sockets and clients handed over, if any were.
    pub taken: Option<Taken>,
    /// After a `SIGUSR2` upgrade: the old instance, waiting for `ready`
    /// ([`commit`]).
    pub old: Option<Predecessor>,
}

/// Takes what a previous instance handed over, if one did. After a
/// `SIGUSR2` upgrade: checks it, says `valid` and waits until the old
/// instance has released the clients (or says `invalid`, and this start
/// fails: the old one goes on serving). A store that cannot be taken is
/// left: the start goes on fresh.
pub async fn take(
    inherited: Option<Inherited>,
    shutdown_timeout: Duration,
) -> anyhow::Result<Start> {
    let Some(mut inherited) = inherited else {
        return Ok(Start {
            gate: Gate::opened(),
            taken: None,
            old: None,
        });
    };
    let names = inherited.names().join(", ");
    let control = inherited.control();
    match inherited.source {
        Source::Upgrade => {
            let gate = Gate::closed();
            let result = inherited.take(&gate);
            let control =
                control.ok_or_else(|| anyhow::anyhow!("upgrade: no control socket was passed"))?;
            let mut old = Predecessor::new(control)?;
            match result {
                Ok(mut taken) => {
                    old.say("valid").await?;
                    if fails_at("after-valid") {
                        // A start that fails as an error returned (its
                        // destructors run), once the state was valid.
                        // Said before the control socket closes: the old
                        // instance ends this process as soon as it sees it close.
                        eprintln!("clawmux: {UPGRADE_FAULT}=after-valid: failing the start");
                        anyhow::bail!("upgrade: {UPGRADE_FAULT}=after-valid");
                    }
                    let clients = old
                        .released(shutdown_timeout + RELEASE_MARGIN)
                        .await
                        .map_err(|e| anyhow::anyhow!("upgrade: {e}"))?;
                    taken.clients = Some(clients);
                    Ok(Start {
                        gate,
                        taken: Some(taken),
                        old: Some(old),
                    })
                }
                Err(e) => {
                    let _ = old.say(&format!("invalid {e}")).await;
                    anyhow::bail!(
                        "upgrade: cannot take over ({e}); the old instance goes on serving"
                    )
                }
            }
        }
        Source::Store => {
            let gate = Gate::opened();
            let taken = match inherited.take(&gate) {
                Ok(taken) => Some(taken),
                Err(e) => {
                    tracing::warn!(
                        descriptors = %names,
                        "the stored state cannot be taken ({e}); starting fresh"
                    );
                    None
                }
            };
            Ok(Start {
                gate,
                taken,
                old: None,
            })
        }
    }
}

/// The end of a `SIGUSR2` upgrade, in the new instance: everything is
/// taken over and `gate` is closed (nothing moved was read or written).
/// Says `ready`; on the old instance's `commit` opens the gate and says
/// `serving`. Without the commit the old instance serves everything again,
/// so this one exits at once, touching nothing (not even the socket files:
/// no destructor runs).
pub async fn commit(old: &mut Predecessor, gate: &Gate) {
    // Crash stand-ins for the tests: the new instance holds what it took
    // over 300 ms, then exits, before `ready` or after the commit.
    let crash_at = |point: &'static str| async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        eprintln!("clawmux: {UPGRADE_FAULT}={point}: exiting");
        std::process::exit(1);
    };
    if fails_at("before-ready") {
        crash_at("before-ready").await;
    }
    // Everything is taken over; the old instance waits for `ready`.
    hold_at("hold-before-ready").await;
    let commit = match old.say("ready").await {
        Ok(()) => old.committed(SERVE_TIMEOUT).await,
        Err(e) => Err(format!("the control socket failed ({e})")),
    };
    if let Err(why) = commit {
        tracing::error!("upgrade: no commit ({why}); the old instance goes on serving");
        eprintln!("clawmux: upgrade: no commit ({why}); the old instance goes on serving");
        std::process::exit(1);
    }
    gate.open();
    if fails_at("after-commit") {
        crash_at("after-commit").await;
    }
    // The main process first, then the word that lets the old one exit:
    // systemd must know who the service is before its main process goes
    // (it reads notifications before exits).
    crate::systemd::now_main_process();
    if let Err(e) = old.say("serving").await {
        // Committed: the clients are this instance's; it serves on.
        tracing::warn!("upgrade: cannot tell the old instance it serves ({e})");
    }
}
