#!/usr/bin/env bash
# Fetches NVIDIA's NVML header (`nvml.h`, CUDA 13.5) from PyPI's `nvidia-nvml-dev` wheel, checked
# against its published digest, for the test that holds Tessera's NVML bindings to it
# (node/tests/nvml_header.rs). Nothing is installed.
#
#   tests/nvidia/nvml-header.sh [CACHE_DIR]     (default: <repo>/.cache/nvidia/nvml-dev)
#
# Prints the header's path. Idempotent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${1:-${TESSERA_NVML_DEV_CACHE:-$here/../../.cache/nvidia/nvml-dev}}"
version=13.5.37
wheel="nvidia_nvml_dev-$version-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
sha256=7394fcbefa9ba537e8238cbb1caa4cd2db6bbfbff208d217a8a884947113ae6d
header="$cache/$version/nvml.h"
if [ ! -f "$header" ]; then
  mkdir -p "$cache/$version"
  tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --python-version 3.11 --dest "$tmp" "nvidia-nvml-dev==$version" >&2
  echo "$sha256  $tmp/$wheel" | sha256sum --check --quiet >&2
  python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("nvidia/cu13/include/nvml.h"))' \
    "$tmp/$wheel" > "$tmp/nvml.h"
  mv "$tmp/nvml.h" "$header"
fi
echo "$header"
