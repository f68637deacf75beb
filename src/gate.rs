//! A one-way gate: closed until it is opened, then open for good.
//!
//! A `SIGUSR2` upgrade's new instance takes every moved socket over while
//! the old one can still serve them again ([`crate::handover::upgrade`]):
//! until the old one commits, nothing here may read or write them, or a
//! failed upgrade would repeat what this one wrote, or lose what it read.
//! Each task that works on a moved socket (a client, a stream, the gateway
//! connection, the accept loops) waits at the gate first. Every other start
//! opens it at once.

use tokio_util::sync::CancellationToken;

/// Cheap to clone: every clone sees the same gate.
#[derive(Debug, Clone)]
pub struct Gate(CancellationToken);

impl Gate {
    /// A gate that is already open.
    pub fn opened() -> Gate {
        let gate = Gate::closed();
        gate.open();
        gate
    }

    /// A gate that stays closed until [`Gate::open`].
    pub fn closed() -> Gate {
        // The token's cancellation is the opening: a one-shot broadcast
        // that wakes every waiter, and stays set.
        Gate(CancellationToken::new())
    }

    pub fn open(&self) {
        self.0.cancel();
    }

    pub fn is_open(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Returns once the gate is open (at once if it is).
    pub async fn passed(&self) {
        self.0.cancelled().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiter_passes_only_once_the_gate_is_opened() {
        let gate = Gate::closed();
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.passed().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished() && !gate.is_open());
        gate.open();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the waiter passes")
            .unwrap();
        // Open for good: a later waiter passes at once.
        gate.passed().await;
        Gate::opened().passed().await;
    }
}
