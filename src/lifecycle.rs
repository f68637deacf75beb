//! The `serve` process: its start, taking over from a previous instance
//! when there is one ([`start_serving`]: the new instance's half of a
//! handover), and from `READY=1` to exit ([`serve_until_stopped`]): waits
//! for SIGTERM/SIGINT, tells systemd, hands over on SIGUSR2 (the old
//! instance's half), and shuts the broker down within a hard deadline.
//!
//! Exit codes (README, "Exit codes"): 0 clean stop, 1 start-up failure (the
//! binary's edge reports it), 2 bad command line (clap), 3 forced stop.

use std::time::Duration;

use std::sync::Arc;

use crate::context::Ctx;
use crate::handover::upgrade::{Predecessor, Program};
use crate::systemd::Notifier;
use crate::RunningBroker;

/// The signals [`serve_until_stopped`] acts on, installed by the caller
/// first thing ([`crate::signals::ServeSignals`]).
pub struct Signals {
    pub term: tokio::signal::unix::Signal,
    pub int: tokio::signal::unix::Signal,
    pub usr2: tokio::signal::unix::Signal,
}

/// Exit status when the stop was forced: a second SIGTERM/SIGINT during the
/// shutdown, or the shutdown overran its deadline by [`BACKSTOP_GRACE`].
pub const EXIT_FORCED: i32 = 3;

/// How long after the shutdown deadline the process is ended regardless of
/// what its tasks are doing (for a runtime that is itself stuck; the broker's
/// own shutdown never waits past the deadline).
pub const BACKSTOP_GRACE: Duration = Duration::from_secs(1);

/// Runs until SIGTERM or SIGINT, then stops the broker within
/// `shutdown_timeout`. Sends `READY=1` first and `STOPPING=1` on the signal.
/// A second signal during the shutdown exits at once with [`EXIT_FORCED`].
///
/// `SIGUSR2` hands the broker over to a new instance of `upgrades`
/// ([`crate::handover::upgrade`]); when that fails, this one goes on
/// serving (a new core, if it had stopped) and `current` is told of it.
/// Under a service manager that keeps a file descriptor store, a stop
/// first stores the sockets clawmux bound itself for the next start.
pub async fn serve_until_stopped(
    mut broker: RunningBroker,
    shutdown_timeout: Duration,
    upgrades: Option<Program>,
    current: Option<tokio::sync::watch::Sender<Arc<Ctx>>>,
    signals: Signals,
) -> std::io::Result<()> {
    // The handlers were installed before the broker started (and the
    // signals held before that: crate::signals), so none is lost.
    let Signals {
        mut term,
        mut int,
        mut usr2,
    } = signals;
    let mut notifier = Notifier::start(broker.ctx());
    crate::upgrade_record::set_can_upgrade(upgrades.is_some());
    let signal_name = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM",
            _ = int.recv() => break "SIGINT",
            _ = usr2.recv() => {
                let Some(program) = &upgrades else {
                    tracing::info!("SIGUSR2 ignored: this broker cannot hand over (demo mode)");
                    eprintln!("clawmux: SIGUSR2 ignored: the demo cannot hand over (its gateway double lives in this process); stop it with Ctrl-C and start it again");
                    continue;
                };
                tracing::info!(program = %program.path.display(), "SIGUSR2: handing over to a new instance");
                crate::upgrade_record::attempt();
                match upgrade(broker, program, shutdown_timeout).await {
                    Outcome::Upgraded(next) => {
                        // The new instance is the service now: no STOPPING=1.
                        notifier.abandon();
                        if keeps_its_terminal() {
                            return stand_in_for(next, term, usr2).await;
                        }
                        return Ok(());
                    }
                    Outcome::StillServing(b, why) => {
                        tracing::error!("upgrade failed, still serving: {why}");
                        crate::upgrade_record::failed(&why);
                        if !Arc::ptr_eq(b.ctx(), notifier.ctx()) {
                            notifier.abandon();
                            notifier = Notifier::start(b.ctx());
                            if let Some(current) = &current {
                                let _ = current.send(Arc::clone(b.ctx()));
                            }
                        }
                        broker = b;
                    }
                    Outcome::Lost(why) => {
                        notifier.stopping();
                        return Err(std::io::Error::other(format!("upgrade failed: {why}")));
                    }
                }
            }
        }
    };
    tracing::info!(signal = signal_name, "stop requested");
    notifier.stopping();
    arm_backstop(shutdown_timeout + BACKSTOP_GRACE);
    // A stop for good (not a restart) is the polite one: nothing would take
    // what is stored, and systemd would close it without a word.
    let restarting = crate::systemd::keeps_a_store()
        && match crate::systemd::stopping().await {
            crate::systemd::Stopping::ForGood => {
                tracing::info!("systemd stops the service (not a restart): closing the clients");
                false
            }
            _ => true,
        };
    if restarting {
        tokio::select! {
            r = store_for_next_start(broker, shutdown_timeout) => return r,
            _ = term.recv() => force_exit("a second SIGTERM"),
            _ = int.recv() => force_exit("a second SIGINT"),
        }
    }
    tokio::select! {
        clean = broker.shutdown(shutdown_timeout) => {
            if !clean {
                tracing::warn!(
                    deadline_ms = shutdown_timeout.as_millis() as u64,
                    "shutdown deadline reached; clients that were not reading were cut off"
                );
            }
            tracing::info!("clawmux stopped");
            Ok(())
        }
        _ = term.recv() => force_exit("a second SIGTERM"),
        _ = int.recv() => force_exit("a second SIGINT"),
    }
}

/// Under a service manager with a file descriptor store: hands the broker
/// over to its next start through the store (design §11). The clients stop
/// at a message boundary and are stored with their sockets, the state and
/// the sockets clawmux bound itself (a socket systemd passed stays
/// systemd's); the next start takes them over, so a restart is a pause.
/// A stop the broker cannot tell from a restart ([`crate::systemd::stopping`])
/// leaves them to systemd, which closes them once the service is down:
/// clients see their connection end without a close frame, and reconnect
/// when it is back (docs/src/restarts.md).
async fn store_for_next_start(
    broker: RunningBroker,
    shutdown_timeout: Duration,
) -> std::io::Result<()> {
    let (mut state, mut fds) = broker.handover()?;
    // What systemd passed stays in systemd's hands.
    state.listeners.retain(|l| l.owned.is_some());
    fds.retain(|(name, _)| {
        state
            .listeners
            .iter()
            .any(|l| *name == l.fd_name || *name == crate::handover::state::lock_name(&l.fd_name))
    });
    let mut released = broker.release(shutdown_timeout).await;
    let packed = released.take_clients();
    let clients = packed.doc.clients.len();
    fds.push((
        crate::handover::state::STATE_FD_NAME.to_owned(),
        state.to_memfd()?,
    ));
    fds.push((
        crate::handover::clients::CLIENTS_FD_NAME.to_owned(),
        packed.doc.to_memfd()?,
    ));
    if let Some(fd) = packed.upstream {
        fds.push((crate::handover::clients::UPSTREAM_FD_NAME.to_owned(), fd));
    }
    fds.extend(
        packed
            .clients
            .into_iter()
            .map(|(id, fd)| (crate::handover::clients::client_fd_name(id), fd)),
    );
    for (i, (client, gateway)) in packed.dedicated.into_iter().enumerate() {
        let (client_name, gateway_name) = crate::handover::clients::dedicated_fd_names(i);
        fds.push((client_name, client));
        fds.push((gateway_name, gateway));
    }
    for (i, stream) in packed.streams.into_iter().enumerate() {
        fds.push((crate::handover::clients::stream_fd_name(i), stream));
    }
    for (i, session) in packed.narrower.into_iter().enumerate() {
        fds.push((crate::handover::clients::narrower_fd_name(i), session));
    }
    match crate::systemd::store(&fds) {
        Ok(()) => {
            released.finish();
            tracing::info!(
                descriptors = fds.len(),
                clients,
                "stored the sockets and clients for the next start"
            );
        }
        Err(e) => tracing::warn!(
            "cannot store the sockets and clients for the next start ({e}); they are closed"
        ),
    }
    tracing::info!("clawmux stopped");
    Ok(())
}

fn force_exit(why: &str) -> ! {
    tracing::warn!("{why} during shutdown: exiting now");
    std::process::exit(EXIT_FORCED)
}

/// Ends the process after `after`, from a plain thread, so not even a stuck
/// async runtime can keep it alive past the deadline.
fn arm_backstop(after: Duration) {
    let spawned = std::thread::Builder::new()
        .name("shutdown-backstop".into())
        .spawn(move || {
            std::thread::sleep(after);
            eprintln!(
                "clawmux: shutdown did not finish within {} ms; exiting",
                after.as_millis()
            );
            std::process::exit(EXIT_FORCED);
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the shutdown backstop thread: {e}");
    }
}

/// Whether this broker was started in a terminal by hand (not by systemd,
/// which tracks the new main process itself): then the process the shell
/// started stays, so the shell does not take its terminal back while a
/// broker still writes to it.
fn keeps_its_terminal() -> bool {
    use std::io::IsTerminal;
    std::env::var_os("NOTIFY_SOCKET").is_none()
        && (std::io::stdin().is_terminal() || std::io::stderr().is_terminal())
}

/// After an upgrade in a terminal: this process (the one the shell waits
/// for) stays until the instance that took over ends, and exits with its
/// status. Ctrl-C reaches that instance from the terminal itself (the same
/// process group), so `SIGINT` is not passed on (twice would force its
/// stop); `SIGTERM` and `SIGUSR2` sent to this pid are, so `kill` and
/// `clawmux upgrade` work on the pid the shell shows as on the broker.
async fn stand_in_for(
    mut next: tokio::process::Child,
    mut term: tokio::signal::unix::Signal,
    mut usr2: tokio::signal::unix::Signal,
) -> std::io::Result<()> {
    tracing::info!(
        pid = next.id(),
        "upgrade: the new instance serves; this process stays for the terminal until it ends"
    );
    let pass_on = |next: &tokio::process::Child, sig| {
        if let Some(pid) = next
            .id()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, sig);
        }
    };
    loop {
        tokio::select! {
            status = next.wait() => {
                let code = status?.code().unwrap_or(EXIT_FORCED);
                std::process::exit(code);
            }
            _ = term.recv() => pass_on(&next, rustix::process::Signal::TERM),
            _ = usr2.recv() => pass_on(&next, rustix::process::Signal::USR2),
        }
    }
}

/// How an upgrade ended.
#[derive(Debug)]
pub enum Outcome {
    /// The new instance (this process) serves: this one exits, or stays
    /// for its terminal.
    Upgraded(tokio::process::Child),
    /// This one serves (still, or again): why the upgrade did not happen.
    StillServing(RunningBroker, String),
    /// The new one failed after this one stopped, and serving again failed
    /// too: the process ends with this error.
    Lost(String),
}

/// Hands the broker over to a new instance of `program`. Nothing is lost
/// or repeated either way: until the new instance says `valid` this broker
/// serves untouched; until it says `commit` it can serve every moved
/// client again exactly (the new one touched none); after, they are the
/// new instance's (the control protocol: [`crate::handover::upgrade`]).
async fn upgrade(broker: RunningBroker, program: &Program, shutdown_timeout: Duration) -> Outcome {
    let (state, fds) = match broker.handover() {
        Ok(x) => x,
        Err(e) => return Outcome::StillServing(broker, format!("cannot copy the sockets: {e}")),
    };
    let mut next = match crate::handover::upgrade::Successor::spawn(program, &state, fds) {
        Ok(next) => next,
        Err(e) => {
            let why = format!("cannot start {}: {e}", program.path.display());
            return Outcome::StillServing(broker, why);
        }
    };
    tracing::info!(pid = next.pid(), program = %program.path.display(), "upgrade: new instance started");
    if let Err(why) = next
        .expect("valid", crate::handover::upgrade::START_TIMEOUT)
        .await
    {
        next.abandon();
        return Outcome::StillServing(broker, why);
    }
    let mut released = broker.release(shutdown_timeout).await;
    let packed = released.take_clients();
    let clients = packed.doc.clients.len();
    use crate::handover::upgrade::SERVE_TIMEOUT;
    let ready = match next.send_released(&packed).await {
        Ok(()) => next.expect("ready", SERVE_TIMEOUT).await,
        Err(e) => Err(format!("cannot pass the clients to the new instance ({e})")),
    };
    // Until `commit` is written the new instance has read and written
    // nothing moved: this one can serve it all again, exactly (no byte
    // twice, none lost).
    let committed = match ready {
        Ok(()) => next
            .commit()
            .await
            .map_err(|e| format!("the new instance is gone before the commit ({e})")),
        Err(why) => Err(why),
    };
    if let Err(why) = committed {
        next.end().await;
        return match released.serve_again(Some(packed)) {
            Ok(broker) => Outcome::StillServing(broker, why),
            Err(e) => Outcome::Lost(format!("{why}; serving again failed too: {e}")),
        };
    }
    // Committed: the moved sockets are the new instance's alone, whatever
    // happens next.
    match next.expect("serving", SERVE_TIMEOUT).await {
        Ok(()) => {
            tracing::info!(
                pid = next.pid(),
                clients,
                "upgrade: the new instance serves; exiting"
            );
            released.finish();
            Outcome::Upgraded(next.into_child())
        }
        Err(why) => {
            // It failed after it took everything: its clients lose their
            // connection (nothing is sent twice) and reconnect here, where
            // the event log goes on with a restart gap they are told of.
            next.end().await;
            drop(packed);
            crate::systemd::now_main_process();
            let why = format!("{why} (after the commit: its clients reconnect)");
            match released.serve_again(Some(Default::default())) {
                Ok(broker) => Outcome::StillServing(broker, why),
                Err(e) => Outcome::Lost(format!("{why}; serving again failed too: {e}")),
            }
        }
    }
}

/// The new instance's half of a handover, and a start without one: takes
/// over what a previous instance handed over (a `SIGUSR2` upgrade's, which
/// waits for this one's answers, or systemd's store), else serves on the
/// socket systemd passed, else binds its own; then, after an upgrade,
/// waits for the old instance's commit ([`commit_with`]). After an
/// upgrade nothing moved is touched before the commit, not even the
/// socket files, however this start fails.
pub async fn start_serving(
    settings: crate::config::Settings,
    inherited: Option<crate::handover::Inherited>,
    activated: Option<crate::systemd::ActivatedSocket>,
    shutdown_timeout: Duration,
) -> anyhow::Result<RunningBroker> {
    use crate::handover::Source;
    let gate = if inherited
        .as_ref()
        .is_some_and(|i| i.source == Source::Upgrade)
    {
        crate::gate::Gate::closed()
    } else {
        crate::gate::Gate::opened()
    };
    let mut predecessor = None;
    let mut taken = None;
    if let Some(mut inherited) = inherited {
        let names = inherited.names().join(", ");
        let control = inherited.control();
        match (inherited.source, inherited.take(&gate)) {
            (Source::Upgrade, result) => {
                let control = control
                    .ok_or_else(|| anyhow::anyhow!("upgrade: no control socket was passed"))?;
                let mut old = Predecessor::new(control)?;
                match result {
                    Ok(mut t) => {
                        old.say("valid").await?;
                        if upgrade_fault().as_deref() == Some("after-valid") {
                            // A start that fails as an error returned (its
                            // destructors run), once the state was valid.
                            // Said before the control socket closes: the old instance ends
                            // this process as soon as it sees it close.
                            eprintln!("clawmux: {UPGRADE_FAULT}=after-valid: failing the start");
                            anyhow::bail!("upgrade: {UPGRADE_FAULT}=after-valid");
                        }
                        let clients = old
                            .released(shutdown_timeout + crate::handover::upgrade::RELEASE_MARGIN)
                            .await
                            .map_err(|e| anyhow::anyhow!("upgrade: {e}"))?;
                        t.clients = Some(clients);
                        taken = Some(t);
                        predecessor = Some(old);
                    }
                    Err(e) => {
                        let _ = old.say(&format!("invalid {e}")).await;
                        anyhow::bail!(
                            "upgrade: cannot take over ({e}); the old instance goes on serving"
                        );
                    }
                }
            }
            (Source::Store, Ok(t)) => taken = Some(t),
            (Source::Store, Err(e)) => tracing::warn!(
                descriptors = %names,
                "the stored state cannot be taken ({e}); starting fresh"
            ),
        }
    }
    let broker = match (taken, activated) {
        (Some(t), activated) => {
            crate::upgrade_record::took_over(
                t.state.from_pid,
                &t.state.from_version,
                t.clients.as_ref().map_or(0, |m| m.doc.clients.len()),
                t.clients.as_ref().map_or(0, |m| m.doc.streams.len()),
            );
            tracing::info!(
                from_pid = t.state.from_pid,
                from_version = %t.state.from_version,
                listeners = t.state.listeners.len(),
                clients = t.clients.as_ref().map_or(0, |m| m.doc.clients.len()),
                "took over from the previous instance"
            );
            let moved = t.clients;
            let main = match (t.main, activated) {
                (Some(main), activated) => {
                    if let Some(socket) = activated {
                        tracing::warn!(name = %socket.name, "systemd also passed a socket; serving on the handed-over one");
                    }
                    main
                }
                (None, Some(socket)) => {
                    let path = socket
                        .listener
                        .local_addr()
                        .ok()
                        .and_then(|a| a.as_pathname().map(std::path::PathBuf::from))
                        .unwrap_or_else(|| settings.socket_path.clone());
                    (
                        socket.listener,
                        crate::local::socket::SocketGuard::activated(path),
                    )
                }
                (None, None) => anyhow::bail!(
                    "the handed-over state has no main socket and systemd passed none"
                ),
            };
            RunningBroker::start_handed_over(settings, main, t.policies, moved, gate)?
        }
        (None, Some(socket)) => {
            RunningBroker::start_with_activated(settings, socket.listener, socket.others)?
        }
        (None, None) => RunningBroker::start(settings).await?,
    };
    if let Some(mut old) = predecessor {
        commit_with(&mut old, &broker).await;
    }
    Ok(broker)
}

/// The end of a `SIGUSR2` upgrade, in the new instance: everything is
/// taken over and its gate is closed (nothing moved was read or written).
/// Says `ready`; on the old instance's `commit` opens the gate and says
/// `serving`. Without the commit the old instance serves everything again,
/// so this one exits at once, touching nothing (not even the socket files:
/// no destructor runs).
async fn commit_with(old: &mut Predecessor, broker: &RunningBroker) {
    // Crash stand-ins for the tests: the new instance holds what it took
    // over 300 ms, then exits, before `ready` or after the commit.
    let fault = upgrade_fault();
    let crash_at = |point: &'static str| async move {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        eprintln!("clawmux: {UPGRADE_FAULT}={point}: exiting");
        std::process::exit(1);
    };
    if fault.as_deref() == Some("before-ready") {
        crash_at("before-ready").await;
    }
    let commit = match old.say("ready").await {
        Ok(()) => old.committed(crate::handover::upgrade::SERVE_TIMEOUT).await,
        Err(e) => Err(format!("the control socket failed ({e})")),
    };
    if let Err(why) = commit {
        tracing::error!("upgrade: no commit ({why}); the old instance goes on serving");
        eprintln!("clawmux: upgrade: no commit ({why}); the old instance goes on serving");
        std::process::exit(1);
    }
    broker.ctx().handover.gate.open();
    if fault.as_deref() == Some("after-commit") {
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

/// Test hook (tests/it/handover.rs): where the new instance of an upgrade
/// fails: `after-valid` (an error returned), `before-ready` or
/// `after-commit` (it exits).
const UPGRADE_FAULT: &str = "CLAWMUX_TEST_UPGRADE_FAULT";

/// [`UPGRADE_FAULT`], read only by a build with debug assertions (the test
/// suite's): a release build, the one users install and run as a service,
/// never looks at it, so no environment can make a broker fail on purpose.
fn upgrade_fault() -> Option<String> {
    if cfg!(debug_assertions) {
        std::env::var(UPGRADE_FAULT).ok()
    } else {
        None
    }
}
