#!/usr/bin/env python3
"""Writes the seed corpus (fuzz/seeds/<target>/) from the recorded
real-gateway run (tests/fixtures/real-gateway-run.jsonl) and the book's
configuration examples. Run from anywhere; the output is committed, so a
change here is a change to the seeds (re-run it and commit the result)."""
import json, os, pathlib, shutil

root = pathlib.Path(__file__).resolve().parent
fixture = (root / ".." / "tests" / "fixtures" / "real-gateway-run.jsonl").read_text().splitlines()
lines = [json.loads(l) for l in fixture]
header = lines[0]
records = lines[1:]
seeds = {}

def put(target, name, data):
    if isinstance(data, str):
        data = data.encode()
    seeds.setdefault(target, {})[name] = data

def frame_text(f):
    return json.dumps(f, separators=(",", ":"))

# The gateway frames: a few small ones of each kind (event, tool event, res).
ins = [r["frame"] for r in records if r.get("dir") == "in"]
small = sorted(ins, key=lambda f: len(frame_text(f)))
picked = [small[0], small[1]] + [f for f in ins if f.get("type") == "res"][:1]
picked += [f for f in ins if f.get("payload", {}).get("stream") == "tool"][:1]
for i, f in enumerate(picked):
    put("gateway_frame", f"in-{i}", frame_text(dict(f, seq=i + 1)))

# The local request frames: what the recording's client sent.
outs = [r["frame"] for r in records if r.get("dir") == "out"]
for i, f in enumerate(outs[:3]):
    put("client_frame", f"req-{i}", frame_text(f))

# connect: the recording's hello shows what a client gets; a connect asks for it.
auth = header["hello"]["auth"]
connect = {"type": "req", "id": "c1", "method": "connect", "params": {
    "minProtocol": header["hello"].get("protocol", 3), "maxProtocol": 4,
    "client": {"id": "cli", "version": header["broker_version"], "platform": "linux", "mode": "cli"},
    "role": auth["role"], "scopes": auth["scopes"], "caps": ["tool-events"],
    "auth": {"token": "fixture-token"}}}
put("connect_params", "connect", frame_text(connect))
put("connect_params", "node", frame_text(dict(connect, params=dict(connect["params"], role="node"))))
put("connect_params", "not-connect", frame_text(outs[0]))

# /v1/events: the recording's own query and cursors.
epoch, after = header["epoch"], header["after_seq"]
cursors = [r["cursor"] for r in records if "cursor" in r]
put("events_query", "after", f"after_seq={after}&events=chat,agent&tool_events=all\n")
put("events_query", "last-event-id", f"tap=1\n{epoch}:{cursors[-1]}")
put("events_query", "epoch", f"after_seq={epoch}%3A{cursors[0]}&epoch={epoch}")

# /v1/hud: query, resume point, epoch, window.
window = f"{epoch} {cursors[0]} {cursors[-1]}"
put("hud_query", "held", f"history=1&after_seq={cursors[3]}\n{cursors[3]}\n{epoch}\n{window}")
put("hud_query", "stranger", f"after_seq=9\nother:9\nother\n{window}")
put("hud_query", "fresh", f"history=0\n\n\n{window}")

# A recording: the fixture's head and end, and a short exchange.
put("recording", "head-and-end", "\n".join([fixture[0]] + fixture[1:4] + [fixture[-1]]) + "\n")
put("recording", "events", "\n".join([fixture[0]] + fixture[6:12]) + "\n")
put("recording", "torn", fixture[0] + "\n" + fixture[1][: len(fixture[1]) // 2])

# The replay log: the recording's events as the broker writes them.
def log_line(r):
    f = {k: v for k, v in r["frame"].items() if k != "seq"}
    return json.dumps({"seq": r["cursor"], "ts": r["ms"], "frame": f}, separators=(",", ":"))
logged = [r for r in records if "cursor" in r]
floor = json.dumps({"v": 1, "floor": logged[0]["cursor"] - 1, "lives": [epoch]}, separators=(",", ":"))
stop = json.dumps({"stop": logged[5]["cursor"], "ts": logged[5]["ms"]}, separators=(",", ":"))
put("replay_log", "clean-stop", b"\x00" + ("\n".join([floor] + [log_line(r) for r in logged[:6]] + [stop]) + "\n").encode())
put("replay_log", "torn-tail", b"\x00" + ("\n".join([floor] + [log_line(r) for r in logged[6:10]]) + "\n" + log_line(logged[10])[:40]).encode())
put("replay_log", "cut", b"\x01" + ("\n".join([log_line(r)[20:] for r in logged[10:11]] + [log_line(r) for r in logged[11:14]]) + "\n").encode())

# Settings: config.toml, Claw3D settings.json, openclaw.json (JSON5), NUL-separated.
toml = """socket = "/run/user/1000/clawmux.sock"
[gateway]
url = "ws://localhost:18789"
token = "fixture-token"
[limits]
request_timeout_ms = 30000
queue_soft_bytes = 1048576
queue_hard_bytes = 52428800
max_clients = 1024
[upstream]
backoff_max_ms = 30000
device_identity = false
[[sockets]]
name = "dashboard"
path = "/run/user/1000/clawmux-ro.sock"
mode = "0600"
scopes = ["operator.read"]
deny_methods = ["logs.*", "config.get"]
"""
claw3d = json.dumps({"gateway": {"url": "ws://127.0.0.1:18789", "token": "claw3d-token"}})
openclaw = """{
  // OpenClaw's own config (JSON5)
  gateway: { mode: 'remote', port: 18789, auth: { token: 'local-token' },
             remote: { url: 'wss://gw.example:443', token: 'remote-token', tlsFingerprint: 'sha256:AB:CD' },
             tls: { enabled: true } },
}"""
put("config_settings", "all-three", toml + "\0" + claw3d + "\0" + openclaw)
put("config_settings", "openclaw-only", "\0\0" + openclaw)
put("config_settings", "claw3d-only", "\0" + claw3d)

# The sanitizer: texts from the recording, and the characters it must escape.
texts = [ins[i].get("payload", {}) for i in range(len(ins))]
put("sanitize", "thinking", b"\x3c" + "Let me check\tthe session first.\n".encode())
put("sanitize", "controls", b"\x10" + "\x1b]0;title\x07\x1b[31mred\x1b[0m \u202eevil\u2066 \u009b2J \x7f".encode())
put("sanitize", "message", b"\x20" + json.dumps(texts[-1])[:200].encode())

# The activity projection: the whole run, its first half, and one with a gap.
put("activity", "run", "\n".join(fixture[1:]) + "\n")
put("activity", "first-half", "\n".join(fixture[1 : len(fixture) // 2]) + "\n")
put("activity", "gap", "\n".join(fixture[1:15] + ["gap"] + fixture[15:]) + "\n")

# The /ws frame writer: flags (bit 0 vectored, bit 1 cut after (flags >> 2)
# * 4099 bytes), then items (an odd tag: an event, its prefix and suffix; an
# even one: a text; each string a length, its bytes, and a byte whose high
# nibble repeats it past the 16- and 64-bit length forms), then piece sizes.
def s(text, repeat=0):
    b = text.encode()
    return bytes([len(b)]) + b + bytes([repeat << 4])
event = s(json.dumps(texts[-1])[:180] + ',"seq":') + s("}")
put("ws_frames", "events-and-a-response",
    b"\x01" + b"\x01" + event + b"\x02" + s('{"type":"res","id":"1","ok":true}') + b"\x03" + event
    + b"\x00" + bytes([1, 7, 200, 3]))
put("ws_frames", "large-event-cut", b"\x0b" + b"\x05" + s('{"a":"', 13) + s('"}') + b"\x07" + event
    + b"\x00" + bytes([255, 17]))
put("ws_frames", "copied-16-bit", b"\x00" + b"\x02" + s("\u00e9t\u00e9 ", 9) + b"\x00" + bytes([2]))

out = root / "seeds"
shutil.rmtree(out, ignore_errors=True)
for target, files in seeds.items():
    (out / target).mkdir(parents=True)
    for name, data in files.items():
        (out / target / name).write_bytes(data)
print(f"{sum(len(f) for f in seeds.values())} seeds for {len(seeds)} targets in {out}")
