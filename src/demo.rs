//! `serve --demo`: the gateway double the demo's broker dials, the banner
//! that says what to try next, and the lines its terminal shows.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clawmux::broker::RunningBroker;
use clawmux::config::{self, Secret, Settings};
use clawmux_mock::replay::Replay;
use clawmux_mock::{MockConfig, MockGateway};

use crate::args::ServeArgs;

/// The demo's gateway double and its private directory, both gone when
/// this is dropped (the double first).
pub(crate) struct Demo {
    _gateway: MockGateway,
    _dir: DemoDir,
    /// The recording served, watched from before the double starts: an
    /// `--instant` replay may end before the banner is printed.
    replaying: Option<(Arc<Replay>, tokio::sync::watch::Receiver<u64>)>,
}

impl Demo {
    /// Starts the double and points `settings` at it. `activated`: systemd
    /// passed the socket, so it is not checked for another demo.
    pub(crate) async fn start(
        args: &ServeArgs,
        settings: &mut Settings,
        activated: bool,
    ) -> anyhow::Result<Demo> {
        if args.settings.state_dir.is_none() {
            // The demo's throwaway gateway must not leave device tokens in your state dir.
            settings.upstream.device_identity = None;
        }
        if !activated {
            // Before the double starts: a second demo on a busy socket fails
            // here, having started nothing.
            clawmux::local::socket::ensure_free(&settings.socket_path)?;
        }
        let replay = args.replay.load()?;
        let replaying = replay.clone().map(|r| {
            let ends = r.ends();
            (r, ends)
        });
        let token = uuid::Uuid::new_v4().simple().to_string();
        // The demo's gateway double listens on a unix socket in a private
        // temporary directory, never on TCP (the broker dials that socket).
        let dir = DemoDir::create()?;
        let path = dir.0.join("gateway.sock");
        let what = if replay.is_some() {
            "serving the recording"
        } else {
            "with scripted agent runs"
        };
        let gateway = MockGateway::start_unix(
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
        Ok(Demo {
            _gateway: gateway,
            _dir: dir,
            replaying,
        })
    }

    /// Once the broker serves: the banner, then one line per finished run
    /// (and per end of the recording) until the broker stops.
    pub(crate) fn narrate(&mut self, broker: &RunningBroker) {
        let socket = broker.socket_path();
        demo_banner(socket, self.replaying.as_ref().map(|(r, _)| &**r));
        let ctx = broker.ctx();
        ctx.tracker
            .spawn(demo_narrator(socket.to_owned(), ctx.cancel.clone()));
        if let Some((replay, ends)) = self.replaying.take() {
            ctx.tracker.spawn(say_when_the_recording_ends(
                replay,
                ends,
                ctx.cancel.clone(),
            ));
        }
    }
}

/// The demo's private directory, removed when the demo ends.
struct DemoDir(PathBuf);

impl DemoDir {
    /// A fresh private (0700) directory under the temp dir.
    fn create() -> anyhow::Result<DemoDir> {
        use std::os::unix::fs::DirBuilderExt;
        let dir =
            std::env::temp_dir().join(format!("clawmux-demo-{}", uuid::Uuid::new_v4().simple()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(DemoDir(dir))
    }
}

impl Drop for DemoDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
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
fn demo_banner(socket: &Path, replay: Option<&Replay>) {
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
    replay: Arc<Replay>,
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
