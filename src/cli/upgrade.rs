//! `clawmux upgrade`: hands the broker behind this socket over to the
//! `clawmux` now at its binary's path, waits, and says what happened in one
//! line. The broker is found by the socket, not by a process name: the pid
//! its `/v1/state` gives, over a connection the client checked is served by
//! this user (`SO_PEERCRED`'s pid would not do: it names the process that
//! first listened, systemd's or an instance long gone). The outcome is read
//! back from `/v1/state`: a new pid that took over (success), or the old
//! one's `broker.upgrade.failures` grown (it serves on).

use std::time::Duration;

use clap::Args;
use http::Method;
use serde_json::Value;

use super::{BrokerArgs, CliError, EXIT_ERROR_ANSWER};

#[derive(Args, Debug)]
pub struct UpgradeArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// How long to wait for the outcome, in seconds.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub timeout: u64,
}

/// How often the outcome is looked for.
const POLL_EVERY: Duration = Duration::from_millis(20);

/// Exit 0 when a new instance serves, 1 when the upgrade failed (the old
/// instance still serves: said), 3 when no broker answers.
pub async fn run(args: UpgradeArgs) -> Result<u8, CliError> {
    let client = args.broker.client();
    let before = state(&client).await?;
    let old_pid = before["broker"]["pid"].as_u64().unwrap_or(0) as u32;
    let upgrade = &before["broker"]["upgrade"];
    if upgrade["can_upgrade"] != true {
        return Err(CliError::Answer(
            "this broker cannot hand over (a demo's gateway double lives in its process): stop it and start it again".to_owned(),
        ));
    }
    let failures = upgrade["failures"].as_u64().unwrap_or(0);
    let old_version = text(&before["broker"]["version"]);
    let started = tokio::time::Instant::now();
    let pid = rustix::process::Pid::from_raw(old_pid as i32)
        .ok_or_else(|| CliError::Answer(format!("the broker's pid {old_pid} is not a pid")))?;
    rustix::process::kill_process(pid, rustix::process::Signal::USR2)
        .map_err(|e| CliError::Answer(format!("cannot signal the broker (pid {old_pid}): {e}")))?;
    let deadline = started + Duration::from_secs(args.timeout);
    loop {
        tokio::time::sleep(POLL_EVERY).await;
        // During the handover the socket may not answer for a moment.
        let now = state(&client).await;
        if now.is_err() && rustix::process::test_kill_process(pid).is_err() {
            super::print_line(&format!(
                "upgrade failed: the broker (pid {old_pid}) ended and no broker answers on {}; start it again (clawmux serve, or systemctl --user start clawmux)",
                client.socket().display()
            ));
            return Ok(EXIT_ERROR_ANSWER);
        }
        if let Ok(now) = now {
            let pid = now["broker"]["pid"].as_u64().unwrap_or(0) as u32;
            if pid != old_pid {
                let took = &now["broker"]["upgrade"]["took_over"];
                let moved = match (took["clients"].as_u64(), took["streams"].as_u64()) {
                    (Some(c), Some(s)) => format!(
                        "{c} {} and {s} event {} moved",
                        if c == 1 { "client" } else { "clients" },
                        if s == 1 { "stream" } else { "streams" }
                    ),
                    _ => "its clients moved".to_owned(),
                };
                super::print_line(&format!(
                    "upgraded: pid {old_pid} ({old_version}) → pid {pid} ({}), {moved}, in {} ms",
                    text(&now["broker"]["version"]),
                    started.elapsed().as_millis()
                ));
                return Ok(0);
            }
            let upgrade = &now["broker"]["upgrade"];
            if upgrade["failures"].as_u64().unwrap_or(0) > failures {
                let why = upgrade["last_failure"]
                    .as_str()
                    .unwrap_or("no reason given");
                super::print_line(&format!(
                    "upgrade failed: {}; pid {old_pid} still serves every client",
                    crate::sanitize::text(why)
                ));
                return Ok(EXIT_ERROR_ANSWER);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            super::print_line(&format!(
                "upgrade: no outcome within {} s; pid {old_pid} was signalled (see its log)",
                args.timeout
            ));
            return Ok(EXIT_ERROR_ANSWER);
        }
    }
}

async fn state(client: &super::BrokerClient) -> Result<Value, CliError> {
    let (status, state) = client.json(Method::GET, "/v1/state", None).await?;
    if !status.is_success() {
        return Err(CliError::Answer(format!(
            "the broker answered {status}: {}",
            crate::sanitize::text(&state.to_string())
        )));
    }
    Ok(state)
}

fn text(v: &Value) -> String {
    crate::sanitize::text(v.as_str().unwrap_or("?")).into_owned()
}
