//! Token buckets: per client for incoming frames (design §5: per-client caps
//! on frame rate), and [`OpenLimiter`], per peer plus in total, for the
//! gateway connections local clients cause the broker to open (before:
//! one client opening and closing `/ws/dedicated` made 41.6 upstream
//! connections per second). Hand-written: a dozen lines each, and the crates
//! for this (governor) bring clocks and generics these counters do not need.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Allows `rate` frames per second on average and bursts of `burst`.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: u32, burst: u32) -> Self {
        Self::starting_at(rate, burst, Instant::now())
    }

    fn starting_at(rate: u32, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            rate: f64::from(rate.max(1)),
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Refills for the time since the last look; `Err(wait)` says how long
    /// until a token is available. Takes nothing.
    fn refill(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
        }
    }

    /// Takes one token at `now`; `Err(wait)` says how long until one is available.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        self.refill(now)?;
        self.tokens -= 1.0;
        Ok(())
    }

    /// Whether the bucket is full at `now` (it remembers nothing a fresh one
    /// would not).
    fn is_full(&mut self, now: Instant) -> bool {
        let _ = self.refill(now);
        self.tokens >= self.burst
    }
}

/// A rate (per second, on average) and the burst allowed above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub per_second: u32,
    pub burst: u32,
}

/// Which bucket refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exceeded {
    /// This peer's own rate.
    Peer,
    /// The rate of every peer together.
    Total,
}

/// An open refused by an [`OpenLimiter`]: which rate, and when to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    pub exceeded: Exceeded,
    /// When a token will be available (rounded up to a whole millisecond).
    pub retry_after: Duration,
}

impl Limited {
    /// `retryAfterMs` for a `studio.*` error.
    pub fn retry_after_ms(&self) -> u64 {
        self.retry_after.as_millis() as u64 + 1
    }
}

/// Peers tracked at once before full buckets (peers idle long enough to be
/// back at their burst) are forgotten: bounds the map, changes no answer.
const PRUNE_AT: usize = 1024;

/// Rate limits on something local clients make the broker do (open a
/// gateway connection): a token bucket per peer key plus one for all peers.
/// An attempt takes a token from both or from neither, so one peer over its
/// rate does not drain the total for the others.
#[derive(Debug)]
pub struct OpenLimiter<K> {
    per_peer: Rate,
    inner: Mutex<OpenState<K>>,
}

#[derive(Debug)]
struct OpenState<K> {
    total: TokenBucket,
    peers: HashMap<K, TokenBucket>,
}

impl<K: Hash + Eq + Clone> OpenLimiter<K> {
    pub fn new(per_peer: Rate, total: Rate) -> Self {
        OpenLimiter {
            per_peer,
            inner: Mutex::new(OpenState {
                total: TokenBucket::new(total.per_second, total.burst),
                peers: HashMap::new(),
            }),
        }
    }

    /// The limits of `[limits] upstream_open_*`.
    pub fn from_limits(limits: &crate::config::Limits) -> Self {
        Self::new(
            Rate {
                per_second: limits.upstream_open_rate,
                burst: limits.upstream_open_burst,
            },
            Rate {
                per_second: limits.upstream_open_rate_total,
                burst: limits.upstream_open_burst_total,
            },
        )
    }

    /// One open for `peer` at `now`: `Ok` took a token from the peer's
    /// bucket and the total; `Err` took none and says which rate refused
    /// and when to retry.
    pub fn try_acquire(&self, peer: &K, now: Instant) -> Result<(), Limited> {
        let mut state = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if state.peers.len() >= PRUNE_AT && !state.peers.contains_key(peer) {
            state.peers.retain(|_, b| !b.is_full(now));
        }
        let rate = self.per_peer;
        let OpenState { total, peers } = &mut *state;
        let bucket = peers
            .entry(peer.clone())
            .or_insert_with(|| TokenBucket::starting_at(rate.per_second, rate.burst, now));
        bucket.refill(now).map_err(|wait| Limited {
            exceeded: Exceeded::Peer,
            retry_after: wait,
        })?;
        total.refill(now).map_err(|wait| Limited {
            exceeded: Exceeded::Total,
            retry_after: wait,
        })?;
        bucket.tokens -= 1.0;
        total.tokens -= 1.0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_refills_at_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10, 3);
        for _ in 0..3 {
            assert!(b.take(t0).is_ok());
        }
        let wait = b.take(t0).unwrap_err();
        assert!(wait <= Duration::from_millis(100) && wait > Duration::ZERO);
        assert!(b.take(t0 + Duration::from_millis(100)).is_ok());
        assert!(b.take(t0 + Duration::from_millis(100)).is_err());
        assert!(
            b.take(t0 + Duration::from_secs(10)).is_ok(),
            "refills up to the burst"
        );
    }

    #[test]
    fn opens_are_limited_per_peer_and_in_total() {
        let t0 = Instant::now();
        let limiter = OpenLimiter::new(
            Rate {
                per_second: 2,
                burst: 3,
            },
            Rate {
                per_second: 5,
                burst: 5,
            },
        );
        for _ in 0..3 {
            assert!(limiter.try_acquire(&1u32, t0).is_ok());
        }
        let refused = limiter.try_acquire(&1, t0).unwrap_err();
        assert_eq!(refused.exceeded, Exceeded::Peer);
        assert!(refused.retry_after > Duration::ZERO);
        assert!(refused.retry_after <= Duration::from_millis(500));
        assert!(refused.retry_after_ms() >= 1);
        // Another peer has its own bucket, within the total's.
        assert!(limiter.try_acquire(&2, t0).is_ok());
        assert!(limiter.try_acquire(&2, t0).is_ok());
        let total = limiter.try_acquire(&3, t0).unwrap_err();
        assert_eq!(total.exceeded, Exceeded::Total);
        // A refusal by the total took nothing from the peer: peer 3 still
        // has its whole burst once the total refills.
        let later = t0 + Duration::from_secs(1);
        for _ in 0..3 {
            assert!(limiter.try_acquire(&3, later).is_ok());
        }
        assert_eq!(
            limiter.try_acquire(&3, later).unwrap_err().exceeded,
            Exceeded::Peer
        );
        // Peer 1 refilled at its rate meanwhile.
        assert!(limiter.try_acquire(&1, later).is_ok());
    }

    #[test]
    fn idle_peers_are_forgotten_past_the_bound() {
        let t0 = Instant::now();
        let limiter = OpenLimiter::new(
            Rate {
                per_second: 1,
                burst: 1,
            },
            Rate {
                per_second: 1_000_000,
                burst: 1_000_000,
            },
        );
        for peer in 0..PRUNE_AT as u32 {
            assert!(limiter.try_acquire(&peer, t0).is_ok());
        }
        let later = t0 + Duration::from_secs(5);
        assert!(limiter.try_acquire(&u32::MAX, later).is_ok());
        let peers = limiter.inner.lock().unwrap().peers.len();
        assert_eq!(peers, 1, "refilled peers were dropped");
    }
}
