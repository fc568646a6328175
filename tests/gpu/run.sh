#!/usr/bin/env bash
# Tessera's node stack on a real GPU: the CDI spec generated with no flags, the MPS supervisor,
# the NRI plugin on containerd 1.7 and 2.x, containers created through CRI, and what CUDA sees
# inside them (a whole card, 30% + 8 GiB shares alone and side by side, ...).
# Prints a table: runtime | case | expected | PASS/FAIL/SKIP | observed (SKIP: needs a newer driver than
# the machine has, naming its version). Exits 1 if a case fails.
#
# Then, with `--only cluster` or by default after that table, Tessera on a real Kubernetes on the
# same machine (tessera-gpu-cluster: v1.36.2's control plane, a kubelet and containerd 2.x in a
# network namespace of their own, Tessera's node agents on NVML, the extender and the DRA plugin):
# pods through the real scheduler, the kubelet's Allocate and NodePrepareResources, the probe in
# each; MPS, then hook; pod start of a share pod against a plain one. Its table goes to
# $OUT/gpu-cluster-table.txt.
#
# Not part of .ci/run (CI has no GPU). On a machine with an NVIDIA GPU, driver, nvcc, root and
# no network, from the repository root:
#
#   bash tests/gpu/pack.sh        # on a machine with network: builds .cache/gpu/bundle.tar.xz
#                                 # and .cache/gpu/cluster.tar.xz (Kubernetes, etcd, CNI)
#   bash tests/gpu/run.sh [--only cri|cluster] [--runtime 1.7|2]...   # on the GPU machine (carry .cache/gpu there:
#                                 # each tarball is under 64 MiB, so two transfers can carry them)
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
#       bundle: what the test suite runs (tests/tests/gpu_dry_run.rs, gpu_cluster_dry_run.rs)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dry="" bin_dir="" only=""
runtimes=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift ;;
    --only)
      case "${2:-}" in cri|cluster) only="$2" ;; *) echo "run.sh: --only takes cri or cluster, not '${2:-}'" >&2; exit 2 ;; esac
      shift 2 ;;
    --bin-dir) bin_dir="$(cd "${2:?--bin-dir needs a directory}" && pwd)"; shift 2 ;;
    --runtime)
      case "${2:-}" in 1.7|2) runtimes+=(--runtime "$2") ;; *) echo "run.sh: --runtime takes 1.7 or 2, not '${2:-}'" >&2; exit 2 ;; esac
      shift 2 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work="$(mktemp -d /tmp/tgpu.XXXXXX)"
trap 'rm -rf "$work"' EXIT
if [ -n "$bin_dir" ]; then
  mkdir -p "$work/bin"
  for b in tessera-cdi-generator tessera-nri-plugin tessera-mps-supervisor tessera-gpu-e2e \
    tessera-gpu-cluster tessera-extender tessera-device-plugin tessera-dra-plugin; do
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
  if [ "$only" != cri ]; then
    # Kubernetes, etcd and the CNI plugins, laid out as tests/cluster/fetch.sh's cache.
    kube="$repo/.cache/gpu/cluster.tar.xz"
    [ -f "$kube" ] || { echo "run.sh: $kube is missing: run tests/gpu/pack.sh first (or --only cri)" >&2; exit 2; }
    tar -xJf "$kube" -C "$work"
    mkdir -p "$work/cluster/kube/bin"
    xz -dc "$work/cluster/kube-all.xz" > "$work/cluster/kube/bin/kube-all" && chmod +x "$work/cluster/kube/bin/kube-all"
    for n in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do ln -s kube-all "$work/cluster/kube/bin/$n"; done
    export TESSERA_CLUSTER_CACHE="$work/cluster"
    # The machine's `ip` if it has one, else Debian's from the bundle, with its libraries.
    if ! command -v ip >/dev/null && [ -x "$work/cluster/ip/bin/ip" ]; then
      mkdir -p "$work/tools"
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$work/cluster/ip/lib" "$work/cluster/ip/bin/ip" > "$work/tools/ip"
      chmod +x "$work/tools/ip"
      export PATH="$PATH:$work/tools"
      echo "== ip: the machine has none, Debian's from the bundle ($("$work/tools/ip" -V))"
    fi
  fi
fi
if [ "$only" != cri ]; then
  for t in ip nsenter openssl mount; do
    command -v "$t" >/dev/null || { echo "run.sh: the cluster part needs $t on PATH (or --only cri)" >&2; exit 2; }
  done
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
[ -f /run/tessera/hook/config ] && echo "hook_compute=$(grep '^compute=' /run/tessera/hook/config | cut -d= -f2)"
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

rc=0
if [ "$only" != cluster ]; then
  out="${OUT:-$work}/gpu-table.txt"
  "$work/bin/tessera-gpu-e2e" --bin-dir "$work/bin" --probe-image "$work/probe.tar" \
    ${dry:+--dry-run "$repo/mps/tests/fixtures/fake-mps-control"} ${runtimes[@]+"${runtimes[@]}"} --out "$out" || rc=$?

  # The hook under a real framework, on the host (tests/gpu/torch_hook.py), where python3 has
  # PyTorch and CuPy.
  if [ -z "$dry" ] && python3 -c 'import torch, cupy' 2>/dev/null; then
    uuid="$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)"
    python3 "$repo/tests/gpu/torch_hook.py" --hook "$work/bin/libtessera-cuda-hook.so" --uuid "$uuid" \
      --out "$out" || rc=$?
  fi
fi

if [ "$only" != cri ]; then
  "$work/bin/tessera-gpu-cluster" --probe-image "$work/probe.tar" --hook-library "$work/bin/libtessera-cuda-hook.so" \
    ${dry:+--dry-run "$repo/mps/tests/fixtures/fake-mps-control" --rounds 3} \
    --out "${OUT:-$work}/gpu-cluster-table.txt" || rc=$?
fi
exit "$rc"
