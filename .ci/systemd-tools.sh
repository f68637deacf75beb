#!/usr/bin/env bash
# Makes sure the tests have systemd-analyze (tests/install_service.rs) and
# systemd-socket-activate (tests/systemd.rs), both from Debian's
# systemd package, and tmux (tests/activity.rs runs `clawmux top` in it).
# Best effort: without them those tests print a note and skip; socket
# activation is still covered by the fd-passing test in Rust.
set -u
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v tmux >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends tmux; } >/dev/null 2>&1 \
        || echo "note: could not install tmux; the terminal test of clawmux top will skip" >&2
fi
if command -v systemd-analyze >/dev/null && command -v systemd-socket-activate >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends systemd; } >/dev/null 2>&1; then
        echo "note: could not install systemd (systemd-analyze); unit-file tests will skip" >&2
    fi
else
    echo "note: systemd-analyze missing and not root; unit-file tests will skip" >&2
fi
exit 0
