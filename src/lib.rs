//! # clawmux
//!
//! A local-only broker that shares **one** OpenClaw Gateway session among
//! many local programs. It listens on a unix socket (never TCP), holds one
//! upstream WebSocket with the host's token, answers every local client's
//! `connect` itself, routes requests and responses, and fans gateway events
//! out to every client through that client's own bounded queue.
//!
//! The map, in layers: each module imports only the ones below it (no
//! import circle among `src/`), and a lower layer that must tell an upper
//! one something is handed a trait object or a channel.
//!
//! - [`cli`]: the everyday commands (`status`, `tail`, `call`, `record`,
//!   `top`), which talk to a running broker over its socket like any other
//!   client.
//! - [`frontends`]: the front ends on this machine (Claw3D's and OpenClaw's
//!   settings) and where each points, for `doctor`; `setup claw3d` and its undo.
//! - [`broker`]: assembly and shutdown; [`lifecycle`] runs `serve` from
//!   ready to exit; [`systemd`]: socket activation and notifications.
//! - [`local`]: the unix listener (peer uid check, connection cap, open-file
//!   budget, header read timeout), one module per HTTP route (`/ws`,
//!   `/v1/state`, `/v1/events`, `/v1/rpc`, `/metrics`, `/ws/dedicated`) and
//!   the helpers they share below them (`local::respond`).
//! - [`context`]: the shared [`context::Ctx`] every route and task is
//!   handed.
//! - [`dispatch`]: a client request parsed once into a typed
//!   [`dispatch::Request`], checked against the client's access, and sent
//!   on one path; a client's [`dispatch::Registration`] owns its share of
//!   the broker and releases it at once.
//! - [`sessions`]: the owners of the upstream sessions (the main one, the
//!   narrower ones, the broker's own requests): what a session being ready,
//!   a frame, or its end means; and [`sessions::Session::send`], the one
//!   send path.
//! - [`upstream`]: the transport. One generation-tagged gateway socket at a
//!   time per connector: connect loop, backoff, TLS, challenge, the signed
//!   `connect` ([`upstream::identity`]), the silence watchdog; it reports
//!   `ready`/`frame`/`ended` to its [`upstream::SessionOwner`] and knows
//!   nothing of clients, subscriptions or runs.
//! - [`hub`]: the client registry and fan-out; an event is encoded once and
//!   its bytes shared, only the per-client `seq` differs; per-client
//!   byte-counted queues decide drops and slow-consumer closes; the replay
//!   ring gives every event a broker-wide cursor for HTTP clients.
//! - [`router`]: request-id rewriting and the pending table (deadlines,
//!   `agent`'s two answers, failing everything when a session is lost);
//!   [`sharing`]: the gateway's per-connection state shared by many clients
//!   (subscriptions, run ownership, who receives each event);
//!   [`dedicated_registry`]: the open `/ws/dedicated` connections (their
//!   cap, listing and counters), plain data the context holds.
//! - At the bottom, pure: [`config`] (settings and every limit),
//!   [`policy`] (scopes, the gateway's method table, socket policies),
//!   [`protocol`] (frames with raw payloads, the `studio.*` errors),
//!   [`rate`] (token buckets, the upstream-open limiter), [`gate`] (a
//!   one-way gate moved sockets wait at during an upgrade), [`files`] and
//!   [`private_files`] (local files read with a bound; the 0700/0600 state dir).
//! - [`tap`]: a broker-side copy of requests, answers and targeted events
//!   for `clawmux record --requests` (secrets redacted).
//! - [`logging`]: the log never blocks fan-out (a lossy writer thread),
//!   never shows a secret (the wire crates capped at info at the sink), and
//!   holds back repeated lines.
//! - [`metrics`]: request accounting and the Prometheus text for `/metrics`.
//! - [`sanitize`]: the one sanitizer every string a human-facing command
//!   prints goes through (controls, bidi and invisible characters escaped).
//! - [`activity`]: the client-side projection of raw events into runs,
//!   thinking and tool calls, for `clawmux top` and `tail --tree/--hud`.
//! - [`install`] writes the user units.
//! - `fuzz_api` (hidden): the fuzz targets' way into private parsers.
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
pub mod boundary;
pub mod bounds;
pub mod broker;
pub mod cli;
pub mod config;
pub mod context;
pub mod dedicated_registry;
pub mod dispatch;
pub mod files;
pub mod frontends;
#[doc(hidden)]
pub mod fuzz_api;
pub mod gate;
pub mod handover;
pub mod hub;
pub mod install;
pub mod lifecycle;
pub mod local;
pub mod logging;
pub mod metrics;
pub mod parcels;
pub mod policy;
pub mod private_files;
pub mod protocol;
pub mod rate;
pub mod router;
pub mod sanitize;
pub mod sessions;
pub mod settings;
pub mod sharing;
pub mod signals;
pub mod slots;
pub mod systemd;
pub mod tap;
pub mod test_hook;
pub mod upgrade_record;
pub mod upstream;

pub use broker::RunningBroker;
pub use config::Settings;
