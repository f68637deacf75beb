//! The `clawmux` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

mod man_pages;

use clap::{Args, Parser, Subcommand};
use clawmux::bounds::{self, Zero};
use clawmux::config::{self, Secret, Settings};
use clawmux::settings::{self, Env, Overrides, Resolved};
use clawmux::RunningBroker;
use clawmux_mock::{MockConfig, MockGateway};

/// Share one OpenClaw Gateway session among many local programs, over a unix socket.
///
/// clawmux keeps ONE WebSocket to the gateway (with your token) and lets any
/// number of local clients use it through a unix socket that only you can open.
/// Clients speak the normal gateway protocol to `ws+unix://<socket>:/ws`.
#[derive(Parser, Debug)]
#[command(name = "clawmux", version, about, long_about)]
struct Cli {
    /// Log filter (e.g. info, debug, clawmux=trace) [default: info for serve (warn for its demo) and mock-gateway, off for doctor (its report says everything), warn for the rest]. Secrets are never logged.
    #[arg(long, global = true, env = "CLAWMUX_LOG", value_name = "FILTER")]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the broker: listen on the unix socket and hold the gateway session.
    Serve(ServeArgs),
    /// Show where each setting comes from and try the gateway handshake once (exit 1 on failure).
    Doctor(DoctorArgs),
    /// Run the gateway test double on loopback (for trying clients and the broker without a real gateway).
    MockGateway(MockArgs),
    /// Install the systemd user units (clawmux.socket, clawmux.service) for this binary.
    InstallService(InstallArgs),
    /// Print the socket path the broker uses, as `serve` resolves it (for `S=$(clawmux socket-path)`).
    SocketPath(SocketPathArgs),
    /// Print a shell completion script, e.g. `clawmux completions bash > ~/.local/share/bash-completion/completions/clawmux`.
    Completions(CompletionsArgs),
    /// Print the man page (roff) to stdout, or write one page per command into a directory.
    Man(ManArgs),
    #[command(flatten)]
    Client(clawmux::cli::ClientCommand),
}

#[derive(Args, Debug)]
struct SocketPathArgs {
    /// The socket to print instead (what `serve --socket` would get).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Config file (env CLAWMUX_CONFIG) [default: $XDG_CONFIG_HOME/clawmux/config.toml].
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Args, Debug)]
struct ManArgs {
    /// Write `clawmux.1` and one `clawmux-COMMAND.1` per command here instead of printing `clawmux.1`.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct InstallArgs {
    /// Show what would be written, write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Replace unit files that differ from what would be written.
    #[arg(long)]
    force: bool,
}

/// Where the broker finds the gateway and its limits. Each flag wins over its
/// environment variable, which wins over the config file, which wins over
/// Claw3D's and OpenClaw's own settings (see README "Configuration").
#[derive(Args, Debug, Clone)]
struct SettingsArgs {
    /// Unix socket to listen on (env CLAWMUX_SOCKET) [default: $XDG_RUNTIME_DIR/clawmux.sock, else <tmp>/clawmux-<uid>/clawmux.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Gateway WebSocket URL (env CLAWMUX_GATEWAY_URL) [default: from config files, else ws://localhost:18789].
    #[arg(long, value_name = "URL")]
    gateway_url: Option<String>,
    /// Gateway token (env CLAWMUX_GATEWAY_TOKEN); prefer --token-file: command lines are visible to other users.
    #[arg(long, value_name = "TOKEN")]
    token: Option<String>,
    /// File holding the gateway token (env CLAWMUX_GATEWAY_TOKEN_FILE; also $CREDENTIALS_DIRECTORY/gateway-token).
    #[arg(long, value_name = "PATH", conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// Config file (env CLAWMUX_CONFIG) [default: $XDG_CONFIG_HOME/clawmux/config.toml].
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Connect with the token alone, without the broker's signed device identity.
    #[arg(long)]
    no_device_identity: bool,
    /// Directory for the broker's device key and device tokens (env CLAWMUX_STATE_DIR) [default: $XDG_STATE_HOME/clawmux, else ~/.local/state/clawmux].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// SHA-256 fingerprint of the gateway's TLS certificate, as OpenClaw's gateway.remote.tlsFingerprint (env CLAWMUX_TLS_FINGERPRINT): a wss:// gateway is accepted only with this certificate.
    #[arg(long, value_name = "SHA256")]
    tls_fingerprint: Option<String>,
    /// PEM file of CA certificates to trust for a wss:// gateway, beside the system's (env CLAWMUX_TLS_CA_FILE).
    #[arg(long, value_name = "PATH")]
    tls_ca_file: Option<PathBuf>,
}

/// Limits only `serve` uses (so `doctor --help` does not list them).
#[derive(Args, Debug, Clone, Default)]
struct LimitArgs {
    /// Seconds a local connect waits for the gateway session before failing, 0 to 86400 [default: 10].
    #[arg(long, value_name = "SECS", value_parser = |s: &str| secs_arg("--connect-wait", s, Zero::Allowed))]
    connect_wait: Option<Duration>,
    /// Seconds a request waits for the gateway's answer (studio.request_timeout after), 1 to 86400 [default: 30].
    #[arg(long, value_name = "SECS", value_parser = |s: &str| secs_arg("--request-timeout", s, Zero::Refused))]
    request_timeout: Option<Duration>,
}

impl SettingsArgs {
    fn overrides(&self) -> Overrides {
        Overrides {
            socket: self.socket.clone(),
            gateway_url: self.gateway_url.clone(),
            token: self
                .token
                .as_deref()
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(Secret::new),
            token_file: self.token_file.clone(),
            config: self.config.clone(),
            state_dir: self.state_dir.clone(),
            no_device_identity: self.no_device_identity,
            tls_fingerprint: self.tls_fingerprint.clone(),
            tls_ca_file: self.tls_ca_file.clone(),
        }
    }

    /// Resolves the settings; flags for limits are applied on top.
    fn resolve(&self, limits: &LimitArgs) -> Result<Resolved, clawmux::protocol::ErrorShape> {
        let mut resolved = settings::resolve(&self.overrides(), &Env::from_process())?;
        if let Some(wait) = limits.connect_wait {
            resolved.settings.limits.connect_wait = wait;
        }
        if let Some(timeout) = limits.request_timeout {
            resolved.settings.limits.request_timeout = timeout;
        }
        resolved.settings.limits.check_queues().map_err(|message| {
            clawmux::protocol::ErrorShape::studio(
                clawmux::protocol::StudioCode::SettingsLoadFailed,
                format!("inconsistent limits: {message}"),
            )
        })?;
        Ok(resolved)
    }

    /// Whether `e` is an error in clawmux's own settings: its config.toml
    /// (unreadable, a typo, a bad value) or inconsistent limits. At start that
    /// is a usage error (exit 2): nothing was wrong but what the user wrote.
    /// Errors in files clawmux only borrows (Claw3D's, OpenClaw's, a systemd
    /// credential) are served to clients instead, who learn what to fix.
    fn is_own_config_error(&self, e: &clawmux::protocol::ErrorShape) -> bool {
        let config = settings::config_file_path(&self.overrides(), &Env::from_process());
        e.message.starts_with("inconsistent limits")
            || config.is_some_and(|path| {
                e.message
                    .starts_with(&format!("cannot load settings from {}:", path.display()))
            })
    }

    /// Settings to serve with: resolved ones, or — when a settings file is
    /// broken — defaults that answer every connect with the load error, so
    /// the broker still runs and clients learn what to fix.
    fn serve_settings(&self, limits: &LimitArgs) -> Settings {
        match self.resolve(limits) {
            Ok(r) => r.settings,
            Err(e) => {
                tracing::error!(code = %e.code, "{}", e.message);
                let socket = self
                    .socket
                    .clone()
                    .or_else(|| std::env::var_os("CLAWMUX_SOCKET").map(PathBuf::from))
                    .unwrap_or_else(config::default_socket_path);
                let mut s = Settings::new(socket);
                s.load_error = Some(e);
                s
            }
        }
    }
}

#[derive(Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    settings: SettingsArgs,
    #[command(flatten)]
    limits: LimitArgs,
    /// Start an in-process gateway double with scripted agent activity and connect to it (try clawmux without a gateway).
    #[arg(long)]
    demo: bool,
    /// With --demo: the double serves this recorded session (`clawmux record`) instead of scripted runs.
    #[command(flatten)]
    replay: ReplayArgs,
    /// Seconds a stop (SIGTERM/SIGINT) may take, 0 to 86400: clients get a `shutdown` event and `1001 going away`; any still open after this are cut off.
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = |s: &str| bounds::duration_secs_f64("--shutdown-timeout", s, Zero::Allowed))]
    shutdown_timeout: Duration,
}

#[derive(Args, Debug)]
struct DoctorArgs {
    #[command(flatten)]
    settings: SettingsArgs,
    /// Print the report as one JSON document (for scripts); the exit code is the same.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct MockArgs {
    /// Loopback port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 18789)]
    port: u16,
    /// Token clients must present (printed at start: it is a test double's, not a secret).
    #[arg(
        long,
        env = "CLAWMUX_MOCK_TOKEN",
        default_value = "test-token",
        hide_env_values = true
    )]
    token: String,
    /// Milliseconds between tick events.
    #[arg(long, default_value_t = 30_000)]
    tick_ms: u64,
    /// Simulate agent runs every few seconds.
    #[arg(long, conflicts_with = "replay")]
    demo: bool,
    #[command(flatten)]
    replay: ReplayArgs,
}

/// Fastest `--speed` accepted: beyond it, use `--instant`.
const MAX_REPLAY_SPEED: f64 = 1000.0;
/// Slowest `--speed` accepted: a recording's day then lasts 1000 days; a
/// slower factor (1e-300) made the pause overflow and panic a worker.
const MIN_REPLAY_SPEED: f64 = 0.001;

/// Serving a recording (README "Record and replay").
#[derive(Args, Debug)]
struct ReplayArgs {
    /// Serve this recorded session (`clawmux record`): its hello-ok, its events in order, its recorded answers.
    #[arg(long, value_name = "FILE")]
    replay: Option<PathBuf>,
    /// Play events this many times faster than recorded (0.5 = half speed), from 0.001 to 1000 [default: 1].
    #[arg(long, value_name = "X", requires = "replay", conflicts_with = "instant", value_parser = speed_arg)]
    speed: Option<f64>,
    /// Send all recorded events at once (in order), without the recorded pauses.
    #[arg(long, requires = "replay")]
    instant: bool,
    /// Start the recording again after its end (after a short pause), on every connection.
    #[arg(long = "loop", requires = "replay")]
    looped: bool,
}

impl ReplayArgs {
    /// The recording to serve, loaded and checked (a cut-off last line is a warning).
    fn load(&self) -> anyhow::Result<Option<std::sync::Arc<clawmux_mock::replay::Replay>>> {
        use clawmux_mock::replay::{Pace, Replay};
        let Some(path) = &self.replay else {
            return Ok(None);
        };
        let recording = clawmux_mock::recording::Recording::load(path)?;
        for warning in &recording.warnings {
            eprintln!("clawmux: warning: recording {}: {warning}", path.display());
        }
        eprintln!(
            "clawmux: replaying {} (gateway {}): {} events, {} recorded answers",
            path.display(),
            recording.gateway_version().unwrap_or("?"),
            recording.timeline.len(),
            recording.exchanges.len()
        );
        let pace = if self.instant {
            Pace::Instant
        } else {
            Pace::Speed(self.speed.unwrap_or(1.0))
        };
        Ok(Some(Replay::new(recording, pace, self.looped)))
    }
}

fn speed_arg(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(x) if (MIN_REPLAY_SPEED..=MAX_REPLAY_SPEED).contains(&x) => Ok(x),
        _ => Err(format!(
            "--speed takes a number from {MIN_REPLAY_SPEED} to {MAX_REPLAY_SPEED} (or use --instant)"
        )),
    }
}

/// A whole number of seconds on the command line, checked against
/// [`bounds::MAX_DURATION`] so an absurd value is a usage error (exit 2),
/// not a panic on the first request.
fn secs_arg(flag: &str, text: &str, zero: Zero) -> Result<Duration, String> {
    let secs: u64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{flag} takes a whole number of seconds"))?;
    bounds::duration_secs(flag, secs, zero)
}

/// An error that ends the command with exit 2 (a usage error) rather than 1.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UsageExit(String);

fn main() -> ExitCode {
    // SAFETY: first thing in main, before anything opens a file descriptor, so
    // the descriptors systemd passed are owned by nothing else (see its docs).
    let activated = unsafe { clawmux::systemd::take_activated_listener() };
    let cli = Cli::parse();
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
            Command::Serve(args) => serve(args, activated).await.map(|()| ExitCode::SUCCESS),
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
            Command::SocketPath(_) | Command::Completions(_) | Command::Man(_) => {
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
            eprintln!("clawmux: {e:#}");
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
    activated: Result<Option<clawmux::systemd::ActivatedSocket>, clawmux::systemd::ActivationError>,
) -> anyhow::Result<()> {
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
    let activated = activated?;
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
    let broker = match activated {
        Some(socket) => {
            RunningBroker::start_with_activated(settings, socket.listener, socket.others)?
        }
        None => RunningBroker::start(settings).await?,
    };
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
    let ctx = std::sync::Arc::clone(broker.ctx());
    tokio::select! {
        r = clawmux::lifecycle::serve_until_stopped(broker, shutdown_timeout) => r?,
        r = reload_on_sighup(&ctx, reload_args) => r?,
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
    ctx: &clawmux::context::Ctx,
    args: Option<(SettingsArgs, LimitArgs)>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        hup.recv().await;
        let Some((args, limits)) = &args else {
            tracing::info!("SIGHUP ignored in demo mode");
            continue;
        };
        match args.resolve(limits) {
            Ok(resolved) => {
                let target = clawmux::upstream::Target::from_settings(&resolved.settings);
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
            let call = match replay.recording.exchanges.first() {
                Some(e) if e.params.is_null() || e.params == serde_json::json!({}) => {
                    format!("{bin} call {}{flag}     # answered as recorded", e.method)
                }
                Some(e) if e.params.to_string().len() <= 80 => format!(
                    "{bin} call {} '{}'{flag}     # answered as recorded",
                    e.method, e.params
                ),
                Some(_) => format!(
                    "{bin} call …{flag}     # answered as recorded for: {}",
                    replay.answered_methods().join(", ")
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
