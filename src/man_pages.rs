//! `clawmux man`: the pages clap_mangen writes from the command line's own
//! help (name, synopsis, description, options, commands), with the sections
//! a man page is expected to have and clap knows nothing of: EXIT STATUS and
//! ENVIRONMENT on every page, and KEYS on clawmux-top(1).

use std::io::Write;

/// One page's roff: clap_mangen's sections, then ours, then its version.
pub fn render(cmd: &clap::Command, path: &[&str], w: &mut dyn Write) -> std::io::Result<()> {
    let man = clap_mangen::Man::new(cmd.clone());
    man.render_title(w)?;
    man.render_name_section(w)?;
    man.render_synopsis_section(w)?;
    man.render_description_section(w)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(w)?;
    }
    if cmd.has_subcommands() {
        man.render_subcommands_section(w)?;
    }
    let name = path.last().copied().unwrap_or("clawmux");
    if name == "top" {
        section(w, "KEYS", TOP_KEYS)?;
    }
    section(w, "EXIT STATUS", exit_status(name))?;
    section(w, "ENVIRONMENT", ENVIRONMENT)?;
    if cmd
        .get_version()
        .or_else(|| cmd.get_long_version())
        .is_some()
    {
        man.render_version_section(w)?;
    }
    Ok(())
}

/// Writes `clawmux.1` and one `clawmux-COMMAND.1` per command into `dir`.
pub fn generate_to(cmd: clap::Command, dir: &std::path::Path) -> std::io::Result<()> {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let mut pages = vec![(cmd.clone(), vec![])];
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        pages.push((sub.clone(), vec![sub.get_name()]));
    }
    for (page, path) in pages {
        let file = dir.join(format!(
            "{}.1",
            page.get_display_name().unwrap_or("clawmux")
        ));
        let mut out = std::fs::File::create(file)?;
        render(&page, &path, &mut out)?;
        out.flush()?;
    }
    Ok(())
}

/// `(term, text)` pairs as a roff section of tagged paragraphs.
fn section(w: &mut dyn Write, title: &str, items: &[(&str, &str)]) -> std::io::Result<()> {
    writeln!(w, ".SH \"{title}\"")?;
    for (term, text) in items {
        writeln!(w, ".TP\n{}\n{}", escape(term), escape(text))?;
    }
    Ok(())
}

/// Text as roff: backslashes and hyphens escaped, no line led by a control
/// character.
fn escape(s: &str) -> String {
    let out = s.replace('\\', "\\e").replace('-', "\\-");
    if out.starts_with('.') || out.starts_with('\'') {
        format!("\\&{out}")
    } else {
        out
    }
}

const TOP_KEYS: &[(&str, &str)] = &[
    ("q, Esc, Ctrl-C", "Quit and give the terminal back."),
    ("Up, k / Down, j", "Select the row above / below."),
    ("Home, g / End, G", "Select the first / last row."),
    (
        "Enter",
        "Expand or collapse the selected run (its thinking, tool calls and answer).",
    ),
    ("Right / Left", "Expand / collapse the selected run."),
    (
        "p, Space",
        "Pause the view (events keep arriving and are shown on resume); again to resume.",
    ),
    (
        "s",
        "Show one session, then the next; after the last, all sessions again.",
    ),
];

/// The codes of the commands that talk to a running broker.
const CLIENT_EXIT: &[(&str, &str)] = &[
    ("0", "Success (status: the gateway session is ready)."),
    ("1", "An error answer (call: ok:false), or (status) the broker runs but its gateway session is not ready."),
    ("2", "Usage or bad input: bad flags, PARAMS_JSON not JSON, a request the broker refused as malformed, or a broken config.toml."),
    ("3", "No broker answers on the socket, or the socket (or the process serving it) is not this user's."),
];

fn exit_status(name: &str) -> &'static [(&'static str, &'static str)] {
    match name {
        "serve" => &[
            ("0", "Stopped by SIGTERM or SIGINT, every client told, within --shutdown-timeout."),
            ("1", "Start-up failure: the socket is in use by another clawmux, an unsafe socket directory, an unreadable or empty token file, a socket passed by systemd that cannot be used."),
            ("2", "Bad command line, or a broken config.toml (an unknown key, with the nearest real one; a bad value; inconsistent limits): nothing is started."),
            ("3", "Forced stop: a second signal during the shutdown, or the shutdown overran its deadline."),
        ],
        "doctor" => &[
            ("0", "The settings resolve and the gateway handshake succeeded."),
            ("1", "The settings or the handshake failed: the report says why and what to do."),
            ("2", "A broken config.toml (the report shows it too)."),
        ],
        "install-service" => &[
            ("0", "The units are written (or already as they would be written)."),
            ("1", "A unit differs from what would be written (without --force), or writing failed."),
            ("2", "Bad command line."),
        ],
        "mock-gateway" => &[
            ("0", "Stopped by SIGTERM or SIGINT."),
            ("1", "It cannot listen (the port is busy) or the recording cannot be read."),
            ("2", "Bad command line."),
        ],
        "socket-path" | "completions" | "man" => &[
            ("0", "Success."),
            ("1", "The output could not be written."),
            ("2", "Bad command line, or (socket-path) a broken config.toml."),
        ],
        "clawmux" => &[
            ("0", "Success."),
            ("1, 2, 3", "As each command's page says: 1 a failure or error answer, 2 bad usage or a broken config.toml, 3 no broker on the socket (serve: a forced stop)."),
        ],
        _ => CLIENT_EXIT,
    }
}

const ENVIRONMENT: &[(&str, &str)] = &[
    ("CLAWMUX_SOCKET", "The broker's unix socket (as --socket)."),
    ("CLAWMUX_CONFIG", "The config file (default: $XDG_CONFIG_HOME/clawmux/config.toml)."),
    ("CLAWMUX_GATEWAY_URL", "The gateway's WebSocket URL (as --gateway-url)."),
    ("CLAWMUX_GATEWAY_TOKEN_FILE", "A file holding the gateway token (as --token-file); systemd's credential $CREDENTIALS_DIRECTORY/gateway-token is read too."),
    ("CLAWMUX_GATEWAY_TOKEN, CLAWMUX_GATEWAY_PASSWORD", "The gateway token or password itself (prefer the token file)."),
    ("CLAWMUX_TLS_FINGERPRINT, CLAWMUX_TLS_CA_FILE", "Pin the wss:// gateway's certificate, or trust another CA (as --tls-fingerprint, --tls-ca-file)."),
    ("CLAWMUX_STATE_DIR", "The broker's device key and device tokens (default: $XDG_STATE_HOME/clawmux)."),
    ("CLAWMUX_LOG", "The log filter (as --log)."),
    ("XDG_RUNTIME_DIR", "The default socket is $XDG_RUNTIME_DIR/clawmux.sock; without it, <tmp>/clawmux-<uid>/clawmux.sock."),
    ("NO_COLOR", "Set to anything: no colour in status, tail and doctor."),
];
