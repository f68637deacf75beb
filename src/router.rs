//! Request routing: every local request gets a broker-unique upstream id;
//! the pending table maps the answer back to the client and its own id.
//!
//! The table is keyed by upstream id. An entry lives until the final answer
//! (`agent` answers twice), its deadline, the loss of the upstream session it
//! was sent on (its *generation*), or its requester's departure — whichever
//! is first. Each [`Requester`] lists its own pending ids, so a departure costs
//! what that requester holds, not a scan of the table.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use serde_json::value::RawValue;

use crate::hub::Client;
use crate::metrics::{Outcome, RequestMetrics};
use crate::protocol::frames::{encode_res, encode_res_error, payload_status};
use crate::protocol::{ErrorShape, StudioCode};

/// Runs once with a forwarded request's outcome (`true`: its final answer
/// was `ok`), so what was recorded for it can be confirmed or undone.
pub type Settle = Box<dyn FnOnce(bool) + Send + Sync>;

/// `now + d`, or a far-off instant when that does not fit (an absurd
/// configured timeout must not panic a task).
pub fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Whose in-flight budget a requester spends.
#[derive(Debug)]
enum Budget {
    /// Its own (`Client::inflight`): a WebSocket client, the broker itself.
    Own,
    /// One shared by every requester of a kind (`/v1/rpc`: each HTTP request
    /// is a fresh requester, so a per-request budget would bound nothing).
    Shared(Arc<AtomicUsize>, &'static str),
}

/// Who a request answers to: the client whose queue gets the answer, the
/// in-flight budget it spends, and the ids of its requests still waiting
/// (so its departure costs what it holds, not a scan of the table).
#[derive(Debug)]
pub struct Requester {
    /// Its queue: answers (and, once admitted, events) go here.
    pub client: Arc<Client>,
    budget: Budget,
    pending: Mutex<HashSet<String>>,
}

impl Requester {
    /// A requester spending its own in-flight budget.
    pub fn new(client: Arc<Client>) -> Self {
        Requester {
            client,
            budget: Budget::Own,
            pending: Mutex::default(),
        }
    }

    /// A requester spending a budget shared with others of its kind.
    pub fn with_shared_budget(
        client: Arc<Client>,
        budget: Arc<AtomicUsize>,
        name: &'static str,
    ) -> Self {
        Requester {
            client,
            budget: Budget::Shared(budget, name),
            pending: Mutex::default(),
        }
    }

    pub fn id(&self) -> u64 {
        self.client.id
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counter(&self) -> &AtomicUsize {
        match &self.budget {
            Budget::Own => &self.client.inflight,
            Budget::Shared(n, _) => n,
        }
    }

    /// Who the in-flight cap counts, for the refusal message.
    pub fn budget_name(&self) -> &'static str {
        match &self.budget {
            Budget::Own => "this client",
            Budget::Shared(_, name) => name,
        }
    }

    /// Takes an in-flight slot for `upstream_id`; false at the cap.
    fn take_slot(&self, upstream_id: &str, max: usize) -> bool {
        let counter = self.counter();
        if counter.fetch_add(1, Ordering::AcqRel) >= max {
            counter.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        self.pending().insert(upstream_id.to_owned());
        true
    }

    /// Gives back the slot of an answered, failed or forgotten request.
    fn release_slot(&self, upstream_id: &str) {
        if self.pending().remove(upstream_id) {
            self.counter().fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The ids of its pending requests.
    fn pending_ids(&self) -> Vec<String> {
        self.pending().iter().cloned().collect()
    }

    /// Requests in flight on its budget.
    pub fn inflight(&self) -> usize {
        self.counter().load(Ordering::Relaxed)
    }
}

/// The queue a request waits in before it is written to the gateway, as
/// the table sees it: a request that times out is withdrawn from it first,
/// so it is either written or answered as failed, never both. (A trait
/// object passed down: the transport sits above the table.)
pub trait Withdraw: Send + Sync + std::fmt::Debug {
    /// Takes the request out of the queue if it has not been written:
    /// true means it never will be.
    fn withdraw(&self, upstream_id: &str) -> bool;
}

/// One request waiting for its upstream answer.
struct Pending {
    member: Arc<Requester>,
    local_id: String,
    method: String,
    /// The upstream session generation the request was sent on.
    generation: u64,
    deadline: Instant,
    /// Undoes what the driver recorded if the request does not succeed.
    settle: Option<Settle>,
    /// When it was registered, for the latency histogram.
    started: Instant,
    /// The queue it waits in until written (none in unit tests).
    queue: Option<Arc<dyn Withdraw>>,
    /// An `agent` request whose first answer (`accepted`) was delivered.
    accepted: bool,
}

/// A request in flight on a gateway session handed over to the next
/// instance (design §11): its answer arrives there, on the same
/// connection, under the same upstream id.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MovedRequest {
    pub upstream_id: String,
    pub client_id: u64,
    /// The client's own id, as it sent it (JSON).
    pub local_id: String,
    pub method: String,
    /// `agent`: its `accepted` answer was delivered; the final one is due.
    pub accepted: bool,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("client", &self.member.client.id)
            .field("local_id", &self.local_id)
            .field("method", &self.method)
            .field("generation", &self.generation)
            .finish()
    }
}

impl Pending {
    /// Releases the client's in-flight slot and tells the driver whether
    /// the request succeeded (it confirms or undoes what it recorded).
    fn settle(mut self, upstream_id: &str, ok: bool) -> Self {
        if let Some(settle) = self.settle.take() {
            settle(ok);
        }
        self.member.release_slot(upstream_id);
        self
    }
}

/// The pending-request table.
#[derive(Debug)]
pub struct Router {
    pending: DashMap<String, Pending>,
    next_id: AtomicU64,
    request_timeout: Duration,
    run_timeout: Duration,
    max_inflight: usize,
    /// Requests by method and outcome, and their latency (for `/metrics`).
    pub metrics: RequestMetrics,
    /// A copy of requests and answers for `clawmux record` (idle unless tapped).
    pub tap: crate::tap::Tap,
}

impl Router {
    pub fn new(request_timeout: Duration, run_timeout: Duration, max_inflight: usize) -> Self {
        Router {
            pending: DashMap::new(),
            next_id: AtomicU64::new(1),
            request_timeout,
            run_timeout,
            max_inflight,
            metrics: RequestMetrics::default(),
            tap: crate::tap::Tap::default(),
        }
    }

    /// Records a request and returns the id to send upstream, or the error
    /// to answer the client with (too many requests in flight; `settle` is
    /// then dropped without running).
    pub fn register(
        &self,
        member: &Arc<Requester>,
        local_id: &str,
        method: &str,
        generation: u64,
        settle: Option<Settle>,
        queue: Option<Arc<dyn Withdraw>>,
    ) -> Result<String, ErrorShape> {
        let upstream_id = format!("cm-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        if !member.take_slot(&upstream_id, self.max_inflight) {
            // Never registered: the caller undoes what it recorded (it may
            // hold a lock the settle would take).
            drop(settle);
            self.metrics.record(method, Outcome::Rejected, None);
            return Err(ErrorShape::studio(
                StudioCode::TooManyRequests,
                format!(
                    "{} already has {} requests in flight; wait for answers before sending more",
                    member.budget_name(),
                    self.max_inflight
                ),
            ));
        }
        self.pending.insert(
            upstream_id.clone(),
            Pending {
                member: Arc::clone(member),
                local_id: local_id.to_owned(),
                method: method.to_owned(),
                generation,
                deadline: deadline_after(self.request_timeout),
                settle,
                started: Instant::now(),
                queue,
                accepted: false,
            },
        );
        Ok(upstream_id)
    }

    /// The next upstream id's number (handed to the next instance, which
    /// goes on from it: an answer to an old id can never be taken for a new
    /// request's).
    pub fn next_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Numbers upstream ids from `next` on (at least).
    pub fn continue_ids(&self, next: u64) {
        self.next_id.fetch_max(next, Ordering::Relaxed);
    }

    /// The gateway session `generation` moves to the next instance: takes
    /// out every request registered for it. Those of a client that moves
    /// too (`moves`) and that were written are returned, for the next
    /// instance to wait for their answers; every other one is answered
    /// here, as failed: `unsent` (withdrawn unwritten) `sent: false`, the
    /// rest `sent: true` (its answer will reach the next instance, which
    /// does not know it). Exactly once either way.
    pub fn take_for_handover(
        &self,
        generation: u64,
        moves: impl Fn(u64) -> bool,
        unsent: &[String],
    ) -> Vec<MovedRequest> {
        let unsent: HashSet<&str> = unsent.iter().map(String::as_str).collect();
        let ids: Vec<String> = self
            .pending
            .iter()
            .filter(|e| e.value().generation == generation)
            .map(|e| e.key().clone())
            .collect();
        let mut moved = Vec::new();
        for id in ids {
            let Some((_, mut p)) = self.pending.remove(&id) else {
                continue;
            };
            let written = !unsent.contains(id.as_str());
            if written && moves(p.member.id()) {
                // What the driver recorded stays recorded: the request was
                // sent, and its outcome is the next instance's to see.
                drop(p.settle.take());
                p.member.release_slot(&id);
                moved.push(MovedRequest {
                    upstream_id: id,
                    client_id: p.member.id(),
                    local_id: p.local_id,
                    method: p.method,
                    accepted: p.accepted,
                });
                continue;
            }
            let error = ErrorShape::studio(
                StudioCode::UpstreamClosed,
                "the broker handed its gateway session over to its next instance before the answer",
            )
            .with_sent(written);
            self.answer_error(&id, p, &error);
        }
        moved
    }

    /// Waits, on session `generation`, for the answer to a request the
    /// previous instance sent for `member` ([`MovedRequest`]). It counts in
    /// the member's in-flight budget (even over the cap: it is in flight).
    pub fn take_over(&self, member: &Arc<Requester>, moved: MovedRequest, generation: u64) {
        member.counter().fetch_add(1, Ordering::AcqRel);
        member.pending().insert(moved.upstream_id.clone());
        let timeout = if moved.accepted {
            self.run_timeout
        } else {
            self.request_timeout
        };
        self.pending.insert(
            moved.upstream_id,
            Pending {
                member: Arc::clone(member),
                local_id: moved.local_id,
                method: moved.method,
                generation,
                deadline: deadline_after(timeout),
                settle: None,
                started: Instant::now(),
                queue: None,
                accepted: moved.accepted,
            },
        );
    }

    /// Delivers an upstream answer to its client under the client's own id.
    /// Returns false for an id the table does not know (late or foreign).
    pub fn complete(
        &self,
        upstream_id: &str,
        ok: bool,
        payload: Option<&RawValue>,
        error: Option<&RawValue>,
    ) -> bool {
        // `agent` answers `accepted` first: its entry stays for the final
        // answer. Only an `agent` answer's payload is read for that (every
        // other answer passes untouched, whatever its size).
        let removed = self.pending.remove_if(upstream_id, |_, p| {
            !(ok && p.method == "agent" && payload_status(payload).as_deref() == Some("accepted"))
        });
        let Some((_, p)) = removed else {
            let Some(mut entry) = self.pending.get_mut(upstream_id) else {
                return false;
            };
            entry.deadline = deadline_after(self.run_timeout);
            entry.accepted = true;
            entry
                .member
                .client
                .push_frame(encode_res(&entry.local_id, ok, payload, error));
            return true;
        };
        let p = p.settle(upstream_id, ok);
        let outcome = if ok { Outcome::Ok } else { Outcome::Error };
        self.metrics
            .record(&p.method, outcome, Some(p.started.elapsed()));
        p.member
            .client
            .push_frame(encode_res(&p.local_id, ok, payload, error));
        true
    }

    /// Fails one request (e.g. it could not be sent) with `error`.
    pub fn fail(&self, upstream_id: &str, error: &ErrorShape) {
        if let Some((_, p)) = self.pending.remove(upstream_id) {
            self.answer_error(upstream_id, p, error);
        }
    }

    /// Fails every request registered for upstream session `generation`
    /// (it ended, or never opened). `unsent` are the ids its queue gave
    /// back unwritten: they are answered `sent: false`; every other one was
    /// written, or may have been, and is answered `sent: true` (the gateway
    /// may have run it).
    pub fn fail_generation(&self, generation: u64, unsent: &[String], error: &ErrorShape) -> usize {
        let unsent: HashSet<&str> = unsent.iter().map(String::as_str).collect();
        self.fail_where(
            |p| p.generation == generation,
            |id, _| error.clone().with_sent(!unsent.contains(id)),
        )
    }

    /// Fails every request registered for `generation`, none of which was
    /// written (the attempt that would have opened it failed).
    pub fn fail_generation_unsent(&self, generation: u64, error: &ErrorShape) -> usize {
        self.fail_where(
            |p| p.generation == generation,
            |_, _| error.clone().with_sent(false),
        )
    }

    /// Answers every request past its deadline with `studio.request_timeout`:
    /// one still waiting in its session's queue is withdrawn first and
    /// answered `sent: false`; one already written, `sent: true`.
    pub fn expire(&self, now: Instant) -> usize {
        self.fail_where(
            |p| p.deadline <= now,
            |id, p| {
                let withdrawn = p.queue.as_ref().is_some_and(|q| q.withdraw(id));
                ErrorShape::studio(
                    StudioCode::RequestTimeout,
                    format!("the gateway did not answer {} in time", p.method),
                )
                .with_sent(!withdrawn)
            },
        )
    }

    /// Drops every entry of a requester that left; their answers will be
    /// discarded. Their settles do not run: the requests were sent, so what
    /// was recorded for them is not undone here but released with the rest
    /// of what the requester holds (a pending subscribe is then
    /// unsubscribed, in order). Costs what it holds.
    pub fn forget(&self, member: &Requester) {
        for id in member.pending_ids() {
            if let Some((_, mut p)) = self.pending.remove(&id) {
                drop(p.settle.take());
                let _ = p.settle(&id, false);
            }
        }
    }

    /// Requests waiting for an answer, broker-wide.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    fn fail_where(
        &self,
        matches: impl Fn(&Pending) -> bool,
        error: impl Fn(&str, &Pending) -> ErrorShape,
    ) -> usize {
        let ids: Vec<String> = self
            .pending
            .iter()
            .filter(|e| matches(e.value()))
            .map(|e| e.key().clone())
            .collect();
        let mut n = 0;
        for id in ids {
            if let Some((_, p)) = self.pending.remove(&id) {
                let e = error(&id, &p);
                self.answer_error(&id, p, &e);
                n += 1;
            }
        }
        n
    }

    /// Every error the table answers says whether its request was sent;
    /// one whose caller did not say is answered `sent: true` (it was
    /// registered, so it may have been written).
    fn answer_error(&self, upstream_id: &str, p: Pending, error: &ErrorShape) {
        let unsaid;
        let error = if error.says_sent() {
            error
        } else {
            unsaid = error.clone().with_sent(true);
            &unsaid
        };
        let p = p.settle(upstream_id, false);
        let outcome = Outcome::of_studio_code(&error.code);
        self.metrics
            .record(&p.method, outcome, Some(p.started.elapsed()));
        p.member
            .client
            .push_frame(encode_res_error(&p.local_id, error));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{Client, Outgoing, QueueLimits};
    use serde_json::Value;

    fn client(id: u64) -> Arc<Requester> {
        Arc::new(Requester::new(Arc::new(Client::new(
            id,
            QueueLimits {
                soft_bytes: 1 << 20,
                hard_bytes: 1 << 22,
                grace: Duration::from_secs(10),
            },
        ))))
    }

    async fn frames(m: &Requester) -> Vec<Value> {
        m.client
            .next_batch()
            .await
            .into_iter()
            .map(|o| match o {
                Outgoing::Frame(b) => serde_json::from_slice(&b).unwrap(),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).unwrap()
    }

    #[tokio::test]
    async fn same_local_id_from_two_clients_is_kept_apart() {
        let r = Router::new(Duration::from_secs(5), Duration::from_secs(60), 8);
        let (a, b) = (client(1), client(2));
        let ua = r.register(&a, "1", "health", 1, None, None).unwrap();
        let ub = r.register(&b, "1", "health", 1, None, None).unwrap();
        assert_ne!(ua, ub);
        assert!(r.complete(&ub, true, Some(&raw(r#"{"who":"b"}"#)), None));
        assert!(r.complete(&ua, true, Some(&raw(r#"{"who":"a"}"#)), None));
        assert!(!r.complete(&ua, true, None, None), "answered once");
        assert_eq!(frames(&a).await[0]["payload"]["who"], "a");
        let fb = frames(&b).await;
        assert_eq!(
            (fb[0]["id"].as_str(), fb[0]["payload"]["who"].as_str()),
            (Some("1"), Some("b"))
        );
        assert_eq!(a.inflight(), 0);
    }

    #[tokio::test]
    async fn agent_answers_twice() {
        let r = Router::new(Duration::from_secs(5), Duration::from_secs(60), 8);
        let a = client(1);
        let u = r.register(&a, "x", "agent", 1, None, None).unwrap();
        assert!(r.complete(
            &u,
            true,
            Some(&raw(r#"{"runId":"r","status":"accepted"}"#)),
            None
        ));
        assert_eq!(r.pending_count(), 1);
        assert!(r.complete(&u, true, Some(&raw(r#"{"runId":"r","status":"ok"}"#)), None));
        assert_eq!(r.pending_count(), 0);
        let f = frames(&a).await;
        assert_eq!(f.len(), 2);
        assert_eq!(f[1]["payload"]["status"], "ok");
    }

    #[tokio::test]
    async fn session_loss_deadline_and_departure() {
        let r = Router::new(Duration::from_millis(0), Duration::from_secs(60), 8);
        let a = client(1);
        let u1 = r.register(&a, "1", "status", 1, None, None).unwrap();
        let _u2 = r.register(&a, "2", "status", 2, None, None).unwrap();
        let closed = ErrorShape::studio(StudioCode::UpstreamClosed, "gone");
        assert_eq!(r.fail_generation(1, &[], &closed), 1);
        assert!(!r.complete(&u1, true, None, None));
        assert_eq!(r.expire(Instant::now()), 1);
        let f = frames(&a).await;
        assert_eq!(f[0]["error"]["code"], "studio.upstream_closed");
        assert_eq!(f[1]["error"]["code"], "studio.request_timeout");
        let b = client(2);
        r.register(&b, "1", "status", 3, None, None).unwrap();
        r.register(&b, "2", "status", 3, None, None).unwrap();
        assert_eq!(b.inflight(), 2);
        r.forget(&b);
        assert_eq!(r.pending_count(), 0);
        assert_eq!(b.inflight(), 0, "a departure gives its slots back");
    }

    #[tokio::test]
    async fn outcomes_are_counted_by_method() {
        let r = Router::new(Duration::from_millis(0), Duration::from_secs(60), 8);
        let a = client(1);
        let ok = r.register(&a, "1", "health", 1, None, None).unwrap();
        let err = r.register(&a, "2", "status", 1, None, None).unwrap();
        r.register(&a, "3", "status", 1, None, None).unwrap();
        r.complete(&ok, true, None, None);
        r.complete(
            &err,
            false,
            None,
            Some(&raw(r#"{"code":"X","message":"m"}"#)),
        );
        r.expire(Instant::now());
        let counts: Vec<(String, &str, u64)> = r
            .metrics
            .counts()
            .into_iter()
            .map(|(m, o, n)| (m, o.as_str(), n))
            .collect();
        assert_eq!(
            counts,
            vec![
                ("health".into(), "ok", 1),
                ("status".into(), "error", 1),
                ("status".into(), "timeout", 1)
            ]
        );
    }

    #[test]
    fn inflight_cap() {
        let r = Router::new(Duration::from_secs(5), Duration::from_secs(60), 2);
        let a = client(1);
        r.register(&a, "1", "status", 1, None, None).unwrap();
        r.register(&a, "2", "status", 1, None, None).unwrap();
        let e = r.register(&a, "3", "status", 1, None, None).unwrap_err();
        assert_eq!(e.code, "studio.too_many_requests");
    }
}
