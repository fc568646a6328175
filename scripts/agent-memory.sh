#!/usr/bin/env bash
# Idle resident memory of the node agents on the 8-GPU fixture (h100x8), no GPU needed:
# each release binary is started on its own, left idle for a few seconds, and its VmRSS read
# from /proc. The NRI plugin is not measured here: it needs a runtime's NRI socket to stay up.
# Usage: scripts/agent-memory.sh [seconds idle, default 5]
set -euo pipefail
cd "$(dirname "$0")/.."
idle="${1:-5}"
cargo build --release --locked -q -p tessera-cdi-generator -p tessera-device-plugin -p tessera-mps
bin=target/release
work="$(mktemp -d)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/cdi" "$work/plugins" "$work/mps"

start() { # <name> <command...>
    local name="$1"
    shift
    "$@" >"$work/$name.log" 2>&1 &
    pids+=("$!")
    echo "$name $!" >>"$work/started"
}
start tessera-cdi-generator "$bin/tessera-cdi-generator" run --fixture h100x8 --cdi-dir "$work/cdi" \
    --driver-bundle-dir "$work/bundles"
start tessera-device-plugin "$bin/tessera-device-plugin" --fixture h100x8 --plugin-dir "$work/plugins"
start tessera-mps-supervisor "$bin/tessera-mps-supervisor" run --fixture h100x8 --mps-root "$work/mps" \
    --control-binary "$PWD/mps/tests/fixtures/fake-mps-control"
sleep "$idle"
printf '%-24s %10s %10s\n' agent 'RSS MiB' 'peak MiB'
while read -r name pid; do
    if [[ ! -r /proc/$pid/status ]]; then
        echo "$name exited; its log:" >&2
        tail -5 "$work/$name.log" >&2
        exit 1
    fi
    awk -v n="$name" '/^VmRSS:/{r=$2} /^VmHWM:/{h=$2} END{printf "%-24s %10.1f %10.1f\n", n, r/1024, h/1024}' \
        "/proc/$pid/status"
done <"$work/started"
