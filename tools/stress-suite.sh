#!/usr/bin/env bash
# Runs the README's test command N times in a row (default 20) while a CPU hog
# keeps both cores busy, stopping at the first failure. Issue 11's bar for a
# suite CI can trust. Needs stress-ng (Debian package `stress-ng`).
#   tools/stress-suite.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-20}"
command -v stress-ng >/dev/null || { echo "stress-ng is not installed (apt-get install stress-ng)"; exit 2; }
cargo test --locked --all-targets --no-run -q
stress-ng --cpu "$(nproc)" --timeout 0 --quiet &
hog=$!
trap 'kill $hog 2>/dev/null || true' EXIT
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  if ! cargo test --locked --all-targets -q > "/tmp/stress-suite-run-$i.log" 2>&1; then
    echo "run $i FAILED ($(( $(date +%s) - start )) s); log: /tmp/stress-suite-run-$i.log"
    grep -E '^test .* FAILED|panicked' "/tmp/stress-suite-run-$i.log" | head -20
    exit 1
  fi
  echo "run $i passed in $(( $(date +%s) - start )) s (load $(cut -d' ' -f1 /proc/loadavg))"
done
echo "$n consecutive runs passed under a CPU hog on $(nproc) cores"
