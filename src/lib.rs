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
//!   injection, phases, reconnect with backoff; requests are tagged with the
//!   session *epoch* they were sent on.
//! - [`hub`]: the client registry and fan-out; an event is encoded once and its
//!   bytes shared, only the per-client `seq` differs; per-client byte-counted
//!   queues decide drops and slow-consumer closes.
//! - [`router`]: request-id rewriting and the pending table (deadlines, `agent`'s
//!   two answers, failing everything when a session is lost).
//! - [`local`]: the unix listener (peer uid check), HTTP routes, and WebSocket
//!   sessions with connect enforcement and the synthesized `hello-ok`.
//! - [`broker`]: assembly and shutdown (stop accepting, `shutdown` event,
//!   `1001 going away`, upstream close, all within a deadline).
//! - [`systemd`]: socket activation (`LISTEN_FDS`), `READY=1`/`STATUS=`/
//!   `WATCHDOG=1`/`STOPPING=1`, the token from `LoadCredential=`; no-ops
//!   outside systemd. [`lifecycle`] runs `serve` from ready to exit (signals,
//!   hard deadline, exit codes); [`install`] writes the user units.
//! - [`mock`]: a faithful gateway test double on loopback TCP, used by the
//!   tests, `clawmux mock-gateway` and `clawmux serve --demo`.

pub mod broker;
pub mod config;
pub mod hub;
pub mod install;
pub mod lifecycle;
pub mod local;
pub mod mock;
pub mod protocol;
pub mod router;
pub mod systemd;
pub mod upstream;

pub use broker::RunningBroker;
pub use config::Settings;
