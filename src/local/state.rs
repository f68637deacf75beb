//! `GET /v1/state`: one self-consistent document of what the broker knows.
//!
//! The gateway snapshot and the replay cursor are taken under the hub's one
//! lock, so a client that streams `/v1/events?after_seq=<newest_seq>` next
//! sees exactly the events the snapshot does not include (cursors are
//! durable: that holds across broker restarts; `epoch` is information). Nothing secret is
//! in it: no token, no device token (the upstream `hello-ok` is not copied
//! whole), and the gateway URL without user info or query.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::respond::Body;
use crate::config::Limits;
use crate::context::Ctx;
use crate::policy::SocketPolicy;

/// Answers `/v1/state` for a caller on `socket`: the whole document on the
/// main socket; on any other socket only what concerns that socket's own
/// clients ([`document_on`]). Built and encoded off the runtime's workers
/// (with 1,000 clients it is tens of milliseconds of CPU, which would hold
/// up the fan-out of the worker it ran on); the hub's lock is held only
/// for the snapshot, as before.
pub async fn respond(ctx: &Arc<Ctx>, socket: Arc<SocketPolicy>) -> Response<Body> {
    let (for_blocking, on) = (Arc::clone(ctx), Arc::clone(&socket));
    let built =
        tokio::task::spawn_blocking(move || document_on(&for_blocking, &on).to_string()).await;
    // (Not built there only when the runtime is shutting down: here, then.)
    let text = built.unwrap_or_else(|_| document_on(ctx, &socket).to_string());
    super::respond::bytes_response(StatusCode::OK, "application/json", bytes::Bytes::from(text))
}

/// The `/v1/state` document as the main socket sees it.
pub fn document(ctx: &Ctx) -> Value {
    document_on(ctx, &SocketPolicy::main(ctx.settings.socket_path.clone()))
}

/// The `/v1/state` document for a caller on `socket`. On a further socket
/// (`[[sockets]]`, maybe another user's) it lists only the clients of that
/// socket and the subscriptions they hold, its own policy without the uid
/// and gid lists, the main socket's path not at all, and the dedicated
/// connections as a count (before: every socket saw every client's peer
/// pid, identity, scopes and connection id, every policy's users, and the
/// dedicated clients' blocks; before, the session keys other sockets'
/// clients subscribed to, and the scope sets of other sockets' clients'
/// narrower sessions).
pub fn document_on(ctx: &Ctx, socket: &SocketPolicy) -> Value {
    let full = socket.is_main();
    let (snapshot, window, runs) = ctx.hub.snapshot_with_runs();
    // Runs in flight show every run's tool calls: only where observers are
    // allowed, as on `/v1/hud`.
    let runs = if socket.observe { runs } else { Value::Null };
    let status = ctx.upstream().status();
    let hello = status.hello.as_deref();
    let all = ctx.hub.clients();
    let mine: Vec<_> = all
        .iter()
        .filter(|c| full || c.access().is_some_and(|a| a.socket.name == socket.name))
        .collect();
    let own: HashSet<u64> = mine.iter().map(|c| c.id).collect();
    let clients: Vec<Value> = mine
        .iter()
        .map(|c| {
            json!({
                "id": c.id,
                "kind": c.kind.as_str(),
                "conn_id": c.conn_id,
                "queue_bytes": c.queued_bytes(),
                "drops": c.dropped.load(Ordering::Relaxed),
                "inflight": c.inflight.load(Ordering::Relaxed),
                "scopes": c.grant(),
                "socket": c.access().map(|a| a.socket.name.as_str()),
                "connected_at_ms": c.connected_at_ms,
                "declared": c.identity.get(),
                "peer_pid": c.identity.get().and_then(|i| i.peer_pid),
                "tool_observer": c.observer.load(std::sync::atomic::Ordering::Relaxed),
            })
        })
        .collect();
    let policy_json = |p: &SocketPolicy| {
        let mut v = json!({
            "name": p.name,
            "path": p.path.display().to_string(),
            "scopes": p.scopes,
            "allow_methods": p.methods.allow,
            "deny_methods": p.methods.deny,
            "observe": p.observe,
        });
        if full {
            v["uids"] = json!(p.uids);
            v["gids"] = json!(p.gids);
        }
        v
    };
    let policy_sockets: Vec<Value> = ctx
        .settings
        .sockets
        .iter()
        .filter(|p| full || p.name == socket.name)
        .map(policy_json)
        .collect();
    let main_socket = if full {
        ctx.settings.socket_path.display().to_string()
    } else {
        socket.path.display().to_string()
    };
    let dedicated = if full {
        ctx.dedicated.to_json()
    } else {
        Value::Array(Vec::new())
    };
    json!({
        "epoch": &*window.epoch,
        "newest_seq": window.newest_seq,
        "oldest_seq": window.oldest_seq,
        // Where the replay log is kept (null: in memory, ends with this life).
        "replay_file": ctx.hub.replay_file().map(|p| p.display().to_string()),
        // The runs in flight at `newest_seq` (open thinking, open tool
        // calls); null on a socket without observer powers.
        "runs": runs,
        "broker": {
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "uptime_ms": process_uptime_ms(),
            "socket": main_socket,
            "policy_sockets": policy_sockets,
            // What `clawmux upgrade` reads: can this broker hand over, how
            // its upgrades went, what it took over itself.
            "upgrade": crate::upgrade_record::to_json(),
        },
        "upstream": {
            "phase": status.phase.as_str(),
            "url": crate::config::redact_url(&ctx.upstream().target_url()),
            // Settings files passed over because they point at this broker.
            "discovery": ctx.upstream().target_discovery(),
            "session": status.sessions,
            "server_version": hello.map(|h| h.server_version.as_str()),
            "protocol": hello.map(|h| h.protocol),
            "scopes": hello.map(|h| &h.scopes),
            "lost_scopes": hello.map_or(&[][..], |h| &h.lost_scopes[..]),
            // The event names the gateway announced (`hello-ok.features.events`).
            "events": hello.and_then(|h| h.payload.pointer("/features/events")),
            // And the methods (`hello-ok.features.methods`): `clawmux call` suggests from them.
            "methods": hello.and_then(|h| h.payload.pointer("/features/methods")),
            "last_error": status.last_error.as_ref().map(|e| e.to_json()),
            "retry_after_ms": status.retry_after_ms(),
            "reconnects": status.reconnects,
            // On a further socket, only the sessions of its own clients'
            // grants: another socket's narrower session would tell which
            // scope sets other clients hold.
            "narrower_sessions": ctx.sessions.narrower.to_json_where(|grant| {
                full || mine.iter().any(|c| c.grant() == grant)
            }),
        },
        "snapshot": &*snapshot,
        "clients": clients,
        // On a further socket: how many clients there are in all, not who.
        "clients_total": all.len(),
        "dedicated": dedicated,
        "dedicated_open": ctx.dedicated.count(),
        "requests_pending": ctx.router.pending_count(),
        "rpc_inflight": ctx.dispatcher.rpc_inflight(),
        "subscriptions": subscriptions_json(ctx, |id| full || own.contains(&id)),
        "broker_requests": ctx.sessions.own.snapshot(),
        "limits": limits_json(&ctx.settings.limits),
    })
}

/// How long this process has run, from `/proc` (Linux): the system's
/// uptime less the process's start time (`/proc/self/stat` field 22, in
/// clock ticks: `USER_HZ`, 100 on every Linux ABI). `None` elsewhere.
fn process_uptime_ms() -> Option<u64> {
    const USER_HZ: u64 = 100;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let start_ticks: u64 = rest.split_whitespace().nth(22 - 3)?.parse().ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let system_secs: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    let system_ms = (system_secs * 1000.0) as u64;
    Some(system_ms.saturating_sub(start_ticks * 1000 / USER_HZ))
}

/// Local subscriptions as the broker holds them upstream, counting only the
/// holders `holder` accepts (on a further socket: that socket's clients).
fn subscriptions_json(ctx: &Ctx, holder: impl Fn(u64) -> bool) -> Value {
    let (sessions, messages) = ctx.sharing.subscriptions.counts_held_by(holder);
    json!({"sessions": sessions, "messages": messages})
}

fn limits_json(l: &Limits) -> Value {
    let ms = |d: std::time::Duration| d.as_millis() as u64;
    json!({
        "connect_timeout_ms": ms(l.connect_timeout),
        "connect_wait_ms": ms(l.connect_wait),
        "request_timeout_ms": ms(l.request_timeout),
        "run_timeout_ms": ms(l.run_timeout),
        "preconnect_max_bytes": l.preconnect_max_bytes,
        "max_frame_bytes": l.max_frame_bytes,
        "queue_soft_bytes": l.queue_soft_bytes,
        "queue_hard_bytes": l.queue_hard_bytes,
        "slow_grace_ms": ms(l.slow_grace),
        "queue_total_bytes": l.queue_total_bytes,
        "max_clients": l.max_clients,
        "max_inflight": l.max_inflight,
        "replay_max_events": l.replay_max_events,
        "replay_max_bytes": l.replay_max_bytes,
        "replay_persist": l.replay_persist,
        "sse_keepalive_ms": ms(l.sse_keepalive),
        "max_connections": l.max_connections(),
        "header_read_timeout_ms": ms(l.header_read_timeout),
        "max_dedicated": l.max_dedicated,
        "send_buffer_bytes": l.send_buffer_bytes,
        "upstream_open_rate": l.upstream_open_rate,
        "upstream_open_burst": l.upstream_open_burst,
        "upstream_open_rate_total": l.upstream_open_rate_total,
        "upstream_open_burst_total": l.upstream_open_burst_total,
        "max_handshakes": crate::context::MAX_HANDSHAKES,
        "max_subscriptions_per_client": crate::dispatch::MAX_SUBSCRIPTIONS_PER_CLIENT,
        "upstream_queue_frames": crate::upstream::UPSTREAM_QUEUE_FRAMES,
    })
}

#[cfg(test)]
mod tests {
    use crate::config::redact_url;

    #[test]
    fn the_process_uptime_is_known_on_linux() {
        let up = super::process_uptime_ms().expect("/proc is readable");
        // This test process started moments ago, not days.
        assert!(up < 24 * 3600 * 1000, "{up}");
    }

    #[test]
    fn urls_lose_credentials() {
        assert_eq!(redact_url("ws://localhost:18789"), "ws://localhost:18789");
        assert_eq!(
            redact_url("wss://u:secret@gw.example/ws?token=abc#x"),
            "wss://gw.example/ws"
        );
        assert_eq!(redact_url("ws://a@b@host/p"), "ws://host/p");
    }
}
