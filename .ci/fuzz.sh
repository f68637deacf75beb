#!/usr/bin/env bash
# The fuzz step of CI: builds the cargo-fuzz targets (fuzz/, nightly) and runs
# each for FUZZ_SECONDS (default 15: ten targets fit in about three minutes on
# two cores, after the build), starting from the committed seeds
# (fuzz/seeds/<target>/; new inputs go to a scratch corpus, never into the
# repository) and the target's dictionary of JSON keys if it has one
# (fuzz/dicts/<target>.dict). Fails if any target crashes, times out (FUZZ_TIMEOUT seconds
# for one input) or runs out of memory, after printing the reproducer: its
# path, its bytes, and the command that replays it. Prints the totals
# (targets, executions, seconds) at the end, for docs/src/status.md.
#
#   bash .ci/fuzz.sh                    # every target
#   bash .ci/fuzz.sh sanitize activity  # some
#   FUZZ_SECONDS=300 bash .ci/fuzz.sh   # longer
#
# Installs a nightly toolchain (rustup) and cargo-fuzz if they are missing. FUZZ_TARGET_DIR: where to build (default
# target/fuzz, apart from the stable builds: the flags differ).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-15}
timeout=${FUZZ_TIMEOUT:-10}
target_dir=${FUZZ_TARGET_DIR:-$PWD/target/fuzz}

if ! cargo +nightly --version >/dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install --locked cargo-fuzz
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi

# Built once up front, so the time limits below are spent fuzzing.
cargo +nightly fuzz build --target-dir "$target_dir"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The settings target writes its files under TMPDIR; keep them in the scratch dir.
export TMPDIR=$scratch
artifacts=${FUZZ_ARTIFACTS:-$PWD/fuzz/artifacts}
failed=()
total_execs=0
start=$(date +%s)
for t in "${targets[@]}"; do
    mkdir -p "$scratch/corpus/$t" "$artifacts/$t"
    log=$scratch/$t.log
    status=0
    dict=()
    if [ -f "fuzz/dicts/$t.dict" ]; then
        dict=(-dict="fuzz/dicts/$t.dict")
    fi
    # ws_frames frees everything it allocates each execution, but under
    # ASan's default quarantine its large, short-lived buffers kept the RSS
    # growing ~600 KB an execution (2 GB after 3,000; 69 MB with this).
    asan=${ASAN_OPTIONS:-}
    if [ "$t" = ws_frames ] && [ -z "$asan" ]; then
        asan=quarantine_size_mb=1:malloc_context_size=0
    fi
    ASAN_OPTIONS=$asan cargo +nightly fuzz run --target-dir "$target_dir" "$t" "$scratch/corpus/$t" "fuzz/seeds/$t" -- \
        -max_total_time="$seconds" -timeout="$timeout" -rss_limit_mb=2048 "${dict[@]}" \
        -print_final_stats=1 -artifact_prefix="$artifacts/$t/" >"$log" 2>&1 || status=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    execs=${execs:-0}
    total_execs=$((total_execs + execs))
    if [ "$status" -ne 0 ]; then
        failed+=("$t")
        echo "fuzz: $t FAILED after $execs executions (exit $status)"
        # The panic message (or the sanitizer's or libFuzzer's verdict), not the stack.
        grep -E -A2 "panicked at" "$log" | head -20 || true
        grep -E "ERROR: (libFuzzer|AddressSanitizer|LeakSanitizer)|^SUMMARY:" "$log" | head -5 \
            || tail -30 "$log"
        for a in $(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log"); do
            echo "fuzz: reproducer $a ($(wc -c <"$a") bytes):"
            od -A d -c "$a" | head -32
            echo "fuzz: base64: $(base64 -w0 "$a" | head -c 4000)"
            echo "fuzz: replay: cargo +nightly fuzz run $t $a"
        done
    else
        echo "fuzz: $t ok, $execs executions in ${seconds}s"
    fi
done
elapsed=$(($(date +%s) - start))
echo "fuzz: ${#targets[@]} targets, $total_execs executions, ${elapsed}s"
if [ ${#failed[@]} -ne 0 ]; then
    echo "fuzz: crashed: ${failed[*]}" >&2
    exit 1
fi
