#!/usr/bin/env bash
# Builds Tessera's image without Docker: every tessera-* binary and the CUDA hook, with the C
# library they (and the driver programs the node agents run from the host) need, packed as a
# one-layer OCI image archive, reproducibly (sorted, mtime 0, root-owned: the same binaries give
# the same digest). The Dockerfile builds the same image where a Docker engine runs.
#
#   bash scripts/image.sh [--name NAME] [--out FILE] [--from DIR]
#
#   --name   the image's name (default: tessera:dev)
#   --out    the archive (default: target/image/tessera.tar)
#   --from   pack the binaries already built in DIR (e.g. target/debug, after
#            `cargo build --workspace`), the hook from DIR/libtessera_cuda_hook.so, instead of
#            building the release ones (scripts/ship.sh): quick, for tests; not for clusters
#
# Then, to a registry (either tool; neither needs a daemon):
#   skopeo copy oci-archive:target/image/tessera.tar docker://registry.example.com/tessera:0.1.0
#   crane push target/image/tessera.tar registry.example.com/tessera:0.1.0
# or into a node's containerd without a registry:
#   ctr -n k8s.io images import target/image/tessera.tar
# and render the manifests for it:
#   cargo run -p tessera-deploy -- --image registry.example.com/tessera:0.1.0 --out tessera.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
name="tessera:dev" out="target/image/tessera.tar" from=""
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="${2:?--name needs a value}"; shift 2 ;;
    --out) out="${2:?--out needs a value}"; shift 2 ;;
    --from) from="${2:?--from needs a directory}"; shift 2 ;;
    *) echo "image.sh: unknown argument $1 (see the header of scripts/image.sh)" >&2; exit 2 ;;
  esac
done
bins=(tessera-extender tessera-manifests tessera-cdi-generator tessera-device-plugin tessera-dra-plugin
      tessera-nri-plugin tessera-mps-supervisor)
strip=""
if [ -n "$from" ]; then
  strip=1 hook="$from/libtessera_cuda_hook.so"
  for f in "${bins[@]/#/$from/}" "$hook"; do
    [ -f "$f" ] || { echo "image.sh: $f is not built (cargo build --workspace)" >&2; exit 2; }
  done
else
  bash scripts/ship.sh target/ship >&2
  from="target/ship/bin" hook="target/ship/bin/libtessera-cuda-hook.so"
fi
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/local/bin" "$root/usr/local/lib/tessera" "$root/etc" "$root/tmp"
chmod 1777 "$root/tmp"
# put SRC DEST MODE: a binary into the image. Debug builds (--from) lose their debug info on the
# way, as the shipped ones did (scripts/ship.sh): the symbol table stays, and the image test's
# archives stay small on a CI disk that is often nearly full.
put() {
  if [ -n "$strip" ]; then strip --strip-debug -o "$2" "$1"; else cp "$1" "$2"; fi
  chmod "$3" "$2"
}
for b in "${bins[@]}"; do
  put "$from/$b" "$root/usr/local/bin/$b" 0755
done
# Installed on the host by tessera-cdi-generator, preloaded into share containers.
put "$hook" "$root/usr/local/lib/tessera/libtessera-cuda-hook.so" 0644
# The C library: what the binaries link, and what the host's nvidia-smi and MPS control daemon
# (run from the driver's own directory by the node agents) expect of the image they run in.
libs=()
for b in "${bins[@]}"; do
  while read -r lib; do libs+=("$lib"); done < <(ldd "$from/$b" | grep -o '/[^ ]*\.so[^ ]*')
done
for l in libdl.so.2 libpthread.so.0 librt.so.1; do
  p="$(ldconfig -p | awk -v l="$l" '!found && $1 == l && /x86-64/ { print $NF; found = 1 }')"
  [ -n "$p" ] && libs+=("$p")
done
for lib in $(printf '%s\n' "${libs[@]}" | sort -u); do
  real="$(readlink -f "$lib")"
  mkdir -p "$root$(dirname "$lib")"
  cp "$real" "$root$lib"
done
echo 'root:x:0:0:root:/root:/usr/sbin/nologin' > "$root/etc/passwd"
echo 'nonroot:x:65532:65532:nonroot:/nonexistent:/usr/sbin/nologin' >> "$root/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' > "$root/etc/group"
mkdir -p "$(dirname "$out")"
# As the Dockerfile's: the extender by default, as user 65532 (the node agents run as root).
IMAGE_CONFIG='{"Env":["PATH=/usr/local/bin:/usr/bin:/bin"],"Entrypoint":["/usr/local/bin/tessera-extender"],"User":"65532:65532"}' \
  bash tests/runtimes/oci-image.sh "$root" "$name" "$out"
digest="$(tar -xOf "$out" ./index.json | grep -o 'sha256:[0-9a-f]*' | sed -n 1p)"
echo "$out: $name ($digest, $(stat -c %s "$out") bytes)"
