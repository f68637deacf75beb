//! `pluginSurfaceUrls` (capability URLs the gateway mints per connection)
//! through the broker: a local client gets the current upstream session's,
//! and after a reconnect connected clients learn the new ones from the
//! `clawmux.upstream` ready event while new clients get them in hello-ok.

use crate::support::*;
use serde_json::json;

#[tokio::test]
async fn plugin_surface_urls_follow_the_upstream_session() {
    let h = start().await;
    let (mut a, hello) = h.connected().await;
    let first = hello["pluginSurfaceUrls"]["canvas"]
        .as_str()
        .expect("the gateway's plugin surface passes through")
        .to_owned();
    assert!(first.contains("/__openclaw__/cap/"), "{first}");
    // Another local client shares the session, so the same capability.
    let (_b, hello_b) = h.connected().await;
    assert_eq!(hello_b["pluginSurfaceUrls"]["canvas"], first.as_str());

    // The upstream session drops; the broker reconnects.
    h.gw.drop_all();
    let lost = a.event("clawmux.upstream").await;
    assert_eq!(lost["payload"]["phase"], "backoff", "{lost}");
    let back = a.event("clawmux.upstream").await;
    assert_eq!(back["payload"]["phase"], "ready", "{back}");
    let fresh = back["payload"]["pluginSurfaceUrls"]["canvas"]
        .as_str()
        .expect("the ready event carries the new session's URLs")
        .to_owned();
    assert_ne!(fresh, first, "minted anew for the new session");

    // A client connecting now gets the new ones in its hello-ok.
    let (mut c, hello_c) = h.connected().await;
    assert_eq!(hello_c["pluginSurfaceUrls"]["canvas"], fresh.as_str());
    assert_eq!(c.request("health", json!({})).await["ok"], true);
}
