//! Dispatch: the one path every local request takes to the gateway —
//! WebSocket clients and `/v1/rpc` — with the same caps and metrics.
//!
//! A request is parsed once into a [`Request`] (its [`Kind`] and the params
//! the broker reads), checked against the client's access, then takes one
//! path: the broker's rules for its kind, then [`Session::send`] on the
//! session chosen for it. A requester is a [`Member`]; its
//! [`Registration`] owns its lifecycle.
//!
//! What the broker answers or refuses itself, because the gateway's state is
//! per connection (gateway-protocol.md §4.2):
//! - subscriptions are reference-counted in [`crate::sharing::subscriptions`]
//!   and every change is queued upstream while its lock is held (ordered);
//! - runs belong to the client that started them: every abort-like method
//!   ([`crate::policy::methods::ABORT_LIKE`]) of another client's run needs
//!   `operator.admin`, and so does a chat message the gateway reads as
//!   "stop" ([`crate::policy::stop`]);
//! - node-only methods are refused here: every refusal upstream would count
//!   toward the gateway's shared "repeated unauthorized calls" close.

mod member;
mod request;
#[cfg(test)]
mod sent_props;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use serde_json::json;
use serde_json::value::RawValue;

pub use member::{Book, Member, Registration};
pub use request::{Kind, Request, Subscription};

use crate::hub::{Client, ClientKind, Hub};
use crate::policy::stop::Touch;
use crate::protocol::frames::encode_res_ok;
use crate::protocol::{ErrorShape, StudioCode};
use crate::router::{Requester, Router, Settle};
use crate::sessions::narrower::Choice;
use crate::sessions::{Outbound, Session, Sessions};
use crate::sharing::runs::RunOwner;
use crate::sharing::subscriptions::Plan;
use crate::sharing::Sharing;

/// Subscription keys one client may hold at once (`sessions.subscribe`
/// counts as one); one more is answered `studio.too_many_requests`. The
/// gateway has no such cap, but it holds one connection's set; the broker
/// holds every client's.
pub const MAX_SUBSCRIPTIONS_PER_CLIENT: usize = 1024;

/// Runs a client may have recorded before its list is pruned of ended ones.
const RUN_BOOK_PRUNE_AT: usize = 64;

/// The dispatcher, shared by every local session and `/v1/rpc`.
#[derive(Debug)]
pub struct Dispatcher {
    hub: Arc<Hub>,
    router: Arc<Router>,
    sharing: Arc<Sharing>,
    sessions: Arc<Sessions>,
    /// The in-flight budget every `/v1/rpc` request shares (`max_inflight`).
    rpc_budget: Arc<AtomicUsize>,
}

impl Dispatcher {
    pub fn new(
        hub: Arc<Hub>,
        router: Arc<Router>,
        sharing: Arc<Sharing>,
        sessions: Arc<Sessions>,
    ) -> Self {
        Dispatcher {
            hub,
            router,
            sharing,
            sessions,
            rpc_budget: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A WebSocket (or SSE) client's registration: its own budget.
    pub fn register(self: &Arc<Self>, client: Arc<Client>) -> Registration {
        Registration::new(
            Arc::new(Member::new(Requester::new(client))),
            Arc::clone(self),
        )
    }

    /// One `/v1/rpc` request's registration: it spends the budget every
    /// `/v1/rpc` request shares, so opening more HTTP requests cannot
    /// exceed `max_inflight` (one shared budget: simple, and bounded however
    /// many connections are open).
    pub fn register_rpc(self: &Arc<Self>, client: Arc<Client>) -> Registration {
        let requester = Requester::with_shared_budget(
            client,
            Arc::clone(&self.rpc_budget),
            "/v1/rpc (all callers together)",
        );
        Registration::new(Arc::new(Member::new(requester)), Arc::clone(self))
    }

    /// `/v1/rpc` requests in flight (all callers together).
    pub fn rpc_inflight(&self) -> usize {
        self.rpc_budget.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Dispatches one request from `member`. An `Err` is the answer to send
    /// the member under its id; otherwise the answer reaches its queue later
    /// (or already did, for what the broker answers itself). Every broker
    /// (`studio.*`) `Err` says `details.sent: false`: nothing of it was
    /// queued for a gateway. A refusal in the gateway's own words (a missing
    /// scope, a node-only method) is left exactly as the gateway words it.
    pub fn dispatch(
        &self,
        member: &Arc<Member>,
        id: &str,
        method: &str,
        params: Option<&RawValue>,
    ) -> Result<(), ErrorShape> {
        self.dispatch_unsent(member, id, method, params)
            .map_err(|e| {
                if e.code.starts_with("studio.") {
                    e.or_sent(false)
                } else {
                    e
                }
            })
    }

    fn dispatch_unsent(
        &self,
        member: &Arc<Member>,
        id: &str,
        method: &str,
        params: Option<&RawValue>,
    ) -> Result<(), ErrorShape> {
        let request = Request::parse(id, method, params, &self.sharing.defaults());
        // What the gateway would refuse on a connection holding only this
        // client's scopes is refused here, before anything is forwarded.
        match member.client().access() {
            Some(access) => access.check_parsed(method, &request.parsed)?,
            None => {
                return Err(crate::policy::methods::missing_scope(
                    crate::policy::scopes::READ,
                    &[],
                ))
            }
        }
        let main = &self.sessions.main;
        if main.upstream.ready_generation().is_none() {
            let _ = main.upstream.nudge();
            self.router.metrics.record_refused(method);
            return Err(main.not_ready_error());
        }
        match &request.kind {
            Kind::Subscribe(sub) => self.subscribe(member, &request, sub),
            Kind::Unsubscribe(sub) => self.unsubscribe(member, &request, sub),
            Kind::StartRun {
                run_id,
                session_key,
                touch,
            } => {
                let queued;
                let mut params = request.params;
                match touch {
                    Touch::Takes => self.check_abort(member, None, session_key.as_deref())?,
                    Touch::Default
                        if !member.client().grant().is_admin()
                            && self
                                .sharing
                                .runs
                                .foreign_run_in(session_key.as_deref(), member.id()) =>
                    {
                        // The session's own mode would inject it into the
                        // other client's run: it waits behind it instead.
                        queued = queued_behind(&request.parsed);
                        params = queued.as_deref().or(params);
                    }
                    _ => {}
                }
                self.start_run(member, &request, params, run_id, session_key.clone())
            }
            Kind::Abort {
                run_id,
                session_key,
            } => {
                self.check_abort(member, run_id.as_deref(), session_key.as_deref())?;
                self.send(main, member, &request, None)
            }
            Kind::Plain => {
                let hello = main.upstream.hello();
                let choice = self.sessions.narrower.choose(
                    member.client().grant(),
                    hello.as_deref(),
                    method,
                    &member.narrower,
                    member.peer(),
                )?;
                match choice {
                    Choice::Main => self.send(main, member, &request, None),
                    Choice::Narrower(session) => self.send(&session, member, &request, None),
                }
            }
        }
    }

    /// The one send path: `request` onto `session`, a failure answered at once.
    fn send(
        &self,
        session: &Session,
        member: &Member,
        request: &Request<'_>,
        settle: Option<Settle>,
    ) -> Result<(), ErrorShape> {
        session
            .send(&self.router, outbound(member, request), settle)?
            .answer(&self.router);
        Ok(())
    }

    /// [`Dispatcher::send`] with the params the broker chose to forward.
    fn send_params(
        &self,
        session: &Session,
        member: &Member,
        request: &Request<'_>,
        params: Option<&RawValue>,
        settle: Option<Settle>,
    ) -> Result<(), ErrorShape> {
        let outbound = Outbound {
            params,
            ..outbound(member, request)
        };
        session
            .send(&self.router, outbound, settle)?
            .answer(&self.router);
        Ok(())
    }

    fn subscribe(
        &self,
        member: &Arc<Member>,
        request: &Request<'_>,
        sub: &Subscription,
    ) -> Result<(), ErrorShape> {
        let cid = member.id();
        let key = &sub.key;
        let mut st = self.sharing.subscriptions.lock();
        {
            let book = member.book();
            if !book.subs.contains(key) && book.subs.len() >= MAX_SUBSCRIPTIONS_PER_CLIENT {
                return Err(ErrorShape::studio(
                    StudioCode::TooManyRequests,
                    format!("this client already holds {MAX_SUBSCRIPTIONS_PER_CLIENT} subscriptions; unsubscribe some first"),
                ));
            }
        }
        let plan = st.subscribe(key, cid);
        member.book().subs.insert(key.clone());
        let Plan::Forward { gen } = plan else {
            member
                .client()
                .push_frame(encode_res_ok(request.id, &local_answer(sub, true)));
            return Ok(());
        };
        let sharing = Arc::clone(&self.sharing);
        let me = Arc::clone(member);
        let settle_key = key.clone();
        let settle: Settle = Box::new(move |ok| {
            let removed =
                sharing
                    .subscriptions
                    .lock()
                    .settle_subscribe(&settle_key, Some(cid), gen, ok);
            if removed {
                me.book().subs.remove(&settle_key);
            }
        });
        let deferred = match self.sessions.main.send_in_order(
            &self.router,
            outbound(member, request),
            Some(settle),
        ) {
            Ok(deferred) => deferred,
            Err(refused) => {
                if st.settle_subscribe(key, Some(cid), gen, false) {
                    member.book().subs.remove(key);
                }
                return Err(refused);
            }
        };
        drop(st);
        deferred.answer(&self.router);
        Ok(())
    }

    fn unsubscribe(
        &self,
        member: &Arc<Member>,
        request: &Request<'_>,
        sub: &Subscription,
    ) -> Result<(), ErrorShape> {
        let mut st = self.sharing.subscriptions.lock();
        let plan = st.unsubscribe(&sub.key, member.id());
        member.book().subs.remove(&sub.key);
        if plan == Plan::Answer {
            member
                .client()
                .push_frame(encode_res_ok(request.id, &local_answer(sub, false)));
            return Ok(());
        }
        let deferred =
            self.sessions
                .main
                .send_in_order(&self.router, outbound(member, request), None)?;
        drop(st);
        deferred.answer(&self.router);
        Ok(())
    }

    fn start_run(
        &self,
        member: &Arc<Member>,
        request: &Request<'_>,
        params: Option<&RawValue>,
        run_id: &str,
        session_key: Option<String>,
    ) -> Result<(), ErrorShape> {
        let main = &self.sessions.main;
        let cid = member.id();
        let owner = RunOwner {
            client_id: cid,
            session_key,
            tool_events: member
                .client()
                .tool_events
                .load(std::sync::atomic::Ordering::Relaxed),
        };
        if !self.sharing.runs.start(run_id, owner) {
            // A duplicate key: the gateway answers it (in_flight / cached).
            return self.send_params(main, member, request, params, None);
        }
        {
            let mut book = member.book();
            if book.runs.len() >= RUN_BOOK_PRUNE_AT {
                book.runs
                    .retain(|r| self.sharing.runs.owner(r) == Some(cid));
            }
            book.runs.insert(run_id.to_owned());
        }
        let sharing = Arc::clone(&self.sharing);
        let settle_run = run_id.to_owned();
        let settle: Settle = Box::new(move |ok| {
            if !ok {
                sharing.runs.end_if_owned(&settle_run, cid);
            }
        });
        self.send_params(main, member, request, params, Some(settle))
            .inspect_err(|_| self.sharing.runs.end_if_owned(run_id, cid))
    }

    /// An abort-like request of a run another local client started needs
    /// admin: by run id, or, session-wide, when another client's run is live
    /// in that session.
    fn check_abort(
        &self,
        member: &Member,
        run_id: Option<&str>,
        session_key: Option<&str>,
    ) -> Result<(), ErrorShape> {
        if member.client().grant().is_admin() {
            return Ok(());
        }
        let cid = member.id();
        let foreign = match run_id {
            Some(run_id) => self.sharing.runs.owner(run_id).is_some_and(|o| o != cid),
            None => self.sharing.runs.foreign_run_in(session_key, cid),
        };
        if foreign {
            return Err(ErrorShape::studio(
                StudioCode::Forbidden,
                "this run was started by another local client; only that client or one connected with operator.admin may stop or steer it",
            ));
        }
        Ok(())
    }

    /// Releases everything a requester holds (its [`Registration`] dropped).
    fn release(&self, member: &Member) {
        let cid = member.id();
        self.hub.remove(cid);
        self.router.forget(&member.requester);
        if let Some(grant) = member.narrower.get() {
            self.sessions.narrower.release(grant);
        }
        let (keys, runs) = {
            let mut book = member.book();
            (
                book.subs.drain().collect::<Vec<_>>(),
                book.runs.drain().collect::<Vec<_>>(),
            )
        };
        // A `/v1/rpc` request ends with its answer, not with its run: the
        // run stays owned until it ends (only `operator.admin` may stop it
        // then), as the gateway keeps running it.
        if member.client().kind != ClientKind::Rpc {
            for run in runs {
                self.sharing.runs.end_if_owned(&run, cid);
            }
        }
        if keys.is_empty() {
            return;
        }
        let main = &self.sessions.main;
        let mut st = self.sharing.subscriptions.lock();
        let releases = st.release(cid, keys);
        // Without a session the gateway's state is gone already.
        if main.upstream.ready_generation().is_none() {
            return;
        }
        let hello = main.upstream.hello();
        // A gateway without the unsubscribe method (2026.9.6 has no
        // `sessions.unsubscribe`) is not sent one: it would only answer
        // "unknown method"; its subscription ends with the session.
        let deferred: Vec<_> = releases
            .iter()
            .filter(|key| {
                let method = key.request(false).0;
                hello.as_ref().is_none_or(|h| h.supports(method))
            })
            .map(|key| {
                self.sessions
                    .own
                    .subscription_change(&mut st, main, "release", key, false, None)
            })
            .collect();
        drop(st);
        for d in deferred {
            d.answer(&self.router);
        }
    }
}

/// The broker's own answer to a subscription change it settles itself.
fn local_answer(sub: &Subscription, subscribed: bool) -> serde_json::Value {
    match &sub.asked {
        Some(k) => json!({"subscribed": subscribed, "key": k}),
        None => json!({"subscribed": subscribed}),
    }
}

/// A `chat.send`'s params with `queueMode: "followup"`: queued behind the
/// session's running run rather than injected into it.
fn queued_behind(parsed: &serde_json::Value) -> Option<Box<RawValue>> {
    let mut params = parsed.as_object()?.clone();
    params.insert("queueMode".into(), json!("followup"));
    serde_json::value::to_raw_value(&params).ok()
}

fn outbound<'a>(member: &'a Member, request: &'a Request<'a>) -> Outbound<'a> {
    Outbound {
        requester: &member.requester,
        local_id: request.id,
        method: request.method,
        params: request.params,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;
    use tokio::sync::watch;

    use super::*;
    use crate::config::Settings;
    use crate::hub::{Client, QueueLimits};
    use crate::upstream::Status;

    struct Fixture {
        dispatcher: Arc<Dispatcher>,
        router: Arc<Router>,
        queue: crate::upstream::FakeQueue,
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
        let settings = Settings::new("/nonexistent.sock");
        let (upstream, seed) = crate::upstream::Upstream::new(&settings);
        let (status, queue) = seed.fake_ready(1);
        let sessions = Arc::new(Sessions::for_tests(&settings, &hub, &router, upstream));
        let dispatcher = Arc::new(Dispatcher::new(hub, Arc::clone(&router), sharing, sessions));
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

    /// Two clients; the first has started `run-1` in the main session.
    fn a_run_of_the_first(f: &Fixture) -> (Registration, Registration) {
        let (a, b) = (client(f), client(f));
        let params = RawValue::from_string(
            r#"{"idempotencyKey":"run-1","sessionKey":"main","message":"hi"}"#.into(),
        )
        .unwrap();
        f.dispatcher
            .dispatch(a.member(), "1", "chat.send", Some(&params))
            .unwrap();
        (a, b)
    }

    #[test]
    fn aborting_another_clients_run_needs_admin() {
        let mut f = fixture(8);
        let (a, b) = a_run_of_the_first(&f);
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
    fn every_abort_like_method_has_the_ownership_rule() {
        let mut f = fixture(8);
        let (_a, b) = a_run_of_the_first(&f);
        for (method, params) in [
            ("sessions.abort", r#"{"key":"main"}"#),
            ("sessions.abort", r#"{"key":"main","runId":"run-1"}"#),
            (
                "sessions.steer",
                r#"{"key":"agent:main:main","message":"x"}"#,
            ),
        ] {
            let raw = RawValue::from_string(params.into()).unwrap();
            let e = f
                .dispatcher
                .dispatch(b.member(), "2", method, Some(&raw))
                .unwrap_err();
            assert_eq!(e.code, "studio.forbidden", "{method} {params}");
        }
        assert_eq!(methods(&sent(&mut f)), ["chat.send"]);
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
