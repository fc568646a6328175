#!/usr/bin/env bash
# Packs a root filesystem directory as a one-layer OCI image-layout tarball that
# `ctr images import` accepts, reproducibly (sorted, mtime 0, root-owned).
#
#   tests/runtimes/oci-image.sh ROOTFS IMAGE_NAME OUT.tar [CMD_JSON]
#
# CMD_JSON is the image's default command (default: ["sleep","2147483647"], so the image can
# also serve as the sandbox image). IMAGE_CONFIG, when set, is the whole `config` object of the
# image instead (Env, Entrypoint, User, ...; scripts/image.sh sets it).
set -euo pipefail
rootfs="$1" name="$2" out="$3" cmd="${4:-[\"sleep\",\"2147483647\"]}"
config="${IMAGE_CONFIG:-}"
[ -n "$config" ] || config="{\"Env\":[\"PATH=/bin:/usr/bin\"],\"Cmd\":$cmd}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/layout/blobs/sha256"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$work/layer.tar" -C "$rootfs" .
blob() { # FILE -> moves into blobs, prints "digest size"
  local d; d="$(sha256sum "$1" | cut -d' ' -f1)"
  local s; s="$(stat -c %s "$1")"
  mv "$1" "$work/layout/blobs/sha256/$d"
  echo "$d $s"
}
read -r layer_d layer_s < <(blob "$work/layer.tar")
printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
  "$config" "$layer_d" > "$work/config.json"
read -r config_d config_s < <(blob "$work/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
  "$config_d" "$config_s" "$layer_d" "$layer_s" > "$work/manifest.json"
read -r manifest_d manifest_s < <(blob "$work/manifest.json")
tag="${name##*:}"
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
  "$manifest_d" "$manifest_s" "$name" "$tag" > "$work/layout/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' > "$work/layout/oci-layout"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$out" -C "$work/layout" .
