//! The limits and socket policies `config.toml` sets: each value checked
//! against its bound where it is read, the error naming the key.

use std::path::Path;

use super::file::{ConfigFile, LimitsSection, SocketSection, UpstreamSection};
use super::Env;
use crate::config::Settings;

/// The `[[sockets]]` entries as policies; the error names the entry.
pub(super) fn socket_policies(
    main: &Path,
    sections: &[SocketSection],
    env: &Env,
) -> Result<Vec<crate::policy::SocketPolicy>, String> {
    use crate::policy::{scopes, Grant, MethodFilter, SocketPolicy};
    let mut out: Vec<SocketPolicy> = Vec::new();
    for (i, s) in sections.iter().enumerate() {
        let at = format!("sockets[{i}]");
        let name = s.name.trim();
        if name.is_empty()
            || name == "default"
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "{at}.name must be a name of letters, digits, '-', '_' or '.' (not \"default\")"
            ));
        }
        let path = env.expand(&s.path.to_string_lossy());
        if !path.is_absolute() {
            return Err(format!("{at}.path must be an absolute path"));
        }
        if path == main || out.iter().any(|o| o.path == path || o.name == name) {
            return Err(format!(
                "{at}: another socket already has this name or path"
            ));
        }
        let mode = match &s.mode {
            None => 0o600,
            Some(m) => match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
                Ok(m) if m & !0o777 == 0 && m & 0o600 == 0o600 => m,
                _ => return Err(format!("{at}.mode must be octal permissions such as \"0660\", readable and writable by the owner")),
            },
        };
        if mode & 0o007 != 0 && s.uids.is_empty() && s.gids.is_empty() {
            // Harmless (peer credentials decide), but a sign of a mistake.
            tracing::debug!(
                socket = name,
                "mode lets everyone reach the socket; only the owner is admitted"
            );
        }
        let known = |v: &str| v.starts_with("operator.");
        let granted = match &s.scopes {
            None => None,
            Some(list) => {
                if let Some(bad) = list.iter().find(|v| !known(v)) {
                    return Err(format!(
                        "{at}.scopes: {bad:?} is not an operator scope (e.g. {}, {})",
                        scopes::READ,
                        scopes::WRITE
                    ));
                }
                Some(Grant::new(list))
            }
        };
        out.push(SocketPolicy {
            name: name.to_owned(),
            path,
            mode,
            uids: s.uids.clone(),
            gids: s.gids.clone(),
            scopes: granted,
            methods: MethodFilter {
                allow: s.allow_methods.clone(),
                deny: s.deny_methods.clone(),
            },
            observe: s.observe,
        });
    }
    Ok(out)
}

/// Copies the `[limits]` and `[upstream]` values of `config.toml` into the
/// settings, each checked ([`crate::bounds`]); the error names the key.
pub(super) fn apply_limits(settings: &mut Settings, file: &ConfigFile) -> Result<(), String> {
    use crate::bounds::{duration_ms, positive, Zero};
    let l = &file.limits;
    let lim = &mut settings.limits;
    // `set!(field, value, check)`: a present value, checked, replaces the default.
    macro_rules! set {
        ($target:expr, $section:literal, $key:ident, $check:expr) => {
            if let Some(v) = $key {
                let check = $check;
                $target = check(concat!($section, ".", stringify!($key)), v)?;
            }
        };
    }
    let ms = |zero| move |name: &str, v| duration_ms(name, v, zero);
    let LimitsSection {
        connect_timeout_ms,
        connect_wait_ms,
        request_timeout_ms,
        run_timeout_ms,
        preconnect_max_bytes,
        max_frame_bytes,
        queue_soft_bytes,
        queue_hard_bytes,
        slow_grace_ms,
        queue_total_bytes,
        max_clients,
        max_inflight,
        request_rate,
        request_burst,
        replay_max_events,
        replay_max_bytes,
        replay_persist,
        sse_keepalive_ms,
        max_connections,
        header_read_timeout_ms,
        max_dedicated,
        send_buffer_bytes,
        upstream_open_rate,
        upstream_open_burst,
        upstream_open_rate_total,
        upstream_open_burst_total,
    } = *l;
    let any = |_: &str, v| Ok::<_, String>(v);
    set!(
        lim.connect_timeout,
        "limits",
        connect_timeout_ms,
        ms(Zero::Refused)
    );
    set!(
        lim.connect_wait,
        "limits",
        connect_wait_ms,
        ms(Zero::Allowed)
    );
    set!(
        lim.request_timeout,
        "limits",
        request_timeout_ms,
        ms(Zero::Refused)
    );
    set!(lim.run_timeout, "limits", run_timeout_ms, ms(Zero::Refused));
    set!(
        lim.preconnect_max_bytes,
        "limits",
        preconnect_max_bytes,
        positive
    );
    set!(lim.max_frame_bytes, "limits", max_frame_bytes, positive);
    set!(lim.queue_soft_bytes, "limits", queue_soft_bytes, positive);
    set!(lim.queue_hard_bytes, "limits", queue_hard_bytes, positive);
    set!(lim.slow_grace, "limits", slow_grace_ms, ms(Zero::Allowed));
    set!(lim.queue_total_bytes, "limits", queue_total_bytes, positive);
    set!(lim.max_clients, "limits", max_clients, positive);
    set!(lim.max_inflight, "limits", max_inflight, positive);
    set!(lim.request_rate, "limits", request_rate, positive);
    set!(lim.request_burst, "limits", request_burst, positive);
    set!(lim.replay_max_events, "limits", replay_max_events, any);
    set!(lim.replay_max_bytes, "limits", replay_max_bytes, any);
    set!(
        lim.replay_persist,
        "limits",
        replay_persist,
        |_: &str, v: bool| { Ok::<_, String>(v) }
    );
    set!(
        lim.sse_keepalive,
        "limits",
        sse_keepalive_ms,
        ms(Zero::Refused)
    );
    set!(lim.max_connections, "limits", max_connections, |n, v| {
        positive(n, v).map(Some)
    });
    set!(
        lim.header_read_timeout,
        "limits",
        header_read_timeout_ms,
        ms(Zero::Refused)
    );
    set!(lim.max_dedicated, "limits", max_dedicated, positive);
    set!(lim.send_buffer_bytes, "limits", send_buffer_bytes, any);
    set!(
        lim.upstream_open_rate,
        "limits",
        upstream_open_rate,
        positive
    );
    set!(
        lim.upstream_open_burst,
        "limits",
        upstream_open_burst,
        positive
    );
    set!(
        lim.upstream_open_rate_total,
        "limits",
        upstream_open_rate_total,
        positive
    );
    set!(
        lim.upstream_open_burst_total,
        "limits",
        upstream_open_burst_total,
        positive
    );
    let UpstreamSection {
        handshake_timeout_ms,
        backoff_initial_ms,
        backoff_max_ms,
        write_timeout_ms,
        max_frame_bytes: upstream_max_frame_bytes,
        ..
    } = file.upstream;
    let up = &mut settings.upstream;
    set!(
        up.handshake_timeout,
        "upstream",
        handshake_timeout_ms,
        ms(Zero::Refused)
    );
    set!(
        up.backoff_initial,
        "upstream",
        backoff_initial_ms,
        ms(Zero::Refused)
    );
    set!(
        up.backoff_max,
        "upstream",
        backoff_max_ms,
        ms(Zero::Refused)
    );
    set!(
        up.write_timeout,
        "upstream",
        write_timeout_ms,
        ms(Zero::Refused)
    );
    if let Some(v) = upstream_max_frame_bytes {
        up.max_frame_bytes = positive("upstream.max_frame_bytes", v)?;
    }
    if let Some(v) = &file.upstream.dedicated_origin {
        up.dedicated_origin = crate::config::DedicatedOrigin::parse(v)?;
    }
    Ok(())
}
