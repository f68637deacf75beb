//! The command line's words: every command, flag and argument (clap), and
//! the checks a flag's value gets as it is parsed.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use clawmux::bounds::{self, Zero};
use clawmux::config::{self, Secret, Settings};
use clawmux::settings::{self, Env, Overrides, Resolved};

/// Share one OpenClaw Gateway session among many local programs, over a unix socket.
///
/// clawmux keeps ONE WebSocket to the gateway (with your token) and lets any
/// number of local clients use it through a unix socket that only you can open.
/// Clients speak the normal gateway protocol to `ws+unix://<socket>:/ws`.
#[derive(Parser, Debug)]
#[command(
    name = "clawmux",
    version,
    about,
    long_about,
    after_help = "Logging: --log FILTER (or CLAWMUX_LOG) on any command, e.g. debug or clawmux=trace. Default: info for serve (warn for its demo) and mock-gateway, off for doctor (its report says everything), warn for the rest. Secrets are never logged."
)]
pub(crate) struct Cli {
    /// Log filter, e.g. debug (defaults: see `clawmux --help`).
    #[arg(long, global = true, env = "CLAWMUX_LOG", value_name = "FILTER")]
    pub(crate) log: Option<String>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Run the broker: listen on the unix socket and hold the gateway session.
    #[command(
        after_help = "Signals: SIGTERM or SIGINT stops (under systemd with a descriptor store, the clients are stored for the next start); SIGHUP re-reads the settings; SIGUSR2 hands the sockets and the connected clients over to the clawmux now at this binary's path (an upgrade), and goes on serving if it fails. See the book's \"Restarts and upgrades\"."
    )]
    #[command(display_order = 5)]
    Serve(ServeArgs),
    /// Show where each setting comes from and try the gateway handshake once (exit 1 on failure).
    #[command(display_order = 6)]
    Doctor(DoctorArgs),
    /// Run the gateway test double on loopback (for trying clients and the broker without a real gateway).
    #[command(display_order = 99)]
    MockGateway(MockArgs),
    /// Install the systemd user units (clawmux.socket, clawmux.service) for this binary.
    #[command(display_order = 9)]
    InstallService(InstallArgs),
    /// Point a front end at this broker, showing the change first (`setup claw3d`; `--undo` puts it back).
    #[command(subcommand, display_order = 7)]
    Setup(SetupCommand),
    /// Print the socket path the broker uses, as `serve` resolves it (for `S=$(clawmux socket-path)`).
    #[command(display_order = 10)]
    SocketPath(SocketPathArgs),
    /// Print a shell completion script, e.g. `clawmux completions bash > ~/.local/share/bash-completion/completions/clawmux`.
    #[command(display_order = 11)]
    Completions(CompletionsArgs),
    /// Print the man page (roff) to stdout, or write one page per command into a directory.
    #[command(display_order = 12)]
    Man(ManArgs),
    #[command(flatten)]
    Client(clawmux::cli::ClientCommand),
}

#[derive(Args, Debug)]
pub(crate) struct SocketPathArgs {
    /// The socket to print instead (what `serve --socket` would get).
    #[arg(long, value_name = "PATH")]
    pub(crate) socket: Option<PathBuf>,
    /// Config file (env CLAWMUX_CONFIG) [default: $XDG_CONFIG_HOME/clawmux/config.toml].
    #[arg(long, value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub(crate) enum SetupCommand {
    /// Point Claw3D studio at this broker: its settings.json gets the broker's socket URL (backed up beside it, mode 0600), and the gateway it named is kept in clawmux's own config.toml so the broker still finds it.
    #[command(
        after_help = "Claw3D reads the file at each connection: reconnect in the studio. In production (NODE_ENV=production: `npm start`, its Docker image) Claw3D also needs UPSTREAM_ALLOWLIST=localhost. See the book's \"Claw3D\" page."
    )]
    Claw3d(SetupClaw3dArgs),
}

#[derive(Args, Debug)]
pub(crate) struct SetupClaw3dArgs {
    /// Put back what an earlier setup changed (Claw3D's settings from the backup, clawmux's config.toml as it was).
    #[arg(long)]
    pub(crate) undo: bool,
    /// Show the change, write nothing.
    #[arg(long, conflicts_with = "undo")]
    pub(crate) dry_run: bool,
    /// Write without asking (needed when standard input is not a terminal).
    #[arg(long, short = 'y')]
    pub(crate) yes: bool,
    /// Claw3D's settings file [default: $OPENCLAW_STATE_DIR/claw3d/settings.json, else ~/.openclaw/claw3d/settings.json].
    #[arg(long, value_name = "PATH")]
    pub(crate) settings_file: Option<PathBuf>,
    /// The broker's socket to point Claw3D at (env CLAWMUX_SOCKET) [default: the one `serve` uses].
    #[arg(long, value_name = "PATH")]
    pub(crate) socket: Option<PathBuf>,
    /// clawmux's config file (env CLAWMUX_CONFIG) [default: $XDG_CONFIG_HOME/clawmux/config.toml].
    #[arg(long, value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub(crate) struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub(crate) shell: clap_complete::Shell,
}

#[derive(Args, Debug)]
pub(crate) struct ManArgs {
    /// Write `clawmux.1` and one `clawmux-COMMAND.1` per command here instead of printing `clawmux.1`.
    #[arg(long, value_name = "DIR")]
    pub(crate) dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub(crate) struct InstallArgs {
    /// Show what would be written, write nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Replace unit files that differ from what would be written.
    #[arg(long)]
    pub(crate) force: bool,
}

/// Where the broker finds the gateway and its limits. Each flag wins over its
/// environment variable, which wins over the config file, which wins over
/// Claw3D's and OpenClaw's own settings (see README "Configuration").
#[derive(Args, Debug, Clone)]
pub(crate) struct SettingsArgs {
    /// Unix socket to listen on (env CLAWMUX_SOCKET) [default: $XDG_RUNTIME_DIR/clawmux.sock, else <tmp>/clawmux-<uid>/clawmux.sock].
    #[arg(long, value_name = "PATH")]
    pub(crate) socket: Option<PathBuf>,
    /// Gateway WebSocket URL (env CLAWMUX_GATEWAY_URL) [default: from config files, else ws://localhost:18789].
    #[arg(long, value_name = "URL")]
    pub(crate) gateway_url: Option<String>,
    /// Gateway token (env CLAWMUX_GATEWAY_TOKEN); prefer --token-file: command lines are visible to other users.
    #[arg(long, value_name = "TOKEN")]
    pub(crate) token: Option<String>,
    /// File holding the gateway token (env CLAWMUX_GATEWAY_TOKEN_FILE; also $CREDENTIALS_DIRECTORY/gateway-token).
    #[arg(long, value_name = "PATH", conflicts_with = "token")]
    pub(crate) token_file: Option<PathBuf>,
    /// Config file (env CLAWMUX_CONFIG) [default: $XDG_CONFIG_HOME/clawmux/config.toml].
    #[arg(long, value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
    /// Connect with the token alone, without the broker's signed device identity.
    #[arg(long)]
    pub(crate) no_device_identity: bool,
    /// Directory for the broker's device key and device tokens (env CLAWMUX_STATE_DIR) [default: $XDG_STATE_HOME/clawmux, else ~/.local/state/clawmux].
    #[arg(long, value_name = "DIR")]
    pub(crate) state_dir: Option<PathBuf>,
    /// SHA-256 fingerprint of the gateway's TLS certificate, as OpenClaw's gateway.remote.tlsFingerprint (env CLAWMUX_TLS_FINGERPRINT): a wss:// gateway is accepted only with this certificate.
    #[arg(long, value_name = "SHA256")]
    pub(crate) tls_fingerprint: Option<String>,
    /// PEM file of CA certificates to trust for a wss:// gateway, beside the system's (env CLAWMUX_TLS_CA_FILE).
    #[arg(long, value_name = "PATH")]
    pub(crate) tls_ca_file: Option<PathBuf>,
}

/// Limits only `serve` uses (so `doctor --help` does not list them).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct LimitArgs {
    /// Seconds a local connect waits for the gateway session before failing, 0 to 86400 [default: 10].
    #[arg(long, value_name = "SECS", value_parser = |s: &str| secs_arg("--connect-wait", s, Zero::Allowed))]
    pub(crate) connect_wait: Option<Duration>,
    /// Seconds a request waits for the gateway's answer (studio.request_timeout after), 1 to 86400 [default: 30].
    #[arg(long, value_name = "SECS", value_parser = |s: &str| secs_arg("--request-timeout", s, Zero::Refused))]
    pub(crate) request_timeout: Option<Duration>,
}

impl SettingsArgs {
    pub(crate) fn overrides(&self) -> Overrides {
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
    pub(crate) fn resolve(
        &self,
        limits: &LimitArgs,
    ) -> Result<Resolved, clawmux::protocol::ErrorShape> {
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
    /// (unreadable, a typo, a bad value), inconsistent limits, or a gateway
    /// URL given by flag, environment or config.toml that names one of the
    /// broker's own sockets (resolve reports no other `gateway_url_invalid`). At start that
    /// is a usage error (exit 2): nothing was wrong but what the user wrote.
    /// Errors in files clawmux only borrows (Claw3D's, OpenClaw's, a systemd
    /// credential) are served to clients instead, who learn what to fix.
    pub(crate) fn is_own_config_error(&self, e: &clawmux::protocol::ErrorShape) -> bool {
        let config = settings::config_file_path(&self.overrides(), &Env::from_process());
        e.message.starts_with("inconsistent limits")
            || e.code == clawmux::protocol::StudioCode::GatewayUrlInvalid.as_str()
            || config.is_some_and(|path| {
                e.message
                    .starts_with(&format!("cannot load settings from {}:", path.display()))
            })
    }

    /// Settings to serve with: resolved ones, or — when a settings file is
    /// broken — defaults that answer every connect with the load error, so
    /// the broker still runs and clients learn what to fix.
    pub(crate) fn serve_settings(&self, limits: &LimitArgs) -> Settings {
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
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) settings: SettingsArgs,
    #[command(flatten)]
    pub(crate) limits: LimitArgs,
    /// Start an in-process gateway double with scripted agent activity and connect to it (try clawmux without a gateway).
    #[arg(long)]
    pub(crate) demo: bool,
    /// With --demo: the double serves this recorded session (`clawmux record`) instead of scripted runs.
    #[command(flatten)]
    pub(crate) replay: ReplayArgs,
    /// Seconds a stop (SIGTERM/SIGINT) may take, 0 to 86400: clients get a `shutdown` event and `1001 going away`; any still open after this are cut off.
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = |s: &str| bounds::duration_secs_f64("--shutdown-timeout", s, Zero::Allowed))]
    pub(crate) shutdown_timeout: Duration,
}

#[derive(Args, Debug)]
pub(crate) struct DoctorArgs {
    #[command(flatten)]
    pub(crate) settings: SettingsArgs,
    /// Print the report as one JSON document (for scripts); the exit code is the same.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct MockArgs {
    /// Loopback port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 18789)]
    pub(crate) port: u16,
    /// Token clients must present (printed at start: it is a test double's, not a secret).
    #[arg(
        long,
        env = "CLAWMUX_MOCK_TOKEN",
        default_value = "test-token",
        hide_env_values = true
    )]
    pub(crate) token: String,
    /// Milliseconds between tick events.
    #[arg(long, default_value_t = 30_000)]
    pub(crate) tick_ms: u64,
    /// Simulate agent runs every few seconds.
    #[arg(long, conflicts_with = "replay")]
    pub(crate) demo: bool,
    #[command(flatten)]
    pub(crate) replay: ReplayArgs,
}

/// Fastest `--speed` accepted: beyond it, use `--instant`.
pub(crate) const MAX_REPLAY_SPEED: f64 = 1000.0;
/// Slowest `--speed` accepted: a recording's day then lasts 1000 days; a
/// slower factor (1e-300) made the pause overflow and panic a worker.
pub(crate) const MIN_REPLAY_SPEED: f64 = 0.001;

/// Serving a recording (README "Record and replay").
#[derive(Args, Debug)]
pub(crate) struct ReplayArgs {
    /// Serve this recorded session (`clawmux record`): its hello-ok, its events in order, its recorded answers.
    #[arg(long, value_name = "FILE")]
    pub(crate) replay: Option<PathBuf>,
    /// Play events this many times faster than recorded (0.5 = half speed), from 0.001 to 1000 [default: 1].
    #[arg(long, value_name = "X", requires = "replay", conflicts_with = "instant", value_parser = speed_arg)]
    pub(crate) speed: Option<f64>,
    /// Send all recorded events at once (in order), without the recorded pauses.
    #[arg(long, requires = "replay")]
    pub(crate) instant: bool,
    /// Start the recording again after its end (after a short pause), on every connection.
    #[arg(long = "loop", requires = "replay")]
    pub(crate) looped: bool,
}

impl ReplayArgs {
    /// The recording to serve, loaded and checked (a cut-off last line is a warning).
    pub(crate) fn load(
        &self,
    ) -> anyhow::Result<Option<std::sync::Arc<clawmux_mock::replay::Replay>>> {
        use clawmux_mock::replay::{Pace, Replay};
        let Some(path) = &self.replay else {
            return Ok(None);
        };
        let recording = clawmux_mock::recording::Recording::load(path)?;
        // What a recording file says is not this program's text: shown
        // through the one sanitizer.
        use clawmux::sanitize::Shown;
        for warning in &recording.warnings {
            eprintln!(
                "clawmux: warning: recording {}: {}",
                Shown(&path.display().to_string()),
                Shown(warning)
            );
        }
        eprintln!(
            "clawmux: replaying {} (gateway {}): {} events, {} recorded answers",
            Shown(&path.display().to_string()),
            clawmux::sanitize::field(recording.gateway_version().unwrap_or("?"), 100),
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

pub(crate) fn speed_arg(text: &str) -> Result<f64, String> {
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
pub(crate) fn secs_arg(flag: &str, text: &str, zero: Zero) -> Result<Duration, String> {
    let secs: u64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{flag} takes a whole number of seconds"))?;
    bounds::duration_secs(flag, secs, zero)
}
