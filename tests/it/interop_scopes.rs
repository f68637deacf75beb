//! Against a REAL OpenClaw Gateway (2026.9.6, from `../shared/peers`): the
//! `openclaw` CLI asks for `operator.read` for its reads; through the broker
//! (a test-only TCP relay to its socket) it must get what it gets direct,
//! scope-tailored answers included (`src/upstream/aux.rs`). Run by
//! `.ci/interop` (`--ignored`); skips with a note when the peers script is
//! absent.

use std::time::Duration;

use crate::differential::*;
use crate::real_gateway::*;
use crate::support::*;
use serde_json::Value;

/// Patience for one CLI run (node start ~2-5 s on a loaded box).
const CLI_WAIT: Duration = Duration::from_secs(120);

/// Places that differ whatever the scopes: `status --json` shows the
/// calling connection's own presence (`gateway.self`), which through the
/// broker is the broker's narrower connection (`gateway-client`), and the
/// CLI's measured connect latency. (`status`'s work in flight is masked
/// by the normaliser.)
const VOLATILE: &[&str] = &["gateway/self", "gateway/connectLatencyMs"];

fn json_of(run: &CliRun, what: &str) -> Value {
    serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "{what}: not JSON ({e}); status {:?}\nstdout: {}\nstderr: {}",
            run.status, run.stdout, run.stderr
        )
    })
}

/// `openclaw <command…> --url ws://127.0.0.1:<port> --token T --json`.
fn cli_args(command: &[&str], port: u16) -> Vec<String> {
    let url = format!("ws://127.0.0.1:{port}");
    command
        .iter()
        .copied()
        .chain(["--url", &url, "--token", TOKEN, "--json"])
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
#[ignore = "needs a real OpenClaw gateway (~1 GB, installed from npm): run by .ci/interop"]
async fn the_cli_reading_gets_the_same_answers_direct_and_through_the_broker() {
    if !peers_present("interop_scopes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut gw = Gateway::start(port, dir.path().join("gateway.log"));
    gw.wait_ready(FIRST_START).await;
    let broker = RunningBroker::start(broker_settings(&dir.path().join("b"), port, TOKEN))
        .await
        .expect("broker starts");
    let sock = broker.socket_path().to_owned();
    wait_phase(&sock, "ready", Duration::from_secs(30), &gw).await;
    let relay = Relay::start(&sock).await;
    let n = Normalizer {
        literals: vec![
            (format!("127.0.0.1:{port}"), "127.0.0.1:<port>".into()),
            (
                format!("127.0.0.1:{}", relay.port),
                "127.0.0.1:<port>".into(),
            ),
        ],
    };
    let url = |p: u16| format!("ws://127.0.0.1:{p}");
    let mut diffs = Vec::new();
    let mut compared = Vec::new();
    for m in ["status", "sessions.list", "health"] {
        let args = |p: u16| cli_args(&["gateway", "call", m], p);
        let (ad, ab) = (args(port), args(relay.port));
        let (d, b) = tokio::join!(
            openclaw_cli(&ad, "", CLI_WAIT),
            openclaw_cli(&ab, "", CLI_WAIT)
        );
        let (mut d, mut b) = (n.normalize(&json_of(&d, m)), n.normalize(&json_of(&b, m)));
        for p in VOLATILE {
            strip(&mut d, p);
            strip(&mut b, p);
        }
        compared.push((format!("gateway call {m}"), d.clone(), b.clone()));
        for p in differing_paths(&d, &b, "") {
            diffs.push(format!("gateway call {m}: {p}"));
        }
    }
    let env = |p: u16| {
        format!(
            "OPENCLAW_GATEWAY_URL={} OPENCLAW_GATEWAY_TOKEN={TOKEN}",
            url(p)
        )
    };
    let status = ["status".to_string(), "--json".to_string()];
    let (ed, eb) = (env(port), env(relay.port));
    let (d, b) = tokio::join!(
        openclaw_cli(&status, &ed, CLI_WAIT),
        openclaw_cli(&status, &eb, CLI_WAIT)
    );
    let (mut d, mut b) = (
        n.normalize(&json_of(&d, "status")),
        n.normalize(&json_of(&b, "status")),
    );
    for p in VOLATILE {
        strip(&mut d, p);
        strip(&mut b, p);
    }
    for p in differing_paths(&d, &b, "") {
        diffs.push(format!("status: {p}"));
    }
    let probe = |p: u16| cli_args(&["gateway", "probe"], p);
    let (pd, pb) = (probe(port), probe(relay.port));
    let (d, b) = tokio::join!(
        openclaw_cli(&pd, "", CLI_WAIT),
        openclaw_cli(&pb, "", CLI_WAIT)
    );
    let (d, b) = (
        n.normalize(&json_of(&d, "probe")),
        n.normalize(&json_of(&b, "probe")),
    );
    // Not compared field by field: the probe connects without a device
    // key as a client id the gateway clears the scopes of (`scopes: []`,
    // "connected_no_operator_scope"), while the broker grants a local
    // client what it asks, like a locally paired device (README "Least
    // privilege"). What the narrower session fixes: the probe sees its own
    // grant's capability, not the broker session's `admin_capable`.
    assert_eq!(d["capability"], "connected_no_operator_scope", "{d}");
    assert_eq!(b["capability"], "read_only", "{b}");
    // The answers are the read-only ones: redacted, and `owner`, not `admin`.
    let sessions_list = &compared[1].2;
    let roles: Vec<&Value> = sessions_list["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| &s["sharingRole"])
        .collect();
    assert!(
        roles.iter().all(|r| r.as_str() != Some("admin")),
        "{sessions_list}"
    );
    let (_, state) = http_get(&sock, "/v1/state").await;
    let narrower = state["upstream"]["narrower_sessions"].clone();
    drop(relay);
    drop(broker);
    gw.stop().await;
    assert!(
        diffs.is_empty(),
        "{} differences:\n{}",
        diffs.len(),
        diffs.join("\n")
    );
    assert!(
        narrower["opened"].as_u64().unwrap_or(0) >= 1,
        "the reads ran on a narrower session: {narrower}"
    );
}
