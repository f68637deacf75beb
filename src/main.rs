//! The `clawmux` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

mod args;
mod man_pages;

use args::*;

// The allocator: glibc's unless built with one of these features (measured
// side by side in BENCHMARKS.md).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use clawmux::config::{self, Secret};
use clawmux_mock::{MockConfig, MockGateway};

/// An error that ends the command with exit 2 (a usage error) rather than 1.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UsageExit(String);

fn main() -> ExitCode {
    // Before anything else: a stop, reload or upgrade signal that arrives
    // while the process starts waits for its handler (clawmux::signals).
    let held = clawmux::signals::hold();
    // SAFETY: first thing in main (after the signal mask, which opens no
    // file descriptor), before anything opens a file descriptor, so
    // the descriptors systemd passed are owned by nothing else (see its docs).
    let passed = unsafe { clawmux::systemd::take_passed() };
    // SAFETY: likewise first thing: the descriptors a SIGUSR2 upgrade's old
    // instance left open for this process, named in its environment.
    let handed = unsafe { clawmux::handover::Inherited::take_from_env() };
    let cli = Cli::parse();
    // Only `serve` keeps them held until its handlers are installed; every
    // other command gets the default actions back (a hang-up ends `tail`).
    let mut held = match cli.command {
        Command::Serve(_) => Some(held),
        _ => {
            held.release();
            None
        }
    };
    // Non-blocking, secret-safe, rate-limited (see clawmux::logging); the
    // guard flushes the last lines when main returns.
    let _log = clawmux::logging::init(cli.log.as_deref().unwrap_or(match cli.command {
        // The demo's terminal is for the banner and the runs it narrates.
        Command::Serve(ref a) if a.demo => "warn",
        Command::Serve(_) | Command::MockGateway(_) => "info",
        // The report is the output; a log line in it would only confuse.
        Command::Doctor(_) => "off",
        _ => "warn",
    }));
    // One rule for a broken config file, for every command that reads it.
    let config_error = own_config_error(&cli.command);
    if let Some(message) = &config_error {
        eprintln!("clawmux: {message}");
        if !matches!(cli.command, Command::Doctor(_)) {
            return ExitCode::from(2);
        }
    }
    // Commands that need no runtime and no broker.
    match &cli.command {
        Command::SocketPath(args) => return socket_path(args),
        Command::Completions(args) => {
            clap_complete::generate(
                args.shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "clawmux",
                &mut std::io::stdout(),
            );
            return ExitCode::SUCCESS;
        }
        Command::Man(args) => return man(args),
        Command::Setup(SetupCommand::Claw3d(args)) => return setup_claw3d(args),
        Command::Serve(args) if args.replay.replay.is_some() && !args.demo => {
            let mut cli = <Cli as clap::CommandFactory>::command();
            cli.build();
            cli.find_subcommand_mut("serve")
                .expect("the serve command")
                .clone()
                .error(
                    clap::error::ErrorKind::MissingRequiredArgument,
                    "--replay needs --demo: the recording is served by the demo's gateway double (clawmux serve --demo --replay FILE)",
                )
                .exit();
        }
        _ => {}
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("clawmux: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args, passed, handed, held.take())
                .await
                .map(|()| ExitCode::SUCCESS),
            Command::MockGateway(args) => mock_gateway(args).await.map(|()| ExitCode::SUCCESS),
            Command::Client(command) => Ok(clawmux::cli::run(command).await),
            Command::Doctor(args) => {
                let code = clawmux::cli::doctor::run(
                    args.settings.resolve(&LimitArgs::default()),
                    args.json,
                )
                .await;
                // The report shows the broken file too; the exit is the rule's.
                Ok(if config_error.is_some() {
                    ExitCode::from(2)
                } else {
                    code
                })
            }
            Command::SocketPath(_)
            | Command::Completions(_)
            | Command::Man(_)
            | Command::Setup(_) => {
                unreachable!("answered before the runtime starts")
            }
            Command::InstallService(a) => clawmux::install::install_service(
                clawmux::install::InstallOptions {
                    dry_run: a.dry_run,
                    force: a.force,
                },
                &mut std::io::stdout(),
            )
            .map(|()| ExitCode::SUCCESS)
            .map_err(anyhow::Error::from),
        }
    });
    // Tasks cut off at the shutdown deadline are dropped, not waited for.
    runtime.shutdown_timeout(Duration::from_millis(100));
    match result {
        Ok(code) => code,
        Err(e) => {
            // An error can quote a file or a peer (a recording's header, a
            // gateway's words): each line through the one sanitizer.
            eprintln!("clawmux: {}", clawmux::sanitize::lines(&format!("{e:#}")));
            if e.downcast_ref::<UsageExit>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// The demo's private directory, removed when the demo ends.
struct DemoDir(std::path::PathBuf);

impl Drop for DemoDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh private (0700) directory under the temp dir.
fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = std::env::temp_dir().join(format!("clawmux-demo-{}", uuid::Uuid::new_v4().simple()));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    Ok(dir)
}

async fn serve(
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
    if args.demo && args.settings.state_dir.is_none() {
        // The demo's throwaway gateway must not leave device tokens in your state dir.
        settings.upstream.device_identity = None;
    }
    if args.demo && activated.is_none() {
        // Before the double starts: a second demo on a busy socket fails
        // here, having started nothing.
        clawmux::local::socket::ensure_free(&settings.socket_path)?;
    }
    let mut replaying = None;
    let _demo = if args.demo {
        let replay = args.replay.load()?;
        // Watched from before the double starts: an --instant replay may
        // end before the banner is printed.
        replaying = replay.clone().map(|r| {
            let ends = r.ends();
            (r, ends)
        });
        let token = uuid::Uuid::new_v4().simple().to_string();
        // The demo's gateway double listens on a unix socket in a private
        // temporary directory, never on TCP (the broker dials that socket).
        let dir = tempfile_dir()?;
        let path = dir.join("gateway.sock");
        let what = if replay.is_some() {
            "serving the recording"
        } else {
            "with scripted agent runs"
        };
        let mock = MockGateway::start_unix(
            &path,
            MockConfig {
                token: Some(token.clone()),
                demo: replay.is_none(),
                tick_interval_ms: 5_000,
                replay,
                ..MockConfig::default()
            },
        )
        .await?;
        tracing::debug!(path = %path.display(), "demo: gateway double started ({what})");
        settings.gateway_url = "ws://localhost/".into();
        settings.upstream.unix_socket = Some(path);
        settings.token = Some(Secret::new(token));
        Some((mock, DemoDir(dir)))
    } else {
        None
    };
    // After a `SIGUSR2` upgrade nothing moved is touched before the old
    // instance commits, not even the socket files, however this start
    // fails; systemd's store has no old instance left to serve.
    let inherited = inherited.filter(|_| !args.demo);
    let broker =
        clawmux::lifecycle::start_serving(settings, inherited, activated, shutdown_timeout).await?;
    if !args.demo {
        eprintln!(
            "clawmux: serving on {}{} (try: curl --unix-socket {} http://localhost/healthz)",
            broker.socket_path().display(),
            if broker.is_socket_activated() {
                " (from systemd)"
            } else {
                ""
            },
            broker.socket_path().display()
        );
    }
    if args.demo {
        demo_banner(broker.socket_path(), replaying.as_ref().map(|(r, _)| &**r));
        broker.ctx().tracker.spawn(demo_narrator(
            broker.socket_path().to_owned(),
            broker.ctx().cancel.clone(),
        ));
        if let Some((replay, ends)) = replaying {
            broker.ctx().tracker.spawn(say_when_the_recording_ends(
                replay,
                ends,
                broker.ctx().cancel.clone(),
            ));
        }
    }
    let reload_args = (!args.demo).then(|| (args.settings.clone(), args.limits.clone()));
    let (current, ctx) = tokio::sync::watch::channel(std::sync::Arc::clone(broker.ctx()));
    let upgrades = if args.demo {
        None
    } else {
        Some(clawmux::handover::upgrade::Program::current()?)
    };
    let stop = clawmux::lifecycle::Signals {
        term: signals.term,
        int: signals.int,
        usr2: signals.usr2,
    };
    tokio::select! {
        r = clawmux::lifecycle::serve_until_stopped(broker, shutdown_timeout, upgrades, Some(current), stop) => r?,
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

async fn mock_gateway(args: MockArgs) -> anyhow::Result<()> {
    // Watched before "listening" is said, so a stop right after it is seen.
    let stop = stop_signals()?;
    let replay = args.replay.load()?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], args.port));
    let token = args.token.clone();
    let mock = MockGateway::start_on(
        addr,
        MockConfig {
            token: Some(args.token),
            tick_interval_ms: args.tick_ms,
            demo: args.demo,
            replay,
            ..MockConfig::default()
        },
    )
    .await
    .map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            "; something already listens there (a gateway?): pick another with --port N, or --port 0 for any free one"
        } else {
            ""
        };
        anyhow::anyhow!("cannot listen on {addr}: {e}{hint}")
    })?;
    // A test double's token is not a secret: showing it is how a newcomer
    // learns what to give the broker.
    eprintln!(
        "clawmux: gateway double listening on {} (expects token {token:?}); try: clawmux serve --gateway-url {} --token {token}",
        mock.url(),
        mock.url()
    );
    wait_for_stop_signal(stop).await;
    mock.stop().await;
    Ok(())
}

type StopSignals = (tokio::signal::unix::Signal, tokio::signal::unix::Signal);

fn stop_signals() -> anyhow::Result<StopSignals> {
    use tokio::signal::unix::{signal, SignalKind};
    Ok((
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    ))
}

async fn wait_for_stop_signal((mut term, mut int): StopSignals) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// `clawmux socket-path`: the socket `serve` would use with the same flags,
/// environment and config file, so scripts and README examples never guess.
/// The settings a command that takes no settings flags reads: the config
/// file (`config`, else `CLAWMUX_CONFIG` or the default) and the environment.
fn settings_from(socket: Option<PathBuf>, config: Option<PathBuf>) -> SettingsArgs {
    SettingsArgs {
        socket,
        gateway_url: None,
        token: None,
        token_file: None,
        config,
        no_device_identity: true,
        state_dir: None,
        tls_fingerprint: None,
        tls_ca_file: None,
    }
}

/// One rule for a broken clawmux config file — config.toml unreadable, an
/// unknown key (with the nearest known one), a bad value, inconsistent
/// limits — for every command that reads it (`serve` with or without
/// `--demo`, `socket-path`, `doctor`, the broker's clients): the message on
/// stderr and exit 2, before anything is done (`doctor` still prints its
/// report). Errors in files clawmux only borrows (Claw3D's, OpenClaw's) are
/// not this rule's: the broker serves them to clients, who learn what to fix.
fn own_config_error(command: &Command) -> Option<String> {
    let (settings, limits) = match command {
        Command::Serve(a) => (a.settings.clone(), a.limits.clone()),
        Command::Doctor(a) => (a.settings.clone(), LimitArgs::default()),
        Command::SocketPath(a) => (
            settings_from(a.socket.clone(), a.config.clone()),
            LimitArgs::default(),
        ),
        Command::Client(_) => (settings_from(None, None), LimitArgs::default()),
        Command::Setup(SetupCommand::Claw3d(a)) => (
            settings_from(a.socket.clone(), a.config.clone()),
            LimitArgs::default(),
        ),
        Command::MockGateway(_)
        | Command::InstallService(_)
        | Command::Completions(_)
        | Command::Man(_) => return None,
    };
    let e = settings.resolve(&limits).err()?;
    settings.is_own_config_error(&e).then(|| {
        format!(
            "{}\n({}; nothing was done: `clawmux doctor` shows every setting and where it comes from)",
            e.message, e.code
        )
    })
}

fn socket_path(args: &SocketPathArgs) -> ExitCode {
    let settings = settings_from(args.socket.clone(), args.config.clone());
    // Only files clawmux borrows can be broken here (its own config file
    // stopped the command before): the socket is the one serve falls back to.
    println!(
        "{}",
        settings
            .serve_settings(&LimitArgs::default())
            .socket_path
            .display()
    );
    ExitCode::SUCCESS
}

/// `clawmux setup claw3d [--undo]`: shows the change, asks on a terminal
/// (`--yes` does not), writes it; exit 0 when done (or nothing was left to
/// do), 1 when refused, 2 when it could not ask and was not told `--yes`.
fn setup_claw3d(args: &SetupClaw3dArgs) -> ExitCode {
    use clawmux::frontends::setup;
    use std::io::{IsTerminal, Write};
    let settings = settings_from(args.socket.clone(), args.config.clone());
    let resolved = match settings.resolve(&LimitArgs::default()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "clawmux setup claw3d: {} ({}); nothing was done",
                e.message, e.code
            );
            return ExitCode::from(1);
        }
    };
    let env = clawmux::settings::Env::from_process();
    let mut out = std::io::stdout();
    let result = if args.undo {
        setup::undo(&resolved, &env, &mut out).map(|()| true)
    } else {
        let opts = setup::Options {
            settings_file: args.settings_file.clone(),
            dry_run: args.dry_run,
        };
        let mut asked_without_terminal = false;
        let mut confirm = || {
            if args.yes {
                return true;
            }
            if !std::io::stdin().is_terminal() {
                asked_without_terminal = true;
                return false;
            }
            print!("Write these changes? [y/N] ");
            let _ = std::io::stdout().flush();
            let mut answer = String::new();
            let _ = std::io::stdin().read_line(&mut answer);
            matches!(answer.trim(), "y" | "Y" | "yes")
        };
        let result = setup::setup(&resolved, &env, &opts, &mut confirm, &mut out);
        if asked_without_terminal {
            eprintln!("clawmux setup claw3d: standard input is not a terminal, so it cannot ask: rerun with --yes to write the change above");
            return ExitCode::from(2);
        }
        result
    };
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(setup::SetupError::AlreadyDone(message)) => {
            println!("{message}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("clawmux setup claw3d: {e}");
            ExitCode::from(1)
        }
    }
}

/// On a terminal the page is shown formatted, through `man -l -` (and its
/// pager); piped, or where `man` is missing, it is printed as roff.
fn show_man_page(roff: &[u8]) -> std::io::Result<()> {
    use std::io::{IsTerminal, Write};
    if std::io::stdout().is_terminal() {
        let child = std::process::Command::new("man")
            .args(["-l", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn();
        if let Ok(mut child) = child {
            if let Some(mut stdin) = child.stdin.take() {
                // A pager quit early closes its input: not an error.
                let _ = stdin.write_all(roff);
            }
            return child.wait().map(drop);
        }
    }
    let mut out = std::io::stdout().lock();
    out.write_all(roff).and_then(|()| out.flush())
}

/// `clawmux man`: the page for `clawmux`, or (with `--dir`) one page per command.
fn man(args: &ManArgs) -> ExitCode {
    let command = <Cli as clap::CommandFactory>::command();
    let result = match &args.dir {
        Some(dir) => std::fs::create_dir_all(dir)
            .and_then(|()| man_pages::generate_to(command, dir))
            .map(|()| {
                eprintln!(
                    "clawmux: man pages written to {}; `man clawmux` finds them when {} is on man's search path (MANPATH)",
                    dir.display(),
                    dir.parent().unwrap_or(dir).display()
                )
            }),
        None => {
            let mut roff = Vec::new();
            man_pages::render(&command, &[], &mut roff).and_then(|()| show_man_page(&roff))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("clawmux man: {e}");
            ExitCode::from(1)
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

/// How to run this binary from a shell: `clawmux` when that name on `PATH`
/// is this binary, else its full path (e.g. after `cargo run`).
fn this_binary() -> String {
    let Ok(me) = std::env::current_exe().and_then(std::fs::canonicalize) else {
        return "clawmux".into();
    };
    let on_path = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .any(|dir| std::fs::canonicalize(dir.join("clawmux")).is_ok_and(|p| p == me))
    });
    if on_path {
        "clawmux".into()
    } else {
        me.display().to_string()
    }
}

/// What a newcomer who just ran `serve --demo` can do next.
fn demo_banner(socket: &std::path::Path, replay: Option<&clawmux_mock::replay::Replay>) {
    let bin = this_binary();
    let flag = if socket == config::default_socket_path() {
        String::new()
    } else {
        format!(" --socket {}", socket.display())
    };
    let sock = socket.display();
    let (double, call) = match replay {
        None => (
            "a gateway double that runs a scripted agent every 3 s".to_owned(),
            format!("{bin} call health{flag}     # one gateway request"),
        ),
        Some(replay) => {
            let double = format!(
                "a gateway double that plays the recording ({} events{})",
                replay.recording.timeline.len(),
                if replay.looped {
                    ", again and again"
                } else {
                    ""
                }
            );
            // Only a request the recording can answer is worth suggesting.
            // Method names and params come from the recording file: shown
            // through the one sanitizer.
            use clawmux::sanitize;
            let call = match replay.recording.exchanges.first() {
                Some(e) if e.params.is_null() || e.params == serde_json::json!({}) => {
                    format!(
                        "{bin} call {}{flag}     # answered as recorded",
                        sanitize::Shown(&e.method)
                    )
                }
                Some(e) if e.params.to_string().len() <= 80 => format!(
                    "{bin} call {} '{}'{flag}     # answered as recorded",
                    sanitize::Shown(&e.method),
                    sanitize::json(&e.params)
                ),
                Some(_) => format!(
                    "{bin} call …{flag}     # answered as recorded for: {}",
                    sanitize::text(&replay.answered_methods().join(", "))
                ),
                None => "(no `call`: the recording has no answers; `clawmux record --requests` records them)".to_owned(),
            };
            (double, call)
        }
    };
    eprintln!(
        "clawmux: demo: serving on {sock} with {double}.\n\
         Next, in another terminal:\n  \
         {bin} status{flag}          # the broker, its gateway session, its clients\n  \
         {bin} tail{flag}            # every event as it comes\n  \
         {call}\n  \
         curl -s --unix-socket {sock} http://localhost/healthz\n\
         This terminal shows each finished run. Ctrl-C stops the demo."
    );
}

/// `serve --demo --replay`: one line each time the recording has been
/// played to its end.
async fn say_when_the_recording_ends(
    replay: std::sync::Arc<clawmux_mock::replay::Replay>,
    mut ends: tokio::sync::watch::Receiver<u64>,
    cancel: tokio_util::sync::CancellationToken,
) {
    let events = replay.recording.timeline.len();
    loop {
        tokio::select! {
            r = ends.changed() => if r.is_err() { return },
            _ = cancel.cancelled() => return,
        }
        let next = if replay.looped {
            "it starts again in a moment (--loop)"
        } else {
            "the broker keeps serving; Ctrl-C stops the demo"
        };
        eprintln!("clawmux demo: the recording has ended ({events} events played); {next}");
    }
}

/// The demo's activity in its own terminal: one line per answered run.
async fn demo_narrator(socket: PathBuf, cancel: tokio_util::sync::CancellationToken) {
    let mut stderr = std::io::stderr();
    tokio::select! {
        r = clawmux::cli::demo::narrate(socket, &mut stderr) => {
            if let Err(e) = r {
                tracing::warn!("the demo's event narrator stopped: {e}");
            }
        }
        _ = cancel.cancelled() => {}
    }
}
