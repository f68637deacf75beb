//! Request frames the gateway's schema allows or refuses, through the broker
//! (found by the differential suite against the real gateway,
//! tests/it/interop_diff.rs): its words for schema errors, `traceparent`
//! accepted, `expectedProfileId` refused rather than silently dropped.

use crate::support::*;
use serde_json::json;

#[tokio::test]
async fn request_frames_follow_the_gateway_schema() {
    let h = start().await;
    let (mut c, _) = h.connected().await;

    c.send_json(&json!({"type": "req", "id": "t1", "method": "health",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}))
        .await;
    let res = c.response("t1").await;
    assert_eq!(
        res["ok"], true,
        "traceparent is in the gateway's schema: {res}"
    );

    c.send_json(&json!({"type": "req", "id": "t2"})).await;
    let res = c.response("t2").await;
    assert_eq!(
        res["error"]["message"], "invalid request frame: must have required property 'method'",
        "{res}"
    );

    c.send_json(&json!({"type": "req", "id": "t3", "method": "health", "extra": 1}))
        .await;
    let res = c.response("t3").await;
    assert_eq!(
        res["error"]["message"], "invalid request frame: at root: unexpected property 'extra'",
        "{res}"
    );

    c.send_json(&json!({"type": "req", "id": "t4", "method": "health", "expectedProfileId": "p1"}))
        .await;
    let res = c.response("t4").await;
    assert_eq!(res["error"]["code"], "INVALID_REQUEST", "{res}");
    assert!(
        res["error"]["message"]
            .as_str()
            .unwrap()
            .contains("expectedProfileId is not supported"),
        "{res}"
    );
    // Nothing of the refused ones reached the gateway; the socket is open.
    assert_eq!(c.request("status", json!({})).await["ok"], true);
    let sent: Vec<String> =
        h.gw.requests()
            .iter()
            .map(|(_, r)| r["method"].as_str().unwrap_or_default().to_owned())
            .collect();
    assert_eq!(
        sent.iter().filter(|m| *m == "health").count(),
        1,
        "{sent:?}"
    );
}
