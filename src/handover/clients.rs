//! The connected WebSocket clients a handover moves (design §11): each
//! client's socket travels as a descriptor; what it is (its id, `connId`,
//! grant, declared identity, next `seq`, subscriptions), the frames queued
//! for it and not yet written, and the bytes read from it and not parsed
//! travel in this document (a sealed memfd, like [`super::State`]).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::state::{Unreadable, FORMAT};
use crate::context::{Ctx, Parcel};
use crate::hub::{ClientIdentity, Outgoing};
use crate::policy::{Access, Grant, SocketPolicy};
use crate::sharing::SubKey;

/// The descriptor name of the clients document (systemd's store).
pub const CLIENTS_FD_NAME: &str = "clawmux-clients";

/// The largest clients document read back: the queues it carries are
/// bounded by `queue_total_bytes` (at most 1 GiB, see the limits page),
/// and the rest is a few hundred bytes per client.
pub const MAX_CLIENTS_BYTES: u64 = 2 << 30;

/// The descriptor name of a client's socket.
pub fn client_fd_name(id: u64) -> String {
    format!("clawmux-client-{id}")
}

/// Every client moved, in the order of their descriptors.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Clients {
    pub format: u32,
    pub clients: Vec<ClientEntry>,
}

/// One moved client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientEntry {
    pub id: u64,
    pub conn_id: String,
    pub connected_at_ms: u64,
    pub identity: Identity,
    pub tool_events: bool,
    /// Its grant's scopes.
    pub scopes: Vec<String>,
    /// The socket it connected to (`[[sockets]]` name; `default`: the main one).
    pub socket: String,
    /// The `seq` its next event gets.
    pub next_seq: u64,
    pub subscriptions: Vec<Subscription>,
    /// Frames queued for it and not written yet, in order.
    pub queued: Vec<String>,
    /// Bytes read from its socket and not parsed (base64).
    pub unread: String,
}

/// What a client declared at connect (for `/v1/state`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    pub client_id: Option<String>,
    pub mode: Option<String>,
    pub version: Option<String>,
    pub display_name: Option<String>,
    pub peer_pid: Option<u32>,
}

/// A subscription a client holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Subscription {
    Sessions,
    Messages { key: String },
}

impl Clients {
    pub fn parse(bytes: &[u8]) -> Result<Clients, Unreadable> {
        let head: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| Unreadable::Invalid(e.to_string()))?;
        match head.get("format").and_then(serde_json::Value::as_u64) {
            Some(f) if f == u64::from(FORMAT) => {}
            Some(found) => return Err(Unreadable::Format { found }),
            None => return Err(Unreadable::Invalid("no format number".into())),
        }
        serde_json::from_value(head).map_err(|e| Unreadable::Invalid(e.to_string()))
    }

    pub fn to_memfd(&self) -> std::io::Result<OwnedFd> {
        super::state::memfd_with(&serde_json::to_vec(self).map_err(std::io::Error::other)?)
    }

    pub fn from_fd(fd: impl std::os::fd::AsFd) -> Result<Clients, Unreadable> {
        Clients::parse(&super::state::read_memfd(fd, MAX_CLIENTS_BYTES)?)
    }
}

/// Packs what the client tasks left, once the sessions have ended (every
/// answer to their requests is queued by then): the document, and each
/// client's socket by id. The registrations are dropped here.
pub fn pack(parcels: Vec<Parcel>) -> (Clients, Vec<(u64, OwnedFd)>) {
    let mut clients = Vec::with_capacity(parcels.len());
    let mut fds = Vec::with_capacity(parcels.len());
    for parcel in parcels {
        let client = Arc::clone(parcel.registration.client());
        let (items, next_seq) = client.take_all();
        let mut queued = Vec::with_capacity(items.len());
        for item in items {
            let frame = match item {
                Outgoing::Event(head, seq) => head.with_seq(seq),
                Outgoing::Frame(bytes) => bytes,
                // A client being closed is not moved.
                Outgoing::Close(..) => break,
            };
            queued.push(String::from_utf8_lossy(&frame).into_owned());
        }
        let subscriptions = {
            let book = parcel.registration.member().book();
            let mut subs: Vec<Subscription> = book
                .subs
                .iter()
                .map(|k| match k {
                    SubKey::Sessions => Subscription::Sessions,
                    SubKey::Messages(key) => Subscription::Messages { key: key.clone() },
                })
                .collect();
            subs.sort_by_key(|s| format!("{s:?}"));
            subs
        };
        let identity = client.identity.get().cloned().unwrap_or_default();
        let access = client.access();
        clients.push(ClientEntry {
            id: client.id,
            conn_id: client.conn_id.clone(),
            connected_at_ms: client.connected_at_ms,
            identity: Identity {
                client_id: identity.client_id,
                mode: identity.mode,
                version: identity.version,
                display_name: identity.display_name,
                peer_pid: identity.peer_pid,
            },
            tool_events: client
                .tool_events
                .load(std::sync::atomic::Ordering::Relaxed),
            scopes: access
                .map(|a| a.grant.scopes().to_vec())
                .unwrap_or_default(),
            socket: access.map_or_else(|| "default".into(), |a| a.socket.name.clone()),
            next_seq,
            subscriptions,
            queued,
            unread: base64::engine::general_purpose::STANDARD.encode(&parcel.unread),
        });
        fds.push((client.id, parcel.fd));
    }
    (
        Clients {
            format: FORMAT,
            clients,
        },
        fds,
    )
}

/// Serves the moved clients in this instance: each from where the previous
/// one stopped. A client whose socket or `[[sockets]]` entry is missing is
/// not taken (its descriptor is closed: it reconnects and resumes by
/// cursor). Returns how many were taken.
pub fn restore(
    ctx: &Arc<Ctx>,
    policies: &[Arc<SocketPolicy>],
    clients: Clients,
    mut fds: HashMap<u64, OwnedFd>,
) -> usize {
    let mut taken = 0;
    for entry in clients.clients {
        let Some(fd) = fds.remove(&entry.id) else {
            tracing::warn!(
                client_id = entry.id,
                "handover: a client's socket was not passed"
            );
            continue;
        };
        let Some(policy) = policies.iter().find(|p| p.name == entry.socket) else {
            tracing::warn!(client_id = entry.id, socket = %entry.socket, "handover: the client's socket is no longer configured; closing it");
            continue;
        };
        let Ok(unread) = base64::engine::general_purpose::STANDARD.decode(&entry.unread) else {
            continue;
        };
        let stream = std::os::unix::net::UnixStream::from(fd);
        let stream = match stream
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(stream))
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(
                    client_id = entry.id,
                    "handover: a client's socket is unusable ({e})"
                );
                continue;
            }
        };
        let client = ctx
            .hub
            .restored_client(entry.id, entry.conn_id, entry.connected_at_ms);
        let _ = client.identity.set(ClientIdentity {
            client_id: entry.identity.client_id,
            mode: entry.identity.mode,
            version: entry.identity.version,
            display_name: entry.identity.display_name,
            peer_pid: entry.identity.peer_pid,
        });
        client
            .tool_events
            .store(entry.tool_events, std::sync::atomic::Ordering::Relaxed);
        let asked = Grant::new(&entry.scopes);
        client.set_access(Access {
            grant: asked.within(&policy.ceiling(&asked)),
            socket: Arc::clone(policy),
        });
        client.continue_seq(entry.next_seq);
        let registration = ctx.dispatcher.register(Arc::clone(&client));
        if ctx.hub.admit_restored(&client).is_err() {
            continue;
        }
        {
            let mut st = ctx.sharing.subscriptions.lock();
            let mut book = registration.member().book();
            for sub in entry.subscriptions {
                let key = match sub {
                    Subscription::Sessions => SubKey::Sessions,
                    Subscription::Messages { key } => SubKey::Messages(key),
                };
                st.restore(key.clone(), client.id);
                book.subs.insert(key);
            }
        }
        for frame in entry.queued {
            client.push_frame(Bytes::from(frame));
        }
        ctx.tracker.spawn(crate::local::ws::resume(
            stream,
            unread,
            registration,
            Arc::clone(ctx),
        ));
        taken += 1;
    }
    if taken > 0 {
        ctx.sessions.main_owner.clients_taken_over();
    }
    taken
}
