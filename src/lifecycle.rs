//! The `serve` process: its start ([`start_serving`]), and from `READY=1`
//! to exit ([`serve_until_stopped`]): waits for SIGTERM/SIGINT, tells
//! systemd, hands over on SIGUSR2, and shuts the broker down within a hard
//! deadline. Both halves of a handover are [`crate::handover`]'s
//! (`old_instance`, `new_instance`); this module only decides when.
//!
//! Exit codes (README, "Exit codes"): 0 clean stop, 1 start-up failure (the
//! binary's edge reports it), 2 bad command line (clap), 3 forced stop.

use std::time::Duration;

use std::sync::Arc;

use crate::context::Ctx;
use crate::handover::old_instance::{self, Outcome};
use crate::handover::upgrade::{Next, Predecessor, Program};
use crate::systemd::Notifier;
use crate::RunningBroker;

/// The signals [`serve_until_stopped`] acts on, installed by the caller
/// first thing ([`crate::signals::ServeSignals`]).
pub struct Signals {
    pub term: tokio::signal::unix::Signal,
    pub int: tokio::signal::unix::Signal,
    pub usr2: tokio::signal::unix::Signal,
}

/// Exit status when the stop was forced: a second stop during the shutdown
/// (a `SIGTERM`/`SIGINT`, or after an upgrade a second stop the previous
/// instance passed on), or the shutdown overran its deadline by
/// [`BACKSTOP_GRACE`].
pub const EXIT_FORCED: i32 = 3;

/// How long after the stop's own bound (the shutdown deadline and the event
/// log's close; for a stop that stores the clients, the release's own
/// bounds too) the process is ended regardless of what its tasks are doing
/// (for a runtime that is itself stuck; the stop never waits past its bound).
pub const BACKSTOP_GRACE: Duration = Duration::from_secs(1);

/// Runs until SIGTERM or SIGINT, then stops the broker within
/// `shutdown_timeout`. Sends `READY=1` first and `STOPPING=1` on the signal.
/// A second stop during the shutdown exits at once with [`EXIT_FORCED`]
/// (stops counted as [`StopCount`] says: a stop the previous instance
/// passed on and this process's own signal, one stop signalled to both,
/// in either order, are one).
///
/// `SIGUSR2` hands the broker over to a new instance of `upgrades`
/// ([`crate::handover::upgrade`]); when that fails, this one goes on
/// serving (a new core, if it had stopped) and `current` is told of it.
/// Under a service manager that keeps a file descriptor store, a stop
/// first stores the sockets clawmux bound itself for the next start.
/// `previous`: the control socket of the instance this one took over
/// from, which says `stop` for each stop asked of it while it is still
/// there.
pub async fn serve_until_stopped(
    mut broker: RunningBroker,
    shutdown_timeout: Duration,
    upgrades: Option<Program>,
    current: Option<tokio::sync::watch::Sender<Arc<Ctx>>>,
    signals: Signals,
    mut previous: Option<Predecessor>,
) -> std::io::Result<()> {
    // The handlers were installed before the broker started (and the
    // signals held before that: crate::signals), so none is lost.
    let Signals {
        mut term,
        mut int,
        mut usr2,
    } = signals;
    let mut notifier = Notifier::start(broker.ctx());
    let signal_name = loop {
        tokio::select! {
            // A stop signal first, so that the log names it when the same
            // stop also came from the previous instance.
            biased;
            _ = term.recv() => break "SIGTERM",
            _ = int.recv() => break "SIGINT",
            asked = stop_word(&mut previous) => {
                if asked {
                    break PASSED_ON;
                }
                previous = None;
            }
            _ = usr2.recv() => {
                let Some(program) = &upgrades else {
                    tracing::info!("SIGUSR2 ignored: this broker cannot hand over (demo mode)");
                    eprintln!("clawmux: SIGUSR2 ignored: the demo cannot hand over (its gateway double lives in this process); stop it with Ctrl-C and start it again");
                    continue;
                };
                tracing::info!(program = %program.path.display(), "SIGUSR2: handing over to a new instance");
                crate::upgrade_record::attempt();
                let target = broker.ctx().upstream().target();
                // Heard from before the handover: a reload asked during it
                // (the settings' own task reloads this instance, which is
                // about to stop serving) is the new instance's too.
                let mut hup =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
                match old_instance::upgrade(broker, program, shutdown_timeout).await {
                    Outcome::Upgraded(next, moved) => {
                        // A reload during the handover, or one that changed
                        // what this instance connects to while the new one
                        // may have read the settings before it: the new one
                        // reads them again.
                        let reloaded = hup.as_mut().is_some_and(arrived);
                        if reloaded || notifier.ctx().upstream().target().differs(&target) {
                            signal_next(&next.child, rustix::process::Signal::HUP, "a reload");
                        }
                        // The new instance is the service now: no STOPPING=1.
                        notifier.abandon();
                        // No broker serves in this process any more: a
                        // `SIGHUP` here is the new instance's (passed on).
                        drop(current);
                        // A stop or another upgrade asked of this process
                        // while it handed over, or until it exits, is the
                        // new instance's now.
                        let mut relay = Relay::new(next, previous.take());
                        relay
                            .pass_on_pending("during the handover", &mut term, &mut int, &mut usr2)
                            .await;
                        if keeps_its_terminal() {
                            moved.let_go();
                            return stand_in_for(relay, term, int, usr2, hup).await;
                        }
                        let signals = Signals { term, int, usr2 };
                        relay.pass_on_until(moved.leave_to_exit(), signals, hup).await;
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
    let mut stops = Stops {
        term,
        int,
        previous,
        count: StopCount::first(signal_name),
    };
    // The stop's own bound, and the process ends at most a grace after it.
    let may_store = crate::systemd::keeps_a_store();
    arm_backstop(
        shutdown_timeout
            + if may_store {
                crate::systemd::STOPPING_QUERY_TIMEOUT + crate::broker::RELEASE_OWN_BOUNDS
            } else {
                crate::broker::REPLAY_LOG_CLOSE_WAIT
            }
            + BACKSTOP_GRACE,
    );
    // A stop for good (not a restart) is the polite one: nothing would take
    // what is stored, and systemd would close it without a word.
    let restarting = may_store
        && match crate::systemd::stopping().await {
            crate::systemd::Stopping::ForGood => {
                tracing::info!("systemd stops the service (not a restart): closing the clients");
                false
            }
            _ => true,
        };
    if restarting {
        tokio::select! {
            r = old_instance::store_for_next_start(broker, shutdown_timeout) => return r,
            signal = stops.second() => force_exit(signal),
        }
    }
    let shutdown = async {
        crate::test_hook::hold_at("hold-in-stop").await;
        broker.shutdown(shutdown_timeout).await
    };
    tokio::select! {
        clean = shutdown => {
            if !clean {
                tracing::warn!(
                    deadline_ms = shutdown_timeout.as_millis() as u64,
                    "shutdown deadline reached; clients that were not reading were cut off"
                );
            }
            tracing::info!("clawmux stopped");
            Ok(())
        }
        signal = stops.second() => force_exit(signal),
    }
}

/// What [`serve_until_stopped`] calls a stop the previous instance passed
/// on.
const PASSED_ON: &str = "a stop passed on by the previous instance";

/// How many stops were asked of this process. A stop reaches it as a
/// signal of its own, as the word `stop` from the instance it took over
/// from (which passes on the stops asked of it), or both: a stop sent to
/// the whole group (systemd, `kill %1` in a shell, `pkill`) reaches every
/// instance. So the count is the larger of the two, and a stop that comes
/// both ways is one.
#[derive(Default)]
struct StopCount {
    signals: u32,
    words: u32,
}

impl StopCount {
    /// Begun with the first stop: `PASSED_ON`, else a signal.
    fn first(what: &str) -> StopCount {
        let mut count = StopCount::default();
        if what == PASSED_ON {
            count.word();
        } else {
            count.signal();
        }
        count
    }

    fn stops(&self) -> u32 {
        self.signals.max(self.words)
    }

    /// Counts a stop signal; whether it is a further stop.
    fn signal(&mut self) -> bool {
        self.count(|c| c.signals += 1, "a stop signal")
    }

    /// Counts the predecessor's word; whether it is a further stop.
    fn word(&mut self) -> bool {
        self.count(|c| c.words += 1, "the previous instance's word")
    }

    /// Counts one with `add`; logs when `what` was a stop already heard.
    fn count(&mut self, add: impl FnOnce(&mut StopCount), what: &str) -> bool {
        let before = self.stops();
        add(self);
        let further = self.stops() > before;
        if !further {
            tracing::info!(
                what,
                "the stop reached this process both as a signal and from the previous instance: one stop"
            );
        }
        further
    }
}

/// The stops heard while the broker stops, counted as [`StopCount`] says:
/// a second stop forces it.
struct Stops {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    previous: Option<Predecessor>,
    count: StopCount,
}

impl Stops {
    /// What forces the stop: the next `SIGTERM`, `SIGINT` or word `stop`
    /// that is not the same stop as one before.
    async fn second(&mut self) -> &'static str {
        loop {
            let (what, further) = tokio::select! {
                _ = self.term.recv() => ("SIGTERM", self.count.signal()),
                _ = self.int.recv() => ("SIGINT", self.count.signal()),
                asked = stop_word(&mut self.previous) => {
                    if !asked {
                        self.previous = None;
                        continue;
                    }
                    ("stop passed on by the previous instance", self.count.word())
                }
            };
            if further {
                return what;
            }
        }
    }
}

/// Whether `signal` was received since it was last asked (without waiting).
fn arrived(signal: &mut tokio::signal::unix::Signal) -> bool {
    use futures_util::FutureExt as _;
    signal.recv().now_or_never().is_some()
}

/// What this process, no longer serving after a handover that succeeded,
/// passes on to the instance that took over ([`Next`]): what is asked of
/// it by signal, and the stops its own predecessor passes on to it (it may
/// still be there: it stands in for this one in a terminal, or it has not
/// exited yet).
///
/// Each stop, counted as [`StopCount`] says, goes on as the word `stop` on
/// the control socket, which the next instance counts the same way: a stop
/// sent to the whole group is one stop in every instance, and a second
/// stop, however it reaches them, forces the serving instance's stop.
struct Relay {
    next: Next,
    previous: Option<Predecessor>,
    count: StopCount,
}

impl Relay {
    fn new(next: Next, previous: Option<Predecessor>) -> Relay {
        Relay {
            next,
            previous,
            count: StopCount::default(),
        }
    }

    /// A `SIGTERM` or `SIGINT` reached this process.
    async fn stop_signalled(&mut self, when: &str) {
        if self.count.signal() {
            pass_on_stop(&mut self.next, when).await;
        }
    }

    /// The predecessor said `stop` (`asked`), or ended without.
    async fn word(&mut self, asked: bool, when: &str) {
        if !asked {
            self.previous = None;
        } else if self.count.word() {
            pass_on_stop(&mut self.next, when).await;
        }
    }

    /// Passes on what was asked of this process and not heard yet (`when`,
    /// for the log): a stop; else another upgrade (`SIGUSR2`) as that
    /// signal. This process exits without acting on either.
    async fn pass_on_pending(
        &mut self,
        when: &str,
        term: &mut tokio::signal::unix::Signal,
        int: &mut tokio::signal::unix::Signal,
        usr2: &mut tokio::signal::unix::Signal,
    ) {
        use futures_util::FutureExt as _;
        if let Some(asked) = self
            .previous
            .as_mut()
            .and_then(|p| p.stop_asked().now_or_never())
        {
            self.word(asked, when).await;
        }
        // Each of the two is a stop (two of one signal are one: the kernel
        // keeps one pending).
        let stops = usize::from(arrived(term)) + usize::from(arrived(int));
        let upgrade = arrived(usr2);
        for _ in 0..stops {
            self.stop_signalled(when).await;
        }
        if stops == 0 && upgrade {
            signal_next(
                &self.next.child,
                rustix::process::Signal::USR2,
                "an upgrade",
            );
        }
    }

    /// Until `exit` (this process letting go of what it moved) is done:
    /// what is asked of this process is passed on, as
    /// [`Relay::pass_on_pending`] does, and a `SIGHUP` as that signal.
    /// Letting go at the lowest priority can take a while on a busy
    /// machine, and this pid may be the one a script or a user knows the
    /// broker by. A signal that arrives as the let-go ends is passed on
    /// too.
    async fn pass_on_until(
        mut self,
        exit: impl std::future::Future<Output = ()>,
        signals: Signals,
        mut hup: Option<tokio::signal::unix::Signal>,
    ) {
        let Signals {
            mut term,
            mut int,
            mut usr2,
        } = signals;
        let when = "as this process exits";
        let mut exit = std::pin::pin!(exit);
        let mut let_go = false;
        // Once let go: until the predecessor has ended too (its stops are
        // relayed through here), at most RELAY_WAIT.
        let linger = tokio::time::sleep(RELAY_WAIT);
        let mut linger = std::pin::pin!(linger);
        loop {
            tokio::select! {
                // What was asked first: a let-go that ends in the same poll
                // does not drop it.
                biased;
                _ = term.recv() => self.stop_signalled(when).await,
                _ = int.recv() => self.stop_signalled(when).await,
                asked = stop_word(&mut self.previous) => self.word(asked, when).await,
                _ = usr2.recv() => signal_next(&self.next.child, rustix::process::Signal::USR2, "an upgrade"),
                _ = hangup(&mut hup) => signal_next(&self.next.child, rustix::process::Signal::HUP, "a reload"),
                () = &mut exit, if !let_go => {
                    let_go = true;
                    if self.previous.is_some() {
                        tracing::info!(
                            "let go; relaying for the previous instance until it exits too"
                        );
                        linger.as_mut().reset(tokio::time::Instant::now() + RELAY_WAIT);
                    }
                }
                () = &mut linger, if let_go => break,
            }
            if let_go && self.previous.is_none() {
                break;
            }
        }
        self.pass_on_pending(when, &mut term, &mut int, &mut usr2)
            .await;
        if hup.as_mut().is_some_and(arrived) {
            signal_next(&self.next.child, rustix::process::Signal::HUP, "a reload");
        }
    }
}

/// How long an old instance that has let go stays for its own predecessor,
/// which may still be letting go, so that a stop sent to that one's pid
/// still reaches the serving instance through this one.
const RELAY_WAIT: Duration = Duration::from_secs(5);

/// The predecessor's word ([`Predecessor::stop_asked`]); never, without one.
async fn stop_word(previous: &mut Option<Predecessor>) -> bool {
    match previous {
        Some(p) => p.stop_asked().await,
        None => std::future::pending().await,
    }
}

/// The next `SIGHUP`; never, without its handler.
async fn hangup(hup: &mut Option<tokio::signal::unix::Signal>) {
    match hup {
        Some(hup) => {
            hup.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// Passes a stop asked of this process `when` on to the instance that
/// took over, as the word `stop` on the control socket.
async fn pass_on_stop(next: &mut Next, when: &str) {
    let pid = next.child.id();
    match next.ask_to_stop().await {
        Ok(()) => tracing::info!(
            pid,
            "a stop was asked {when}: passed on to the new instance"
        ),
        Err(e) => tracing::warn!(pid, "a stop was asked {when} and cannot be passed on ({e})"),
    }
}

/// Passes `what`, asked of this process during a handover that succeeded
/// or after it, on to the new instance as `sig`.
fn signal_next(next: &tokio::process::Child, sig: rustix::process::Signal, what: &str) {
    tracing::info!(
        pid = next.id(),
        "{what} was asked of this instance: passed on to the new instance"
    );
    signal_child(next, sig);
}

/// Sends `sig` to `child`, unless it has been reaped.
fn signal_child(child: &tokio::process::Child, sig: rustix::process::Signal) {
    if let Some(pid) = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32))
    {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

/// Ends the process at once, after a second stop (`what`). Said on stderr
/// directly, as the backstop does: the log's writer is a thread of its own,
/// and the exit would not wait for it to write the line.
fn force_exit(what: &str) -> ! {
    say(&format!("a second {what} during shutdown: exiting now"));
    std::process::exit(EXIT_FORCED)
}

/// Writes `what` to stderr at once, as `clawmux: <what>`; a stderr that is
/// gone (a closed pipe, a hung-up terminal) is not an error here.
fn say(what: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "clawmux: {what}");
}

/// Ends the process after `after`, from a plain thread, so not even a stuck
/// async runtime can keep it alive past the deadline.
fn arm_backstop(after: Duration) {
    let spawned = std::thread::Builder::new()
        .name("shutdown-backstop".into())
        .spawn(move || {
            std::thread::sleep(after);
            say(&format!(
                "shutdown did not finish within {} ms; exiting",
                after.as_millis()
            ));
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
/// status. A stop (`SIGTERM`, `SIGINT`, or the word of the instance this
/// one stands in for in turn) goes on as [`Relay`] says, and `SIGUSR2` and
/// `SIGHUP` as those signals: Ctrl-C (which the terminal sends to every
/// process of the job), and `kill`, `kill %1` and `kill -HUP` with the pid
/// or the job the shell shows, work however many upgrades the broker had.
async fn stand_in_for(
    mut relay: Relay,
    mut term: tokio::signal::unix::Signal,
    mut int: tokio::signal::unix::Signal,
    mut usr2: tokio::signal::unix::Signal,
    mut hup: Option<tokio::signal::unix::Signal>,
) -> std::io::Result<()> {
    tracing::info!(
        pid = relay.next.child.id(),
        "upgrade: the new instance serves; this process stays for the terminal until it ends"
    );
    let when = "of the process the terminal started";
    loop {
        tokio::select! {
            biased;
            _ = term.recv() => relay.stop_signalled(when).await,
            _ = int.recv() => relay.stop_signalled(when).await,
            asked = stop_word(&mut relay.previous) => relay.word(asked, when).await,
            _ = usr2.recv() => signal_child(&relay.next.child, rustix::process::Signal::USR2),
            _ = hangup(&mut hup) => {
                tracing::info!("SIGHUP passed on to the new instance");
                signal_child(&relay.next.child, rustix::process::Signal::HUP);
            }
            status = relay.next.child.wait() => {
                let code = status?.code().unwrap_or(EXIT_FORCED);
                std::process::exit(code);
            }
        }
    }
}

/// A start: takes over what a previous instance handed over, if one did
/// ([`crate::handover::new_instance::take`]), and serves it, else serves
/// on the socket systemd passed, else binds its own; then, after a
/// `SIGUSR2` upgrade, waits for the old instance's commit
/// ([`crate::handover::new_instance::commit`]).
///
/// After an upgrade, also the old instance's control socket: it may still
/// pass on a stop asked of it meanwhile ([`serve_until_stopped`]'s
/// `previous`).
pub async fn start_serving(
    settings: crate::config::Settings,
    inherited: Option<crate::handover::Inherited>,
    activated: Option<crate::systemd::ActivatedSocket>,
    shutdown_timeout: Duration,
) -> anyhow::Result<(RunningBroker, Option<Predecessor>)> {
    use crate::handover::new_instance;
    let start = new_instance::take(inherited, shutdown_timeout).await?;
    let broker = RunningBroker::start_from(settings, start.taken, activated, start.gate)?;
    let mut previous = start.old;
    if let Some(old) = &mut previous {
        new_instance::commit(old, &broker.ctx().handover.gate).await;
    }
    Ok((broker, previous))
}

#[cfg(test)]
mod tests {
    use super::StopCount;

    /// Counts `heard` in order ('s' a signal, 'w' a word); the stops.
    fn stops(heard: &str) -> u32 {
        let mut count = StopCount::default();
        for h in heard.chars() {
            match h {
                's' => count.signal(),
                _ => count.word(),
            };
        }
        count.stops()
    }

    #[test]
    fn a_stop_that_comes_both_as_a_signal_and_as_the_word_is_one_stop_in_either_order() {
        assert_eq!(stops("sw"), 1);
        assert_eq!(stops("ws"), 1);
        assert_eq!(stops("swsw"), 2);
        assert_eq!(stops("wssw"), 2);
    }

    #[test]
    fn two_stops_that_come_one_way_are_two() {
        assert_eq!(stops("ss"), 2);
        assert_eq!(stops("ww"), 2);
        assert_eq!(stops("wsw"), 2);
    }

    #[test]
    fn whether_a_stop_is_a_further_one() {
        let mut count = StopCount::default();
        assert!(count.word());
        assert!(!count.signal(), "the same stop");
        assert!(count.signal(), "a second one");
        assert!(!count.word(), "the second, passed on as well");
    }
}
