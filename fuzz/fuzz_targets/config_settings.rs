//! The config file → settings resolution (`settings::resolve`): clawmux's
//! `config.toml`, Claw3D's `settings.json` and OpenClaw's `openclaw.json`
//! (JSON5), as `serve` and `doctor` read them.
//!
//! Input: the three files' contents, separated by NUL bytes (a missing
//! part: no such file). They are written to a private temporary state
//! directory the resolver is pointed at (`HOME`, `OPENCLAW_STATE_DIR`).
//! Property: any files resolve or fail with `studio.settings_load_failed`
//! (or an unusable token file), never a panic; resolved durations are
//! within `bounds::MAX_DURATION` (an absurd one would overflow an
//! `Instant` on the first request) and counts that must be positive are.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use clawmux::bounds::MAX_DURATION;
use clawmux::settings::{resolve, Env, Overrides};
use libfuzzer_sys::fuzz_target;

fn home() -> &'static PathBuf {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("clawmux-fuzz-settings-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("state/claw3d")).unwrap();
        std::fs::create_dir_all(dir.join(".config/clawmux")).unwrap();
        dir
    })
}

fn put(path: PathBuf, content: Option<&[u8]>) {
    match content {
        Some(bytes) => std::fs::write(&path, bytes).unwrap(),
        None => {
            let _ = std::fs::remove_file(&path);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut parts = data.split(|&b| b == 0);
    let home = home();
    put(home.join(".config/clawmux/config.toml"), parts.next());
    put(home.join("state/claw3d/settings.json"), parts.next());
    put(home.join("state/openclaw.json"), parts.next());
    let env = Env {
        vars: [
            ("HOME", home.display().to_string()),
            (
                "OPENCLAW_STATE_DIR",
                home.join("state").display().to_string(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect(),
    };
    let over = Overrides {
        socket: Some(home.join("clawmux.sock")),
        ..Overrides::default()
    };
    match resolve(&over, &env) {
        Ok(resolved) => {
            let s = &resolved.settings;
            let l = &s.limits;
            for (name, d) in [
                ("connect_timeout", l.connect_timeout),
                ("connect_wait", l.connect_wait),
                ("request_timeout", l.request_timeout),
                ("run_timeout", l.run_timeout),
                ("slow_grace", l.slow_grace),
                ("sse_keepalive", l.sse_keepalive),
                ("header_read_timeout", l.header_read_timeout),
                ("handshake_timeout", s.upstream.handshake_timeout),
                ("backoff_initial", s.upstream.backoff_initial),
                ("backoff_max", s.upstream.backoff_max),
                ("write_timeout", s.upstream.write_timeout),
            ] {
                assert!(d <= MAX_DURATION, "{name} = {d:?}");
            }
            assert!(l.max_frame_bytes > 0 && l.max_clients > 0 && l.max_inflight > 0);
            let _ = clawmux::config::validate_gateway_url(&s.gateway_url);
            let _ = clawmux::config::redact_url(&s.gateway_url);
        }
        Err(e) => assert!(!e.message.is_empty()),
    }
});
