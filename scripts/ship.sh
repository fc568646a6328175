#!/usr/bin/env bash
# Builds Tessera's shipped binaries and splits their debug info off:
#   OUT/bin/    what the image ships: no debug info, the symbol table kept (function names in
#               panics and crash backtraces), a .gnu_debuglink naming its debug file
#   OUT/debug/  <binary>.debug: the line tables, for gdb/addr2line on a crash report
#               (`gdb -ex 'set debug-file-directory OUT/debug' ...`); kept out of the image
# Usage: scripts/ship.sh [OUT]   (default: target/ship). Prints each file's size.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/ship}"
bins=(tessera-extender tessera-manifests tessera-cdi-generator tessera-device-plugin tessera-dra-plugin tessera-nri-plugin tessera-mps-supervisor)

cargo build --release --locked \
    -p tessera-extender -p tessera-deploy -p tessera-cdi-generator -p tessera-device-plugin -p tessera-dra-plugin -p tessera-nri-plugin -p tessera-mps
# The hook loads in every container of a share: built for glibc 2.28 (hook/build-portable.sh).
hook="$(bash hook/build-portable.sh)"
rm -rf "$out"
mkdir -p "$out/bin" "$out/debug"

split() { # <built file> <shipped name>
    local src="$1" name="$2"
    objcopy --only-keep-debug "$src" "$out/debug/$name.debug"
    objcopy --strip-debug --add-gnu-debuglink="$out/debug/$name.debug" "$src" "$out/bin/$name"
}
for b in "${bins[@]}"; do
    split "target/release/$b" "$b"
done
split "$hook" libtessera-cuda-hook.so

printf '%-28s %12s %12s %12s\n' file built shipped debug
for f in "$out"/bin/*; do
    name="$(basename "$f")"
    src="target/release/$name"
    [[ "$name" == libtessera-cuda-hook.so ]] && src="$hook"
    printf '%-28s %12s %12s %12s\n' "$name" "$(stat -c %s "$src")" "$(stat -c %s "$f")" \
        "$(stat -c %s "$out/debug/$name.debug")"
done
printf '%-28s %12s %12s\n' total "$(cat "${bins[@]/#/target/release/}" "$hook" | wc -c)" \
    "$(cat "$out"/bin/* | wc -c)"
