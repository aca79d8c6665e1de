#!/usr/bin/env bash
# Install the Debian packages the tests drive from outside Python: Chromium for the admin browser
# tests (Playwright drives it), curl and jq for docs/api.md's quick start, run as written.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v jq >/dev/null 2>&1 || missing+=(jq)

if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (Debian packages) for the browser and quick-start tests"
  if [ "$(id -u)" = "0" ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
      || echo "warning: ${missing[*]} could not be installed; the tests that need them will fail"
  else
    echo "warning: not root; install ${missing[*]} yourself for the browser and quick-start tests"
  fi
fi
