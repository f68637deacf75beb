//! The everyday commands: `clawmux status`, `clawmux tail`, `clawmux call`,
//! `clawmux record`, `clawmux metrics` (and `doctor`, `serve --demo`'s
//! narrator, the colour rules in `style`).
//!
//! Each talks to a running broker over its unix socket with plain HTTP
//! (`/v1/state`, `/v1/events`, `/v1/rpc`, `/metrics`), exactly as `curl
//! --unix-socket` would. Exit codes are shared by all of them:
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success (`status`: the upstream session is ready) |
//! | 1 | an error answer (`call`: `ok:false`; `status`: the broker runs but the upstream session is not ready) |
//! | 2 | usage or bad input (bad flags, `PARAMS_JSON` not JSON, a request the broker refused as malformed) |
//! | 3 | the broker is not reachable on its socket, or the socket (or the process serving it) is not this user's |

pub mod call;
pub mod client;
pub mod demo;
pub mod doctor;
pub mod metrics;
pub mod record;
pub mod status;
pub mod style;
pub mod tail;
pub mod top;
pub mod upgrade;
pub mod watch;

use std::path::PathBuf;

/// Writes `text` and a newline to stdout. A reader that went away
/// (`clawmux call … | head -1`) ends the command quietly with exit 0, as
/// other Unix tools do, instead of a panic (Rust ignores `SIGPIPE`, so
/// `println!` would panic on `EPIPE`).
pub fn print_line(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
    }
}
use std::process::ExitCode;

use clap::{Args, Subcommand};

pub use client::BrokerClient;

/// Exit code: the request failed with an error answer.
pub const EXIT_ERROR_ANSWER: u8 = 1;
/// Exit code: usage error or bad input (clap uses 2 for bad flags too).
pub const EXIT_USAGE: u8 = 2;
/// Exit code: no broker answered on the socket.
pub const EXIT_UNREACHABLE: u8 = 3;

/// The commands that talk to a running broker.
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Show what the broker is doing: upstream session, gateway snapshot, clients, event cursor.
    #[command(display_order = 1)]
    Status(status::StatusArgs),
    /// Follow gateway events as they happen, one line each; resumes after disconnects and broker restarts.
    #[command(display_order = 2)]
    Tail(tail::TailArgs),
    /// Send one gateway request (e.g. `clawmux call health`) and print its answer.
    #[command(display_order = 3)]
    Call(call::CallArgs),
    /// Record the gateway session the broker shares (events, and with --requests every request and answer) as JSON Lines, for `mock-gateway --replay`.
    #[command(display_order = 9)]
    Record(record::RecordArgs),
    /// Print the broker's Prometheus metrics, or write them for node_exporter (`--textfile DIR`).
    #[command(display_order = 9)]
    Metrics(metrics::MetricsArgs),
    /// Watch the broker and its agents live: clients, event rate, and each run's thinking and tool calls.
    #[command(display_order = 4)]
    Top(top::TopArgs),
    /// Hand the broker behind this socket over to the clawmux now at its binary's path (after an install), and say how it went.
    #[command(display_order = 8)]
    Upgrade(upgrade::UpgradeArgs),
}

/// Where to find the broker.
#[derive(Args, Debug, Clone)]
pub struct BrokerArgs {
    /// The broker's unix socket [default: $XDG_RUNTIME_DIR/clawmux.sock, else <tmp>/clawmux-<uid>/clawmux.sock].
    #[arg(long, env = "CLAWMUX_SOCKET")]
    pub socket: Option<PathBuf>,
}

impl BrokerArgs {
    /// The broker at `--socket` / `CLAWMUX_SOCKET`, else where `serve` would
    /// listen (config.toml's `socket`, else the default path).
    pub fn client(&self) -> BrokerClient {
        if let Some(socket) = &self.socket {
            return BrokerClient::new(socket.clone()).with_origin("--socket or CLAWMUX_SOCKET");
        }
        let default = crate::config::default_socket_path();
        let socket = crate::settings::resolve(
            &crate::settings::Overrides::default(),
            &crate::settings::Env::from_process(),
        )
        .map(|r| r.settings.socket_path)
        .unwrap_or_else(|_| default.clone());
        let origin = if socket != default {
            "`socket` in config.toml".to_owned()
        } else if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| !d.is_empty()) {
            "the default, $XDG_RUNTIME_DIR/clawmux.sock".to_owned()
        } else {
            "the default without XDG_RUNTIME_DIR, which is not set here".to_owned()
        };
        BrokerClient::new(socket).with_origin(origin)
    }
}

/// What to do when no broker answers (the last lines of
/// [`CliError::Unreachable`]).
pub const START_THE_BROKER: &str = "Start it with `clawmux serve` (or `systemctl --user start clawmux.socket`),\nor point --socket / CLAWMUX_SOCKET at its socket.";

/// Why a command failed; each cause has its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Nothing answered on the socket: what happened on the first line
    /// (the socket, how it was chosen, why), what to do on one or two more.
    #[error("cannot reach the broker at {socket}: {cause}.\n{next}")]
    Unreachable {
        /// The path, with how it was chosen when known.
        socket: String,
        cause: String,
        /// What to do, in short lines ([`START_THE_BROKER`] unless a
        /// better hint is known).
        next: String,
    },
    /// The socket or the process behind it belongs to another user: nothing
    /// was sent.
    #[error(
        "refusing to talk to {socket}: {why}; it is not your broker (another user may have put it there); remove it or point --socket / CLAWMUX_SOCKET at your own"
    )]
    NotOurs { socket: String, why: String },
    /// Bad flags or input, found before or by the broker.
    #[error("{0}")]
    Usage(String),
    /// The broker answered, with an error or something unexpected.
    #[error("{0}")]
    Answer(String),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Unreachable { .. } | CliError::NotOurs { .. } => EXIT_UNREACHABLE,
            CliError::Usage(_) => EXIT_USAGE,
            CliError::Answer(_) => EXIT_ERROR_ANSWER,
        }
    }
}

/// Runs one command; prints its error as one line on stderr.
pub async fn run(command: ClientCommand) -> ExitCode {
    let (name, result) = match command {
        ClientCommand::Status(args) => ("status", status::run(args).await),
        ClientCommand::Tail(args) => ("tail", tail::run(args).await),
        ClientCommand::Call(args) => ("call", call::run(args).await),
        ClientCommand::Record(args) => ("record", record::run(args).await),
        ClientCommand::Metrics(args) => ("metrics", metrics::run(args).await),
        ClientCommand::Top(args) => ("top", top::run(args).await),
        ClientCommand::Upgrade(args) => ("upgrade", upgrade::run(args).await),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // An error may quote the gateway or a client (codes, messages).
            eprintln!("clawmux {name}: {}", crate::sanitize::lines(&e.to_string()));
            ExitCode::from(e.exit_code())
        }
    }
}
