//! `clawmux serve`: the broker from the first instruction that can receive
//! a signal to the stop, with the settings re-read on `SIGHUP`.

use std::path::PathBuf;

use clawmux::config;

use crate::args::*;
use crate::demo::Demo;

/// Serves until a stop signal, or hands over on `SIGUSR2` (then this
/// process ends once the next instance serves).
pub(crate) async fn serve(
    args: ServeArgs,
    passed: Result<clawmux::systemd::Passed, clawmux::systemd::ActivationError>,
    handed: Option<Result<clawmux::handover::Inherited, String>>,
    held: Option<clawmux::signals::Held>,
) -> anyhow::Result<()> {
    use clawmux::handover::Inherited;
    // The handlers first, before anything can fail or wait: every signal
    // from now on is acted on once the broker serves.
    let signals = clawmux::signals::ServeSignals::install(held.expect("serve holds the signals"))?;
    let passed = passed?;
    // What a previous instance handed over: a SIGUSR2 upgrade's (which
    // waits for our answer) or systemd's store (read by this start only).
    let inherited = match handed {
        Some(h) => Some(h.map_err(|e| anyhow::anyhow!("upgrade: {e}"))?),
        None => Inherited::from_store(passed.stored),
    };
    let activated = passed.socket;
    raise_open_file_limit();
    if !args.demo {
        check_startup_token_file(&args.settings)?;
    }
    let mut settings = args.settings.serve_settings(&args.limits);
    let shutdown_timeout = args.shutdown_timeout;
    let mut demo = if args.demo {
        Some(Demo::start(&args, &mut settings, activated.is_some()).await?)
    } else {
        None
    };
    // After a `SIGUSR2` upgrade nothing moved is touched before the old
    // instance commits, not even the socket files, however this start
    // fails; systemd's store has no old instance left to serve.
    let inherited = inherited.filter(|_| !args.demo);
    let upgrades = if args.demo {
        None
    } else {
        Some(clawmux::handover::upgrade::Program::current()?)
    };
    // Known before the broker answers: `clawmux upgrade` may ask at once.
    clawmux::upgrade_record::set_can_upgrade(upgrades.is_some());
    let (broker, previous) =
        clawmux::lifecycle::start_serving(settings, inherited, activated, shutdown_timeout).await?;
    match &mut demo {
        Some(demo) => demo.narrate(&broker),
        None => eprintln!(
            "clawmux: serving on {}{} (try: curl --unix-socket {} http://localhost/healthz)",
            broker.socket_path().display(),
            if broker.is_socket_activated() {
                " (from systemd)"
            } else {
                ""
            },
            broker.socket_path().display()
        ),
    }
    let reload_args = (!args.demo).then(|| (args.settings.clone(), args.limits.clone()));
    let (current, ctx) = tokio::sync::watch::channel(std::sync::Arc::clone(broker.ctx()));
    let stop = clawmux::lifecycle::Signals {
        term: signals.term,
        int: signals.int,
        usr2: signals.usr2,
    };
    clawmux::test_hook::hold_at("hold-before-serving").await;
    tokio::select! {
        r = clawmux::lifecycle::serve_until_stopped(broker, shutdown_timeout, upgrades, Some(current), stop, previous) => r?,
        r = reload_on_sighup(ctx, reload_args, signals.hup) => r?,
    }
    Ok(())
}

/// Every local connection is a file descriptor: take the whole hard limit
/// (see `clawmux::local::fdlimit`); the accept loop warns if it is too low.
fn raise_open_file_limit() {
    use clawmux::local::fdlimit::{raise_to_hard, Raise};
    match raise_to_hard() {
        Ok(Raise::Raised { from, to }) => {
            tracing::debug!(from, to, "raised the open-file limit to the hard limit")
        }
        Ok(Raise::Unchanged { soft }) => tracing::debug!(?soft, "open-file limit unchanged"),
        Err(e) => tracing::info!("cannot raise the open-file limit ({e}); keeping the current one"),
    }
}

/// `SIGHUP` re-reads the settings: a changed URL or token re-opens the
/// upstream session; a broken file keeps the old settings running.
async fn reload_on_sighup(
    current: tokio::sync::watch::Receiver<std::sync::Arc<clawmux::context::Ctx>>,
    args: Option<(SettingsArgs, LimitArgs)>,
    mut hup: tokio::signal::unix::Signal,
) -> anyhow::Result<()> {
    loop {
        hup.recv().await;
        if current.has_changed().is_err() {
            // No broker serves in this process any more (it stands in for
            // the instance that took over, and passes the signal on).
            continue;
        }
        let Some((args, limits)) = &args else {
            eprintln!(
                "clawmux: SIGHUP ignored: the demo's settings are its own and are not re-read"
            );
            continue;
        };
        match args.resolve(limits) {
            Ok(resolved) => {
                let target = clawmux::upstream::Target::from_settings(&resolved.settings);
                let ctx = std::sync::Arc::clone(&current.borrow());
                let changed = ctx.upstream().retarget(target);
                tracing::info!(changed, "settings reloaded");
            }
            Err(e) => {
                tracing::error!(code = %e.code, "settings reload failed, keeping the old settings: {}", e.message)
            }
        }
    }
}

/// A token file named on the command line or in `CLAWMUX_GATEWAY_TOKEN_FILE`
/// must be usable at start: exit 1 rather than serve without the token it
/// was told to use (README "Exit codes"). The precedence is
/// `settings::resolve`'s for these sources. systemd's credential and a
/// `token_file` in config.toml are settings like the others: the broker
/// serves, and tells every client (and `doctor`) what to fix — under socket
/// activation that reaches the user, where a failing unit would not.
fn check_startup_token_file(args: &SettingsArgs) -> anyhow::Result<()> {
    let var = |key: &str| {
        std::env::var(key)
            .ok()
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    let expand = |p: String| match (p.strip_prefix("~/"), var("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(p),
    };
    let file = if args.token.is_some() {
        None
    } else if let Some(p) = &args.token_file {
        Some(p.clone())
    } else if var("CLAWMUX_GATEWAY_TOKEN").is_some() {
        None
    } else {
        var("CLAWMUX_GATEWAY_TOKEN_FILE").map(expand)
    };
    match file {
        Some(path) => config::read_token_file(&path)
            .map(drop)
            .map_err(|why| anyhow::anyhow!("{why}; fix the file or point to another one")),
        None => Ok(()),
    }
}
