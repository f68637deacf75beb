//! The `serve` process from `READY=1` to exit: waits for SIGTERM/SIGINT,
//! tells systemd, and shuts the broker down within a hard deadline.
//!
//! Exit codes (README, "Exit codes"): 0 clean stop, 1 start-up failure (the
//! binary's edge reports it), 2 bad command line (clap), 3 forced stop.

use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};

use crate::systemd::Notifier;
use crate::RunningBroker;

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
pub async fn serve_until_stopped(
    broker: RunningBroker,
    shutdown_timeout: Duration,
) -> std::io::Result<()> {
    // Handlers first, so a stop request right after READY=1 is never lost.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let notifier = Notifier::start(broker.ctx());
    let signal_name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = signal_name, "stop requested");
    notifier.stopping();
    arm_backstop(shutdown_timeout + BACKSTOP_GRACE);
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
