//! What real WebSocket libraries make of the broker's frames: events it
//! writes as vectored frames (a shared encoded event, each client's `seq`)
//! of every length form (7, 16 and 64 bits), read by Python `websockets`
//! and Node `ws` while each also pings the broker and gets its pong
//! between them.

use std::process::Stdio;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::support::*;

/// How long a client library may take to read every event.
const READ_PATIENCE: Duration = Duration::from_secs(30);

/// Pad lengths around the header's length boundaries (125/126 and
/// 65,535/65,536 payload bytes are reached with the event's own bytes).
const PADS: [usize; 9] = [0, 60, 70, 65_400, 65_500, 65_600, 200_000, 1 << 20, 3];

const PYTHON: &str = r#"
import asyncio, json, sys, websockets
async def main():
    async with websockets.unix_connect(sys.argv[1], "ws://localhost/ws", max_size=None) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "req", "id": "c1", "method": "connect", "params": {
            "minProtocol": 3, "maxProtocol": 4,
            "client": {"id": "cli", "version": "1", "platform": "linux", "mode": "cli"},
            "scopes": ["operator.admin", "operator.read"]}}))
        assert json.loads(await ws.recv())["ok"] is True
        print("ready", flush=True)
        want, pads, last_seq, pong = int(sys.argv[2]), json.loads(sys.argv[3]), 0, None
        n = 0
        while n < want:
            msg = json.loads(await ws.recv())
            assert msg["seq"] > last_seq, msg
            last_seq = msg["seq"]
            if msg.get("event") != "test.frame":
                continue
            p = msg["payload"]
            assert p["n"] == n and len(p["pad"]) == pads[n % len(pads)], (n, p["n"], len(p["pad"]))
            n += 1
            if n == want // 2:
                pong = ws.ping(b"mid-stream")
        await asyncio.wait_for(pong, 10)
        print("ok", n, flush=True)
asyncio.run(main())
"#;

const NODE: &str = r#"
const WebSocket = require('ws');
const [sock, wantS, padsS] = process.argv.slice(1);
const want = Number(wantS), pads = JSON.parse(padsS);
const ws = new WebSocket(`ws+unix://${sock}:/ws`, { maxPayload: 0 });
let stage = 0, n = 0, lastSeq = 0, ponged = false;
const fail = (m) => { console.error(m); process.exit(1); };
const done = () => { if (n === want && ponged) { console.log('ok', n); ws.close(); } };
ws.on('pong', (data) => { if (data.toString() !== 'mid-stream') fail('pong ' + data); ponged = true; done(); });
ws.on('message', (data, isBinary) => {
  if (isBinary) fail('a binary frame');
  const msg = JSON.parse(data.toString());
  if (stage === 0) {
    stage = 1;
    ws.send(JSON.stringify({ type: 'req', id: 'c1', method: 'connect', params: {
      minProtocol: 3, maxProtocol: 4,
      client: { id: 'cli', version: '1', platform: 'linux', mode: 'cli' },
      scopes: ["operator.admin", "operator.read"] } }));
    return;
  }
  if (stage === 1) { if (msg.ok !== true) fail('connect'); stage = 2; console.log('ready'); return; }
  if (!(msg.seq > lastSeq)) fail('seq ' + msg.seq + ' after ' + lastSeq);
  lastSeq = msg.seq;
  if (msg.event !== 'test.frame') return;
  const p = msg.payload;
  if (p.n !== n || p.pad.length !== pads[n % pads.length]) fail(`event ${n}: n=${p.n} pad=${p.pad.length}`);
  n += 1;
  if (n === Math.floor(want / 2)) ws.ping('mid-stream');
  done();
});
ws.on('error', (e) => fail(String(e)));
"#;

/// Runs a client library's reader against a broker publishing events of
/// every frame-length form, and waits for its verdict.
async fn read_with(program: &str, code: &str) {
    let h = start().await;
    let want = 3 * PADS.len();
    let pads = serde_json::to_string(&PADS).unwrap();
    let mut child = Command::new(program)
        .arg(if program == "node" { "-e" } else { "-c" })
        .arg(code)
        .arg(h.socket())
        .arg(want.to_string())
        .arg(&pads)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the interpreter starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(READ_PATIENCE, lines.next_line())
        .await
        .expect("the client connects in time")
        .unwrap();
    assert_eq!(ready.as_deref(), Some("ready"), "{program}");
    for n in 0..want {
        let pad = "x".repeat(PADS[n % PADS.len()]);
        h.gw.broadcast("test.frame", json!({"n": n, "pad": pad}));
    }
    let verdict = match tokio::time::timeout(READ_PATIENCE, lines.next_line()).await {
        Ok(line) => line.unwrap(),
        Err(_) => {
            let _ = child.start_kill();
            let out = child.wait_with_output().await.unwrap();
            panic!(
                "{program} did not read every event in time: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    let out = tokio::time::timeout(READ_PATIENCE, child.wait_with_output())
        .await
        .expect("the client exits")
        .unwrap();
    assert_eq!(
        verdict.as_deref(),
        Some(format!("ok {want}").as_str()),
        "{program}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{program}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "python_websockets"),
    ignore = "needs python3 with websockets: run `source .ci/doc-tools.sh` first (CI does)"
)]
async fn python_websockets_reads_every_frame_and_its_pong() {
    read_with("python3", PYTHON).await;
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "node_ws"),
    ignore = "needs node with ws: run `source .ci/doc-tools.sh` first (CI does)"
)]
async fn node_ws_reads_every_frame_and_its_pong() {
    read_with("node", NODE).await;
}
