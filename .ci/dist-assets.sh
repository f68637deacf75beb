#!/usr/bin/env bash
# Generates what the Debian package ships beside the binary: the man pages
# (`clawmux man --dir`), the shell completions (`clawmux completions`) and
# the systemd user units running /usr/bin/clawmux,
# from the release binary, into <target>/release/dist/ where
# [package.metadata.deb] in Cargo.toml takes them. Run after
# `cargo build --release`, before `cargo deb --no-build`.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
bin="$target/release/clawmux"
out="$target/release/dist"
[ -x "$bin" ] || {
    echo "dist-assets: $bin is missing: build it first with cargo build --release --locked" >&2
    exit 1
}
rm -rf "$out"
mkdir -p "$out/man" "$out/completions" "$out/systemd"
"$bin" man --dir "$out/man" 2>/dev/null
gzip -9n "$out"/man/*.1
"$bin" completions bash > "$out/completions/clawmux"
"$bin" completions zsh > "$out/completions/_clawmux"
"$bin" completions fish > "$out/completions/clawmux.fish"
# The packaged units run the packaged binary (install-service writes the
# running binary's path instead).
for unit in systemd/*; do
    sed 's#%h/.cargo/bin/clawmux #/usr/bin/clawmux #' "$unit" > "$out/systemd/$(basename "$unit")"
done
echo "dist-assets: $(ls "$out/man" | wc -l) man pages, 3 completion scripts, $(ls "$out/systemd" | wc -l) units in $out"
