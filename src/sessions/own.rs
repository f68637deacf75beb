//! The broker's own requests: re-subscribes after a reconnect and the
//! releases of clients that left. They take the same path as any client's
//! ([`super::Session::send`]), under the broker's own requester, and their
//! failures are logged and kept for `/v1/state`.

use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::{Deferred, Outbound, Session};
use crate::hub::{ClientKind, Hub, Outgoing};
use crate::router::{Requester, Router, Settle};
use crate::sharing::subscriptions::SubscriptionState;
use crate::sharing::SubKey;

/// How the broker's own requests fared (shown in `/v1/state`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct OwnStats {
    pub sent: u64,
    pub failed: u64,
    /// The last failure: the request (`<purpose>:<method>`) and the error.
    pub last_failure: Option<Value>,
}

/// The broker as a requester.
#[derive(Debug)]
pub struct OwnRequests {
    requester: Arc<Requester>,
    router: Arc<Router>,
    stats: Mutex<OwnStats>,
}

impl OwnRequests {
    pub fn new(hub: &Hub, router: &Arc<Router>) -> Self {
        OwnRequests {
            requester: Arc::new(Requester::new(hub.new_client_of_kind(ClientKind::Rpc))),
            router: Arc::clone(router),
            stats: Mutex::default(),
        }
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, OwnStats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How the broker's own requests fared.
    pub fn snapshot(&self) -> OwnStats {
        self.stats().clone()
    }

    /// Queues a (un)subscribe of `key` on `session`. Takes the subscription
    /// state's guard: it is queued while the lock is held, so it keeps its
    /// place among every client's subscription changes, and written by the
    /// returned [`Deferred`] once the caller let go of the lock. The label (never a
    /// session key: those are user data) says what it was for.
    pub fn subscription_change(
        &self,
        _ordered: &mut SubscriptionState,
        session: &Session,
        purpose: &str,
        key: &SubKey,
        subscribe: bool,
        settle: Option<Settle>,
    ) -> Deferred {
        let (method, params) = key.request(subscribe);
        let raw = serde_json::value::to_raw_value(&params).ok();
        let label = format!("{purpose}:{method}");
        self.stats().sent += 1;
        let request = Outbound {
            requester: &self.requester,
            local_id: &label,
            method,
            params: raw.as_deref(),
        };
        match session.send_in_order(&self.router, request, settle) {
            Ok(deferred) => deferred,
            Err(refused) => {
                self.record_failure(
                    &label,
                    &serde_json::to_value(&refused).unwrap_or(Value::Null),
                );
                Deferred::default()
            }
        }
    }

    fn record_failure(&self, label: &str, error: &Value) {
        tracing::warn!(request = label, error = %error, "a request the broker sent on its own behalf failed");
        let mut stats = self.stats();
        stats.failed += 1;
        stats.last_failure = Some(json!({"request": label, "error": error}));
    }

    /// Reads the answers to the broker's own requests until `cancel`.
    pub async fn drain_answers(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let batch = tokio::select! {
                _ = cancel.cancelled() => return,
                batch = self.requester.client.next_batch() => batch,
            };
            for item in batch {
                let Outgoing::Frame(frame) = item else {
                    continue;
                };
                #[derive(serde::Deserialize)]
                struct Res {
                    #[serde(default)]
                    id: String,
                    #[serde(default)]
                    ok: bool,
                    #[serde(default)]
                    error: Option<Value>,
                }
                if let Ok(res) = serde_json::from_slice::<Res>(&frame) {
                    if !res.ok {
                        self.record_failure(&res.id, &res.error.unwrap_or(Value::Null));
                    }
                }
            }
        }
    }
}
