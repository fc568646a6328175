#!/usr/bin/env bash
# Fetches the container runtimes the end-to-end tests drive, without touching the system's apt
# configuration: containerd (newest 1.7.x of Debian trixie, newest 2.x of sid), runc 1.1.5
# (bookworm; trixie's needs a newer glibc) and busybox-static, extracted under a cache folder,
# plus a one-layer busybox OCI image tarball. Idempotent and safe to run concurrently.
#
#   tests/runtimes/fetch.sh [CACHE_DIR]      (default: <repo>/.cache/runtimes)
#
# Prints one line per component: NAME VERSION PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../private-apt.sh"
# Bump the ready file when the recipe changes.
open_cache "${1:-${TESSERA_RUNTIME_CACHE:-$here/../../.cache/runtimes}}" ready-v3 "${TESSERA_REFRESH_RUNTIMES:-}"
private_apt "$cache/apt" \
  "deb http://deb.debian.org/debian trixie main" \
  "deb http://deb.debian.org/debian sid main" \
  "deb http://deb.debian.org/debian bookworm main"
v17="$(pick containerd trixie 1.7.)"
v2="$(pick containerd sid 2.)"
vrunc="$(pick runc bookworm 1.1.)"
vbusybox="$(pick busybox-static bookworm 1:)"
for v in v17 v2 vrunc vbusybox; do
  [ -n "${!v}" ] || { echo "fetch.sh: no version found for $v" >&2; exit 1; }
done

extract containerd-1.7 containerd "$v17"
extract containerd-2 containerd "$v2"
extract runc runc "$vrunc"
extract busybox busybox-static "$vbusybox"

# A one-layer OCI image: busybox and the links the tests use. Its default command blocks, so
# it also serves as the sandbox (pause) image. Bump the ready-vN marker when the recipe changes.
img="$cache/image.work"
rm -rf "$img" && mkdir -p "$img/bin" "$img/etc" "$img/tmp"
cp "$cache/busybox/bin/busybox" "$img/bin/busybox"
for l in sh sleep env ls cat true false echo test grep stat readlink; do ln -s busybox "$img/bin/$l"; done
echo 'root:x:0:0:root:/root:/bin/sh' > "$img/etc/passwd"
echo 'root:x:0:' > "$img/etc/group"
bash "$here/oci-image.sh" "$img" docker.io/tessera/busybox:test "$cache/busybox-image.tar"
rm -rf "$img"

cat > "$ready.tmp" <<READY
containerd-1.7 $v17 @/containerd-1.7/usr/bin
containerd-2 $v2 @/containerd-2/usr/bin
runc $vrunc @/runc/usr/sbin/runc
busybox $vbusybox @/busybox/bin/busybox
image docker.io/tessera/busybox:test @/busybox-image.tar
READY
publish_ready
