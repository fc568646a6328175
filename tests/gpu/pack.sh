#!/usr/bin/env bash
# Builds what tests/gpu/run.sh needs on a GPU machine without network into
# .cache/gpu/bundle.tar.xz: the release binaries (stripped; the CUDA hook as it ships, built
# for glibc 2.28) and the containerd 1.7 / 2.x, runc
# and busybox the harness fetched (tests/runtimes/fetch.sh); and, for its cluster part, into
# .cache/gpu/cluster.tar.xz: Kubernetes (the shared multi-call binary, still compressed), etcd
# and the CNI plugins the cluster uses (tests/cluster/fetch.sh), and Debian's `ip`
# (tests/gpu/fetch-tools.sh). Carry `.cache/gpu` to the GPU
# machine (each file under 64 MiB: one per transfer where both are too much at once). Prints
# their sizes.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
cache="$repo/.cache/runtimes"
bash tests/runtimes/fetch.sh "$cache" >/dev/null
# The hook as it ships (glibc 2.28 symbols, hook/build-portable.sh), not a native build.
hook="$(bash hook/build-portable.sh)"
bins="tessera-cdi-generator tessera-nri-plugin tessera-mps-supervisor tessera-gpu-e2e tessera-gpu-cluster
  tessera-extender tessera-device-plugin tessera-dra-plugin"
cargo build --release --locked -p tessera-cdi-generator -p tessera-nri-plugin -p tessera-mps -p tessera-tests \
  -p tessera-extender -p tessera-device-plugin -p tessera-dra-plugin $(printf -- '--bin %s ' $bins)
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/runtimes"
for b in $bins; do
  strip -o "$stage/bin/$b" "target/release/$b"
done
strip -o "$stage/bin/libtessera-cuda-hook.so" "$hook"
# Only the runtime binaries the harness runs, in the cache's own layout (ready-v3 is relative).
# One ctr serves both (the harness only imports images; 1.7's ctr uses the content API 2.x
# still serves), which keeps the bundle under the device tool's 64 MiB.
for v in containerd-1.7 containerd-2; do
  mkdir -p "$stage/runtimes/$v/usr/bin"
  for b in containerd containerd-shim-runc-v2; do cp "$cache/$v/usr/bin/$b" "$stage/runtimes/$v/usr/bin/"; done
done
cp "$cache/containerd-1.7/usr/bin/ctr" "$stage/runtimes/containerd-1.7/usr/bin/"
ln -s ../../../containerd-1.7/usr/bin/ctr "$stage/runtimes/containerd-2/usr/bin/ctr"
mkdir -p "$stage/runtimes/runc/usr/sbin" "$stage/runtimes/busybox/bin"
cp "$cache/runc/usr/sbin/runc" "$stage/runtimes/runc/usr/sbin/"
cp "$cache/busybox/bin/busybox" "$stage/runtimes/busybox/bin/"
cp "$cache/busybox-image.tar" "$cache/ready-v3" "$stage/runtimes/"
mkdir -p .cache/gpu
tar -C "$stage" -cf - bin runtimes | xz -T0 -9 > .cache/gpu/bundle.tar.xz.tmp
mv .cache/gpu/bundle.tar.xz.tmp .cache/gpu/bundle.tar.xz

# The cluster part: what tests/cluster/fetch.sh lays out, but Kubernetes still compressed
# (run.sh unpacks it and links its names) and only the CNI plugins the cluster's network uses.
kube_xz="${KUBE_ALL_XZ:-$repo/../shared/k8s/kube-all.xz}"
[ -f "$kube_xz" ] || { echo "pack.sh: no $kube_xz (set KUBE_ALL_XZ)" >&2; exit 1; }
cluster="$repo/.cache/cluster"
bash tests/cluster/fetch.sh "$cluster" >/dev/null
rm -rf "$stage/cluster" && mkdir -p "$stage/cluster/etcd/usr/bin" "$stage/cluster/cni/usr/lib/cni"
cp "$kube_xz" "$stage/cluster/kube-all.xz"
cp "$cluster/etcd/usr/bin/etcd" "$stage/cluster/etcd/usr/bin/"
for p in bridge host-local loopback portmap; do cp "$cluster/cni/usr/lib/cni/$p" "$stage/cluster/cni/usr/lib/cni/"; done
# `ip` with its libraries, for a GPU machine without one (run.sh uses the machine's own first).
tools="$(bash tests/gpu/fetch-tools.sh | awk '$1 == "ip" {print $3}')"
cp -a "$tools" "$stage/cluster/ip"
cp "$cluster/ready-v1" "$stage/cluster/ready-v1"
tar -C "$stage" -cf - cluster | xz -T0 -9 > .cache/gpu/cluster.tar.xz.tmp
mv .cache/gpu/cluster.tar.xz.tmp .cache/gpu/cluster.tar.xz
du -h .cache/gpu/bundle.tar.xz .cache/gpu/cluster.tar.xz
