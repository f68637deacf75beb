//! TLS to a `wss://` gateway (rustls, no OpenSSL) and the transport rules
//! OpenClaw's own clients apply before they send a credential:
//!
//! - plaintext `ws://` only to this machine, private and link-local
//!   addresses, Tailscale's CGNAT range, `.local` and `*.ts.net` names
//!   ([`check_transport`]);
//! - a certificate pin (`gateway.remote.tlsFingerprint`, `--tls-fingerprint`)
//!   replaces the CA and name checks: the certificate is accepted exactly
//!   when its SHA-256 matches ([`normalize_fingerprint`] reads the formats
//!   OpenClaw accepts);
//! - without a pin, the system's trust store plus an optional CA file, with
//!   SNI and the host name (or IP literal) checked by webpki.
//!
//! A certificate the broker refuses is a configuration problem, not an
//! outage: the attempt is `rejected` (retried only every `backoff_max`) and
//! the message names the fix and the fingerprint that was seen.

use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::{
    self,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    client::WebPkiServerVerifier,
    crypto::CryptoProvider,
    pki_types::{pem::PemObject, CertificateDer, ServerName, UnixTime},
    CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use super::handshake::AttemptError;
use crate::config::{redact_url, TlsSettings};
use crate::protocol::{ErrorShape, StudioCode};

/// OpenClaw's break-glass variable: with `1`, plaintext `ws://` is also
/// allowed to host names (trusted private networks only).
pub const BREAK_GLASS_ENV: &str = "OPENCLAW_ALLOW_INSECURE_PRIVATE_WS";

/// Reads a certificate fingerprint the way OpenClaw does
/// (`normalizeTlsFingerprint`): an optional `sha256:` prefix, then 64 hex
/// digits or 32 colon-separated pairs, any case. `None` when it is not one.
pub fn normalize_fingerprint(raw: &str) -> Option<String> {
    let value = raw.trim();
    let value = match value.get(..7) {
        Some(prefix) if prefix.eq_ignore_ascii_case("sha256:") => &value[7..],
        _ => value,
    };
    let hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
    if value.len() == 64 && hex(value) {
        return Some(value.to_ascii_lowercase());
    }
    let pairs: Vec<&str> = value.split(':').collect();
    if pairs.len() == 32 && pairs.iter().all(|p| p.len() == 2 && hex(p)) {
        return Some(pairs.concat().to_ascii_lowercase());
    }
    None
}

/// The SHA-256 fingerprint of a DER certificate, as `sha256:<64 hex>` (a
/// form [`normalize_fingerprint`] and OpenClaw both accept).
pub fn fingerprint_of(der: &[u8]) -> String {
    let digest = Sha256::digest(der);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The first certificate of a PEM file and its fingerprint (how OpenClaw
/// derives the pin of a local gateway with `gateway.tls.enabled`).
pub fn certificate_file_fingerprint(
    path: &Path,
) -> Result<(CertificateDer<'static>, String), String> {
    let pem =
        crate::files::read(path, crate::files::CONFIG_MAX_BYTES).map_err(|e| e.to_string())?;
    let cert = CertificateDer::from_pem_slice(&pem)
        .map_err(|e| format!("cannot read a PEM certificate from {}: {e}", path.display()))?;
    let fp = fingerprint_of(cert.as_ref());
    Ok((cert, fp))
}

/// What a certificate says, for `clawmux doctor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateInfo {
    pub subject: String,
    pub issuer: String,
    /// RFC 3339 (`notAfter`).
    pub not_after: String,
    /// RFC 3339 (`notBefore`).
    pub not_before: String,
    /// `sha256:<64 hex>`.
    pub fingerprint: String,
}

impl CertificateInfo {
    /// Parses a DER certificate (x509-parser); the fingerprint is always set,
    /// the names say `?` when the certificate cannot be parsed.
    pub fn from_der(der: &[u8]) -> CertificateInfo {
        let fingerprint = fingerprint_of(der);
        match x509_parser::parse_x509_certificate(der) {
            Ok((_, cert)) => {
                let time = |t: x509_parser::time::ASN1Time| {
                    chrono::DateTime::from_timestamp(t.timestamp(), 0)
                        .map(|d| d.to_rfc3339())
                        .unwrap_or_else(|| t.to_string())
                };
                CertificateInfo {
                    subject: cert.subject().to_string(),
                    issuer: cert.issuer().to_string(),
                    not_after: time(cert.validity().not_after),
                    not_before: time(cert.validity().not_before),
                    fingerprint,
                }
            }
            Err(_) => CertificateInfo {
                subject: "?".into(),
                issuer: "?".into(),
                not_after: "?".into(),
                not_before: "?".into(),
                fingerprint,
            },
        }
    }
}

/// The host of a `ws://`/`wss://` URL, without brackets, lowercased and
/// without trailing dots.
fn url_host(url: &str) -> Option<String> {
    let uri: http::Uri = url.trim().parse().ok()?;
    let host = uri.host()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(host.to_ascii_lowercase().trim_end_matches('.').to_owned())
}

/// Loopback, private (RFC 1918 / IPv6 unique-local and site-local),
/// link-local and CGNAT (100.64.0.0/10, Tailscale) addresses: the ranges
/// OpenClaw's `isPrivateOrLoopbackIpAddress` accepts.
fn is_private_or_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || (a == 100 && (64..128).contains(&b))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_private_or_loopback(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || (first & 0xffc0) == 0xfe80 // link-local fe80::/10
                || (first & 0xfe00) == 0xfc00 // unique-local fc00::/7
                || (first & 0xffc0) == 0xfec0 // site-local fec0::/10
        }
    }
}

/// Whether plaintext `ws://` to `host` is allowed (OpenClaw's
/// `isSecureWebSocketUrl` for a `ws:` URL).
pub fn plaintext_allowed(host: &str, break_glass: bool) -> bool {
    if host == "localhost" {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(ip) => is_private_or_loopback(ip),
        Err(_) => host.ends_with(".local") || host.ends_with(".ts.net") || break_glass,
    }
}

/// The transport rules checked before any connection is opened: plaintext
/// only where OpenClaw allows it, and a pin only with `wss://`. The error is
/// `studio.gateway_url_invalid` naming the fix, so no credential is ever
/// sent in the clear to another host.
pub fn check_transport(url: &str, tls: &TlsSettings, break_glass: bool) -> Result<(), ErrorShape> {
    let url = url.trim();
    let secure = url
        .get(..6)
        .is_some_and(|s| s.eq_ignore_ascii_case("wss://"));
    if secure {
        return Ok(());
    }
    if tls.fingerprint.is_some() {
        return Err(ErrorShape::studio(
            StudioCode::GatewayUrlInvalid,
            format!(
                "a TLS certificate fingerprint is set but the gateway URL {} is plaintext: use wss://",
                redact_url(url)
            ),
        ));
    }
    let host = url_host(url).unwrap_or_default();
    if plaintext_allowed(&host, break_glass) {
        return Ok(());
    }
    let hint = if break_glass {
        String::new()
    } else {
        format!(" Break-glass (trusted private networks only): {BREAK_GLASS_ENV}=1.")
    };
    Err(ErrorShape::studio(
        StudioCode::GatewayUrlInvalid,
        format!(
            "refusing plaintext ws:// to {host:?}: the token and all traffic would cross the network unencrypted. \
             Use wss:// for a remote gateway (gateway.tls or Tailscale Serve), or an SSH tunnel to ws://127.0.0.1:18789.{hint}"
        ),
    ))
}

/// Marks a certificate refused because it does not match the pin.
#[derive(Debug)]
struct PinMismatch;

impl std::fmt::Display for PinMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("certificate fingerprint does not match the pin")
    }
}

impl std::error::Error for PinMismatch {}

/// Checks the gateway's certificate: against the pin when there is one,
/// else with webpki (chain to a trusted root, name, dates). Either way it
/// keeps the certificate it was shown, for errors and `doctor`, and the
/// handshake signatures are always verified (the peer holds the key).
#[derive(Debug)]
struct GatewayVerifier {
    pin: Option<Vec<u8>>,
    /// `None` when pinned, or when no trusted root could be loaded.
    webpki: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
    seen: Arc<Mutex<Option<CertificateDer<'static>>>>,
}

impl ServerCertVerifier for GatewayVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(end_entity.clone().into_owned());
        if let Some(pin) = &self.pin {
            return if Sha256::digest(end_entity.as_ref()).as_slice() == pin.as_slice() {
                Ok(ServerCertVerified::assertion())
            } else {
                Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                    rustls::OtherError(Arc::new(PinMismatch)),
                )))
            };
        }
        match &self.webpki {
            Some(v) => {
                v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
            }
            None => Err(rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer,
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The TLS side of the connector for one target: the trusted roots (read
/// once per target, off the runtime's threads) and the pin.
#[derive(Debug)]
pub(super) struct TlsClient {
    settings: TlsSettings,
    provider: Arc<CryptoProvider>,
    /// `None` when pinned (roots are not consulted then) or none loaded.
    webpki: Option<Arc<WebPkiServerVerifier>>,
    /// How many trusted roots were loaded (0 is named in the "unknown issuer" message).
    roots_loaded: usize,
}

impl TlsClient {
    /// Loads the system's trust store (rustls-native-certs, which honours
    /// `SSL_CERT_FILE`/`SSL_CERT_DIR`) and the CA file. Blocking file I/O:
    /// call it from `spawn_blocking`. An unreadable CA file is a settings
    /// error naming it.
    pub(super) fn load(settings: &TlsSettings) -> Result<TlsClient, ErrorShape> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut client = TlsClient {
            settings: settings.clone(),
            provider: provider.clone(),
            webpki: None,
            roots_loaded: 0,
        };
        if settings.fingerprint.is_some() {
            return Ok(client);
        }
        let mut roots = RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        for e in &native.errors {
            tracing::debug!("system trust store: {e}");
        }
        roots.add_parsable_certificates(native.certs);
        if let Some(path) = &settings.ca_file {
            let bad = |why: String| {
                ErrorShape::studio(
                    StudioCode::SettingsLoadFailed,
                    format!(
                        "cannot use the TLS CA file {}: {why}; fix the file or the setting",
                        path.display()
                    ),
                )
            };
            // Read like every local file: a regular file under a cap.
            let pem = crate::files::read(path, crate::files::CONFIG_MAX_BYTES)
                .map_err(|e| bad(e.to_string()))?;
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| bad(e.to_string()))?;
            if certs.is_empty() {
                return Err(bad("it holds no PEM certificate".into()));
            }
            for cert in certs {
                roots.add(cert).map_err(|e| bad(e.to_string()))?;
            }
        }
        client.roots_loaded = roots.len();
        if !roots.is_empty() {
            let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| {
                    ErrorShape::studio(
                        StudioCode::SettingsLoadFailed,
                        format!("cannot build the TLS certificate verifier: {e}"),
                    )
                })?;
            client.webpki = Some(verifier);
        }
        Ok(client)
    }

    /// Whether this client was loaded for these settings.
    pub(super) fn serves(&self, settings: &TlsSettings) -> bool {
        &self.settings == settings
    }

    /// Runs the TLS handshake on `tcp` for `host` (SNI for a name; an IP
    /// literal is checked against the certificate's IP addresses). Returns
    /// the stream, and in both outcomes the certificate the gateway showed.
    pub(super) async fn connect(
        &self,
        url: &str,
        host: &str,
        tcp: TcpStream,
    ) -> (
        Result<TlsStream<TcpStream>, AttemptError>,
        Option<CertificateInfo>,
    ) {
        let seen = Arc::new(Mutex::new(None));
        let pin = self.settings.fingerprint.as_deref().and_then(|hex| {
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                .collect::<Option<Vec<u8>>>()
        });
        let verifier = GatewayVerifier {
            pin,
            webpki: self.webpki.clone(),
            provider: self.provider.clone(),
            seen: seen.clone(),
        };
        let config = match rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
        {
            Ok(b) => b
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(verifier))
                .with_no_client_auth(),
            Err(e) => {
                let e = AttemptError::new(StudioCode::UpstreamError, format!("TLS setup: {e}"));
                return (Err(e), None);
            }
        };
        let name = match ServerName::try_from(host.to_owned()) {
            Ok(n) => n,
            Err(e) => {
                let e = AttemptError::new(
                    StudioCode::UpstreamError,
                    format!("the gateway host {host:?} is not a valid TLS server name: {e}"),
                );
                return (Err(e), None);
            }
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let result = connector.connect(name, tcp).await;
        let cert = seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(|der| CertificateInfo::from_der(der.as_ref()));
        let result = result.map_err(|e| self.failure(url, host, &e, cert.as_ref()));
        (result, cert)
    }

    /// Maps a failed TLS handshake to the attempt's error: a refused
    /// certificate is `rejected` (not retried as if the gateway were down)
    /// and its message names the fix and the fingerprint seen.
    fn failure(
        &self,
        url: &str,
        host: &str,
        e: &std::io::Error,
        cert: Option<&CertificateInfo>,
    ) -> AttemptError {
        let url = redact_url(url);
        let tls_error = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        let seen = cert.map_or_else(|| "?".to_owned(), |c| c.fingerprint.clone());
        let Some(rustls::Error::InvalidCertificate(cert_error)) = tls_error else {
            // Not about the certificate: reset, timeout, a gateway without
            // TLS on this port. Retried like any connection failure.
            let hint = match tls_error {
                Some(rustls::Error::InvalidMessage(_)) => {
                    "; the gateway does not seem to speak TLS on this port: enable gateway.tls on it, or use ws:// for a gateway on this machine or a private network"
                }
                _ => "",
            };
            return AttemptError::new(
                StudioCode::UpstreamError,
                format!("the TLS handshake with {url} failed: {e}{hint}"),
            );
        };
        let (kind, message) = match cert_error {
            CertificateError::Other(other) if other.0.downcast_ref::<PinMismatch>().is_some() => (
                "pin_mismatch",
                format!(
                    "the gateway at {url} presented a certificate with fingerprint {seen}, but the pinned fingerprint is sha256:{}; \
                     if the gateway's certificate was replaced, check the new one on the gateway host \
                     (openssl x509 -noout -fingerprint -sha256 -in <cert>) and update gateway.remote.tlsFingerprint or --tls-fingerprint",
                    self.settings.fingerprint.as_deref().unwrap_or("?")
                ),
            ),
            CertificateError::UnknownIssuer | CertificateError::BadSignature => (
                "unknown_issuer",
                format!(
                    "the gateway at {url} presented a certificate (fingerprint {seen}) not signed by a CA this machine trusts{}; \
                     pin it with --tls-fingerprint {seen} (or gateway.remote.tlsFingerprint) after checking it on the gateway host, \
                     or give its CA with --tls-ca-file",
                    if self.roots_loaded == 0 { " (no trusted CA certificates were found at all)" } else { "" }
                ),
            ),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => (
                "name_mismatch",
                format!(
                    "the gateway at {url} presented a certificate (fingerprint {seen}) that is not valid for {host:?}; \
                     connect with a name the certificate was issued for, or pin it with --tls-fingerprint {seen}"
                ),
            ),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => (
                "expired",
                format!(
                    "the gateway at {url} presented an expired certificate (fingerprint {seen}); renew it on the gateway host, or check this machine's clock"
                ),
            ),
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => (
                "not_yet_valid",
                format!(
                    "the gateway at {url} presented a certificate that is not valid yet (fingerprint {seen}); check the clocks of both machines"
                ),
            ),
            other => (
                "refused",
                format!("the gateway at {url} presented a certificate that was refused ({other:?}, fingerprint {seen})"),
            ),
        };
        let mut details = json!({ "tls": kind, "fingerprint": seen });
        if let Some(pin) = &self.settings.fingerprint {
            details["expected"] = json!(format!("sha256:{pin}"));
        }
        AttemptError {
            error: ErrorShape::studio(StudioCode::UpstreamError, message)
                .with_retryable(false)
                .with_details(details),
            rejected: true,
            retry_after: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_in_openclaw_formats() {
        let hex = "AB".repeat(32);
        let want = Some("ab".repeat(32));
        assert_eq!(normalize_fingerprint(&hex), want);
        assert_eq!(normalize_fingerprint(&format!("sha256:{hex}")), want);
        assert_eq!(normalize_fingerprint(&format!(" SHA256:{hex} ")), want);
        let colons = vec!["aB"; 32].join(":");
        assert_eq!(normalize_fingerprint(&colons), want);
        assert_eq!(normalize_fingerprint(&format!("sha256:{colons}")), want);
        for bad in [
            "",
            "sha256:",
            "abc",
            &"ab".repeat(31),
            &"zz".repeat(32),
            "sha1:ab",
        ] {
            assert_eq!(normalize_fingerprint(bad), None, "{bad}");
        }
        assert_eq!(normalize_fingerprint(&vec!["ab"; 31].join(":")), None);
    }

    #[test]
    fn plaintext_only_where_openclaw_allows_it() {
        for host in [
            "localhost",
            "127.0.0.1",
            "::1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.10",
            "169.254.3.4",
            "100.64.0.1",
            "100.127.255.254",
            "fd7a:115c:a1e0::1",
            "fe80::1",
            "::ffff:192.168.0.1",
            "gateway.local",
            "box.tail1234.ts.net",
        ] {
            assert!(plaintext_allowed(host, false), "{host}");
        }
        for host in [
            "8.8.8.8",
            "100.128.0.1",
            "2001:db8::1",
            "gw.example.com",
            "tailnet",
        ] {
            assert!(!plaintext_allowed(host, false), "{host}");
        }
        // Break-glass: names are allowed, public IP literals still are not.
        assert!(plaintext_allowed("gateway-host", true));
        assert!(!plaintext_allowed("8.8.8.8", true));
    }

    #[test]
    fn transport_rules_name_the_fix() {
        let none = TlsSettings::default();
        assert!(check_transport("ws://localhost:18789", &none, false).is_ok());
        assert!(check_transport("ws://LOCALHOST.:18789", &none, false).is_ok());
        assert!(check_transport("wss://gw.example.com", &none, false).is_ok());
        assert!(check_transport("ws://[fd00::2]:18789", &none, false).is_ok());
        assert!(check_transport("ws://u:p@localhost:18789/x?y", &none, false).is_ok());
        let e = check_transport("ws://gw.example.com:18789", &none, false).unwrap_err();
        assert_eq!(e.code, "studio.gateway_url_invalid");
        assert!(
            e.message.contains("wss://") && e.message.contains(BREAK_GLASS_ENV),
            "{}",
            e.message
        );
        let e = check_transport("ws://u:secret@8.8.8.8/", &none, true).unwrap_err();
        assert!(!e.message.contains("secret") && !e.message.contains(BREAK_GLASS_ENV));
        let pinned = TlsSettings {
            fingerprint: Some("ab".repeat(32)),
            ca_file: None,
        };
        let e = check_transport("ws://localhost:18789", &pinned, false).unwrap_err();
        assert_eq!(e.code, "studio.gateway_url_invalid");
    }

    #[test]
    fn certificate_info_from_der() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["gw.test".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let info = CertificateInfo::from_der(cert.der());
        assert_eq!(info.fingerprint, fingerprint_of(cert.der()));
        assert!(info.subject.contains("CN=rcgen"), "{info:?}");
        assert!(info.not_after.starts_with("4096"), "{info:?}");
    }
}
