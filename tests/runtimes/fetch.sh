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
cache="${1:-${TESSERA_RUNTIME_CACHE:-$here/../../.cache/runtimes}}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
exec 9>"$cache/.lock"
flock 9

if [ -f "$cache/ready-v2" ] && [ -z "${TESSERA_REFRESH_RUNTIMES:-}" ]; then
  cat "$cache/ready-v2"
  exit 0
fi

apt_dir="$cache/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
cat > "$apt_dir/sources.list" <<'LIST'
deb http://deb.debian.org/debian trixie main
deb http://deb.debian.org/debian sid main
deb http://deb.debian.org/debian bookworm main
LIST
apt_opts=(
  -o "Dir::Etc::SourceList=$apt_dir/sources.list"
  -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$apt_dir/lists"
  -o "Dir::Cache=$apt_dir/cache"
  -o "Debug::NoLocking=1"
  -o "APT::Sandbox::User=root"
)
apt-get "${apt_opts[@]}" -qq update >/dev/null

# Newest version of PACKAGE in SUITE whose version starts with PREFIX.
pick() {
  apt-cache "${apt_opts[@]}" madison "$1" | awk -F'|' -v suite="$2" -v prefix="$3" '
    { gsub(/ /, "", $2); if (index($3, " " suite "/") && index($2, prefix) == 1) print $2 }' |
    sort -V | tail -n 1
}
v17="$(pick containerd trixie 1.7.)"
v2="$(pick containerd sid 2.)"
vrunc="$(pick runc bookworm 1.1.)"
vbusybox="$(pick busybox-static bookworm 1:)"
for v in v17 v2 vrunc vbusybox; do
  [ -n "${!v}" ] || { echo "fetch.sh: no version found for $v" >&2; exit 1; }
done

extract() { # NAME PACKAGE VERSION
  local dest="$cache/$1"
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" -qq download "$2=$3" >/dev/null)
  dpkg -x "$apt_dir/debs/$(ls "$apt_dir/debs" | grep -F "$2_" | grep -F "$(echo "$3" | sed 's/:/%3a/')" | head -n 1)" "$dest.tmp"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}
extract containerd-1.7 containerd "$v17"
extract containerd-2 containerd "$v2"
extract runc runc "$vrunc"
extract busybox busybox-static "$vbusybox"

# A one-layer OCI image (image-layout tarball): busybox and the links the tests use. Its
# default command blocks, so it also serves as the sandbox (pause) image. Bump the ready-vN
# marker when the recipe changes.
img="$cache/image.work"
rm -rf "$img" && mkdir -p "$img/rootfs/bin" "$img/rootfs/etc" "$img/rootfs/tmp" "$img/layout/blobs/sha256"
cp "$cache/busybox/bin/busybox" "$img/rootfs/bin/busybox"
for l in sh sleep env ls cat true false echo test grep stat; do ln -s busybox "$img/rootfs/bin/$l"; done
echo 'root:x:0:0:root:/root:/bin/sh' > "$img/rootfs/etc/passwd"
echo 'root:x:0:' > "$img/rootfs/etc/group"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$img/layer.tar" -C "$img/rootfs" .
blob() { # FILE -> moves into blobs, prints "digest size"
  local d; d="$(sha256sum "$1" | cut -d' ' -f1)"
  local s; s="$(stat -c %s "$1")"
  mv "$1" "$img/layout/blobs/sha256/$d"
  echo "$d $s"
}
read -r layer_d layer_s < <(blob "$img/layer.tar")
printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin"],"Cmd":["sleep","2147483647"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
  "$layer_d" > "$img/config.json"
read -r config_d config_s < <(blob "$img/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
  "$config_d" "$config_s" "$layer_d" "$layer_s" > "$img/manifest.json"
read -r manifest_d manifest_s < <(blob "$img/manifest.json")
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"docker.io/tessera/busybox:test","org.opencontainers.image.ref.name":"test"}}]}' \
  "$manifest_d" "$manifest_s" > "$img/layout/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' > "$img/layout/oci-layout"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$cache/busybox-image.tar" -C "$img/layout" .
rm -rf "$img"

cat > "$cache/ready-v2.tmp" <<READY
containerd-1.7 $v17 $cache/containerd-1.7/usr/bin
containerd-2 $v2 $cache/containerd-2/usr/bin
runc $vrunc $cache/runc/usr/sbin/runc
busybox $vbusybox $cache/busybox/bin/busybox
image docker.io/tessera/busybox:test $cache/busybox-image.tar
READY
mv "$cache/ready-v2.tmp" "$cache/ready-v2"
cat "$cache/ready-v2"
