//! The `clawmux` command line.

use std::process::ExitCode;
use std::time::Duration;

mod args;
mod commands;
mod demo;
mod man_pages;
mod serve;

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
    // Large frames go back to the system as soon as they are freed.
    clawmux::bounds::return_large_blocks_at_once();
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
    let config_error = commands::own_config_error(&cli.command);
    if let Some(message) = &config_error {
        eprintln!("clawmux: {message}");
        if !matches!(cli.command, Command::Doctor(_)) {
            return ExitCode::from(2);
        }
    }
    // Commands that need no runtime and no broker.
    match &cli.command {
        Command::SocketPath(args) => return commands::socket_path(args),
        Command::Completions(args) => {
            clap_complete::generate(
                args.shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "clawmux",
                &mut std::io::stdout(),
            );
            return ExitCode::SUCCESS;
        }
        Command::Man(args) => return commands::man(args),
        Command::Setup(SetupCommand::Claw3d(args)) => return commands::setup_claw3d(args),
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
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if matches!(cli.command, Command::Serve(_)) {
        // A new instance's take-over allocates for every client at once.
        runtime.on_thread_start(|| {
            clawmux::bounds::reserve_thread_heap(clawmux::bounds::THREAD_HEAP_RESERVE_BYTES)
        });
    }
    let runtime = match runtime.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("clawmux: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::serve(args, passed, handed, held.take())
                .await
                .map(|()| ExitCode::SUCCESS),
            Command::MockGateway(args) => commands::mock_gateway(args)
                .await
                .map(|()| ExitCode::SUCCESS),
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
