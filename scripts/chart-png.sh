#!/usr/bin/env bash
# Renders a simulator chart (SVG) as PNG, to look at it as an image: CairoSVG from PyPI,
# installed under .cache/tools (nothing on the system), drawn with the machine's libcairo.
#
#   scripts/chart-png.sh target/simulate/embedded-default.svg [OUT.png]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
svg="${1:?usage: chart-png.sh CHART.svg [OUT.png]}"
png="${2:-${svg%.svg}.png}"
tools="$here/.cache/tools/cairosvg"
if [ ! -f "$tools/.ready" ]; then
  python3 -m pip install --quiet --target "$tools" cairosvg
  touch "$tools/.ready"
fi
PYTHONPATH="$tools" python3 -c 'import sys, cairosvg; cairosvg.svg2png(url=sys.argv[1], write_to=sys.argv[2], output_width=1140)' "$svg" "$png"
echo "$png"
