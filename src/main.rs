//! The `clawmux` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use clawmux::config::{self, Secret, Settings};
use clawmux::mock::{MockConfig, MockGateway};
use clawmux::RunningBroker;
use tracing_subscriber::EnvFilter;

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
    /// Run the gateway test double on loopback (for trying clients and the broker without a real gateway).
    MockGateway(MockArgs),
    /// Install the systemd user units (clawmux.socket, clawmux.service) for this binary.
    InstallService(InstallArgs),
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

#[derive(Args, Debug)]
struct ServeArgs {
    /// Unix socket to listen on [default: $XDG_RUNTIME_DIR/clawmux.sock, else <tmp>/clawmux-<uid>/clawmux.sock].
    #[arg(long, env = "CLAWMUX_SOCKET")]
    socket: Option<PathBuf>,
    /// Gateway WebSocket URL.
    #[arg(long, env = "CLAWMUX_GATEWAY_URL", default_value = config::DEFAULT_GATEWAY_URL)]
    gateway_url: String,
    /// Gateway token (prefer --token-file or the environment: command lines are visible to other users).
    #[arg(long, env = "CLAWMUX_GATEWAY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the gateway token.
    #[arg(long, env = "CLAWMUX_GATEWAY_TOKEN_FILE", conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// Start an in-process gateway double with scripted agent activity and connect to it (try clawmux without a gateway).
    #[arg(long)]
    demo: bool,
    /// Seconds a local connect waits for the gateway session before failing.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    connect_wait: u64,
    /// Seconds a request waits for the gateway's answer (studio.request_timeout after).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    request_timeout: u64,
    /// Seconds a stop (SIGTERM/SIGINT) may take: clients get a `shutdown` event and `1001 going away`; any still open after this are cut off.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    shutdown_timeout: f64,
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
    #[arg(long)]
    demo: bool,
}

fn main() -> ExitCode {
    // SAFETY: first thing in main, before anything opens a file descriptor, so
    // the descriptors systemd passed are owned by nothing else (see its docs).
    let activated = unsafe { clawmux::systemd::take_activated_listener() };
    let cli = Cli::parse();
    // The WebSocket library logs whole frames at trace level, and frames carry
    // the token during the handshake: keep it at info whatever the filter says.
    let filter = EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| EnvFilter::new("info"))
        .add_directive("tungstenite=info".parse().expect("static directive"))
        .add_directive("tokio_tungstenite=info".parse().expect("static directive"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("clawmux: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args, activated).await,
            Command::MockGateway(args) => mock_gateway(args).await,
            Command::InstallService(a) => Ok(clawmux::install::install_service(
                clawmux::install::InstallOptions {
                    dry_run: a.dry_run,
                    force: a.force,
                },
                &mut std::io::stdout(),
            )?),
        }
    });
    // Tasks cut off at the shutdown deadline are dropped, not waited for.
    runtime.shutdown_timeout(Duration::from_millis(100));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("clawmux: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn serve(
    args: ServeArgs,
    activated: Result<Option<clawmux::systemd::ActivatedSocket>, clawmux::systemd::ActivationError>,
) -> anyhow::Result<()> {
    let mut settings = Settings::new(args.socket.unwrap_or_else(config::default_socket_path));
    settings.gateway_url = args.gateway_url;
    settings.token = match (args.token, args.token_file) {
        (Some(t), _) if !t.trim().is_empty() => Some(Secret::new(t.trim())),
        (_, Some(path)) => Some(config::read_token_file(&path).map_err(anyhow::Error::msg)?),
        _ => clawmux::systemd::credential_token().map_err(anyhow::Error::msg)?,
    };
    let shutdown_timeout = Duration::try_from_secs_f64(args.shutdown_timeout)
        .map_err(|e| anyhow::anyhow!("--shutdown-timeout {}: {e}", args.shutdown_timeout))?;
    settings.limits.connect_wait = Duration::from_secs(args.connect_wait);
    settings.limits.request_timeout = Duration::from_secs(args.request_timeout);
    let _demo = if args.demo {
        let token = uuid::Uuid::new_v4().simple().to_string();
        let mock = MockGateway::start(MockConfig {
            token: Some(token.clone()),
            demo: true,
            tick_interval_ms: 5_000,
            ..MockConfig::default()
        })
        .await?;
        eprintln!(
            "clawmux: demo mode: gateway double on {} with scripted agent runs",
            mock.url()
        );
        settings.gateway_url = mock.url();
        settings.token = Some(Secret::new(token));
        Some(mock)
    } else {
        None
    };
    let broker = match activated? {
        Some(socket) => RunningBroker::start_with_activated(settings, socket.listener)?,
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
    clawmux::lifecycle::serve_until_stopped(broker, shutdown_timeout).await?;
    Ok(())
}

async fn mock_gateway(args: MockArgs) -> anyhow::Result<()> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], args.port));
    let mock = MockGateway::start_on(
        addr,
        MockConfig {
            token: Some(args.token),
            tick_interval_ms: args.tick_ms,
            demo: args.demo,
            ..MockConfig::default()
        },
    )
    .await?;
    eprintln!("clawmux: gateway double listening on {}", mock.url());
    wait_for_stop_signal().await?;
    mock.stop().await;
    Ok(())
}

async fn wait_for_stop_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
