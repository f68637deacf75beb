#!/usr/bin/env bash
# Regenerates tests/fixtures/real-gateway-run.jsonl: a recording (`clawmux record --requests`)
# of one agent run on a REAL OpenClaw Gateway (the pinned version, /work/shared/peers or
# $GATEWAY_SH), with the scripted loopback model provider tools/mock-provider.py (reasoning, a
# tool call, then assistant text). Everything runs on loopback in a throwaway directory with
# its own HOME; nothing touches your real state.
#   tools/record-fixture.sh [OUT]        (default: tests/fixtures/real-gateway-run.jsonl)
# Env: CLAWMUX (binary; default: builds target/debug/clawmux), GATEWAY_SH, GW_PORT, PROVIDER_PORT.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/tests/fixtures/real-gateway-run.jsonl}
GATEWAY_SH=${GATEWAY_SH:-/work/shared/peers/openclaw-gateway.sh}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GW_PORT=${GW_PORT:-$(free_port)}
PROVIDER_PORT=${PROVIDER_PORT:-$(free_port)}
TOKEN=fixture-$(python3 -c 'import secrets; print(secrets.token_hex(12))')
if [[ -z ${CLAWMUX:-} ]]; then
  (cd "$here" && cargo build --quiet --bin clawmux)
  CLAWMUX=$here/target/debug/clawmux
fi

work=$(mktemp -d /tmp/clawmux-fixture.XXXXXX)
chmod 700 "$work"
mkdir -p "$work/home" "$work/run" "$work/state"
chmod 700 "$work/run"
pids=()
cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  # The gateway's SQLite lock files live in a fixed /tmp dir (see openclaw-gateway.sh).
  local hash
  hash=$(printf '%s' "$work/gw/state/state/openclaw.sqlite" | sha256sum | cut -c1-8)
  rm -f "/tmp/openclaw-state-locks-$(id -u)"/*."$hash".lock.sqlite
  rm -rf "$work"
}
trap cleanup EXIT
log() { printf '[record-fixture] %s\n' "$*" >&2; }

# The broker and the recorder see only this throwaway home. (An array, not a function, so a
# background `"${cm[@]}" … &` is the clawmux process itself and gets our signals.)
cm=(env -i PATH="$PATH" HOME="$work/home" XDG_CONFIG_HOME="$work/home/.config"
  XDG_STATE_HOME="$work/state" XDG_RUNTIME_DIR="$work/run" CLAWMUX_LOG=warn "$CLAWMUX")
sock=$work/run/clawmux.sock

log "model provider on 127.0.0.1:$PROVIDER_PORT"
python3 "$here/tools/mock-provider.py" "$PROVIDER_PORT" 2>"$work/provider.log" &
pids+=($!)

log "real gateway on 127.0.0.1:$GW_PORT (takes 15-20 s)"
# Our own state root, so the agent's workspace holds the file the model's tool call reads.
mkdir -p "$work/gw/workspace"
printf 'Remember to water the plants.\n' >"$work/gw/workspace/notes.txt"
STATE_ROOT=$work/gw PORT=$GW_PORT TOKEN=$TOKEN bash "$GATEWAY_SH" >"$work/gateway.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 120); do
  if [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$GW_PORT/startupz" || true) == 200 ]]; then break; fi
  sleep 0.5
done

printf '%s' "$TOKEN" >"$work/token"
chmod 600 "$work/token"
"${cm[@]}" serve --socket "$sock" --gateway-url "ws://127.0.0.1:$GW_PORT" --token-file "$work/token" \
  --state-dir "$work/state/clawmux" 2>"$work/broker.log" &
pids+=($!)
for _ in $(seq 1 120); do
  if "${cm[@]}" status --socket "$sock" >/dev/null 2>&1; then break; fi
  sleep 0.5
done
"${cm[@]}" status --socket "$sock" >&2

log "pointing the gateway at the model provider (before recording: the patch is not in the fixture)"
hash=$("${cm[@]}" call config.get --socket "$sock" | python3 -c 'import json,sys; print(json.load(sys.stdin)["hash"])')
patch=$(python3 - "$PROVIDER_PORT" "$hash" <<'EOF'
import json, sys
port, base = sys.argv[1], sys.argv[2]
raw = {"models": {"providers": {"mock": {
    "baseUrl": f"http://127.0.0.1:{port}/v1", "apiKey": "x", "api": "openai-completions",
    "models": [{"id": "echo", "name": "Echo", "reasoning": True, "input": ["text"],
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                "contextWindow": 128000, "maxTokens": 4096}]}}},
       "agents": {"defaults": {"model": {"primary": "mock/echo"}}}}
print(json.dumps({"raw": json.dumps(raw), "baseHash": base}))
EOF
)
"${cm[@]}" call config.patch "$patch" --socket "$sock" >/dev/null
# The config hot-reloads; wait until the model is the primary one.
for _ in $(seq 1 60); do
  if "${cm[@]}" call config.get --socket "$sock" | grep 'mock/echo' >/dev/null; then break; fi
  sleep 0.5
done
"${cm[@]}" status --socket "$sock" >/dev/null || sleep 3

rec=$work/recording.jsonl
log "recording"
"${cm[@]}" record --socket "$sock" --out "$rec" --requests 2>"$work/record.log" &
recorder=$!
pids+=("$recorder")
for _ in $(seq 1 100); do [[ -s $rec ]] && break; sleep 0.1; done

"${cm[@]}" call sessions.list '{}' --socket "$sock" >/dev/null || true
"${cm[@]}" call chat.send '{"sessionKey":"main","message":"hello from the fixture","idempotencyKey":"fixture-run-1","thinking":"low"}' \
  --socket "$sock" >/dev/null
for _ in $(seq 1 120); do
  if grep -q '"state":"final"' "$rec"; then break; fi
  sleep 0.5
done
grep -q '"state":"final"' "$rec" || { log "no final chat event; see $work/*.log"; tail -20 "$work/gateway.log" >&2; exit 1; }
sleep 1 # the lifecycle end and session updates that follow the final message
"${cm[@]}" call chat.history '{"sessionKey":"main","limit":10}' --socket "$sock" >/dev/null
for _ in $(seq 1 50); do grep -q '"chat.history"' "$rec" && grep -q '"type":"res"' "$rec" && break; sleep 0.1; done
sleep 0.5

kill -INT "$recorder"
wait "$recorder" || true
if grep -q -- "$TOKEN" "$rec"; then log "the token is in the recording: refusing to keep it"; exit 1; fi
mkdir -p "$(dirname "$out")"
cp "$rec" "$out"
log "wrote $out ($(wc -c <"$out") bytes, $(wc -l <"$out") lines)"
