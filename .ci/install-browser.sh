#!/usr/bin/env bash
# Install what tests/comparator/reports/test_html_browser.py needs, idempotently: Debian's chromium (and node/npm if
# missing) from apt, and playwright-core from tests/browser/package-lock.json. Without them that
# test is skipped; CI calls this so it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  for attempt in 1 2 3; do  # a registry hiccup should not fail CI on its own
    if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null; then
      break
    fi
    [ "$attempt" = 3 ] && exit 1
    sleep 10
  done
fi

cd tests/browser
wanted=$(node -p "require('./package-lock.json').packages['node_modules/playwright-core'].version")
have=$(node -p "try { require('./node_modules/playwright-core/package.json').version } catch { '' }")
if [ "$wanted" != "$have" ]; then
  npm ci --no-audit --no-fund --loglevel=error || { sleep 10; npm ci --no-audit --no-fund --loglevel=error; }
fi
