#!/usr/bin/env bash
# Fetches what a real single-node Kubernetes needs besides the container runtimes (those come
# from tests/runtimes/fetch.sh): the Kubernetes binaries, etcd and the CNI plugins, unpacked
# under a cache folder, nothing installed on the host.
#
#   tests/cluster/fetch.sh [CACHE_DIR]      (default: <repo>/.cache/cluster)
#
# Kubernetes comes from KUBE_BIN_DIR (a directory of upstream binaries: kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kubectl) when set, else from the shared
# multi-call binary (shared/k8s/kube-all.xz beside the checkout or in it, or KUBE_ALL_XZ), linked
# under each name. etcd is Debian sid's etcd-server, the CNI plugins bookworm's
# containernetworking-plugins. Prints one line per item: NAME VERSION PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
source "$here/../private-apt.sh"
open_cache "${1:-${TESSERA_CLUSTER_CACHE:-$repo/.cache/cluster}}" ready-v1 "${TESSERA_REFRESH_CLUSTER:-}"

bin="$cache/kube/bin"
rm -rf "$cache/kube" && mkdir -p "$bin"
names="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl"
if [ -n "${KUBE_BIN_DIR:-}" ]; then
  for n in $names; do
    [ -x "$KUBE_BIN_DIR/$n" ] || { echo "fetch.sh: KUBE_BIN_DIR has no $n" >&2; exit 1; }
    ln -s "$(cd "$KUBE_BIN_DIR" && pwd)/$n" "$bin/$n"
  done
else
  xz_file="${KUBE_ALL_XZ:-}"
  if [ -z "$xz_file" ]; then
    # shared/ beside the checkout, or inside it (a working tree carried elsewhere).
    for c in "$repo/../shared/k8s/kube-all.xz" "$repo/shared/k8s/kube-all.xz"; do
      [ -f "$c" ] && { xz_file="$c"; break; }
    done
  fi
  [ -n "$xz_file" ] && [ -f "$xz_file" ] || {
    echo "fetch.sh: no Kubernetes binaries: neither ../shared/k8s/kube-all.xz beside the checkout nor KUBE_ALL_XZ or KUBE_BIN_DIR" >&2
    exit 1
  }
  xz -dc "$xz_file" > "$bin/kube-all"
  chmod +x "$bin/kube-all"
  for n in $names; do ln -s kube-all "$bin/$n"; done
fi
vkube="$("$bin/kubelet" --version | awk '{print $2}')"

private_apt "$cache/apt" \
  "deb http://deb.debian.org/debian sid main" \
  "deb http://deb.debian.org/debian bookworm main"
vetcd="$(pick etcd-server sid 3.5)"
vcni="$(pick containernetworking-plugins bookworm 1.)"
for v in vetcd vcni; do
  [ -n "${!v}" ] || { echo "fetch.sh: no version found for $v" >&2; exit 1; }
done
extract etcd etcd-server "$vetcd"
extract cni containernetworking-plugins "$vcni"

cat > "$ready.tmp" <<READY
kube $vkube @/kube/bin
etcd $vetcd @/etcd/usr/bin/etcd
cni $vcni @/cni/usr/lib/cni
READY
publish_ready
