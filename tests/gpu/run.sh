#!/usr/bin/env bash
# Tessera's node stack on a real GPU: the CDI spec generated with no flags, the MPS supervisor,
# the NRI plugin on containerd 1.7 and 2.x, containers created through CRI, and what CUDA sees
# inside them (a whole card, 30% + 8 GiB shares alone and side by side, ...).
# Prints a table: runtime | case | expected | PASS/FAIL/SKIP | observed (SKIP: needs a newer driver than
# the machine has, naming its version). Exits 1 if a case fails.
#
# Not part of .ci/run (CI has no GPU). On a machine with an NVIDIA GPU, driver, nvcc, root and
# no network, from the repository root:
#
#   bash tests/gpu/pack.sh        # on a machine with network: builds .cache/gpu/bundle.tar.xz
#   bash tests/gpu/run.sh         # on the GPU machine (carry .cache/gpu there)
#   bash tests/gpu/run.sh --dry-run   # anywhere: the same cases on a fixture node, no CUDA
#
# The bundle holds the release binaries (stripped), containerd 1.7 and 2.x, runc and busybox
# from the harness's cache. The CUDA probe (tests/gpu/probe.cu) is built here with nvcc and
# packed into an image with the C libraries it and nvidia-smi need; the driver's libraries come
# only from Tessera's injection. Where python3 has PyTorch and CuPy, tests/gpu/torch_hook.py
# then runs them under the hook on the host. The table is also written to $OUT/gpu-table.txt when OUT is set.
#
#   bash tests/gpu/run.sh --dry-run --bin-dir target/debug   # the dry run on binaries built
#       here (`cargo build --workspace`) and the runtimes tests/runtimes/fetch.sh fetched, no
#       bundle: what the test suite runs (tests/tests/gpu_dry_run.rs)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dry="" bin_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift ;;
    --bin-dir) bin_dir="$(cd "${2:?--bin-dir needs a directory}" && pwd)"; shift 2 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work="$(mktemp -d /tmp/tgpu.XXXXXX)"
trap 'rm -rf "$work"' EXIT
if [ -n "$bin_dir" ]; then
  mkdir -p "$work/bin"
  for b in tessera-cdi-generator tessera-nri-plugin tessera-mps-supervisor tessera-gpu-e2e; do
    [ -x "$bin_dir/$b" ] || { echo "run.sh: $bin_dir/$b is not built (cargo build --workspace --bins --lib)" >&2; exit 2; }
    ln -s "$bin_dir/$b" "$work/bin/$b"
  done
  [ -f "$bin_dir/libtessera_cuda_hook.so" ] || {
    echo "run.sh: $bin_dir/libtessera_cuda_hook.so is not built (cargo build --workspace --bins --lib)" >&2; exit 2; }
  ln -s "$bin_dir/libtessera_cuda_hook.so" "$work/bin/libtessera-cuda-hook.so"
  bash "$repo/tests/runtimes/fetch.sh" >/dev/null
  export TESSERA_RUNTIME_CACHE="${TESSERA_RUNTIME_CACHE:-$repo/.cache/runtimes}"
else
  bundle="$repo/.cache/gpu/bundle.tar.xz"
  [ -f "$bundle" ] || { echo "run.sh: $bundle is missing: run tests/gpu/pack.sh first" >&2; exit 2; }
  tar -xJf "$bundle" -C "$work"
  export TESSERA_RUNTIME_CACHE="$work/runtimes"
fi

echo "== machine: $(uname -r), $(nproc) cores"
if [ -z "$dry" ]; then
  command -v nvidia-smi >/dev/null || { echo "run.sh: no nvidia-smi: not a GPU machine (use --dry-run)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader
fi

# The probe image: busybox, the probe, and the C libraries the probe and nvidia-smi link.
root="$work/probe-root"
mkdir -p "$root/bin" "$root/etc" "$root/tmp"
cp "$TESSERA_RUNTIME_CACHE/busybox/bin/busybox" "$root/bin/busybox"
for l in sh env ls wc grep cat echo test sleep; do ln -s busybox "$root/bin/$l"; done
echo 'root:x:0:0:root:/root:/bin/sh' > "$root/etc/passwd"
echo 'root:x:0:' > "$root/etc/group"
if [ -n "$dry" ]; then
  cat > "$root/probe" <<'PROBE'
#!/bin/sh
# Dry-run stand-in for the CUDA probe: counts GPU device nodes; reports the driver mount and
# the MPS daemon the container is connected to (the fake daemon writes its card into its shm).
n=0
for d in /dev/nvidia[0-9]*; do [ -e "$d" ] && n=$((n+1)); done
echo "devices=$n"
[ -f /usr/local/nvidia/lib64/libcuda.so.1 ] && echo "name=libcuda.so.1 mounted"
[ -n "$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" ] && echo "mps_threads=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
[ -f /dev/shm/tessera-fake-mps ] && echo "mps_shm=$(cat /dev/shm/tessera-fake-mps)"
[ -f /etc/ld.so.preload ] && echo "hook_preload=$(cat /etc/ld.so.preload)"
[ -f /run/tessera/hook/config ] && echo "hook_memory=$(grep memory_limit_mib /run/tessera/hook/config | cut -d= -f2)"
# A benchmark run lasts a while on a GPU (the node metrics are scraped meanwhile): so here.
case "$*" in *--bench-ms*) sleep 1 ;; esac
exit 0
PROBE
  chmod +x "$root/probe"
else
  nvcc -O2 -o "$root/probe" "$repo/tests/gpu/probe.cu"
  for bin in "$root/probe" "$(command -v nvidia-smi)"; do
    ldd "$bin" | awk '/=>/ {print $3} !/=>/ && /^\t\// {print $1}' | grep -v -E 'libnvidia|libcuda' |
      while read -r lib; do
        [ -n "$lib" ] && [ -e "$lib" ] || continue
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
      done
  done
fi
bash "$repo/tests/runtimes/oci-image.sh" "$root" docker.io/tessera/probe:gpu "$work/probe.tar"

out="${OUT:-$work}/gpu-table.txt"
rc=0
"$work/bin/tessera-gpu-e2e" --bin-dir "$work/bin" --probe-image "$work/probe.tar" \
  ${dry:+--dry-run "$repo/mps/tests/fixtures/fake-mps-control"} --out "$out" || rc=$?

# The hook under a real framework, on the host (tests/gpu/torch_hook.py), where python3 has
# PyTorch and CuPy.
if [ -z "$dry" ] && python3 -c 'import torch, cupy' 2>/dev/null; then
  uuid="$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)"
  python3 "$repo/tests/gpu/torch_hook.py" --hook "$work/bin/libtessera-cuda-hook.so" --uuid "$uuid" \
    --out "$out" || rc=$?
fi
exit "$rc"
