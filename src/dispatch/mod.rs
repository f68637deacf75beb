//! Dispatch: the one path every request takes to the gateway — WebSocket
//! clients, `/v1/rpc`, and the broker's own requests (subscription releases,
//! re-subscribes after a reconnect). Same caps, same metrics, real ids.
//!
//! A requester is a [`Member`]; its [`Registration`] owns its lifecycle.
//! What the broker answers or refuses itself, because the gateway's state is
//! per connection (gateway-protocol.md §4.2):
//! - subscriptions are reference-counted in [`crate::sharing::subscriptions`]
//!   and every change is queued upstream while its lock is held (ordered);
//! - runs belong to the client that started them (`chat.abort` of another
//!   client's run needs `operator.admin`);
//! - node-only methods are refused here: every refusal upstream would count
//!   toward the gateway's shared "repeated unauthorized calls" close.

mod member;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

pub use member::{Book, Member, Registration};

use crate::hub::{ClientKind, Hub, Outgoing};
use crate::protocol::frames::{encode_req, encode_res_ok};
use crate::protocol::{ErrorShape, StudioCode};
use crate::router::{Router, Settle};
use crate::sharing::runs::RunOwner;
use crate::sharing::subscriptions::{Plan, SubscriptionState};
use crate::sharing::{Sharing, SubKey};
use crate::upstream::Upstream;

/// Subscription keys one client may hold at once (`sessions.subscribe`
/// counts as one); one more is answered `studio.too_many_requests`. The
/// gateway has no such cap, but it holds one connection's set; the broker
/// holds every client's.
pub const MAX_SUBSCRIPTIONS_PER_CLIENT: usize = 1024;

/// Runs a client may have recorded before its list is pruned of ended ones.
const RUN_BOOK_PRUNE_AT: usize = 64;

/// Methods only a `role:"node"` connection may call.
/// A request's params as a value (`null` when absent or not JSON): only
/// for the few methods the broker reads params of.
fn parse_params(params: Option<&RawValue>) -> Value {
    params
        .and_then(|p| serde_json::from_str(p.get()).ok())
        .unwrap_or(Value::Null)
}

fn param_str<'a>(params: &'a Value, key: &str) -> Option<&'a str> {
    params
        .get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// A request registered and queued, whose failure must be answered after
/// the subscription lock is let go (answering runs its settle, which takes it).
type Deferred = Option<(String, ErrorShape)>;

/// How the broker's own requests fared (shown in `/v1/state`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct OwnRequests {
    pub sent: u64,
    pub failed: u64,
    /// The last failure: the request (`<purpose>:<method>[:<key>]`) and the error.
    pub last_failure: Option<Value>,
}

/// The dispatcher, shared by every session, `/v1/rpc` and the connector.
#[derive(Debug)]
pub struct Dispatcher {
    hub: Arc<Hub>,
    router: Arc<Router>,
    sharing: Arc<Sharing>,
    upstream: Upstream,
    /// The in-flight budget every `/v1/rpc` request shares (`max_inflight`).
    rpc_budget: Arc<AtomicUsize>,
    /// The broker's own requester.
    broker: Arc<Member>,
    own: Mutex<OwnRequests>,
}

impl Dispatcher {
    pub fn new(
        hub: Arc<Hub>,
        router: Arc<Router>,
        sharing: Arc<Sharing>,
        upstream: Upstream,
    ) -> Self {
        let broker = Arc::new(Member::new(hub.new_client_of_kind(ClientKind::Rpc)));
        Dispatcher {
            hub,
            router,
            sharing,
            upstream,
            rpc_budget: Arc::new(AtomicUsize::new(0)),
            broker,
            own: Mutex::new(OwnRequests::default()),
        }
    }

    /// A WebSocket (or SSE) client's registration: its own budget.
    pub fn register(self: &Arc<Self>, client: Arc<crate::hub::Client>) -> Registration {
        Registration::new(Arc::new(Member::new(client)), Arc::clone(self))
    }

    /// One `/v1/rpc` request's registration: it spends the budget every
    /// `/v1/rpc` request shares, so opening more HTTP requests cannot
    /// exceed `max_inflight` (one shared budget: simple, and bounded however
    /// many connections are open).
    pub fn register_rpc(self: &Arc<Self>, client: Arc<crate::hub::Client>) -> Registration {
        let member = Member::with_shared_budget(
            client,
            Arc::clone(&self.rpc_budget),
            "/v1/rpc (all callers together)",
        );
        Registration::new(Arc::new(member), Arc::clone(self))
    }

    /// How the broker's own requests fared.
    pub fn own_requests(&self) -> OwnRequests {
        self.own.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `/v1/rpc` requests in flight (all callers together).
    pub fn rpc_inflight(&self) -> usize {
        self.rpc_budget.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Dispatches one request from `member`. An `Err` is the answer to send
    /// the member under its id; otherwise the answer reaches its queue later
    /// (or already did, for what the broker answers itself).
    pub fn dispatch(
        &self,
        member: &Arc<Member>,
        id: &str,
        method: &str,
        params: Option<&RawValue>,
    ) -> Result<(), ErrorShape> {
        // What the gateway would refuse on a connection holding only this
        // client's scopes is refused here, before anything is forwarded.
        match member.client.access() {
            Some(access) => access.check(method, params)?,
            None => {
                return Err(crate::policy::methods::missing_scope(
                    crate::policy::scopes::READ,
                    &[],
                ))
            }
        }
        let Some(generation) = self.upstream.ready_generation() else {
            let _ = self.upstream.nudge();
            self.router.metrics.record_refused(method);
            return Err(self.upstream.status().not_ready_error());
        };
        match method {
            "sessions.subscribe"
            | "sessions.unsubscribe"
            | "sessions.messages.subscribe"
            | "sessions.messages.unsubscribe" => {
                self.subscription(member, id, method, params, generation)
            }
            "chat.send" | "agent" => self.start_run(member, id, method, params, generation),
            "chat.abort" => {
                self.check_abort(member, params)?;
                self.forward(member, id, method, params, generation, None)
            }
            _ => self.forward(member, id, method, params, generation, None),
        }
    }

    /// Registers and queues a request, answering a failure at once.
    fn forward(
        &self,
        member: &Arc<Member>,
        id: &str,
        method: &str,
        params: Option<&RawValue>,
        generation: u64,
        settle: Option<Settle>,
    ) -> Result<(), ErrorShape> {
        let deferred = self.queue(member, id, method, params, generation, settle)?;
        self.answer_deferred(deferred);
        Ok(())
    }

    /// Registers a request and queues it upstream without waiting. A refusal
    /// before registration is returned (its settle is dropped unrun); a
    /// failure after it is returned as [`Deferred`] for the caller to answer.
    fn queue(
        &self,
        member: &Arc<Member>,
        id: &str,
        method: &str,
        params: Option<&RawValue>,
        generation: u64,
        settle: Option<Settle>,
    ) -> Result<Deferred, ErrorShape> {
        let upstream_id = self
            .router
            .register(member, id, method, generation, settle)?;
        let text = encode_req(&upstream_id, method, params);
        self.router.tap.outbound(&text);
        if let Err(error) = self.upstream.try_send(generation, text) {
            return Ok(Some((upstream_id, error)));
        }
        // If the session ended meanwhile, the request may never be written:
        // fail it now rather than at its deadline (a no-op if failed already).
        if self.upstream.ready_generation() != Some(generation) {
            return Ok(Some((
                upstream_id,
                self.upstream.status().not_ready_error(),
            )));
        }
        Ok(None)
    }

    fn answer_deferred(&self, deferred: Deferred) {
        if let Some((upstream_id, error)) = deferred {
            self.router.fail(&upstream_id, &error);
        }
    }

    fn subscription(
        &self,
        member: &Arc<Member>,
        id: &str,
        method: &str,
        params: Option<&RawValue>,
        generation: u64,
    ) -> Result<(), ErrorShape> {
        let parsed = parse_params(params);
        let subscribe = !method.ends_with("unsubscribe");
        let (key, asked) = if method.starts_with("sessions.messages.") {
            let Some(asked) = param_str(&parsed, "key") else {
                // Let the gateway word the schema error.
                return self.forward(member, id, method, params, generation, None);
            };
            (
                SubKey::Messages(self.sharing.canonical(asked)),
                Some(asked.to_owned()),
            )
        } else {
            (SubKey::Sessions, None)
        };
        let local_answer = |subscribed: bool| match &asked {
            Some(k) => json!({"subscribed": subscribed, "key": k}),
            None => json!({"subscribed": subscribed}),
        };
        let cid = member.id();
        let mut st = self.sharing.subscriptions.lock();
        let deferred = if subscribe {
            {
                let book = member.book();
                if !book.subs.contains(&key) && book.subs.len() >= MAX_SUBSCRIPTIONS_PER_CLIENT {
                    return Err(ErrorShape::studio(
                        StudioCode::TooManyRequests,
                        format!("this client already holds {MAX_SUBSCRIPTIONS_PER_CLIENT} subscriptions; unsubscribe some first"),
                    ));
                }
            }
            let plan = st.subscribe(&key, cid);
            member.book().subs.insert(key.clone());
            let Plan::Forward { gen } = plan else {
                member
                    .client
                    .push_frame(encode_res_ok(id, &local_answer(true)));
                return Ok(());
            };
            let sharing = Arc::clone(&self.sharing);
            let me = Arc::clone(member);
            let settle_key = key.clone();
            let settle: Settle = Box::new(move |ok| {
                let mut st = sharing.subscriptions.lock();
                st.settle_subscribe(&settle_key, cid, gen, ok);
                if !ok {
                    me.book().subs.remove(&settle_key);
                }
            });
            match self.queue(member, id, method, params, generation, Some(settle)) {
                Ok(deferred) => deferred,
                Err(refused) => {
                    st.settle_subscribe(&key, cid, gen, false);
                    member.book().subs.remove(&key);
                    return Err(refused);
                }
            }
        } else {
            let plan = st.unsubscribe(&key, cid);
            member.book().subs.remove(&key);
            if plan == Plan::Answer {
                member
                    .client
                    .push_frame(encode_res_ok(id, &local_answer(false)));
                return Ok(());
            }
            self.queue(member, id, method, params, generation, None)?
        };
        drop(st);
        self.answer_deferred(deferred);
        Ok(())
    }

    fn start_run(
        &self,
        member: &Arc<Member>,
        id: &str,
        method: &str,
        params: Option<&RawValue>,
        generation: u64,
    ) -> Result<(), ErrorShape> {
        let parsed = parse_params(params);
        let Some(run_id) = param_str(&parsed, "idempotencyKey").map(str::to_owned) else {
            return self.forward(member, id, method, params, generation, None);
        };
        let cid = member.id();
        let owner = RunOwner {
            client_id: cid,
            session_key: param_str(&parsed, "sessionKey").map(|k| self.sharing.canonical(k)),
            tool_events: member
                .client
                .tool_events
                .load(std::sync::atomic::Ordering::Relaxed),
        };
        if !self.sharing.runs.start(&run_id, owner) {
            // A duplicate key: the gateway answers it (in_flight / cached).
            return self.forward(member, id, method, params, generation, None);
        }
        {
            let mut book = member.book();
            if book.runs.len() >= RUN_BOOK_PRUNE_AT {
                book.runs
                    .retain(|r| self.sharing.runs.owner(r) == Some(cid));
            }
            book.runs.insert(run_id.clone());
        }
        let sharing = Arc::clone(&self.sharing);
        let settle_run = run_id.clone();
        let settle: Settle = Box::new(move |ok| {
            if !ok {
                sharing.runs.end_if_owned(&settle_run, cid);
            }
        });
        match self.queue(member, id, method, params, generation, Some(settle)) {
            Ok(deferred) => {
                self.answer_deferred(deferred);
                Ok(())
            }
            Err(refused) => {
                self.sharing.runs.end_if_owned(&run_id, cid);
                Err(refused)
            }
        }
    }

    /// `chat.abort` of a run another local client started needs admin.
    fn check_abort(&self, member: &Member, params: Option<&RawValue>) -> Result<(), ErrorShape> {
        if member.client.grant().is_admin() {
            return Ok(());
        }
        let parsed = parse_params(params);
        let cid = member.id();
        let foreign = match param_str(&parsed, "runId") {
            Some(run_id) => self.sharing.runs.owner(run_id).is_some_and(|o| o != cid),
            None => {
                let key = param_str(&parsed, "sessionKey").map(|k| self.sharing.canonical(k));
                self.sharing.runs.foreign_run_in(key.as_deref(), cid)
            }
        };
        if foreign {
            return Err(ErrorShape::studio(
                StudioCode::Forbidden,
                "this run was started by another local client; only that client or one connected with operator.admin may abort it",
            ));
        }
        Ok(())
    }

    /// Queues one of the broker's own requests (under the subscription lock,
    /// so it keeps its place among subscription changes).
    fn own_request_locked(
        &self,
        _st: &mut SubscriptionState,
        purpose: &str,
        key: &SubKey,
        subscribe: bool,
        generation: u64,
        settle: Option<Settle>,
    ) -> Deferred {
        let (method, params) = key.request(subscribe);
        let raw = serde_json::value::to_raw_value(&params).ok();
        let label = match key {
            SubKey::Sessions => format!("{purpose}:{method}"),
            SubKey::Messages(k) => format!("{purpose}:{method}:{k}"),
        };
        self.own.lock().unwrap_or_else(|p| p.into_inner()).sent += 1;
        match self.queue(
            &self.broker,
            &label,
            method,
            raw.as_deref(),
            generation,
            settle,
        ) {
            Ok(deferred) => deferred,
            Err(refused) => {
                self.record_own_failure(
                    &label,
                    &serde_json::to_value(&refused).unwrap_or(Value::Null),
                );
                None
            }
        }
    }

    fn record_own_failure(&self, label: &str, error: &Value) {
        tracing::warn!(request = label, error = %error, "a request the broker sent on its own behalf failed");
        let mut own = self.own.lock().unwrap_or_else(|p| p.into_inner());
        own.failed += 1;
        own.last_failure = Some(json!({"request": label, "error": error}));
    }

    /// A new upstream session (`generation`): re-issues every held
    /// subscription before any client request can reach it.
    pub fn resubscribe(&self, generation: u64) {
        let mut st = self.sharing.subscriptions.lock();
        let mut deferred = Vec::new();
        for (key, gen) in st.resubscribe() {
            let sharing = Arc::clone(&self.sharing);
            let settle_key = key.clone();
            let settle: Settle = Box::new(move |ok| {
                sharing
                    .subscriptions
                    .lock()
                    .settle_subscribe(&settle_key, 0, gen, ok);
            });
            deferred.push(self.own_request_locked(
                &mut st,
                "resubscribe",
                &key,
                true,
                generation,
                Some(settle),
            ));
        }
        drop(st);
        for d in deferred {
            self.answer_deferred(d);
        }
    }

    /// Releases everything a requester holds (its [`Registration`] dropped).
    fn release(&self, member: &Member) {
        let cid = member.id();
        self.hub.remove(cid);
        self.router.forget(member);
        let (keys, runs) = {
            let mut book = member.book();
            (
                book.subs.drain().collect::<Vec<_>>(),
                book.runs.drain().collect::<Vec<_>>(),
            )
        };
        for run in runs {
            self.sharing.runs.end_if_owned(&run, cid);
        }
        if keys.is_empty() {
            return;
        }
        let mut st = self.sharing.subscriptions.lock();
        let releases = st.release(cid, keys);
        // Without a session the gateway's state is gone already.
        let Some(generation) = self.upstream.ready_generation() else {
            return;
        };
        // A gateway without the unsubscribe method (2026.9.6 has no
        // `sessions.unsubscribe`) is not sent one: it would only answer
        // "unknown method"; its subscription ends with the session.
        let hello = self.upstream.status().hello;
        let deferred: Vec<Deferred> = releases
            .iter()
            .filter(|key| {
                let method = key.request(false).0;
                hello.as_ref().is_none_or(|h| h.supports(method))
            })
            .map(|key| self.own_request_locked(&mut st, "release", key, false, generation, None))
            .collect();
        drop(st);
        for d in deferred {
            self.answer_deferred(d);
        }
    }

    /// Reads the answers to the broker's own requests until `cancel`:
    /// failures are logged and kept for `/v1/state`.
    pub async fn drain_own_answers(self: Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        loop {
            let batch = tokio::select! {
                _ = cancel.cancelled() => return,
                batch = self.broker.client.next_batch() => batch,
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
                        self.record_own_failure(&res.id, &res.error.unwrap_or(Value::Null));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;
    use tokio::sync::{mpsc, watch};

    use super::*;
    use crate::config::Settings;
    use crate::hub::{Client, QueueLimits};
    use crate::upstream::{Outbound, Status};

    struct Fixture {
        dispatcher: Arc<Dispatcher>,
        router: Arc<Router>,
        queue: mpsc::Receiver<Outbound>,
        _status: watch::Sender<Status>,
    }

    fn fixture(max_inflight: usize) -> Fixture {
        let limits = QueueLimits {
            soft_bytes: 1 << 20,
            hard_bytes: 1 << 23,
            grace: Duration::from_secs(10),
        };
        let hub = Arc::new(Hub::new(limits, 16));
        let router = Arc::new(Router::new(
            Duration::from_secs(5),
            Duration::from_secs(5),
            max_inflight,
        ));
        let sharing = Arc::new(Sharing::new());
        let (upstream, seed) = Upstream::new(&Settings::new("/nonexistent.sock"));
        let (status, queue) = seed.fake_ready(1);
        let dispatcher = Arc::new(Dispatcher::new(hub, Arc::clone(&router), sharing, upstream));
        Fixture {
            dispatcher,
            router,
            queue,
            _status: status,
        }
    }

    /// Read and write, not admin (as a typical front end).
    fn access() -> crate::policy::Access {
        crate::policy::Access {
            grant: crate::policy::Grant::new(["operator.read", "operator.write"]),
            socket: Arc::new(crate::policy::SocketPolicy::main("/x".into())),
        }
    }

    fn client(f: &Fixture) -> Registration {
        let client = f.dispatcher.hub.new_client();
        client.set_access(access());
        f.dispatcher.register(client)
    }

    /// The methods queued upstream so far, in order, with their ids.
    fn sent(f: &mut Fixture) -> Vec<(String, String)> {
        let mut out = Vec::new();
        while let Ok(o) = f.queue.try_recv() {
            let v: Value = serde_json::from_str(&o.text).unwrap();
            out.push((
                v["method"].as_str().unwrap().to_owned(),
                v["id"].as_str().unwrap().to_owned(),
            ));
        }
        out
    }

    fn methods(sent: &[(String, String)]) -> Vec<&str> {
        sent.iter().map(|(m, _)| m.as_str()).collect()
    }

    fn ok(f: &Fixture, upstream_id: &str) {
        let payload = RawValue::from_string("{}".into()).unwrap();
        assert!(f.router.complete(upstream_id, true, Some(&payload), None));
    }

    #[test]
    fn a_departure_queues_its_release_before_a_later_subscribe() {
        let mut f = fixture(8);
        let a = client(&f);
        f.dispatcher
            .dispatch(a.member(), "1", "sessions.subscribe", None)
            .unwrap();
        let first = sent(&mut f);
        assert_eq!(methods(&first), ["sessions.subscribe"]);
        ok(&f, &first[0].1);
        // Confirmed: a second subscriber is answered locally.
        let b = client(&f);
        f.dispatcher
            .dispatch(b.member(), "1", "sessions.subscribe", None)
            .unwrap();
        assert!(sent(&mut f).is_empty());
        drop(a);
        drop(b);
        let c = client(&f);
        f.dispatcher
            .dispatch(c.member(), "1", "sessions.subscribe", None)
            .unwrap();
        assert_eq!(
            methods(&sent(&mut f)),
            ["sessions.unsubscribe", "sessions.subscribe"],
            "the release is queued before the later subscribe"
        );
    }

    #[test]
    fn a_departure_with_a_pending_subscribe_still_unsubscribes() {
        let mut f = fixture(8);
        let a = client(&f);
        f.dispatcher
            .dispatch(
                a.member(),
                "1",
                "sessions.messages.subscribe",
                Some(&RawValue::from_string(r#"{"key":"main"}"#.into()).unwrap()),
            )
            .unwrap();
        drop(a);
        let queued = sent(&mut f);
        assert_eq!(
            methods(&queued),
            [
                "sessions.messages.subscribe",
                "sessions.messages.unsubscribe"
            ]
        );
        assert_eq!(
            f.router.pending_count(),
            1,
            "only the broker's own release waits"
        );
        assert_eq!(f.dispatcher.sharing.subscriptions.counts().1.len(), 0);
    }

    #[test]
    fn refusals_before_anything_is_sent() {
        let mut f = fixture(1);
        let a = client(&f);
        let node = f
            .dispatcher
            .dispatch(a.member(), "1", "node.event", None)
            .unwrap_err();
        assert_eq!(node.code, "INVALID_REQUEST");
        f.dispatcher
            .dispatch(a.member(), "2", "status", None)
            .unwrap();
        let capped = f
            .dispatcher
            .dispatch(a.member(), "3", "status", None)
            .unwrap_err();
        assert_eq!(capped.code, "studio.too_many_requests");
        // A refused subscribe leaves no subscription behind.
        let refused = f
            .dispatcher
            .dispatch(a.member(), "4", "sessions.subscribe", None)
            .unwrap_err();
        assert_eq!(refused.code, "studio.too_many_requests");
        assert_eq!(f.dispatcher.sharing.subscriptions.counts().0, 0);
        assert_eq!(methods(&sent(&mut f)), ["status"]);
    }

    #[test]
    fn aborting_another_clients_run_needs_admin() {
        let mut f = fixture(8);
        let (a, b) = (client(&f), client(&f));
        let params = RawValue::from_string(
            r#"{"idempotencyKey":"run-1","sessionKey":"main","message":"hi"}"#.into(),
        )
        .unwrap();
        f.dispatcher
            .dispatch(a.member(), "1", "chat.send", Some(&params))
            .unwrap();
        let abort =
            RawValue::from_string(r#"{"runId":"run-1","sessionKey":"main"}"#.into()).unwrap();
        let e = f
            .dispatcher
            .dispatch(b.member(), "2", "chat.abort", Some(&abort))
            .unwrap_err();
        assert_eq!(e.code, "studio.forbidden");
        f.dispatcher
            .dispatch(a.member(), "3", "chat.abort", Some(&abort))
            .unwrap();
        drop(a);
        assert!(
            f.dispatcher.sharing.runs.is_empty(),
            "a departure ends its runs"
        );
        assert_eq!(methods(&sent(&mut f)), ["chat.send", "chat.abort"]);
    }

    #[test]
    fn rpc_requests_share_one_budget() {
        let mut f = fixture(2);
        let rpcs: Vec<Registration> = (0..3)
            .map(|_| {
                let client = Client::new(
                    100,
                    QueueLimits {
                        soft_bytes: 1 << 20,
                        hard_bytes: 1 << 23,
                        grace: Duration::from_secs(10),
                    },
                );
                client.set_access(access());
                f.dispatcher.register_rpc(Arc::new(client))
            })
            .collect();
        f.dispatcher
            .dispatch(rpcs[0].member(), "h", "status", None)
            .unwrap();
        f.dispatcher
            .dispatch(rpcs[1].member(), "h", "status", None)
            .unwrap();
        let e = f
            .dispatcher
            .dispatch(rpcs[2].member(), "h", "status", None)
            .unwrap_err();
        assert_eq!(e.code, "studio.too_many_requests");
        assert_eq!(f.dispatcher.rpc_inflight(), 2);
        drop(rpcs);
        assert_eq!(f.dispatcher.rpc_inflight(), 0);
        assert_eq!(sent(&mut f).len(), 2);
    }
}
