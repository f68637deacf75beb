//! Settings resolution (design §7): every source, its precedence, and what
//! a broken file becomes.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use clawmux::settings::{resolve, Overrides, Source};

use crate::home::Home;

fn token_of(r: &clawmux::settings::Resolved) -> Option<String> {
    r.settings.token.as_ref().map(|t| t.expose().to_owned())
}

#[test]
fn defaults_with_nothing_configured() {
    let home = Home::new();
    let r = resolve(&Overrides::default(), &home.env(&[])).unwrap();
    assert_eq!(r.settings.gateway_url, "ws://localhost:18789");
    assert_eq!(r.url_source, Source::Default);
    assert!(r.settings.token.is_none());
    assert_eq!(r.openclaw_state_dir, home.path().join(".openclaw"));
}

#[test]
fn url_precedence_flag_env_config_claw3d_openclaw() {
    let home = Home::new();
    home.write(
        ".openclaw/openclaw.json",
        r#"{ gateway: { port: 1111, auth: { token: "oc-token" } } }"#,
    );
    home.write(
        ".openclaw/claw3d/settings.json",
        r#"{"gateway":{"url":"ws://claw3d:2222","token":"c3-token"}}"#,
    );
    home.write(
        ".config/clawmux/config.toml",
        "[gateway]\nurl = \"ws://config:3333\"\ntoken = \"cfg-token\"\n",
    );
    let env_url = [
        ("CLAWMUX_GATEWAY_URL", "ws://env:4444"),
        ("CLAWMUX_GATEWAY_TOKEN", "env-token"),
    ];
    let flags = Overrides {
        gateway_url: Some("ws://flag:5555".into()),
        token: Some(clawmux::config::Secret::new("flag-token")),
        ..Overrides::default()
    };
    let r = resolve(&flags, &home.env(&env_url)).unwrap();
    assert_eq!(
        (r.settings.gateway_url.as_str(), token_of(&r).as_deref()),
        ("ws://flag:5555", Some("flag-token"))
    );
    assert_eq!(r.url_source, Source::Flag("--gateway-url"));
    let r = resolve(&Overrides::default(), &home.env(&env_url)).unwrap();
    assert_eq!(
        (r.settings.gateway_url.as_str(), token_of(&r).as_deref()),
        ("ws://env:4444", Some("env-token"))
    );
    assert_eq!(r.token_source, Some(Source::Env("CLAWMUX_GATEWAY_TOKEN")));
    let r = resolve(&Overrides::default(), &home.env(&[])).unwrap();
    assert_eq!(
        (r.settings.gateway_url.as_str(), token_of(&r).as_deref()),
        ("ws://config:3333", Some("cfg-token"))
    );
    std::fs::remove_file(home.path().join(".config/clawmux/config.toml")).unwrap();
    let r = resolve(&Overrides::default(), &home.env(&[])).unwrap();
    assert_eq!(
        (r.settings.gateway_url.as_str(), token_of(&r).as_deref()),
        ("ws://claw3d:2222", Some("c3-token"))
    );
    assert_eq!(
        r.url_source,
        Source::File(home.path().join(".openclaw/claw3d/settings.json"))
    );
    std::fs::remove_file(home.path().join(".openclaw/claw3d/settings.json")).unwrap();
    let r = resolve(&Overrides::default(), &home.env(&[])).unwrap();
    assert_eq!(
        (r.settings.gateway_url.as_str(), token_of(&r).as_deref()),
        ("ws://localhost:1111", Some("oc-token"))
    );
}

#[test]
fn openclaw_config_is_json5_and_its_env_overrides_win() {
    let home = Home::new();
    home.write(
        ".openclaw/openclaw.json",
        "// OpenClaw config\n{\n  gateway: {\n    port: 19001, // custom port\n    auth: { mode: 'token', token: 'oc-token', },\n  },\n}\n",
    );
    let r = resolve(&Overrides::default(), &home.env(&[])).unwrap();
    assert_eq!(r.settings.gateway_url, "ws://localhost:19001");
    assert_eq!(token_of(&r).as_deref(), Some("oc-token"));
    let env = home.env(&[
        ("OPENCLAW_GATEWAY_PORT", "19002"),
        ("OPENCLAW_GATEWAY_TOKEN", "oc-env-token"),
    ]);
    let r = resolve(&Overrides::default(), &env).unwrap();
    assert_eq!(r.settings.gateway_url, "ws://localhost:19002");
    assert_eq!(token_of(&r).as_deref(), Some("oc-env-token"));
    assert_eq!(r.url_source, Source::Env("OPENCLAW_GATEWAY_PORT"));
}

#[test]
fn state_dir_overrides_and_legacy_dirs() {
    let home = Home::new();
    home.write(".clawdbot/openclaw.json", r#"{"gateway":{"port":2001}}"#);
    let r = resolve(&Overrides::default(), &home.env(&[])).unwrap();
    assert_eq!(
        r.openclaw_state_dir,
        home.path().join(".clawdbot"),
        "an existing legacy dir is used"
    );
    assert_eq!(r.settings.gateway_url, "ws://localhost:2001");
    let custom = home.write("custom/openclaw.json", r#"{"gateway":{"port":2002}}"#);
    let dir = custom.parent().unwrap().display().to_string();
    let r = resolve(
        &Overrides::default(),
        &home.env(&[("OPENCLAW_STATE_DIR", &dir)]),
    )
    .unwrap();
    assert_eq!(r.settings.gateway_url, "ws://localhost:2002");
    let r = resolve(
        &Overrides::default(),
        &home.env(&[("CLAWDBOT_STATE_DIR", "~/custom")]),
    )
    .unwrap();
    assert_eq!(
        r.openclaw_state_dir,
        home.path().join("custom"),
        "~ is expanded"
    );
}

#[test]
fn token_files_and_systemd_credentials() {
    let home = Home::new();
    let file = home.write("secret/token", "  file-token\n");
    let flags = Overrides {
        token_file: Some(file.clone()),
        ..Overrides::default()
    };
    let r = resolve(&flags, &home.env(&[])).unwrap();
    assert_eq!(token_of(&r).as_deref(), Some("file-token"));
    assert!(r.warnings.is_empty());
    let creds = home.write("creds/gateway-token", "cred-token");
    let creds_dir = creds.parent().unwrap().display().to_string();
    let r = resolve(
        &Overrides::default(),
        &home.env(&[("CREDENTIALS_DIRECTORY", &creds_dir)]),
    )
    .unwrap();
    assert_eq!(token_of(&r).as_deref(), Some("cred-token"));
    let env_file = file.display().to_string();
    let r = resolve(
        &Overrides::default(),
        &home.env(&[("CLAWMUX_GATEWAY_TOKEN_FILE", &env_file)]),
    )
    .unwrap();
    assert_eq!(token_of(&r).as_deref(), Some("file-token"));
    // Readable by others: still used, with a warning that says how to fix it.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = resolve(&flags, &home.env(&[])).unwrap();
    assert!(
        r.warnings.iter().any(|w| w.contains("chmod 600")),
        "{:?}",
        r.warnings
    );
    // An empty token file is an error naming the file.
    let empty = home.write("secret/empty", "\n");
    let e = resolve(
        &Overrides {
            token_file: Some(empty),
            ..Overrides::default()
        },
        &home.env(&[]),
    )
    .unwrap_err();
    assert_eq!(e.code, "studio.settings_load_failed");
    assert!(e.message.contains("secret/empty"), "{}", e.message);
}

#[test]
fn config_file_sets_every_limit() {
    let home = Home::new();
    let cfg = home.write(
        "my.toml",
        r#"
socket = "/tmp/x/clawmux.sock"
[limits]
connect_timeout_ms = 1000
connect_wait_ms = 2000
request_timeout_ms = 3000
run_timeout_ms = 4000
preconnect_max_bytes = 5000
max_frame_bytes = 6000
queue_soft_bytes = 7000
queue_hard_bytes = 8000
slow_grace_ms = 9000
max_clients = 10
max_inflight = 11
request_rate = 12
request_burst = 13
replay_max_events = 14
replay_max_bytes = 15000
sse_keepalive_ms = 16000
[upstream]
handshake_timeout_ms = 17000
backoff_initial_ms = 18
backoff_max_ms = 19000
device_identity = false
"#,
    );
    let r = resolve(
        &Overrides {
            config: Some(cfg),
            ..Overrides::default()
        },
        &home.env(&[]),
    )
    .unwrap();
    let l = &r.settings.limits;
    assert_eq!(r.settings.socket_path, PathBuf::from("/tmp/x/clawmux.sock"));
    assert_eq!(l.connect_timeout.as_millis(), 1000);
    assert_eq!(l.connect_wait.as_millis(), 2000);
    assert_eq!(l.request_timeout.as_millis(), 3000);
    assert_eq!(l.run_timeout.as_millis(), 4000);
    assert_eq!((l.preconnect_max_bytes, l.max_frame_bytes), (5000, 6000));
    assert_eq!((l.queue_soft_bytes, l.queue_hard_bytes), (7000, 8000));
    assert_eq!(l.slow_grace.as_millis(), 9000);
    assert_eq!(
        (
            l.max_clients,
            l.max_inflight,
            l.request_rate,
            l.request_burst
        ),
        (10, 11, 12, 13)
    );
    assert_eq!((l.replay_max_events, l.replay_max_bytes), (14, 15000));
    assert_eq!(l.sse_keepalive.as_millis(), 16000);
    assert_eq!(r.settings.upstream.handshake_timeout.as_millis(), 17000);
    assert_eq!(r.settings.upstream.backoff_initial.as_millis(), 18);
    assert_eq!(r.settings.upstream.backoff_max.as_millis(), 19000);
    assert!(r.settings.upstream.device_identity.is_none());
}

#[test]
fn broken_files_name_the_file_and_position_never_the_contents() {
    let home = Home::new();
    let cfg = home.write(
        ".config/clawmux/config.toml",
        "[gateway]\ntoken = \"sekrit-token\"\nurl = \n",
    );
    let e = resolve(&Overrides::default(), &home.env(&[])).unwrap_err();
    assert_eq!(e.code, "studio.settings_load_failed");
    assert!(
        e.message.contains(&cfg.display().to_string()),
        "{}",
        e.message
    );
    assert!(e.message.contains("line 3"), "{}", e.message);
    assert!(!e.message.contains("sekrit"), "{}", e.message);
    std::fs::write(&cfg, "[gateway]\ntokn = \"sekrit-token\"\n").unwrap();
    let e = resolve(&Overrides::default(), &home.env(&[])).unwrap_err();
    assert!(
        e.message.contains("unknown key `tokn`")
            && e.message.contains("valid keys here: url, ")
            && e.message.contains("token_file"),
        "a typo names the key and the valid ones: {}",
        e.message
    );
    assert!(!e.message.contains("sekrit"), "{}", e.message);
    std::fs::remove_file(&cfg).unwrap();
    let s = home.write(
        ".openclaw/claw3d/settings.json",
        "{\"gateway\": {\"token\": \"sekrit-token\",,}}",
    );
    let e = resolve(&Overrides::default(), &home.env(&[])).unwrap_err();
    assert!(
        e.message.contains(&s.display().to_string()) && e.message.contains("line 1"),
        "{}",
        e.message
    );
    assert!(!e.message.contains("sekrit"));
    std::fs::remove_file(&s).unwrap();
    let o = home.write(
        ".openclaw/openclaw.json",
        "{ gateway: { auth: { token: 'sekrit-token' } }\n",
    );
    let e = resolve(&Overrides::default(), &home.env(&[])).unwrap_err();
    assert!(
        e.message.contains(&o.display().to_string()) && e.message.contains("line"),
        "{}",
        e.message
    );
    assert!(!e.message.contains("sekrit"));
    // Unreadable (a directory where the file should be).
    std::fs::remove_file(&o).unwrap();
    std::fs::create_dir_all(&o).unwrap();
    let e = resolve(&Overrides::default(), &home.env(&[])).unwrap_err();
    assert_eq!(e.code, "studio.settings_load_failed");
    // An explicit --config that does not exist.
    let e = resolve(
        &Overrides {
            config: Some(home.path().join("nope.toml")),
            ..Overrides::default()
        },
        &home.env(&[]),
    )
    .unwrap_err();
    assert!(e.message.contains("nope.toml"));
}

#[test]
fn higher_sources_spare_reading_lower_files() {
    let home = Home::new();
    home.write(".openclaw/openclaw.json", "{ this is broken");
    let flags = Overrides {
        gateway_url: Some("ws://127.0.0.1:1".into()),
        token: Some(clawmux::config::Secret::new("t")),
        ..Overrides::default()
    };
    assert!(
        resolve(&flags, &home.env(&[])).is_ok(),
        "a broken file nobody needs does not stop the broker"
    );
}

#[test]
fn explicitly_empty_url_is_kept_for_the_missing_url_error() {
    let home = Home::new();
    let r = resolve(
        &Overrides::default(),
        &home.env(&[("CLAWMUX_GATEWAY_URL", "")]),
    )
    .unwrap();
    assert_eq!(r.settings.gateway_url, "");
    assert_eq!(
        clawmux::config::validate_gateway_url(&r.settings.gateway_url)
            .unwrap_err()
            .code,
        "studio.gateway_url_missing"
    );
}

#[test]
fn a_local_gateways_token_is_never_sent_to_a_remote_url() {
    let home = Home::new();
    home.write(
        ".openclaw/openclaw.json",
        r#"{ gateway: { port: 1111, auth: { token: "local-secret" } } }"#,
    );
    home.write(
        ".openclaw/claw3d/settings.json",
        r#"{"gateway":{"token":"c3-secret"}}"#,
    );
    let remote = [("CLAWMUX_GATEWAY_URL", "wss://gw.example/ws")];
    let r = resolve(&Overrides::default(), &home.env(&remote)).unwrap();
    assert!(
        r.settings.token.is_none(),
        "no token for a remote URL from local files"
    );
    let local = [("CLAWMUX_GATEWAY_URL", "ws://127.0.0.1:1111")];
    let r = resolve(&Overrides::default(), &home.env(&local)).unwrap();
    assert_eq!(token_of(&r).as_deref(), Some("c3-secret"));
}
