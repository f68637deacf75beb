//! `clawmux top`: a full-screen dashboard of the broker and what its agents
//! are doing: upstream phase, gateway version, uptime, event rate; the
//! clients; and the activity tree ([`crate::activity`]) built here, in the
//! client, from the events it follows as an observer
//! (`/v1/events?tool_events=all`, see [`super::watch::follow`]).
//!
//! The terminal is always given back: on `q`, on Ctrl-C, on `SIGTERM`,
//! `SIGHUP` and `SIGINT`, on an error, and on a panic (ratatui's hook, plus
//! a [`TerminalGuard`] for every return path).

mod view;

use std::io::IsTerminal;
use std::time::Duration;

use clap::Args;
use http::Method;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use super::watch::{follow, Feed};
use super::{BrokerArgs, CliError};
pub use view::{draw, Action, App, Key};

/// How often `/v1/state` is read for the header and the clients table.
const STATE_EVERY: Duration = Duration::from_secs(1);
/// The most redraws a second (events arrive much faster during a run).
const FRAME_EVERY: Duration = Duration::from_millis(100);
/// Events waiting between the follower and the screen; a full channel
/// makes the follower wait (the broker then sees a slow reader, and its
/// usual per-client limits apply).
const FEED_CHANNEL: usize = 4096;
/// How long the input thread waits for a key before checking whether `top`
/// is still running.
const INPUT_POLL: Duration = Duration::from_millis(100);

#[derive(Args, Debug)]
pub struct TopArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Show only this session's runs at first (e.g. agent:main:main); `s` cycles sessions.
    #[arg(long, value_name = "KEY")]
    pub session: Option<String>,
}

/// What `top` says when its output is not a terminal (the caller prefixes
/// `clawmux top:`, so the message does not name the command again).
pub const NOT_A_TERMINAL: &str =
    "needs a terminal (its output is not one); for pipes and logs use `clawmux tail --tree` (or --hud)";

/// Gives the terminal back when dropped (every return path, and unwinding).
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
    }
}

fn restore_terminal() {
    ratatui::restore();
    let _ = ratatui::crossterm::execute!(std::io::stdout(), ratatui::crossterm::cursor::Show);
}

/// Runs until `q` (or a signal). Fails before touching the terminal when
/// the broker is unreachable or stdout is not a terminal.
pub async fn run(args: TopArgs) -> Result<u8, CliError> {
    let client = args.broker.client();
    let (_, state) = client.json(Method::GET, "/v1/state", None).await?;
    if !std::io::stdout().is_terminal() {
        return Err(CliError::Usage(NOT_A_TERMINAL.into()));
    }
    let color = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let mut app = App::new(color, crate::protocol::now_ms());
    app.state = state;
    app.session_filter = args.session;

    let mut term = signal(SignalKind::terminate()).map_err(io_error)?;
    let mut hup = signal(SignalKind::hangup()).map_err(io_error)?;
    let mut int = signal(SignalKind::interrupt()).map_err(io_error)?;
    let mut terminal = ratatui::try_init().map_err(io_error)?;
    let _guard = TerminalGuard;
    // Also show the cursor again on a panic (ratatui's hook restores the rest).
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore_terminal();
        hook(info);
    }));

    let (feed_tx, mut feed) = mpsc::channel(FEED_CHANNEL);
    let follower = tokio::spawn(follow(client.clone(), feed_tx));
    let (state_tx, mut states) = mpsc::channel(1);
    let poller = tokio::spawn(poll_state(client, state_tx));
    let (key_tx, mut keys) = mpsc::channel(64);
    std::thread::spawn(move || read_keys(key_tx));

    let mut frames = tokio::time::interval(FRAME_EVERY);
    let mut seconds = tokio::time::interval(Duration::from_secs(1));
    let mut dirty = true;
    let result = loop {
        tokio::select! {
            _ = frames.tick() => {
                if dirty {
                    app.now_ms = crate::protocol::now_ms();
                    if let Err(e) = terminal.draw(|f| draw(f, &app)) {
                        break Err(io_error(e));
                    }
                    dirty = false;
                }
            }
            _ = seconds.tick() => {
                app.next_second();
                dirty = true;
            }
            Some(item) = feed.recv() => {
                match item {
                    Feed::Event { name, frame, replay, .. } => {
                        let received = (!replay).then(crate::protocol::now_ms);
                        app.on_event(&name, &frame, received)
                    }
                    Feed::Connected { .. } => app.link = "live".into(),
                    Feed::Lost(why) => app.link = why,
                    Feed::Missed(what) => app.on_gap(what),
                    Feed::Failed(e) => break Err(e),
                }
                dirty = true;
            }
            Some(state) = states.recv() => {
                app.state = state;
                dirty = true;
            }
            key = keys.recv() => match key {
                Some(key) => {
                    // A pause freezes the tree at this moment.
                    app.now_ms = crate::protocol::now_ms();
                    match app.key(key) {
                        Action::Quit => break Ok(0),
                        Action::Redraw => dirty = true,
                        Action::None => {}
                    }
                }
                None => break Ok(0),
            },
            _ = term.recv() => break Ok(0),
            _ = hup.recv() => break Ok(0),
            _ = int.recv() => break Ok(0),
        }
    };
    follower.abort();
    poller.abort();
    drop(keys);
    result
}

fn io_error(e: std::io::Error) -> CliError {
    CliError::Answer(format!("terminal: {e}"))
}

/// Reads `/v1/state` every [`STATE_EVERY`] (while the broker is away the
/// last document stays on screen; the link status says why).
async fn poll_state(client: super::BrokerClient, tx: mpsc::Sender<serde_json::Value>) {
    let mut every = tokio::time::interval(STATE_EVERY);
    loop {
        every.tick().await;
        if let Ok((status, state)) = client.json(Method::GET, "/v1/state", None).await {
            if status.is_success() && tx.send(state).await.is_err() {
                return;
            }
        }
    }
}

/// The input thread: crossterm's blocking reader, polled so the thread ends
/// soon after `top` stops listening.
fn read_keys(tx: mpsc::Sender<Key>) {
    while !tx.is_closed() {
        match event::poll(INPUT_POLL) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => return,
        }
        let key = match event::read() {
            Ok(Event::Key(k)) if k.kind != KeyEventKind::Release => k,
            Ok(Event::Resize(..)) => {
                if tx.blocking_send(Key::Resize).is_err() {
                    return;
                }
                continue;
            }
            Ok(_) => continue,
            Err(_) => return,
        };
        let key = match key.code {
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Key::Quit,
            KeyCode::Esc => Key::Quit,
            KeyCode::Up => Key::Up,
            KeyCode::Down => Key::Down,
            KeyCode::Home => Key::Home,
            KeyCode::End => Key::End,
            KeyCode::Enter => Key::Toggle,
            KeyCode::Right => Key::Expand,
            KeyCode::Left => Key::Collapse,
            KeyCode::Char(c) => Key::Char(c),
            _ => continue,
        };
        if tx.blocking_send(key).is_err() {
            return;
        }
    }
}
