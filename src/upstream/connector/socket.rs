//! Opening the gateway socket (TCP, TLS or a unix socket, then the
//! WebSocket upgrade), and taking one over from the previous instance.

use std::sync::Arc;

use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use super::super::handshake::{AttemptError, Ws};
use super::super::movable::{Movable, SocketKind, Spooled};
use super::super::tls::TlsClient;
use super::super::PeerCertificate;
use crate::config::{redact_url, TlsSettings, UpstreamOptions};
use crate::protocol::StudioCode;

/// The gateway socket's read buffer. tungstenite zeroes the free part of
/// its buffer before every read, so its default (128 KiB) cost a 128 KiB
/// `memset` per read — a tenth of the broker's CPU per request in the
/// benchmark's profile; 16 KiB still takes ~50 events of 300 bytes per read.
const UPSTREAM_READ_BUFFER_BYTES: usize = 16 * 1024;

/// The gateway WebSocket's settings: frames bounded by `[upstream]
/// max_frame_bytes`, a small read buffer ([`UPSTREAM_READ_BUFFER_BYTES`]).
fn socket_config(opts: &UpstreamOptions) -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(UPSTREAM_READ_BUFFER_BYTES)
        .max_message_size(Some(opts.max_frame_bytes))
        .max_frame_size(Some(opts.max_frame_bytes))
}

/// A gateway socket moved from the previous instance, as a client-side
/// WebSocket with this broker's settings.
pub(crate) async fn take_over_socket(
    socket: super::super::MovedSocket,
    opts: &UpstreamOptions,
) -> std::io::Result<Ws> {
    use tokio_tungstenite::tungstenite::protocol::Role;
    let io = socket.into_io()?;
    Ok(tokio_tungstenite::WebSocketStream::from_raw_socket(
        io,
        Role::Client,
        Some(socket_config(opts)),
    )
    .await)
}

/// Opens a gateway WebSocket: [`open_stream`], then the upgrade, frames
/// bounded by `[upstream] max_frame_bytes`. The shared session and the
/// dedicated route ([`crate::upstream::open_socket`]) both open their
/// connections with this, so both reach the same gateways the same way.
/// `origin`: the `Origin` header of the upgrade request, if any.
pub(crate) async fn open_socket(
    url: &str,
    opts: &UpstreamOptions,
    tls: &TlsSettings,
    tls_client: &mut Option<Arc<TlsClient>>,
    peer_certificate: &PeerCertificate,
    origin: Option<&str>,
) -> Result<Ws, AttemptError> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let config = socket_config(opts);
    let invalid = |what: &str| {
        AttemptError::new(
            StudioCode::GatewayUrlInvalid,
            format!("cannot open {}: {what}", redact_url(url)),
        )
    };
    let mut request = url
        .into_client_request()
        .map_err(|e| invalid(&e.to_string()))?;
    if let Some(origin) = origin {
        let value = http::HeaderValue::from_str(origin)
            .map_err(|_| invalid("the Origin header is not a valid header value"))?;
        request.headers_mut().insert(http::header::ORIGIN, value);
    }
    let io = open_stream(url, opts, tls, tls_client, peer_certificate).await?;
    let (ws, _) = tokio_tungstenite::client_async_with_config(request, io, Some(config))
        .await
        .map_err(|e| {
            AttemptError::new(
                StudioCode::UpstreamError,
                format!(
                    "the WebSocket handshake with {} failed: {e}; is this the gateway's URL?",
                    redact_url(url)
                ),
            )
        })?;
    Ok(ws)
}

/// Applies [`UpstreamOptions::send_buffer_bytes`], when set.
fn set_send_buffer(socket: &impl std::os::fd::AsFd, opts: &UpstreamOptions) -> std::io::Result<()> {
    match opts.send_buffer_bytes {
        Some(bytes) => Ok(rustix::net::sockopt::set_socket_send_buffer_size(
            socket, bytes,
        )?),
        None => Ok(()),
    }
}

/// Opens the byte stream to the gateway: TCP to the URL's host and port
/// (Nagle off, as tokio-tungstenite's own `connect_async` does), then
/// TLS for `wss://` ([`TlsClient`], loaded into `tls_client` the first
/// time); or the configured unix socket. The certificate the gateway
/// showed goes to `peer_certificate`.
async fn open_stream(
    url: &str,
    opts: &UpstreamOptions,
    tls: &TlsSettings,
    tls_client: &mut Option<Arc<TlsClient>>,
    peer_certificate: &PeerCertificate,
) -> Result<Box<dyn super::super::handshake::UpstreamIo>, AttemptError> {
    let unreachable = |e: std::io::Error| {
        AttemptError::new(
            StudioCode::UpstreamError,
            format!(
                "cannot open the gateway connection to {}: {e}; is the gateway running? (start it: openclaw gateway)",
                redact_url(url)
            ),
        )
    };
    if let Some(path) = &opts.unix_socket {
        let unix = tokio::net::UnixStream::connect(path).await;
        let unix = unix.map_err(unreachable)?;
        set_send_buffer(&unix, opts).map_err(unreachable)?;
        return Ok(Box::new(Movable::new(unix, SocketKind::Unix)));
    }
    let uri: http::Uri = url
        .parse()
        .map_err(|e| AttemptError::new(StudioCode::GatewayUrlInvalid, format!("bad URL: {e}")))?;
    let secure = uri.scheme_str() == Some("wss");
    let host = uri.host().unwrap_or_default();
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(if secure { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(unreachable)?;
    tcp.set_nodelay(true).map_err(unreachable)?;
    set_send_buffer(&tcp, opts).map_err(unreachable)?;
    if !secure {
        return Ok(Box::new(Movable::new(tcp, SocketKind::Tcp)));
    }
    let client = load_tls_client(tls_client, tls).await?;
    let (stream, seen) = client.connect(url, &host, tcp).await;
    *peer_certificate.lock().unwrap_or_else(|p| p.into_inner()) = seen;
    Ok(Box::new(Spooled::new(stream?)))
}

/// The TLS client for `settings`, loading the trust store off the
/// runtime's threads the first time (kept in `cache`). An unusable CA file
/// is a settings error: retried only every `backoff_max`.
async fn load_tls_client(
    cache: &mut Option<Arc<TlsClient>>,
    settings: &TlsSettings,
) -> Result<Arc<TlsClient>, AttemptError> {
    if let Some(client) = cache.as_ref().filter(|c| c.serves(settings)) {
        return Ok(Arc::clone(client));
    }
    let owned = settings.clone();
    let loaded = tokio::task::spawn_blocking(move || TlsClient::load(&owned))
        .await
        .unwrap_or_else(|e| {
            Err(crate::protocol::ErrorShape::studio(
                StudioCode::UpstreamError,
                format!("loading the TLS trust store failed: {e}"),
            ))
        });
    match loaded {
        Ok(client) => {
            let client = Arc::new(client);
            *cache = Some(Arc::clone(&client));
            Ok(client)
        }
        Err(error) => Err(AttemptError {
            error,
            rejected: true,
            retry_after: None,
        }),
    }
}
