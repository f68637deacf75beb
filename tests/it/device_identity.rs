//! The broker's device identity against the gateway double (gateway-protocol.md
//! §2.4): signed connects, kept and reused device tokens, an unusable state
//! dir, turning it off, and loud reports of scopes the gateway did not grant.

use std::sync::{Arc, Mutex};

use crate::support::*;
use serde_json::{json, Value};

/// The broker signs the challenge with its device key; a gateway that
/// verifies signatures and requires a device accepts it. The minted device
/// token is kept and, with no shared token configured, used on later connects.
#[tokio::test]
async fn device_signature_is_accepted_and_the_device_token_reused() {
    let cfg = MockConfig {
        require_device: true,
        verify_device: true,
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let (mut a, _) = h.connected().await;
    assert_eq!(a.request("status", json!({})).await["ok"], true);
    let first = &h.gw.connects()[0];
    let device_id = first["device"]["id"].as_str().expect("device block sent");
    assert_eq!(device_id.len(), 64);
    assert_eq!(
        first["auth"],
        json!({"token": "test-token"}),
        "the shared token wins"
    );
    let state = h.dir.path().join("state");
    let tokens: Value =
        serde_json::from_slice(&std::fs::read(state.join("device-tokens.json")).unwrap()).unwrap();
    let minted = tokens["gateways"][h.gw.url()]["token"]
        .as_str()
        .expect("the minted device token is kept")
        .to_owned();
    // The same key on the next session.
    h.gw.drop_all();
    a.event("clawmux.upstream").await;
    a.event("clawmux.upstream").await;
    assert_eq!(h.gw.connects()[1]["device"]["id"], device_id);
    assert_eq!(
        h.gw.connects()[1]["auth"],
        json!({"token": "test-token"}),
        "a stored device token is not sent while a shared token is configured"
    );

    // A broker with the same state dir and no shared token: the device token.
    let dir = tempfile::tempdir().unwrap();
    let mut s = test_settings(dir.path(), &h.gw.url(), None);
    s.upstream.device_identity = Some(state);
    let second = RunningBroker::start(s).await.unwrap();
    let mut c = WsClient::open(second.socket_path(), "/ws").await;
    c.handshake().await;
    assert_eq!(c.request("status", json!({})).await["ok"], true);
    let last = h.gw.connects().last().cloned().unwrap();
    assert_eq!(last["auth"], json!({"deviceToken": minted}));
    assert_eq!(last["device"]["id"], device_id);
}

/// A state dir that cannot be used does not stop the broker: it connects
/// with the token alone and `/healthz` shows no device.
#[tokio::test]
async fn unusable_state_dir_falls_back_to_token_only() {
    let blocker = tempfile::NamedTempFile::new().unwrap();
    let h = start_with(mock_config(), |s| {
        s.upstream.device_identity = Some(blocker.path().join("clawmux"))
    })
    .await;
    let (mut a, _) = h.connected().await;
    assert_eq!(a.request("health", json!({})).await["ok"], true);
    assert!(h.gw.connects()[0].get("device").is_none());
    let (_, body) = http_get(&h.socket(), "/healthz").await;
    assert_eq!(body["deviceId"], Value::Null);
}

/// Device identity off (`--no-device-identity`): no device block, no files.
#[tokio::test]
async fn device_identity_can_be_turned_off() {
    let h = start_with(mock_config(), |s| s.upstream.device_identity = None).await;
    h.connected().await;
    assert!(h.gw.connects()[0].get("device").is_none());
    assert!(!h.dir.path().join("state").exists());
}

#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuf {
    type Writer = LogBuf;
    fn make_writer(&'a self) -> LogBuf {
        self.clone()
    }
}

/// Scopes the gateway did not grant are reported loudly: a warning naming
/// them and the fix, `/healthz` `lostScopes`, the clients' `hello-ok`
/// `auth.scopes`, and the `clawmux.upstream` event after a reconnect.
/// (A current-thread test: the log capture covers the broker's tasks.)
#[tokio::test]
async fn lost_scopes_are_reported_loudly() {
    let logs = LogBuf::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let faults = Faults {
        grant_scopes: Some(vec!["operator.read".into()]),
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |_| {}).await;
    let (mut a, hello) = h.connected().await;
    assert_eq!(hello["auth"]["scopes"], json!(["operator.read"]));
    let (_, body) = http_get(&h.socket(), "/healthz").await;
    let lost = body["lostScopes"].as_array().expect("lostScopes listed");
    assert_eq!(lost.len(), 4, "{body}");
    assert!(lost.contains(&json!("operator.admin")));
    let log = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("WARN"), "{log}");
    assert!(log.contains("SCOPES LOST"), "{log}");
    assert!(log.contains("operator.admin"), "{log}");
    assert!(log.contains("fix:"), "{log}");
    h.gw.drop_all();
    a.event("clawmux.upstream").await;
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["lostScopes"].as_array().unwrap().len(), 4);
}
