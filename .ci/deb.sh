#!/usr/bin/env bash
# Builds the Debian package (cargo-deb, [package.metadata.deb] in Cargo.toml),
# checks what it holds, then unpacks it into a throwaway root and runs the
# packaged binary from there.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-deb >/dev/null || cargo install --locked cargo-deb
cargo build --release --locked
bash .ci/dist-assets.sh
cargo deb --no-build --locked
target="${CARGO_TARGET_DIR:-target}"
deb=$(ls -t "$target"/debian/clawmux_*.deb | head -n 1)
contents=$(dpkg-deb --contents "$deb")
for want in ./usr/bin/clawmux ./usr/lib/systemd/user/clawmux.service ./usr/lib/systemd/user/clawmux.socket \
    ./usr/lib/systemd/user/clawmux-metrics.service ./usr/lib/systemd/user/clawmux-metrics.timer \
    ./usr/share/man/man1/clawmux.1.gz ./usr/share/man/man1/clawmux-serve.1.gz \
    ./usr/share/bash-completion/completions/clawmux ./usr/share/zsh/vendor-completions/_clawmux \
    ./usr/share/fish/vendor_completions.d/clawmux.fish ./usr/share/doc/clawmux/README.md; do
    grep -q " $want\$" <<<"$contents" || { echo "deb: $deb lacks $want" >&2; echo "$contents" >&2; exit 1; }
done
grep -q '^ExecStart=/usr/bin/clawmux serve' <(dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/lib/systemd/user/clawmux.service) \
    || { echo "deb: the packaged clawmux.service does not run /usr/bin/clawmux" >&2; exit 1; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
dpkg -x "$deb" "$root"
version=$("$root/usr/bin/clawmux" --version)
echo "deb: $deb ($(du -h "$deb" | cut -f1)): $version from $root/usr/bin/clawmux"
# The size the README states must be the built one (within 10 %).
stated=$(tr '\n' ' ' < README.md | grep -o 'binary is [0-9.]* MiB' | grep -o '[0-9.]*')
actual=$(stat -c %s "$target/release/clawmux")
python3 - "$stated" "$actual" <<'PY'
import sys
stated, actual = float(sys.argv[1]), int(sys.argv[2]) / 2**20
if abs(actual - stated) > 0.1 * stated:
    sys.exit(f"README says the binary is {stated} MiB; the release binary is {actual:.1f} MiB: update README.md and docs/src/benchmarks.md")
print(f"deb: binary {actual:.1f} MiB, README says {stated} MiB")
PY
