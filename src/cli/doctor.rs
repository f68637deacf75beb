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
    print_tls_settings(&resolved);
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
    if let Some(cert) = upstream.peer_certificate() {
        print_certificate("certificate", &cert);
    }
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

/// The password, the TLS pin and CA file, and the plaintext break-glass,
/// each with where it came from (secrets only as fingerprints).
fn print_tls_settings(resolved: &Resolved) {
    let s = &resolved.settings;
    if let (Some(p), Some(src)) = (&s.password, &resolved.password_source) {
        println!("  password     {}  (from {src})", fingerprint(p));
    }
    match (&s.tls.fingerprint, &resolved.tls_fingerprint_source) {
        (Some(pin), Some(src)) => println!("  tls pin      sha256:{pin}  (from {src})"),
        _ if s.gateway_url.trim().starts_with("wss://") => {
            println!("  tls pin      none (the system trust store and the host name decide)")
        }
        _ => {}
    }
    if let (Some(ca), Some(src)) = (&s.tls.ca_file, &resolved.tls_ca_file_source) {
        println!("  tls ca file  {}  (from {src})", ca.display());
    }
    if let Some(crate::settings::Source::Certificate(path)) = &resolved.tls_fingerprint_source {
        if let Ok((der, _)) = crate::upstream::tls::certificate_file_fingerprint(path) {
            print_certificate(
                "pinned cert",
                &crate::upstream::tls::CertificateInfo::from_der(der.as_ref()),
            );
        }
    }
    if s.allow_insecure_private_ws {
        println!(
            "  plaintext    {}=1: ws:// allowed to host names (break-glass)",
            crate::upstream::tls::BREAK_GLASS_ENV
        );
    }
}

/// A certificate: subject, issuer, validity and SHA-256 (pin with it).
fn print_certificate(label: &str, cert: &crate::upstream::tls::CertificateInfo) {
    println!("  {label:<12} subject {}", cert.subject);
    println!("  {:<12} issuer  {}", "", cert.issuer);
    println!(
        "  {:<12} valid   {} to {}",
        "", cert.not_before, cert.not_after
    );
    println!("  {:<12} sha256  {}", "", cert.fingerprint);
}
