//! `clawmux doctor`: where each setting comes from, and one real handshake.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::settings::{fingerprint, Resolved};

/// Prints the resolved settings (secrets only as fingerprints) and tries the
/// upstream handshake once. Exit 0 when the gateway accepted the broker.
pub async fn run(resolved: Result<Resolved, crate::protocol::ErrorShape>) -> ExitCode {
    let resolved = match resolved {
        Ok(r) => r,
        Err(e) => {
            println!("settings: FAILED");
            println!("  {}: {}", e.code, e.message);
            return ExitCode::from(1);
        }
    };
    let s = &resolved.settings;
    println!("settings:");
    println!(
        "  socket       {}  (from {})",
        s.socket_path.display(),
        resolved.socket_source
    );
    println!(
        "  gateway url  {}  (from {})",
        crate::config::redact_url(&s.gateway_url),
        resolved.url_source
    );
    match (&s.token, &resolved.token_source) {
        (Some(t), Some(src)) => println!("  token        {}  (from {src})", fingerprint(t)),
        _ => println!("  token        none"),
    }
    match &resolved.config_file {
        Some(p) => println!("  config file  {}", p.display()),
        None => println!("  config file  none"),
    }
    println!("  openclaw dir {}", resolved.openclaw_state_dir.display());
    match &s.upstream.device_identity {
        Some(dir) => println!("  device key   {}", dir.display()),
        None => println!("  device key   off"),
    }
    for w in &resolved.warnings {
        println!("  warning: {w}");
    }
    println!("gateway:");
    let cancel = CancellationToken::new();
    let core = crate::broker::Core::start(s, cancel.clone());
    let (upstream, task) = (core.upstream, core.upstream_task);
    let deadline = Instant::now() + s.upstream.handshake_timeout + Duration::from_secs(1);
    let result = upstream.wait_first_attempt(deadline).await;
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
    match result {
        Ok(hello) => {
            println!(
                "  ok: server {} protocol {}",
                hello.server_version, hello.protocol
            );
            println!("  scopes: {}", hello.scopes.join(", "));
            if !hello.lost_scopes.is_empty() {
                println!(
                    "  warning: scopes not granted: {}",
                    hello.lost_scopes.join(", ")
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("  FAILED {}: {}", e.code, e.message);
            if let Some(code) = e.details.as_ref().and_then(|d| d.pointer("/details/code")) {
                println!("  gateway detail: {code}");
            }
            ExitCode::from(1)
        }
    }
}
