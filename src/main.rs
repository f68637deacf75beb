//! The `clawmux` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

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
    /// Log filter (e.g. info, debug, clawmux=trace). Secrets are never logged.
    #[arg(long, global = true, env = "CLAWMUX_LOG", default_value = "info")]
    log: String,
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
    #[command(flatten)]
    Client(clawmux::cli::ClientCommand),
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
    fn resolve(&self) -> Result<Resolved, clawmux::protocol::ErrorShape> {
        let mut resolved = settings::resolve(&self.overrides(), &Env::from_process())?;
        if let Some(wait) = self.connect_wait {
            resolved.settings.limits.connect_wait = wait;
        }
        if let Some(timeout) = self.request_timeout {
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

    /// Settings to serve with: resolved ones, or — when a settings file is
    /// broken — defaults that answer every connect with the load error, so
    /// the broker still runs and clients learn what to fix.
    fn serve_settings(&self) -> Settings {
        match self.resolve() {
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
}

#[derive(Args, Debug)]
struct MockArgs {
    /// Loopback port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 18789)]
    port: u16,
    /// Token clients must present.
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

/// Serving a recording (README "Record and replay").
#[derive(Args, Debug)]
struct ReplayArgs {
    /// Serve this recorded session (`clawmux record`): its hello-ok, its events in order, its recorded answers.
    #[arg(long, value_name = "FILE")]
    replay: Option<PathBuf>,
    /// Play events this many times faster than recorded (0.5 = half speed), above 0 and at most 1000 [default: 1].
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
        Ok(x) if x.is_finite() && x > 0.0 && x <= MAX_REPLAY_SPEED => Ok(x),
        _ => Err(format!(
            "--speed takes a number above 0 and at most {MAX_REPLAY_SPEED} (or use --instant)"
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

fn main() -> ExitCode {
    // SAFETY: first thing in main, before anything opens a file descriptor, so
    // the descriptors systemd passed are owned by nothing else (see its docs).
    let activated = unsafe { clawmux::systemd::take_activated_listener() };
    let cli = Cli::parse();
    // Non-blocking, secret-safe, rate-limited (see clawmux::logging); the
    // guard flushes the last lines when main returns.
    let _log = clawmux::logging::init(&cli.log);
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
            Command::Doctor(args) => Ok(clawmux::cli::doctor::run(args.settings.resolve()).await),
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
            ExitCode::from(1)
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
    let mut settings = args.settings.serve_settings();
    let shutdown_timeout = args.shutdown_timeout;
    if args.demo && args.settings.state_dir.is_none() {
        // The demo's throwaway gateway must not leave device tokens in your state dir.
        settings.upstream.device_identity = None;
    }
    if args.replay.replay.is_some() && !args.demo {
        anyhow::bail!("--replay needs --demo (serve --demo --replay FILE)");
    }
    let _demo = if args.demo {
        let replay = args.replay.load()?;
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
        eprintln!(
            "clawmux: demo mode: gateway double on {} {what}",
            path.display()
        );
        settings.gateway_url = "ws://localhost/".into();
        settings.upstream.unix_socket = Some(path);
        settings.token = Some(Secret::new(token));
        Some((mock, DemoDir(dir)))
    } else {
        None
    };
    let broker = match activated? {
        Some(socket) => {
            RunningBroker::start_with_activated(settings, socket.listener, socket.others)?
        }
        None => RunningBroker::start(settings).await?,
    };
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
    let reload_args = (!args.demo).then(|| args.settings.clone());
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
    ctx: &clawmux::broker::Ctx,
    args: Option<SettingsArgs>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        hup.recv().await;
        let Some(args) = &args else {
            tracing::info!("SIGHUP ignored in demo mode");
            continue;
        };
        match args.resolve() {
            Ok(resolved) => {
                let target = clawmux::upstream::Target::from_settings(&resolved.settings);
                let changed = ctx.upstream.retarget(target);
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
    .await?;
    eprintln!("clawmux: gateway double listening on {}", mock.url());
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
