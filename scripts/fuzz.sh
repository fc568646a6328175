#!/usr/bin/env bash
# Fuzzes every parser of Tessera that takes outside input (fuzz/fuzz_targets: quantities, pod
# requests, the extender's JSON, AdmissionReviews, the published inventory, the signed
# allocation through injection::decide, the hook's configuration), each for SECONDS (default
# 10), from the corpora kept in fuzz/corpus/<target>.tar.xz. A crash fails the run and leaves
# its input in fuzz/artifacts/<target>/ (make it a regression test, then fix it).
# Needs the nightly toolchain (installed with rustup when missing) and cargo-fuzz (installed
# under .cache/tools). `--save-corpus` minimises what the run found and packs it back.
# No sanitizer by default: the fuzzed crates (tessera-core, tessera-api) have no unsafe code, and
# with opt-level 3 it made the fuzz build take 11 minutes of a clean 2-core suite run, twice what
# it takes now (fuzz/Cargo.toml); TESSERA_FUZZ_SANITIZER=address (or another of cargo-fuzz's
# sanitizers) puts one back.
#   scripts/fuzz.sh [SECONDS] [--save-corpus]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=10
save=""
for a in "$@"; do
  case "$a" in
    --save-corpus) save=1 ;;
    *[!0-9]*|"") echo "fuzz.sh: SECONDS must be a number, got '$a'" >&2; exit 2 ;;
    *) secs="$a" ;;
  esac
done
CARGO_FUZZ_VERSION=0.13.2
tools="$PWD/.cache/tools/cargo-fuzz"
if [ ! -x "$tools/bin/cargo-fuzz" ]; then
  cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" --root "$tools"
fi
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
export RUSTUP_TOOLCHAIN=nightly
fuzz="$tools/bin/cargo-fuzz"
sanitizer="${TESSERA_FUZZ_SANITIZER:-none}"
work="$PWD/target/fuzz-corpus"
cd fuzz
targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^tessera-fuzz$')
# Release code with overflow checks and debug assertions on: an overflow is a crash.
"$fuzz" build -O -a -s "$sanitizer"
for t in $targets; do
  rm -rf "$work/$t"
  mkdir -p "$work/$t"
  [ -f "corpus/$t.tar.xz" ] && tar -xJf "corpus/$t.tar.xz" -C "$work/$t"
  out=$("$fuzz" run -O -a -s "$sanitizer" "$t" "$work/$t" -- -max_total_time="$secs" 2>&1) || {
    echo "$out" | tail -40 >&2
    echo "fuzz.sh: $t crashed; the input is in fuzz/artifacts/$t/" >&2
    exit 1
  }
  echo "$t: $(echo "$out" | grep -E '^Done [0-9]+ runs' | tail -1)"
  if [ -n "$save" ]; then
    "$fuzz" cmin -O -a -s "$sanitizer" "$t" "$work/$t" >/dev/null 2>&1
    tar -C "$work/$t" -cf - . | xz -9 > "corpus/$t.tar.xz"
  fi
done
