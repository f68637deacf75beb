//! How long the connector waits between attempts: exponential backoff with
//! jitter, the gateway's retry hints clamped, and loopback's shorter cap.

use std::time::Duration;

/// Attempts started because a local client was waiting are at least this
/// far apart.
pub const NUDGE_MIN_INTERVAL: Duration = Duration::from_millis(250);

/// How long a waiting connect gives the connector to act on its nudge.
pub(crate) const NUDGE_SETTLE: Duration = Duration::from_millis(50);

/// The longest wait between attempts for a gateway on loopback (not after a
/// rejection): probing it is cheap, and a restarted local gateway should be
/// used within this long of becoming ready.
pub const LOOPBACK_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Whether the URL's host is this machine.
pub fn is_loopback_url(url: &str) -> bool {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return false;
    };
    let host = uri.host().unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The least delay taken from a gateway's hint (`shutdown.restartExpectedMs`,
/// an error's `retryAfterMs`): a hint of 0 must not become a reconnect loop.
pub const RETRY_HINT_FLOOR: Duration = Duration::from_millis(250);

/// A session that ends sooner than this counts as a failed attempt, so a
/// gateway that closes right after `hello-ok` is retried with growing
/// delays, not at a fixed rate forever.
pub const STABLE_SESSION: Duration = Duration::from_secs(10);

/// A gateway-supplied delay, bounded: never above `max` (`backoff_max`: a
/// hint of a day must not park the broker), never below a floor that starts
/// at [`RETRY_HINT_FLOOR`] and doubles with consecutive failures up to
/// `max(initial, RETRY_HINT_FLOOR)` (and never above `max`).
pub fn clamp_hint(hint: Duration, initial: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(10);
    let floor = RETRY_HINT_FLOOR
        .saturating_mul(1u32 << exp)
        .min(initial.max(RETRY_HINT_FLOOR))
        .min(max);
    hint.clamp(floor, max)
}

/// The delay before reconnecting after a ready session ended, the
/// `failures`-th in a row: the gateway's hint (clamped) or the backoff; and
/// for a session that did not last [`STABLE_SESSION`], never less than the
/// backoff, so a gateway that drops every session right after `hello-ok`
/// (with `restartExpectedMs: 0`, say) is retried at growing intervals.
pub fn delay_after_session(
    hint: Option<Duration>,
    stable: bool,
    initial: Duration,
    max: Duration,
    failures: u32,
) -> Duration {
    let backoff = backoff_delay(initial, max, failures);
    let delay = hint.map_or(backoff, |h| clamp_hint(h, initial, max, failures));
    if stable {
        delay
    } else {
        delay.max(backoff)
    }
}

/// The backoff delay after `failures` consecutive failures: initial × 2^(n-1),
/// capped, with up to 20 % jitter taken off so many brokers do not retry in step.
pub fn backoff_delay(initial: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(20);
    let base = initial.saturating_mul(1u32 << exp).min(max);
    let jitter = rand::random::<f64>() * 0.2;
    base.mul_f64(1.0 - jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_hints_are_clamped() {
        let (i, m) = (Duration::from_secs(1), Duration::from_secs(30));
        let ms = |n| Duration::from_millis(n);
        assert_eq!(clamp_hint(ms(0), i, m, 1), ms(250));
        assert_eq!(clamp_hint(ms(0), i, m, 2), ms(500));
        assert_eq!(
            clamp_hint(ms(0), i, m, 9),
            ms(1000),
            "the floor stops at backoff_initial"
        );
        assert_eq!(
            clamp_hint(ms(86_400_000), i, m, 1),
            m,
            "a day becomes backoff_max"
        );
        assert_eq!(clamp_hint(Duration::MAX, i, m, 1), m);
        assert_eq!(clamp_hint(ms(5000), i, m, 1), ms(5000));
        // A backoff_max below the floor wins (tests use 200 ms).
        assert_eq!(clamp_hint(ms(0), ms(20), ms(200), 1), ms(200));
    }

    #[test]
    fn short_sessions_back_off_whatever_the_hint() {
        let (i, m) = (Duration::from_secs(1), Duration::from_secs(30));
        let zero = Some(Duration::ZERO);
        for (n, least) in [(1, 0.8), (3, 3.2), (5, 12.8), (8, 24.0)] {
            let d = delay_after_session(zero, false, i, m, n).as_secs_f64();
            assert!(d >= least, "failures={n}: {d} s");
        }
        // A session that lasted honours the gateway's hint.
        let hint = Some(Duration::from_secs(5));
        assert_eq!(
            delay_after_session(hint, true, i, m, 1),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter() {
        let (i, m) = (Duration::from_secs(1), Duration::from_secs(30));
        for (n, want) in [
            (1, 1.0),
            (2, 2.0),
            (3, 4.0),
            (5, 16.0),
            (6, 30.0),
            (40, 30.0),
        ] {
            let d = backoff_delay(i, m, n).as_secs_f64();
            assert!(d <= want && d >= want * 0.8, "failures={n}: {d}");
        }
    }
}
