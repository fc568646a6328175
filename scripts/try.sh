#!/usr/bin/env bash
# Tries Tessera without GPUs, in about three minutes: fetches the real Kubernetes, containerd and
# NVIDIA userspace the tests use (cached under .cache/, never installed), builds Tessera, then
# brings up a real single-node Kubernetes with fixture GPUs in a network namespace of its own,
# installs Tessera from deploy/, runs the examples of deploy/examples (whole card, share, two
# containers, DRA claims, a MIG slice), prints what each container got and
# `kubectl tessera inspect`, and removes everything. As root, on Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/runtimes/fetch.sh >/dev/null
bash tests/nvidia/fetch.sh >/dev/null
bash tests/cluster/fetch.sh >/dev/null
cargo build --locked --workspace --bins
exec cargo run --locked -q -p tessera-tests --bin tessera-try
