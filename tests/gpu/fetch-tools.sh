#!/usr/bin/env bash
# Fetches what the GPU harness's cluster part needs on a machine that may lack it: Debian
# bookworm's `ip` (iproute2) and the libraries it links, unpacked under a cache folder, nothing
# installed. tests/gpu/pack.sh packs it; tests/gpu/run.sh uses it only where the machine has no
# `ip` of its own.
#
#   tests/gpu/fetch-tools.sh [CACHE_DIR]      (default: <repo>/.cache/gpu-tools)
#
# Prints one line: ip VERSION PATH (a folder holding bin/ip and lib/).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
source "$here/../private-apt.sh"
open_cache "${1:-$repo/.cache/gpu-tools}" ready-v1 ""
private_apt "$cache/apt" "deb http://deb.debian.org/debian bookworm main"
rm -rf "$cache/ip" && mkdir -p "$cache/ip/bin" "$cache/ip/lib"
# `ip` and what `ldd ip` lists on bookworm besides libc.
for p in iproute2 libbpf1 libelf1 libmnl0 libbsd0 libcap2 zlib1g libmd0; do
  v="$(pick "$p" bookworm "")"
  [ -n "$v" ] || { echo "fetch-tools.sh: no version of $p in bookworm" >&2; exit 1; }
  extract "pkg-$p" "$p" "$v"
  [ "$p" = iproute2 ] && { vip="$v"; cp "$cache/pkg-$p/bin/ip" "$cache/ip/bin/ip"; continue; }
  find "$cache/pkg-$p" -name '*.so*' \( -type f -o -type l \) -exec cp -P {} "$cache/ip/lib/" \;
  rm -rf "$cache/pkg-$p"
done
rm -rf "$cache/pkg-iproute2"
echo "ip $vip @/ip" > "$ready.tmp"
publish_ready
