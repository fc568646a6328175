#!/usr/bin/env bash
# Builds the CUDA hook as containers get it: linked against glibc 2.28's symbol versions (zig's
# glibc stubs through cargo-zigbuild), so it loads in images as old as UBI 8 / Debian 10 (glibc
# 2.28) and Ubuntu 20.04 (2.31). A preloaded library needing a newer glibc than the image has
# stops every program in the container. Installs zig (PyPI's ziglang) and cargo-zigbuild under
# .cache/tools when they are missing; checks the result needs GLIBC_2.28 at most.
#
#   hook/build-portable.sh            prints the library's path
set -euo pipefail
cd "$(dirname "$0")/.."
tools="$PWD/.cache/tools"
zig_version=0.15.2
zigbuild_version=0.24.1
glibc=2.28
mkdir -p "$tools"
exec 9>"$tools/.lock"
flock 9

zig="$tools/zig-$zig_version/ziglang/zig"
if [ ! -x "$zig" ]; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --target "$tools/zig-$zig_version" \
    "ziglang==$zig_version" >&2
fi
zigbuild="$tools/bin/cargo-zigbuild"
if [ ! -x "$zigbuild" ] || ! "$zigbuild" --version | grep -q " $zigbuild_version\$"; then
  cargo install --quiet --locked --root "$tools" "cargo-zigbuild@$zigbuild_version" >&2
fi

target="x86_64-unknown-linux-gnu"
[ "$(uname -m)" = aarch64 ] && target="aarch64-unknown-linux-gnu"
CARGO_ZIGBUILD_ZIG_PATH="$zig" "$zigbuild" zigbuild --quiet --release --locked -p tessera-cuda-hook --lib \
  --target "$target.$glibc" --target-dir target/portable >&2
lib="$PWD/target/portable/$target/release/libtessera_cuda_hook.so"

# The newest glibc symbol version it needs.
newest="$(objdump -T "$lib" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n 1)"
if [ "$(printf '%s\n%s\n' "$newest" "$glibc" | sort -V | tail -n 1)" != "$glibc" ]; then
  echo "build-portable.sh: $lib needs GLIBC_$newest, more than $glibc" >&2
  exit 1
fi
echo "$lib"
