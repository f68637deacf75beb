#!/usr/bin/env bash
# Builds the book (docs/src, book.toml) with mdBook and checks its links and
# the README's (relative files and #anchors; .ci/check-links.py), then the
# links of the built pages themselves, print.html included.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v mdbook >/dev/null || cargo install --locked mdbook
mdbook build
python3 .ci/check-links.py
python3 .ci/check-links.py --html target/book
