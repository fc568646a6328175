#!/usr/bin/env bash
# Validates the install manifests offline against the Kubernetes OpenAPI schemas of 1.30..1.36
# (strict: unknown fields are errors), with the PyPI package kubernetes-validate in a private
# virtualenv under .cache/. Checks the checked-in rendering and a non-default one, and the
# example custom resources against the rendered CRDs; with `--dra`, against 1.34..1.36.
set -euo pipefail
cd "$(dirname "$0")/.."

KV_VERSION=1.37.0
VENV=.cache/kubernetes-validate-$KV_VERSION
if [ ! -x "$VENV/bin/kubernetes-validate" ]; then
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
        echo "installing python3-venv"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "kubernetes-validate==$KV_VERSION"
fi

out=target/manifests
mkdir -p "$out"
cargo run -q --locked -p tessera-deploy -- \
    --namespace gpu-sharing --image registry.example.com/tessera:dev --replicas 3 \
    --driver-root /run/nvidia/driver --share-enforcement hook --out "$out/custom.yaml"
# The claim examples: custom resources against the CRDs, their pods with the rest.
"$VENV/bin/python" scripts/validate-custom-resources.py deploy/tessera.yaml "$out/claims-builtin.yaml" \
    deploy/examples/claims/*.yaml
for v in 1.30.0 1.31.0 1.32.0 1.33.0 1.34.0 1.35.0 1.36.0; do
    "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" deploy/tessera.yaml "$out/custom.yaml" deploy/examples/*.yaml \
        "$out/claims-builtin.yaml"
    echo "manifests valid for Kubernetes $v"
done
# The DRA install and its examples: resource.k8s.io/v1 is there from 1.34.
cargo run -q --locked -p tessera-deploy -- --dra --out "$out/dra.yaml"
for v in 1.34.0 1.35.0 1.36.0; do
    "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$out/dra.yaml" deploy/examples/dra/*.yaml
    echo "DRA manifests valid for Kubernetes $v"
done
# The Helm chart (deploy/tests/helm.rs compares its rendering with these objects): Helm's lint.
helm="$(bash scripts/fetch-helm.sh)"
"$helm" lint --strict --quiet deploy/chart/tessera
"$helm" lint --strict --quiet deploy/chart/tessera --set dra=true --set shareEnforcement=hook --set driverRoot=/run/nvidia/driver
echo "Helm chart lints clean"
