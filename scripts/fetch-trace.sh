#!/usr/bin/env bash
# Downloads the public Alibaba GPU cluster trace (cluster-trace-gpu-v2023, "openb") that the
# simulator's --trace reads: the two node lists and the five pod lists of the published FGD
# experiment, from github.com/alibaba/clusterdata (folder cluster-trace-gpu-v2023/csv), each
# checked against its SHA-256 below. Prints the directory. Needs network, or TESSERA_TRACE_URL
# naming another copy of that folder (a mirror, or file:///path/to/csv).
#
#   bash scripts/fetch-trace.sh [DIR]      # default: .cache/traces/alibaba-gpu-v2023
#
# The data is Alibaba's, published with the USENIX ATC 2023 paper "Beware of Fragmentation:
# Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent" (Weng et al.); the
# repository has no licence file and asks users to cite the paper. It is downloaded for your
# runs, never committed here.
set -euo pipefail
url="${TESSERA_TRACE_URL:-https://raw.githubusercontent.com/alibaba/clusterdata/master/cluster-trace-gpu-v2023/csv}"
dir="${1:-$(cd "$(dirname "$0")/.." && pwd)/.cache/traces/alibaba-gpu-v2023}"
mkdir -p "$dir"
sums='5a85c2af79c66a1efff8bbcbda430400aae56d8431370d738480967e1a9c6b15  openb_node_list_all_node.csv
2beca64b4d3dfa342036a34b56a495c6cef9225db836c81f541282cb1df320b5  openb_node_list_gpu_node.csv
747f43247bffc2b0bb081d7f61f0705ca8d390dafc0b647e642c92f3baf3ba1e  openb_pod_list_cpu050.csv
1ee7ed79c27a3b0861cda8ddba86a004c6aba904caafa329a76ae93ca63834a8  openb_pod_list_default.csv
d83ce79a4eb6987524bedbb0c65e41aed3a36bf6c1b78b86234c3687a07e1d40  openb_pod_list_gpushare40.csv
2dc7e4cb9480484f08539720b433a9ec9ab5d76b396f3f7557c53a2ff78a7611  openb_pod_list_gpuspec10.csv
d9ec6f6c74fb980cc0b81239470c6353fceea077ea9abd610003b604c7cc2b01  openb_pod_list_multigpu20.csv'
n=0
while read -r sum file; do
  n=$((n + 1))
  if [ -f "$dir/$file" ] && echo "$sum  $dir/$file" | sha256sum -c --status; then
    continue
  fi
  echo "fetch-trace.sh: $file ($n of 7)" >&2
  if ! curl -fsSL --retry 3 -o "$dir/$file.part" "$url/$file"; then
    rm -f "$dir/$file.part"
    echo "fetch-trace.sh: cannot download $url/$file" >&2
    exit 1
  fi
  if ! echo "$sum  $dir/$file.part" | sha256sum -c --status; then
    rm -f "$dir/$file.part"
    echo "fetch-trace.sh: $url/$file is not the published trace (SHA-256 is not $sum)" >&2
    exit 1
  fi
  mv "$dir/$file.part" "$dir/$file"
done <<< "$sums"
echo "$dir"
