//! The commands the binary answers itself, before or beside the broker:
//! `socket-path`, `setup claw3d`, `man`, `mock-gateway`, and the one rule
//! for a broken config file that every command follows.

use std::path::PathBuf;
use std::process::ExitCode;

use clawmux_mock::{MockConfig, MockGateway};

use crate::args::*;
use crate::man_pages;

/// One rule for a broken clawmux config file — config.toml unreadable, an
/// unknown key (with the nearest known one), a bad value, inconsistent
/// limits — for every command that reads it (`serve` with or without
/// `--demo`, `socket-path`, `doctor`, the broker's clients): the message on
/// stderr and exit 2, before anything is done (`doctor` still prints its
/// report). Errors in files clawmux only borrows (Claw3D's, OpenClaw's) are
/// not this rule's: the broker serves them to clients, who learn what to fix.
pub(crate) fn own_config_error(command: &Command) -> Option<String> {
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

/// `clawmux socket-path`: the socket `serve` would use with the same flags,
/// environment and config file, so scripts and README examples never guess.
pub(crate) fn socket_path(args: &SocketPathArgs) -> ExitCode {
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
pub(crate) fn setup_claw3d(args: &SetupClaw3dArgs) -> ExitCode {
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
pub(crate) fn man(args: &ManArgs) -> ExitCode {
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

pub(crate) async fn mock_gateway(args: MockArgs) -> anyhow::Result<()> {
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
