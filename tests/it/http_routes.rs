//! The plain-HTTP API on the socket: `/v1/state`, `/v1/rpc`, `/metrics`,
//! and the answers for wrong methods and paths.

use std::collections::HashMap;
use std::time::Duration;

use crate::http_api::*;
use crate::support::*;
use serde_json::{json, Value};

#[tokio::test]
async fn state_is_one_document_with_upstream_snapshot_clients_and_cursor() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let (_ws, hello) = h.connected().await;
    let _sse = open_events(&h.socket(), "/v1/events", &[]).await.unwrap();
    let (status, _, text) = request_text(&h.socket(), "GET", "/v1/state", b"").await;
    assert_eq!(status, 200);
    assert!(!text.contains("test-token"), "never the token: {text}");
    assert!(
        !text.contains("deviceToken"),
        "never the device token: {text}"
    );
    let s: Value = serde_json::from_str(&text).unwrap();
    assert!(s["epoch"].as_str().is_some_and(|e| !e.is_empty()));
    assert!(s["newest_seq"].is_u64() && s["oldest_seq"].is_u64(), "{s}");
    let up = &s["upstream"];
    assert_eq!(up["phase"], "ready");
    assert_eq!(up["server_version"], "2026.9.6-mock");
    assert_eq!(up["protocol"], 4);
    assert_eq!(up["lost_scopes"], json!([]));
    assert!(up["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x == "operator.admin"));
    assert_eq!(up["last_error"], Value::Null);
    assert_eq!(up["url"], h.gw.url().as_str());
    assert_eq!(
        s["snapshot"]["stateVersion"], hello["snapshot"]["stateVersion"],
        "the same snapshot clients are greeted with"
    );
    assert!(s["snapshot"]["sessionDefaults"].is_object(), "{s}");
    let kinds: Vec<&str> = s["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap())
        .collect();
    assert!(kinds.contains(&"ws") && kinds.contains(&"sse"), "{kinds:?}");
    for c in s["clients"].as_array().unwrap() {
        assert!(c["queue_bytes"].is_u64() && c["drops"].is_u64(), "{c}");
    }
    assert_eq!(s["limits"]["replay_max_events"], 10_000);
    assert_eq!(s["limits"]["sse_keepalive_ms"], 15_000);
}

#[tokio::test]
async fn state_reports_lost_scopes_and_the_last_error() {
    let faults = Faults {
        grant_scopes: Some(vec!["operator.read".into()]),
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |_| {}).await;
    let s = until_ready(&h.socket()).await;
    let lost = s["upstream"]["lost_scopes"].as_array().unwrap();
    assert!(lost.iter().any(|x| x == "operator.admin"), "{s}");
    let (broker, _dir) = broker_only(|_| {}).await;
    let s = eventually_async("an upstream last_error", || async {
        let s = state(broker.socket_path()).await;
        if s["upstream"]["last_error"].is_object() {
            Ok(s)
        } else {
            Err(s)
        }
    })
    .await;
    assert_eq!(s["upstream"]["last_error"]["code"], "studio.upstream_error");
    assert_eq!(s["snapshot"], Value::Null, "no gateway snapshot yet");
}

#[tokio::test]
async fn rpc_answers_with_the_gateway_res_frame() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let (status, res) = rpc(&h.socket(), r#"{"method":"health","params":{}}"#).await;
    assert_eq!(status, 200);
    assert_eq!(
        (&res["type"], &res["id"], &res["ok"]),
        (&json!("res"), &json!("http"), &json!(true))
    );
    assert!(res["payload"].is_object(), "{res}");
    let (status, res) = rpc(&h.socket(), r#"{"method":"no.such.method","id":"mine"}"#).await;
    assert_eq!(
        status, 200,
        "the gateway answered: the request itself went through"
    );
    assert_eq!((&res["id"], &res["ok"]), (&json!("mine"), &json!(false)));
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    // agent answers twice: the first answer by default, the final one on request.
    let (_, first) = rpc(
        &h.socket(),
        r#"{"method":"agent","params":{"message":"hi","idempotencyKey":"run-a"}}"#,
    )
    .await;
    assert_eq!(first["payload"]["status"], "accepted", "{first}");
    let (_, last) = rpc(
        &h.socket(),
        r#"{"method":"agent","params":{"message":"hi","idempotencyKey":"run-b"},"expectFinal":true}"#,
    )
    .await;
    assert_eq!(last["payload"]["status"], "ok", "{last}");
    assert_eq!(
        h.broker.ctx().router.pending_count(),
        0,
        "nothing left behind"
    );
}

#[tokio::test]
async fn rpc_refuses_bad_input_with_a_clear_error() {
    let h = start_with(mock_config(), |s| s.limits.max_frame_bytes = 1024).await;
    until_ready(&h.socket()).await;
    let cases: [(&str, u16, &str); 6] = [
        ("{not json", 400, "invalid JSON body"),
        (r#"{"params":{}}"#, 400, "missing field `method`"),
        (
            r#"{"method":"health","parms":{}}"#,
            400,
            "unknown field `parms`",
        ),
        (r#"{"method":""}"#, 400, "method must be a non-empty string"),
        (
            r#"{"method":"connect","params":{}}"#,
            400,
            "connect is handled by the broker",
        ),
        (r#"[1,2]"#, 400, "invalid JSON body"),
    ];
    for (body, want_status, want_text) in cases {
        let (status, res) = rpc(&h.socket(), body).await;
        assert_eq!(status, want_status, "{body}: {res}");
        assert_eq!(res["ok"], false);
        assert_eq!(res["error"]["code"], "INVALID_REQUEST", "{body}");
        let message = res["error"]["message"].as_str().unwrap();
        assert!(message.contains(want_text), "{body}: {message}");
    }
    let big = format!(
        r#"{{"method":"health","params":{{"pad":"{}"}}}}"#,
        "x".repeat(2000)
    );
    let (status, res) = rpc(&h.socket(), &big).await;
    assert_eq!(status, 413, "{res}");
    assert!(res["error"]["message"]
        .as_str()
        .unwrap()
        .contains("1024 bytes"));
    assert_eq!(h.gw.stats().requests, 0, "nothing bad reached the gateway");
    let (status, res) = rpc(&h.socket(), r#"{"method":"health"}"#).await;
    assert_eq!(
        (status, &res["ok"]),
        (200, &json!(true)),
        "the broker is fine"
    );
}

#[tokio::test]
async fn rpc_while_the_upstream_is_down_or_lost_is_503() {
    let (broker, _dir) = broker_only(|s| s.limits.connect_wait = Duration::from_millis(50)).await;
    let (status, res) = rpc(broker.socket_path(), r#"{"method":"health"}"#).await;
    assert_eq!(status, 503, "{res}");
    assert!(
        res["error"]["code"]
            .as_str()
            .unwrap()
            .starts_with("studio.upstream_"),
        "{res}"
    );
    assert_eq!(res["error"]["retryable"], true);
    let (_, _, metrics) = request_text(broker.socket_path(), "GET", "/metrics", b"").await;
    assert!(
        metrics
            .contains("clawmux_requests_total{method=\"health\",outcome=\"upstream_closed\"} 1\n"),
        "refusals are counted: {metrics}"
    );

    let faults = Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |_| {}).await;
    until_ready(&h.socket()).await;
    let socket = h.socket();
    let call = tokio::spawn(async move { rpc(&socket, r#"{"method":"status"}"#).await });
    h.gw.wait_request("status", PATIENCE)
        .await
        .expect("forwarded");
    h.gw.drop_all();
    let (status, res) = call.await.unwrap();
    assert_eq!(status, 503, "{res}");
    assert_eq!(res["error"]["code"], "studio.upstream_closed");
    assert!(res["error"]["retryAfterMs"].is_u64(), "{res}");
}

#[tokio::test]
async fn rpc_without_an_answer_times_out_with_504() {
    let faults = Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |s| {
        s.limits.request_timeout = Duration::from_millis(200)
    })
    .await;
    until_ready(&h.socket()).await;
    let (status, res) = rpc(&h.socket(), r#"{"method":"status"}"#).await;
    assert_eq!(status, 504, "{res}");
    assert_eq!(res["error"]["code"], "studio.request_timeout");
}

#[tokio::test]
async fn wrong_methods_and_paths_are_explained() {
    let h = start().await;
    let (status, headers, text) = request_text(&h.socket(), "GET", "/v1/rpc", b"").await;
    assert_eq!(status, 405, "{text}");
    assert_eq!(headers["allow"], "POST");
    let (status, _, text) = request_text(&h.socket(), "POST", "/v1/state", b"").await;
    assert_eq!(status, 405, "{text}");
    let (status, _, text) = request_text(&h.socket(), "GET", "/v2/nothing", b"").await;
    assert_eq!(status, 404);
    assert!(text.contains("/v1/events"), "{text}");
}

/// A strict reader of the Prometheus text format (0.0.4): every line is a
/// `# HELP`, a `# TYPE` or a sample of a declared family, names and labels
/// are well-formed, values are numbers, and histograms are cumulative with
/// `+Inf` equal to `_count`. Returns each sample by `name{labels}`.
fn parse_prometheus(text: &str) -> HashMap<String, f64> {
    fn valid_name(n: &str) -> bool {
        let mut chars = n.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(valid_name(name), "{line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(line);
            assert!(valid_name(name), "{line}");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            assert!(
                types.insert(name.into(), kind.into()).is_none(),
                "declared once: {line}"
            );
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "unexpected line {line:?}"
        );
        let (series, value) = line.rsplit_once(' ').expect(line);
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("numeric value: {line}")),
        };
        let name = series.split('{').next().unwrap();
        assert!(valid_name(name), "{line}");
        if let Some(labels) = series.strip_prefix(name).filter(|l| !l.is_empty()) {
            let inner = labels
                .strip_prefix('{')
                .and_then(|l| l.strip_suffix('}'))
                .expect(line);
            let mut rest = inner;
            while !rest.is_empty() {
                let (key, after) = rest.split_once("=\"").expect(line);
                assert!(valid_name(key), "{line}");
                let mut escaped = false;
                let end = after
                    .char_indices()
                    .find(|&(_, c)| {
                        let close = c == '"' && !escaped;
                        escaped = c == '\\' && !escaped;
                        close
                    })
                    .expect(line)
                    .0;
                rest = after[end + 1..]
                    .strip_prefix(',')
                    .unwrap_or(&after[end + 1..]);
            }
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        assert!(
            types.contains_key(family),
            "sample before its # TYPE: {line}"
        );
        samples.insert(series.to_owned(), value);
    }
    for (family, _) in types.iter().filter(|(_, t)| *t == "histogram") {
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter_map(|(k, v)| {
                let le = k
                    .strip_prefix(&format!("{family}_bucket{{le=\""))?
                    .strip_suffix("\"}")?;
                Some((
                    if le == "+Inf" {
                        f64::INFINITY
                    } else {
                        le.parse().unwrap()
                    },
                    *v,
                ))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        assert!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "cumulative: {buckets:?}"
        );
        assert_eq!(buckets.last().unwrap().0, f64::INFINITY);
        assert_eq!(
            Some(&buckets.last().unwrap().1),
            samples.get(&format!("{family}_count"))
        );
    }
    samples
}

#[tokio::test]
async fn metrics_are_valid_prometheus_text_with_the_promised_series() {
    let faults = Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |s| {
        s.limits.request_timeout = Duration::from_millis(100)
    })
    .await;
    until_ready(&h.socket()).await;
    let (mut ws, _) = h.connected().await;
    assert_eq!(ws.request("health", json!({})).await["ok"], true);
    assert_eq!(
        ws.request("status", json!({})).await["error"]["code"],
        "studio.request_timeout"
    );
    rpc(&h.socket(), r#"{"method":"health"}"#).await;
    rpc(&h.socket(), r#"{"method":"we\"ird"}"#).await;
    let _sse = open_events(&h.socket(), "/v1/events", &[]).await.unwrap();
    let (status, headers, text) = request_text(&h.socket(), "GET", "/metrics", b"").await;
    assert_eq!(status, 200);
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let m = parse_prometheus(&text);
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("{k} in\n{text}"));
    assert_eq!(get(r#"clawmux_clients{kind="ws"}"#), 1.0);
    assert_eq!(get(r#"clawmux_clients{kind="sse"}"#), 1.0);
    assert_eq!(
        get(r#"clawmux_requests_total{method="health",outcome="ok"}"#),
        2.0
    );
    assert_eq!(
        get(r#"clawmux_requests_total{method="status",outcome="timeout"}"#),
        1.0
    );
    assert_eq!(
        // Not a gateway method: never a label of its own (it may be user data).
        get(r#"clawmux_requests_total{method="other",outcome="error"}"#),
        1.0
    );
    assert_eq!(get("clawmux_request_duration_seconds_count"), 4.0);
    assert_eq!(get(r#"clawmux_upstream_phase{phase="ready"}"#), 1.0);
    assert_eq!(get(r#"clawmux_upstream_phase{phase="backoff"}"#), 0.0);
    assert_eq!(get("clawmux_upstream_reconnects_total"), 0.0);
    for k in [
        r#"clawmux_client_queue_bytes{kind="ws"}"#,
        "clawmux_event_drops_total",
        "clawmux_slow_consumer_closes_total",
        "clawmux_events_total",
        "clawmux_requests_pending",
        "clawmux_queue_budget_bytes",
        r#"clawmux_broker_requests_total{result="sent"}"#,
        r#"clawmux_broker_requests_total{result="failed"}"#,
        "clawmux_replay_events",
        "clawmux_replay_bytes",
    ] {
        get(k);
    }
    h.gw.drop_all();
    eventually("reconnected", || {
        h.broker.ctx().upstream().status().reconnects == 1
    })
    .await;
    let (_, _, text) = request_text(&h.socket(), "GET", "/metrics", b"").await;
    assert_eq!(
        parse_prometheus(&text)["clawmux_upstream_reconnects_total"],
        1.0
    );
}

#[tokio::test]
async fn streams_count_against_the_client_limit_and_rpc_against_inflight() {
    let h = start_with(mock_config(), |s| {
        s.limits.max_clients = 1;
        s.limits.max_inflight = 0;
    })
    .await;
    until_ready(&h.socket()).await;
    let _first = open_events(&h.socket(), "/v1/events", &[]).await.unwrap();
    let (status, body) = open_events(&h.socket(), "/v1/events", &[])
        .await
        .err()
        .expect("no room for a second client");
    assert_eq!(status, 503);
    assert_eq!(body["error"]["code"], "studio.too_many_clients");
    let (status, res) = rpc(&h.socket(), r#"{"method":"health"}"#).await;
    assert_eq!(status, 429, "{res}");
    assert_eq!(res["error"]["code"], "studio.too_many_requests");
}

/// Every `/v1/rpc` request spends one shared in-flight budget: opening more
/// HTTP requests cannot exceed `max_inflight` (each used to be a fresh client
/// with a budget of its own).
#[tokio::test]
async fn rpc_requests_share_one_inflight_budget() {
    let faults = Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |s| {
        s.limits.max_inflight = 2;
        s.limits.request_timeout = Duration::from_secs(3);
    })
    .await;
    until_ready(&h.socket()).await;
    let socket = h.socket();
    let calls: Vec<_> = (0..10)
        .map(|_| {
            let socket = socket.clone();
            tokio::spawn(async move { rpc(&socket, r#"{"method":"status"}"#).await })
        })
        .collect();
    // Eight are refused at once; two wait at the gateway.
    let mut refused = 0;
    let mut held = Vec::new();
    for call in calls {
        if call.is_finished() {
            let (status, res) = call.await.unwrap();
            assert_eq!(status, 429, "{res}");
            refused += 1;
        } else {
            held.push(call);
        }
    }
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while refused < 8 && tokio::time::Instant::now() < deadline {
        let mut still = Vec::new();
        for call in held {
            if call.is_finished() {
                let (status, res) = call.await.unwrap();
                assert_eq!(status, 429, "only refusals come back early: {res}");
                refused += 1;
            } else {
                still.push(call);
            }
        }
        held = still;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(refused, 8);
    assert_eq!(state(&socket).await["rpc_inflight"], 2);
    let statuses: usize =
        h.gw.requests()
            .iter()
            .filter(|(_, r)| r["method"] == "status")
            .count();
    assert_eq!(statuses, 2, "only two reached the gateway");
    for call in held {
        let (status, _) = call.await.unwrap();
        assert_eq!(status, 504, "held until the request timeout");
    }
    assert_eq!(state(&socket).await["rpc_inflight"], 0);
}

/// The one error shape of every HTTP endpoint: `{"ok":false,"error":{code,
/// message,…}}`, whatever the endpoint and status (README "Endpoints").
#[tokio::test]
async fn every_error_body_has_the_same_shape() {
    let h = start().await;
    let s = until_ready(&h.socket()).await;
    let epoch = s["epoch"].as_str().unwrap().to_owned();
    let socket = h.socket();
    let future = format!("/v1/events?after_seq={epoch}:999999");
    let cases: Vec<(&str, &str, &[u8], u16, &str)> = vec![
        ("GET", "/nope", b"", 404, "not_found"),
        ("POST", "/healthz", b"", 405, "method_not_allowed"),
        ("GET", "/ws", b"", 426, "upgrade_required"),
        ("GET", "/v1/events?after_seq=x", b"", 400, "INVALID_REQUEST"),
        ("GET", &future, b"", 410, "studio.replay_unavailable"),
        ("POST", "/v1/rpc", b"{not json", 400, "INVALID_REQUEST"),
    ];
    for (method, path, body, want, code) in cases {
        let (status, _, text) = request_text(&socket, method, path, body).await;
        assert_eq!(status, want, "{method} {path}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["ok"], false, "{method} {path}: {v}");
        assert_eq!(v["error"]["code"], code, "{method} {path}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{method} {path}: {v}"
        );
        assert!(
            v.get("code").is_none() && v.get("message").is_none(),
            "nothing flat beside `error`: {v}"
        );
    }
    // The 410's replay window is in error.details.
    let (_, _, text) = request_text(&socket, "GET", &future, b"").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["details"]["epoch"], epoch.as_str(), "{v}");
    assert!(v["error"]["details"]["newest_seq"].is_u64(), "{v}");
    assert_eq!(v["error"]["retryable"], false, "{v}");
}

/// `/healthz` is liveness (200 while the broker answers) and says `ok:false`
/// while the gateway refuses the broker; `/readyz` is 503 with the reason
/// until the session is ready; `lostScopes` is always an array.
#[tokio::test]
async fn healthz_is_liveness_and_readyz_waits_for_the_upstream() {
    let faults = Faults {
        reject_connect: Some(clawmux_mock::Rejection::token_mismatch()),
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |_| {}).await;
    let health = eventually_async("upstream rejected on /healthz", || async {
        let (status, body) = http_get(&h.socket(), "/healthz").await;
        assert_eq!(status, 200, "liveness: {body}");
        if body["upstream"] == "rejected" {
            Ok(body)
        } else {
            Err(body)
        }
    })
    .await;
    assert_eq!(health["ok"], false, "not ok while rejected: {health}");
    assert_eq!(health["lostScopes"], json!([]), "{health}");
    let (status, ready) = http_get(&h.socket(), "/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["ok"], false);
    assert_eq!(ready["upstream"], "rejected");
    assert_eq!(
        ready["error"]["code"], "studio.upstream_rejected",
        "{ready}"
    );

    let h = start().await;
    until_ready(&h.socket()).await;
    let (status, ready) = http_get(&h.socket(), "/readyz").await;
    assert_eq!(
        (status, &ready),
        (200, &json!({"ok": true, "upstream": "ready"}))
    );
    let (status, health) = http_get(&h.socket(), "/healthz").await;
    assert_eq!((status, &health["ok"]), (200, &json!(true)), "{health}");
    assert_eq!(health["lostScopes"], json!([]), "{health}");

    // Before any session: 503 with a retry hint, and still an empty array.
    let (broker, _dir) = broker_only(|_| {}).await;
    let (status, ready) = http_get(broker.socket_path(), "/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert!(
        ready["error"]["code"]
            .as_str()
            .unwrap()
            .starts_with("studio."),
        "{ready}"
    );
    let (_, health) = http_get(broker.socket_path(), "/healthz").await;
    assert_eq!(
        (&health["ok"], &health["lostScopes"]),
        (&json!(false), &json!([]))
    );
}

/// `clawmux_build_info` and the standard `process_*` series are exported.
#[tokio::test]
async fn metrics_include_build_info_and_process_series() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let (_, _, text) = request_text(&h.socket(), "GET", "/metrics", b"").await;
    let m = parse_prometheus(&text);
    let version = env!("CARGO_PKG_VERSION");
    let info = m
        .iter()
        .find(|(k, _)| {
            k.starts_with("clawmux_build_info{") && k.contains(&format!("version=\"{version}\""))
        })
        .unwrap_or_else(|| panic!("build_info in\n{text}"));
    assert_eq!(*info.1, 1.0);
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("{k} in\n{text}"));
    assert!(get("process_resident_memory_bytes") > 1e6, "{text}");
    assert!(get("process_virtual_memory_bytes") > 1e6);
    assert!(get("process_open_fds") >= 3.0);
    assert!(get("process_max_fds") >= get("process_open_fds"));
    assert!(get("process_threads") >= 1.0);
    assert!(get("process_cpu_seconds_total") >= 0.0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let start = get("process_start_time_seconds");
    assert!(
        start <= now + 2.0 && start > now - 86_400.0,
        "{start} vs {now}"
    );
    assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
}
