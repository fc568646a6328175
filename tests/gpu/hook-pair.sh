#!/usr/bin/env bash
# Two shares of one card in hook mode (time-sliced, no MPS), on the host: the CUDA probe under
# the hook with two configurations, benchmarking at once, with the hook's control steps
# (TESSERA_HOOK_DEBUG). What the cluster part's "two containers of 50% + 10 GiB" row measures,
# without Kubernetes, so that the throttle's behaviour beside a co-tenant can be read.
#
#   [COMPUTE=windows|throttle] bash tests/gpu/hook-pair.sh [LABEL=HOOK.so]...
#
# COMPUTE (default windows) is how the shares are held: in windows of the card's time that do
# not overlap, as the NRI plugin gives them now, or throttled on their NVML readings, as before.
#
# On a GPU machine (nvcc, nvidia-smi), from the repository root. Each LABEL=HOOK.so is a build
# of the hook to run (several compare builds in one run, against one whole-card baseline); the
# default is the one in .cache/gpu/bundle.tar.xz (tests/gpu/pack.sh). Files land in $OUT.
set -euo pipefail
out="${OUT:-$(mktemp -d)}"
work="$(mktemp -d /tmp/hook-pair.XXXXXX)"
trap 'rm -rf "$work"' EXIT
hooks=("$@")
if [ ${#hooks[@]} -eq 0 ]; then
  tar -xJf .cache/gpu/bundle.tar.xz -C "$work" bin/libtessera-cuda-hook.so
  hooks=("bundle=$work/bin/libtessera-cuda-hook.so")
fi
for h in "${hooks[@]}"; do
  [ -f "${h#*=}" ] || { echo "hook-pair.sh: ${h#*=} is not a file (LABEL=HOOK.so)" >&2; exit 2; }
done
nvcc -O2 -o "$work/probe" tests/gpu/probe.cu
uuid="$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)"

compute="${COMPUTE:-windows}"
case "$compute" in windows|throttle) ;; *) echo "hook-pair.sh: COMPUTE=$compute is neither windows nor throttle" >&2; exit 2 ;; esac
# cfg NAME CORE WINDOW: a share's hook configuration, as the NRI plugin writes it.
cfg() {
  mkdir -p "$work/$1/state"
  printf 'uuid=%s\nmemory_limit_mib=10240\ncore_limit=%s\nstate_dir=%s\ncompute=%s\n' "$uuid" "$2" "$work/$1/state" "$compute" > "$work/$1/config"
  [ "$compute" = windows ] && printf 'window=%s\nperiod_ms=50\n' "$3" >> "$work/$1/config"
  return 0
}
# run NAME PROBE-ARGS...: the probe under $hook with NAME's configuration.
run() {
  local name="$1"; shift
  LD_PRELOAD="$hook" TESSERA_HOOK_CONFIG="$work/$name/config" TESSERA_HOOK_DEBUG=1 \
    "$work/probe" "$@" > "$out/$name.out" 2> "$out/$name.err"
}
rate() { grep -h '^kernels_per_s=' "$out/$1.out" | cut -d= -f2; }
# The controller's utilization readings, one per 100 ms step (None: no new sample).
trace() { grep -o 'util=[^ ]*' "$out/$1.err" | sed 's/util=Some(\([0-9]*\))/\1/; s/util=None/-/' | tr '\n' ' ' | cut -c1-400; echo; }

"$work/probe" --bench-ms 3000 > "$out/whole.out" 2>/dev/null
whole="$(rate whole)"
echo "# hook-pair ($compute): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), whole card $whole kernels/s" |
  tee "$out/hook-pair.txt"
for h in "${hooks[@]}"; do
  label="${h%%=*}" hook="${h#*=}"
  p="$label-"
  cfg "${p}single" 50 0-50; run "${p}single" --bench-ms 3000
  cfg "${p}a" 50 0-50; cfg "${p}b" 50 50-100
  run "${p}a" --bench-ms 6000 & run "${p}b" --bench-ms 6000 & wait
  cfg "${p}c" 50 0-50; cfg "${p}d" 50 50-100
  run "${p}c" --bench-ms 6000 & sleep 1; run "${p}d" --bench-ms 5000 & wait
  cfg "${p}e" 50 0-50; cfg "${p}f" 50 50-100
  run "${p}e" --alloc-gib 20 --bench-ms 3000 --fill & run "${p}f" --alloc-gib 20 --bench-ms 3000 --fill & wait
  cfg "${p}g" 30 0-30
  run "${p}g" --bench-ms 4000 &
  LD_PRELOAD="$hook" TESSERA_HOOK_CONFIG="$work/${p}g/config" "$work/probe" --bench-ms 4000 > "$out/${p}g2.out" 2>/dev/null &
  LD_PRELOAD="$hook" TESSERA_HOOK_CONFIG="$work/${p}g/config" "$work/probe" --bench-ms 4000 > "$out/${p}g3.out" 2>/dev/null &
  wait
  {
    echo "## $label (single: one 50% share alone; a+b, c+d (d 1 s later), e+f (after a fill): two 50% shares at once)"
    for n in single a b c d e f; do
      printf '%-14s %8s kernels/s  %5s x whole\n' "$p$n" "$(rate "$p$n")" \
        "$(awk -v a="$(rate "$p$n")" -v b="$whole" 'BEGIN { printf "%.2f", a / b }')"
    done
    g="$(for n in g g2 g3; do rate "$p$n"; done | awk '{ t += $1 } END { printf "%.2f", t }')"
    printf '%-14s %8s kernels/s  %5s x whole (three processes of one 30%% share, together)\n' "${p}g" "$g" \
      "$(awk -v a="$g" -v b="$whole" 'BEGIN { printf "%.2f", a / b }')"
    for n in single a b; do echo "   $p$n readings: $(trace "$p$n")"; done
  } | tee -a "$out/hook-pair.txt"
done
