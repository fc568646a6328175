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
    ".cache/ $(du -shL .cache 2>/dev/null | cut -f1)" >&2
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
# The real-cluster tests and the GPU harness's dry run use Tessera's own binaries and the CUDA
# hook's cdylib (tests/tests/cluster.rs, gpu_dry_run.rs, gpu_cluster_dry_run.rs): built first (`--bins` alone leaves the
# cdylib out of target/debug).
cargo build --workspace --bins --lib --locked
cargo test --workspace --locked
# The hook as containers get it (glibc 2.28 symbols, built with zig): its suites again.
echo "== the shipped CUDA hook (hook/build-portable.sh):"
TESSERA_HOOK_LIB="$(bash hook/build-portable.sh)" cargo test --locked -p tessera-cuda-hook --test hook --test nri_hook
# Install manifests against the Kubernetes schemas of several versions.
bash scripts/validate-manifests.sh
# Every parser that takes outside input, fuzzed briefly from the corpora in fuzz/corpus
# (nightly, cargo-fuzz; a crash fails the suite). Longer runs: scripts/fuzz.sh 600.
echo "== fuzzing (scripts/fuzz.sh):"
bash scripts/fuzz.sh "${TESSERA_FUZZ_SECONDS:-10}"
