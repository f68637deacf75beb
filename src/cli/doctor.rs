//! `clawmux doctor`: where each setting comes from, and one real handshake.
//!
//! It changes nothing on disk: without a device key yet (the broker makes
//! one at its first start) the handshake is tried with the token alone, and
//! the report says so. `--json` prints the same report as one document.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::settings::{fingerprint, Resolved};
use crate::upstream::identity::KEY_FILE;

/// Prints the resolved settings (secrets only as fingerprints) and tries the
/// upstream handshake once. Exit 0 when the gateway accepted the broker.
pub async fn run(resolved: Result<Resolved, crate::protocol::ErrorShape>, json: bool) -> ExitCode {
    let report = check(resolved).await;
    if json {
        super::print_line(&crate::sanitize::json_pretty(&report));
    } else {
        let paint = super::style::Paint::stdout();
        print!("{}", render(&report, &paint));
    }
    if report["ok"] == true {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The report as a document: `ok`, `settings` (or `settings_error`) and
/// `gateway` (the handshake's outcome).
pub async fn check(resolved: Result<Resolved, crate::protocol::ErrorShape>) -> Value {
    let resolved = match resolved {
        Ok(r) => r,
        Err(e) => {
            return json!({
                "ok": false,
                "settings_error": {"code": e.code, "message": e.message},
            })
        }
    };
    let mut s = resolved.settings.clone();
    let device_key = s.upstream.device_identity.as_ref().map(|dir| {
        let exists = dir.join(KEY_FILE).exists();
        json!({"dir": dir.display().to_string(), "exists": exists})
    });
    if device_key.as_ref().is_some_and(|k| k["exists"] == false) {
        // Making the key is `serve`'s job; a check must not leave one behind.
        s.upstream.device_identity = None;
    }
    let settings = json!({
        "socket": {"value": s.socket_path.display().to_string(), "source": resolved.socket_source.to_string()},
        "gateway_url": {"value": crate::config::redact_url(&s.gateway_url), "source": resolved.url_source.to_string()},
        "token": match (&s.token, &resolved.token_source) {
            (Some(t), Some(src)) => json!({"fingerprint": fingerprint(t), "source": src.to_string()}),
            _ => Value::Null,
        },
        "config_file": resolved.config_file.as_ref().map(|p| p.display().to_string()),
        "openclaw_dir": resolved.openclaw_state_dir.display().to_string(),
        "device_key": device_key,
        "tls": tls_settings(&resolved),
        "warnings": resolved.warnings,
        "discovery": resolved.discovery,
        "front_ends": crate::frontends::to_json(&crate::frontends::found(
            &resolved,
            &crate::settings::Env::from_process(),
        )),
    });
    if let Some(demo) = super::client::running_demo(&s.socket_path).await {
        // The broker there talks to its built-in double, not to the gateway
        // these settings name: no handshake (it would only say what a real
        // `serve` would lack, e.g. a token the demo does not need).
        let ok = demo["phase"] == "ready";
        return json!({"ok": ok, "settings": settings, "gateway": {"ok": ok, "demo": demo}});
    }
    // One attempt of the broker's own transport, with the broker's own
    // settings and device, reporting to nobody: what `serve` would see.
    let cancel = CancellationToken::new();
    let (upstream, seed) = crate::upstream::Upstream::new(&s);
    let identity = crate::upstream::identity::DeviceIdentity::load_configured(
        s.upstream.device_identity.as_deref(),
    )
    .map(std::sync::Arc::new);
    let task = tokio::spawn(seed.run(
        &s,
        crate::upstream::SessionSpec::main(),
        identity,
        std::sync::Arc::new(crate::upstream::NoOwner),
        cancel.clone(),
    ));
    let deadline = Instant::now() + s.upstream.handshake_timeout + Duration::from_secs(1);
    let result = upstream.wait_first_attempt(deadline).await;
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
    let certificate = upstream.peer_certificate().map(|c| certificate_json(&c));
    let mut gateway = match result {
        Ok(hello) => json!({
            "ok": true,
            "server_version": hello.server_version,
            "protocol": hello.protocol,
            "scopes": hello.scopes,
            "lost_scopes": hello.lost_scopes,
        }),
        Err(e) => json!({
            "ok": false,
            "code": e.code,
            "message": e.message,
            "gateway_code": e.details.as_ref().and_then(|d| d.pointer("/details/code")),
        }),
    };
    if let Some(cert) = certificate {
        gateway["certificate"] = cert;
    }
    json!({"ok": gateway["ok"], "settings": settings, "gateway": gateway})
}

/// The TLS and password settings, where each came from (secrets only as
/// fingerprints), and the certificate a derived pin was taken from.
fn tls_settings(resolved: &Resolved) -> Value {
    let s = &resolved.settings;
    let password = match (&s.password, &resolved.password_source) {
        (Some(p), Some(src)) => json!({"fingerprint": fingerprint(p), "source": src.to_string()}),
        _ => Value::Null,
    };
    let pin = match (&s.tls.fingerprint, &resolved.tls_fingerprint_source) {
        (Some(pin), Some(src)) => {
            json!({"value": format!("sha256:{pin}"), "source": src.to_string()})
        }
        _ => Value::Null,
    };
    let ca_file = match (&s.tls.ca_file, &resolved.tls_ca_file_source) {
        (Some(ca), Some(src)) => {
            json!({"value": ca.display().to_string(), "source": src.to_string()})
        }
        _ => Value::Null,
    };
    let pinned_cert = match &resolved.tls_fingerprint_source {
        Some(crate::settings::Source::Certificate(path)) => {
            crate::upstream::tls::certificate_file_fingerprint(path)
                .ok()
                .map(|(der, _)| {
                    certificate_json(&crate::upstream::tls::CertificateInfo::from_der(
                        der.as_ref(),
                    ))
                })
        }
        _ => None,
    };
    json!({
        "wss": s.gateway_url.trim().starts_with("wss://"),
        "password": password,
        "pin": pin,
        "ca_file": ca_file,
        "pinned_certificate": pinned_cert,
        "break_glass": s.allow_insecure_private_ws,
    })
}

fn certificate_json(c: &crate::upstream::tls::CertificateInfo) -> Value {
    json!({
        "subject": c.subject,
        "issuer": c.issuer,
        "not_before": c.not_before,
        "not_after": c.not_after,
        "sha256": c.fingerprint,
    })
}

/// A certificate's lines: subject, issuer, validity and SHA-256 (pin with it).
fn certificate_lines(label: &str, c: &Value) -> Vec<String> {
    vec![
        format!("  {label:<12} subject {}", text(&c["subject"])),
        format!("  {:<12} issuer  {}", "", text(&c["issuer"])),
        format!(
            "  {:<12} valid   {} to {}",
            "",
            text(&c["not_before"]),
            text(&c["not_after"])
        ),
        format!("  {:<12} sha256  {}", "", text(&c["sha256"])),
    ]
}

/// The human report, one labelled line per setting.
pub fn render(report: &Value, paint: &super::style::Paint) -> String {
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    if let Some(e) = report.get("settings_error") {
        line(format!("settings: {}", paint.bad("FAILED")));
        line(format!("  {} ({})", text(&e["message"]), text(&e["code"])));
        return out;
    }
    let s = &report["settings"];
    let sourced = |v: &Value| format!("{}  (from {})", text(&v["value"]), text(&v["source"]));
    line("settings:".into());
    line(format!("  socket       {}", sourced(&s["socket"])));
    line(format!("  gateway url  {}", sourced(&s["gateway_url"])));
    match s["token"].as_object() {
        Some(t) => line(format!(
            "  token        {}  (from {})",
            text(&t["fingerprint"]),
            text(&t["source"])
        )),
        None => line("  token        none".into()),
    }
    let tls = &s["tls"];
    if let Some(p) = tls["password"].as_object() {
        line(format!(
            "  password     {}  (from {})",
            text(&p["fingerprint"]),
            text(&p["source"])
        ));
    }
    if tls["pin"].is_object() {
        line(format!("  tls pin      {}", sourced(&tls["pin"])));
    } else if tls["wss"] == true {
        line("  tls pin      none (the system trust store and the host name decide)".into());
    }
    if tls["ca_file"].is_object() {
        line(format!("  tls ca file  {}", sourced(&tls["ca_file"])));
    }
    if tls["pinned_certificate"].is_object() {
        for l in certificate_lines("pinned cert", &tls["pinned_certificate"]) {
            line(l);
        }
    }
    if tls["break_glass"] == true {
        line(format!(
            "  plaintext    {}=1: ws:// allowed to host names (break-glass)",
            crate::upstream::tls::BREAK_GLASS_ENV
        ));
    }
    line(format!(
        "  config file  {}",
        s["config_file"].as_str().unwrap_or("none")
    ));
    line(format!("  openclaw dir {}", text(&s["openclaw_dir"])));
    match s["device_key"].as_object() {
        Some(k) if k["exists"] == true => line(format!("  device key   {}", text(&k["dir"]))),
        Some(k) => line(format!(
            "  device key   none yet in {} (`serve` creates it at its first start; this check used the token alone)",
            text(&k["dir"])
        )),
        None => line("  device key   off".into()),
    }
    for w in s["warnings"].as_array().into_iter().flatten() {
        line(format!("  {}: {}", paint.warn("warning"), text(w)));
    }
    for l in front_end_lines(s) {
        line(l);
    }
    line("gateway:".into());
    let g = &report["gateway"];
    if g["certificate"].is_object() {
        for l in certificate_lines("certificate", &g["certificate"]) {
            line(l);
        }
    }
    if let Some(demo) = g["demo"].as_object() {
        line(format!(
            "  {}: `clawmux serve --demo` (pid {}) serves {} with its built-in gateway double (upstream {}, {})",
            if g["ok"] == true { paint.good("demo") } else { paint.warn("demo") },
            demo["pid"],
            text(&demo["socket"]),
            text(&demo["phase"]),
            text(&demo["server_version"])
        ));
        line(
            "  the settings above are what `clawmux serve` without --demo would use; stop the demo to check them against your gateway"
                .into(),
        );
    } else if g["ok"] == true {
        line(format!(
            "  {}: server {} protocol {}",
            paint.good("ok"),
            text(&g["server_version"]),
            g["protocol"]
        ));
        line(format!("  scopes: {}", list(&g["scopes"])));
        if g["lost_scopes"].as_array().is_some_and(|l| !l.is_empty()) {
            line(format!(
                "  {}: scopes not granted: {}",
                paint.warn("warning"),
                list(&g["lost_scopes"])
            ));
        }
    } else {
        line(format!(
            "  {}: {} ({})",
            paint.bad("FAILED"),
            text(&g["message"]),
            text(&g["code"])
        ));
        if !g["gateway_code"].is_null() {
            line(format!(
                "  gateway detail: {}",
                crate::sanitize::json(&g["gateway_code"])
            ));
        }
    }
    out
}

/// What discovery passed over, and the front ends found on this machine
/// with where each points (this broker, the gateway, elsewhere).
fn front_end_lines(s: &Value) -> Vec<String> {
    let mut lines: Vec<String> = s["discovery"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|note| format!("  discovery    {}", text(note)))
        .collect();
    let front_ends = s["front_ends"].as_array().cloned().unwrap_or_default();
    if front_ends.is_empty() {
        return lines;
    }
    lines.push("front ends:".into());
    for f in &front_ends {
        let whose = format!("{:<8} {}", text(&f["name"]), text(&f["file"]));
        lines.push(match (f["error"].as_str(), f["points_at"].as_str()) {
            (Some(_), _) => format!("  {whose}: unreadable: {}", text(&f["error"])),
            (None, Some("this broker")) => {
                format!("  {whose}: points at this broker ({})", text(&f["socket"]))
            }
            (None, Some(at)) => format!("  {whose}: points at {at} ({})", text(&f["url"])),
            (None, None) => format!("  {whose}: no gateway URL"),
        });
    }
    lines
}

/// A string of the report, escaped: gateway messages, certificate
/// subjects and file paths are not the user's own text.
fn text(v: &Value) -> std::borrow::Cow<'_, str> {
    crate::sanitize::field(v.as_str().unwrap_or("?"), 500)
}

fn list(v: &Value) -> String {
    v.as_array()
        .map(|a| a.iter().map(text).collect::<Vec<_>>().join(", "))
        .unwrap_or_default()
}
