#!/usr/bin/env bash
# Install Debian's Chromium for the admin browser test (Playwright drives it).
set -euo pipefail

if ! command -v chromium >/dev/null 2>&1; then
  echo "installing Chromium (Debian package) for the admin browser test"
  if [ "$(id -u)" = "0" ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: chromium could not be installed; the browser test will fail"
  else
    echo "warning: not root; install chromium yourself for the browser test"
  fi
fi
