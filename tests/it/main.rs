//! The integration suite, as one test binary: the library is linked once for
//! every file here (one binary per file linked it 35 times). Each module is one
//! area; `support` (and its helpers beside it) is shared by all of them.
//!
//! Run one area with a filter: `cargo test --test it -- sharing::`.

#[path = "support/claw3d.rs"]
mod claw3d;
#[path = "support/differential.rs"]
mod differential;
#[path = "support/home.rs"]
mod home;
#[path = "support/http_api.rs"]
mod http_api;
#[path = "support/real_gateway.rs"]
mod real_gateway;
mod support;

mod activity;
mod backpressure;
mod blocking_io;
mod cli;
mod cli_commands;
mod config_e2e;
mod dedicated;
mod dedicated_origin;
mod device_identity;
mod docs_links;
mod exactly_once;
mod frames;
mod front_ends;
mod handover;
mod handshake;
mod history;
mod http_routes;
mod ignored;
mod install_service;
mod interop;
mod interop_dedicated;
mod interop_diff;
mod interop_handover;
mod interop_hud;
mod interop_ownership;
mod interop_scopes;
mod least_privilege;
mod limits;
mod local_files;
mod logging;
mod memory_bounds;
mod multiplex;
mod narrower_sessions;
mod packaging;
mod plugin_surfaces;
mod readme;
mod record_replay;
mod replay;
mod request_frames;
mod run_ownership;
mod serve_messages;
mod settings;
mod sharing;
mod shedding;
mod socket;
mod socket_shares;
mod studio_errors;
mod subscriptions;
mod systemd;
mod terminal_injection;
mod tls;
mod upstream_faults;
