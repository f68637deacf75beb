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
pub struct Gate {
    /// Opened first: what the others wait for once through (the gateway
    /// connection, whose readiness every moved client waits for next).
    lead: CancellationToken,
    rest: CancellationToken,
}

impl Gate {
    /// A gate that is already open.
    pub fn opened() -> Gate {
        let gate = Gate::closed();
        gate.open();
        gate
    }

    /// A gate that stays closed until [`Gate::open`].
    pub fn closed() -> Gate {
        // A token's cancellation is the opening: a one-shot broadcast
        // that wakes every waiter, and stays set.
        Gate {
            lead: CancellationToken::new(),
            rest: CancellationToken::new(),
        }
    }

    /// Opens it: the waiters of [`Gate::passed_first`] are woken before
    /// every other (the runtime runs woken tasks in about that order).
    pub fn open(&self) {
        self.lead.cancel();
        self.rest.cancel();
    }

    pub fn is_open(&self) -> bool {
        self.rest.is_cancelled()
    }

    /// Returns once the gate is open (at once if it is).
    pub async fn passed(&self) {
        self.rest.cancelled().await;
    }

    /// As [`Gate::passed`], woken ahead of every waiter of it: for the one
    /// task the others wait for next (a thousand moved clients otherwise
    /// each wake, find the gateway session not ready yet, and wake again).
    pub async fn passed_first(&self) {
        self.lead.cancelled().await;
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
        gate.passed_first().await;
        Gate::opened().passed().await;
        Gate::opened().passed_first().await;
    }

    /// The lead is woken before the rest: on a one-thread runtime, it runs
    /// first whatever order they started waiting in.
    #[tokio::test(flavor = "current_thread")]
    async fn the_lead_passes_before_the_rest() {
        let gate = Gate::closed();
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (gate, order) = (gate.clone(), std::sync::Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                gate.passed().await;
                order.lock().unwrap().push(i);
            }));
        }
        let (lead_gate, lead_order) = (gate.clone(), std::sync::Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            lead_gate.passed_first().await;
            lead_order.lock().unwrap().push(99);
        }));
        tokio::task::yield_now().await;
        assert!(order.lock().unwrap().is_empty());
        gate.open();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [99, 0, 1, 2]);
    }
}
