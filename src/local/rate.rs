//! A per-client token bucket for incoming frames (design §5: per-client caps
//! on frame rate). Hand-written: a dozen lines, and the crates for this
//! (governor) bring clocks and generics this one counter does not need.

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
        let burst = f64::from(burst.max(1));
        TokenBucket {
            rate: f64::from(rate.max(1)),
            burst,
            tokens: burst,
            last: Instant::now(),
        }
    }

    /// Takes one token at `now`; `Err(wait)` says how long until one is available.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
        }
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
}
