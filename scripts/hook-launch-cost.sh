#!/usr/bin/env bash
# What the CUDA hook adds to a kernel launch, no GPU needed: one process launching 1-block
# kernels that cost the fake driver nothing (hook/tests/c), for 2 s, under the release hook with
# no configuration (pass-through), with an MPS node's configuration but turns off (memory only,
# as MPS nodes had before), with turns (what MPS nodes get now), and in a window of the card's
# time that spans the whole period (what a hook node's launch pays for its window, the waiting
# outside it aside). Interleaved rounds; prints
# each round, the medians and the ratios to pass-through. The fake launch itself is about
# 0.5 us, a real one on an H100 several us: the difference is what counts.
# Usage: scripts/hook-launch-cost.sh [rounds, default 5]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"
cargo build --release --locked -q -p tessera-cuda-hook
hook="$PWD/target/release/libtessera_cuda_hook.so"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
src=hook/tests/c
cc -shared -fPIC -O2 -I"$src" -Wl,-soname,libcuda.so.1 -Wl,-Bsymbolic -o "$work/libcuda.so.1" "$src/fake_cuda.c"
cc -shared -fPIC -O2 -I"$src" -o "$work/libnvidia-ml.so.1" "$src/fake_nvml.c"
cc -O2 -I"$src" -o "$work/client" "$src/cuda_client.c" -ldl -lpthread
config() { # <name> <compute>
    printf 'uuid=GPU-00000000-0000-0000-0000-000000000001\nmemory_limit_mib=4096\ncore_limit=%s\ncompute=%s\nstate_dir=%s\n' \
        "$3" "$2" "$work/state-$1" >"$work/$1.conf"
}
config memory throttle 100
config turns turns 30
config window windows 99
printf 'window=0-100\nperiod_ms=50\n' >>"$work/window.conf"
rate() { # <config name or "none">
    local env=(LD_LIBRARY_PATH="$work" FAKE_GPU_STATE="$work/gpu-$1" FAKE_NS_PER_BLOCK=0 FAKE_MPS=1 LD_PRELOAD="$hook")
    [ "$1" = none ] || env+=(TESSERA_HOOK_CONFIG="$work/$1.conf")
    rm -rf "$work/gpu-$1" "$work/state-$1"
    env "${env[@]}" "$work/client" launch 2000 1 | sed -n 's/^launches_per_s=//p'
}
declare -A runs
for r in $(seq "$rounds"); do
    for c in none memory turns window; do
        v="$(rate "$c")"
        runs[$c]+="$v "
        printf 'round %d %-7s %10s launches/s\n' "$r" "$c" "$v"
    done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base="$(echo "${runs[none]}" | median)"
printf '\n%-26s %12s %10s %14s\n' configuration 'launches/s' 'ns/launch' 'x pass-through'
for c in none memory turns window; do
    m="$(echo "${runs[$c]}" | median)"
    awk -v c="$c" -v m="$m" -v b="$base" 'BEGIN {
        n = (c == "none") ? "pass-through" : (c == "memory") ? "MPS node, memory only" : (c == "turns") ? "MPS node, turns" : "hook node, window";
        printf "%-26s %12d %10.0f %14.2f\n", n, m, 1e9 / m, m / b }'
done
