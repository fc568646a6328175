#!/usr/bin/env bash
# Runs Tessera's whole test suite on a fresh machine: installs what the suite needs, checks
# formatting and lints, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== toolchain: $(cargo --version)"
# One build from a clean checkout: incremental caches would only double the workspace's share
# of target/ (a clean run's peak is in the README); a run out of disk says so first.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free where target/ grows"
# A run cut short by a full disk says so: what was free, and what the suite's own folders hold.
disk_report() {
  local rc=$?
  [ "$rc" = 0 ] && return
  echo "== disk at exit $rc: $(df -h --output=avail . | tail -1 | tr -d ' ') free here," \
    "$(df -h --output=avail /tmp | tail -1 | tr -d ' ') in /tmp; target/ holds $(du -sh target 2>/dev/null | cut -f1)," \
    "fuzz/target/ $( (du -sh fuzz/target 2>/dev/null || echo none) | cut -f1), .cache/ $(du -shL .cache 2>/dev/null | cut -f1)" >&2
}
trap disk_report EXIT
# Real container runtimes for the end-to-end tests (cached under .cache/runtimes).
echo "== runtimes (tests/runtimes/fetch.sh):"
bash tests/runtimes/fetch.sh
# NVIDIA's real driver userspace (two branches, four node layouts; cached under .cache/nvidia).
echo "== NVIDIA userspace (tests/nvidia/fetch.sh):"
bash tests/nvidia/fetch.sh
# NVIDIA's NVML header (PyPI's nvidia-nvml-dev), for the bindings' layout test.
echo "== NVML header: $(bash tests/nvidia/nvml-header.sh)"
# A real Kubernetes (the shared multi-call binary, or KUBE_BIN_DIR), etcd and the CNI plugins.
echo "== Kubernetes (tests/cluster/fetch.sh):"
bash tests/cluster/fetch.sh
# Helm's own binary for the chart's tests (deploy/tests/helm.rs; cached under .cache/helm).
echo "== Helm (scripts/fetch-helm.sh): $(bash scripts/fetch-helm.sh)"
# Commit messages as CONTRIBUTING.md asks (those after the rule came in).
bash scripts/check-commits.sh
cargo fmt --all -- --check
# Production functions stay under clippy.toml's length: every library and binary of the product
# denies clippy::too_many_lines outside cfg(test) (an exception says why in its
# #[allow(clippy::too_many_lines, reason = ...)]); tests and the test harness may run long.
cargo clippy --workspace --all-targets --locked -- -D warnings
# The API documentation builds without warnings (a link to a private item, a broken link).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
# The real-cluster tests and the GPU harness's dry run use Tessera's own binaries and the CUDA
# hook's cdylib (tests/tests/cluster.rs, gpu_dry_run.rs, gpu_cluster_dry_run.rs): built first (`--bins` alone leaves the
# cdylib out of target/debug). `--tests` too, so that dev-dependencies take part in resolving
# features as they do for `cargo test`: without it every crate whose features they change (kube,
# k8s-openapi, Tessera's own) was built twice, about a gigabyte of target/ and minutes of a
# 2-core run.
cargo build --workspace --bins --lib --tests --locked
cargo test --workspace --locked
# The hook as containers get it (glibc 2.28 symbols, built with zig): its suites again.
# The test binaries the run above built, run again as cargo runs them (from the crate's folder):
# `cargo test -p` would resolve features for that one crate and rebuild a dozen crates.
echo "== the shipped CUDA hook (hook/build-portable.sh):"
shipped_hook="$(bash hook/build-portable.sh)"
built="$(cargo test --workspace --locked --no-run --message-format=json)"
for t in hook nri_hook; do
  exe="$(python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("executable") and t.get("name") == sys.argv[1] and t.get("kind") == ["test"] and "tessera-cuda-hook" in m["package_id"]:
        print(m["executable"])
' "$t" <<< "$built")"
  [ -x "$exe" ] || { echo "test.sh: no built test binary named $t of tessera-cuda-hook" >&2; exit 1; }
  (cd hook && TESSERA_HOOK_LIB="$shipped_hook" "$exe")
done
# Install manifests against the Kubernetes schemas of several versions.
bash scripts/validate-manifests.sh
# Every parser that takes outside input, fuzzed briefly from the corpora in fuzz/corpus
# (nightly, cargo-fuzz; a crash fails the suite). Longer runs: scripts/fuzz.sh 600.
# The fuzz build needs about 2 GB beside target/ (fuzz/target, the nightly toolchain): where the
# disk is nearly full (often so on CI), the debug build, whose tests have all run, makes room.
if [ "$(df --output=avail -k . | tail -1)" -lt $((4 * 1024 * 1024)) ]; then
  echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free; removing target/debug ($(du -sh target/debug | cut -f1)) for the fuzz build"
  rm -rf target/debug
fi
echo "== fuzzing (scripts/fuzz.sh):"
bash scripts/fuzz.sh "${TESSERA_FUZZ_SECONDS:-10}"
