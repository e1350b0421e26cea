#!/usr/bin/env bash
# Screenshot a report.html in headless Chromium (what docs/quickstart_report.png is made with):
#   bash scripts/screenshot_report.sh [runs/quickstart/report.html] [docs/quickstart_report.png] [width] [height]
# Needs Chromium: `apt-get install chromium` (Debian) — the script offers to do it when it is missing.
set -euo pipefail
page=${1:-runs/quickstart/report.html}
out=${2:-docs/quickstart_report.png}
width=${3:-1540}
height=${4:-2400}
[ -f "$page" ] || { echo "error: $page not found (run \`make quickstart\` first)" >&2; exit 2; }
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q chromium >/dev/null && browser=$(command -v chromium)
    fi
    [ -n "$browser" ] || { echo "error: no Chromium found; install it (apt-get install chromium) and rerun" >&2; exit 2; }
fi
mkdir -p "$(dirname "$out")"
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
    --window-size="$width,$height" --screenshot="$(realpath -m "$out")" "file://$(realpath "$page")" 2>/dev/null
echo "screenshot: $out (${width}x${height})"
