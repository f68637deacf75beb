# Sourced by .ci/run: the tools the README's and the book's examples need
# (tests/it/readme.rs fails under CI=true when one is missing): curl, jq,
# Python with `websockets` (in a venv: a system Python refuses pip, PEP 668)
# and Node with `ws`; and man and script for the `clawmux man` test
# (tests/it/serve_messages.rs). Exports PATH and NODE_PATH for the test run.
tools="${CLAWMUX_CI_TOOLS:-${HOME:-/root}/.cache/clawmux-ci}"
mkdir -p "$tools"
apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "$@"; } >/dev/null 2>&1 \
            || echo "note: could not install $*" >&2
    fi
}
missing=()
command -v curl >/dev/null || missing+=(curl)
command -v jq >/dev/null || missing+=(jq)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
command -v man >/dev/null || missing+=(man-db)
command -v script >/dev/null || missing+=(bsdutils)
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
if [ ! -x "$tools/venv/bin/python3" ] || ! "$tools/venv/bin/python3" -c 'import websockets' 2>/dev/null; then
    rm -rf "$tools/venv"
    python3 -m venv "$tools/venv" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$tools/venv"; }
    "$tools/venv/bin/pip" install -q websockets
fi
if [ ! -d "$tools/node/node_modules/ws" ]; then
    npm install --prefix "$tools/node" --no-audit --no-fund --silent ws
fi
export PATH="$tools/venv/bin:$PATH"
export NODE_PATH="$tools/node/node_modules${NODE_PATH:+:$NODE_PATH}"
