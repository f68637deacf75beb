//! # clawmux
//!
//! A local-only broker that shares **one** OpenClaw Gateway session among
//! many local programs. It listens on a unix socket (never TCP), holds one
//! upstream WebSocket with the host's token, answers every local client's
//! `connect` itself, routes requests and responses, and fans gateway events
//! out to every client through that client's own bounded queue.
//!
//! The map, in the order a frame travels:
//!
//! - [`config`]: settings and every limit, with defaults and what happens at each.
//! - [`protocol`]: pure frame parsing/encoding (payloads kept as raw JSON) and
//!   the `studio.*` error vocabulary. No I/O.
//! - [`upstream`]: the one gateway session — connect, challenge, token
//!   injection, the broker's signed device identity (key and device tokens in
//!   a private state dir), phases, reconnect with backoff and a silence
//!   watchdog; a reader and a separate writer, so a gateway that stops
//!   reading cannot freeze the broker; requests are tagged with the session
//!   *generation* they were sent on.
//! - [`hub`]: the client registry and fan-out; an event is encoded once and its
//!   bytes shared, only the per-client `seq` differs; per-client byte-counted
//!   queues decide drops and slow-consumer closes; the replay ring gives every
//!   event a broker-wide cursor for HTTP clients to resume from.
//! - [`dispatch`]: the one path every request takes upstream (WebSocket
//!   clients, `/v1/rpc`, the broker's own requests), with the same caps and
//!   metrics; a client's [`dispatch::Registration`] owns its lifecycle and
//!   releases everything it holds at once.
//! - [`router`]: request-id rewriting and the pending table (deadlines, `agent`'s
//!   two answers, failing everything when a session is lost).
//! - [`sharing`]: the gateway's per-connection state shared by many clients:
//!   reference-counted subscriptions (changes decided and queued in one
//!   ordered place), run ownership (tool events, `chat.abort`), who receives
//!   each event.
//! - [`local`]: the unix listener (peer uid check, connection cap, open-file
//!   budget, header read timeout), HTTP routes, and WebSocket
//!   sessions with connect enforcement and the synthesized `hello-ok`; the
//!   HTTP API: `/v1/state` (snapshot + cursor), `/v1/events` (SSE replay
//!   stream), `/v1/rpc`, `/metrics`; and `/ws/dedicated`, a gateway
//!   connection of its own per client (Claw3D proxy semantics) for clients
//!   that need their own identity.
//! - [`tap`]: a broker-side copy of requests, answers and targeted events
//!   for `clawmux record --requests` (secrets redacted).
//! - [`logging`]: the log never blocks fan-out (a lossy writer thread),
//!   never shows a secret (the wire crates capped at info at the sink), and
//!   holds back repeated lines.
//! - [`metrics`]: request accounting and the Prometheus text for `/metrics`.
//! - [`broker`]: assembly and shutdown.
//! - [`cli`]: the everyday commands (`status`, `tail`, `call`, `record`, `top`), which talk to a
//!   running broker over its socket like any other client.
//! - [`sanitize`]: the one sanitizer every string a human-facing command
//!   prints goes through (controls, bidi and invisible characters escaped).
//! - [`activity`]: the client-side projection of raw events into runs,
//!   thinking and tool calls, for `clawmux top` and `tail --tree/--hud`.
//! - [`systemd`]: socket activation (`LISTEN_FDS`), `READY=1`/`STATUS=`/
//!   `WATCHDOG=1`/`STOPPING=1`; no-ops outside systemd. [`lifecycle`] runs
//!   `serve` from ready to exit (signals, hard deadline, exit codes);
//!   [`install`] writes the user units.
//! - [`settings`]: where each setting comes from (flags, environment,
//!   config.toml, Claw3D's and OpenClaw's own files) for `serve` and `doctor`.
//!   [`bounds`] is the range each duration and count may take (at most one
//!   day; zero only where it means something), checked where a value is read.
//!   [`files`] reads every local file clawmux trusts: regular files only, up to a cap.
//!
//! Not in this library: the gateway test double is its own crate,
//! `clawmux-mock` (`crates/clawmux-mock`), used by the tests, `clawmux
//! mock-gateway` and `clawmux serve --demo`.

pub mod activity;
pub mod bounds;
pub mod broker;
pub mod cli;
pub mod config;
pub mod dispatch;
pub mod files;
pub mod hub;
pub mod install;
pub mod lifecycle;
pub mod local;
pub mod logging;
pub mod metrics;
pub mod policy;
pub mod protocol;
pub mod router;
pub mod sanitize;
pub mod settings;
pub mod sharing;
pub mod systemd;
pub mod tap;
pub mod upstream;

pub use broker::RunningBroker;
pub use config::Settings;
