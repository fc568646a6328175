#!/usr/bin/env bash
# Builds what tests/gpu/run.sh needs on a GPU machine without network into
# .cache/gpu/bundle.tar.xz: the release binaries (stripped; the CUDA hook as it ships, built
# for glibc 2.28) and the containerd 1.7 / 2.x, runc
# and busybox the harness fetched (tests/runtimes/fetch.sh). Carry `.cache/gpu` to the GPU
# machine. Prints the bundle's size.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
cache="$repo/.cache/runtimes"
bash tests/runtimes/fetch.sh "$cache" >/dev/null
# The hook as it ships (glibc 2.28 symbols, hook/build-portable.sh), not a native build.
hook="$(bash hook/build-portable.sh)"
cargo build --release --locked -p tessera-cdi-generator -p tessera-nri-plugin -p tessera-mps -p tessera-tests \
  --bin tessera-cdi-generator --bin tessera-nri-plugin --bin tessera-mps-supervisor --bin tessera-gpu-e2e
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/runtimes"
for b in tessera-cdi-generator tessera-nri-plugin tessera-mps-supervisor tessera-gpu-e2e; do
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
du -h .cache/gpu/bundle.tar.xz
