#!/usr/bin/env bash
# The sandbox runner's needs (docs/sandbox.md): bubblewrap and setpriv (and runsc for the gVisor
# backend where the distribution has it), the interpreter the
# sandboxes run (/usr/bin/python3), and the read-only runtime of pinned wheels for it under
# var/sandbox-runtime. Idempotent: rebuilds the runtime only when its requirements changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNTIME=${SANDBOX_RUNTIME:-var/sandbox-runtime}
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v setpriv >/dev/null || need+=(util-linux)
test -x /usr/bin/python3 || need+=(python3)
if ((${#need[@]})); then
  (apt-get install -y -q "${need[@]}" >/dev/null 2>&1) || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
fi
# gVisor, the second backend (tests/sandbox runs the contract under it too), where Debian has it;
# without it the bubblewrap backend is all there is, which is no error.
if ! command -v runsc >/dev/null && apt-cache show runsc >/dev/null 2>&1; then
  apt-get install -y -q runsc >/dev/null 2>&1 || echo "runsc did not install: the gVisor backend is unavailable" >&2
fi
stamp="$RUNTIME/.requirements"
if [ -f "$stamp" ] && cmp -s sandbox/runtime-requirements.txt "$stamp"; then
  exit 0
fi
version=$(/usr/bin/python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
build="$RUNTIME.build.$$"
rm -rf "$build" && mkdir -p "$build"
$PY -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$version" --target "$build/site-packages" -r sandbox/runtime-requirements.txt
cp sandbox/runtime-requirements.txt "$build/.requirements"
chmod -R a+rX,a-w "$build"
if [ -d "$RUNTIME" ]; then chmod -R u+w "$RUNTIME" && rm -rf "$RUNTIME"; fi
mv "$build" "$RUNTIME"
echo "sandbox runtime for python $version: $(grep -v "^#" sandbox/runtime-requirements.txt | tr "\n" " ")" >&2
