# Sourced by scripts/serve.sh: the user the platform's processes run as.
#
# Started as root (a container's default, `sudo make serve`), serve.sh runs uvicorn, the Celery
# worker, beat and Flower as SERVE_USER (default `agentplatform`), with no capabilities and
# no_new_privs: a bug in request handling or in a tool's answer parsing then runs as a user that
# owns nothing. Only the sandbox runner stays root (docs/sandbox.md says why). Create the user
# once, with no login and no home:
#     useradd --system --no-create-home --shell /usr/sbin/nologin agentplatform
# When SERVE_USER cannot run $PY where it is (an interpreter under /root, mode 0700: pyenv's
# default) or cannot read the checkout, serve builds it a tree of hard links to the interpreter,
# the virtualenv and (if needed) the code under SERVICE_PYTHON_DIR (scripts/service_python.py),
# which must be a directory SERVE_USER can reach; nothing under /root is opened to it. If even
# that cannot run, production refuses to start, unless SERVE_AS_ROOT=1 says that running as root
# is accepted; development warns and goes on as root. Started as another user, serve.sh runs
# everything as that user.
#
# Sets, for serve.sh: service_prefix (the command that runs a service as SERVE_USER; empty: as the
# current user), SERVICE_PY (the python the services run) and SERVICE_DIR (their working directory).

SERVE_USER=${SERVE_USER:-agentplatform}
service_prefix=()

# The command that runs the rest of the line as SERVE_USER, with no capabilities.
as_serve_user() {
  setpriv --reuid="$(id -u "$SERVE_USER")" --regid="$(id -g "$SERVE_USER")" --clear-groups \
    --inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"
}

# Why SERVE_USER cannot run python $1 with the code in directory $2 ("" when it can). $3: extra
# environment (NAME=value) for that python.
service_user_problem() {
  local python=${1:-$PY} dir=${2:-$PWD}
  if ! id -u "$SERVE_USER" >/dev/null 2>&1; then
    echo "no user $SERVE_USER (useradd --system --no-create-home --shell /usr/sbin/nologin $SERVE_USER, or set SERVE_USER)"
    return
  fi
  if ! (cd / && as_serve_user env ${3:+"$3"} sh -c 'cd "$1" && exec "$2" -c "import agentplatform"' - "$dir" "$python") \
      >/dev/null 2>&1; then
    echo "$SERVE_USER cannot run $python with the code in $dir (both must be readable by $SERVE_USER)"
  fi
}

# Whether SERVE_USER can read the checkout's code where it is.
serve_user_reads_checkout() {
  (cd / && as_serve_user sh -c 'test -r "$1/agentplatform/settings.py"' - "$PWD") 2>/dev/null
}

# Set service_prefix, SERVICE_PY and SERVICE_DIR. $1: production or development. Exits 2 when
# production cannot drop root and SERVE_AS_ROOT is unset.
choose_service_user() {
  service_prefix=()
  SERVICE_PY=$PY
  SERVICE_DIR=$PWD
  [ "$(id -u)" = 0 ] || return 0
  local problem built app=() extra=""
  problem=$(service_user_problem "$PY" "$PWD")
  if [ -n "$problem" ] && id -u "$SERVE_USER" >/dev/null 2>&1; then
    # The usual cause: an interpreter the user cannot reach. Give it one it can.
    local dest=${SERVICE_PYTHON_DIR:-${AGENTPLATFORM_VAR_DIR:-$PWD/var}/service-python}
    serve_user_reads_checkout || app=(--app "$PWD")
    if built=$($PY scripts/service_python.py "$dest" "${app[@]}" 2>&1); then
      extra="LD_LIBRARY_PATH=$(realpath "$dest")/base/lib"
      local dir=$PWD
      [ ${#app[@]} -eq 0 ] || dir=$(realpath "$dest")/app
      problem=$(service_user_problem "$built" "$dir" "$extra")
      if [ -z "$problem" ]; then
        SERVICE_PY=$built
        SERVICE_DIR=$dir
        echo "$SERVE_USER runs the services with $SERVICE_PY (hard links to $PY's files: scripts/service_python.py)" >&2
      else
        problem="$problem; SERVICE_PYTHON_DIR ($dest) and its parents must be reachable by $SERVE_USER"
      fi
    else
      problem="$problem; building a Python it can run failed: ${built##*$'\n'}"
    fi
  fi
  if [ -z "$problem" ]; then
    service_prefix=(setpriv --reuid="$(id -u "$SERVE_USER")" --regid="$(id -g "$SERVE_USER")" --clear-groups
                    --inh-caps=-all --bounding-set=-all --no-new-privs -- env ${extra:+"$extra"})
    return 0
  fi
  if [ "${SERVE_AS_ROOT:-0}" = 1 ]; then
    echo "WARNING: the web, worker, beat and Flower processes run as root (SERVE_AS_ROOT=1): $problem" >&2
  elif [ "$1" = production ]; then
    echo "refusing to run the platform as root in production: $problem; or set SERVE_AS_ROOT=1 to accept root" >&2
    exit 2
  else
    echo "WARNING: running as root (development mode): $problem" >&2
  fi
}

# Directories the services write to, handed to SERVE_USER.
give_to_service_user() {
  [ ${#service_prefix[@]} -gt 0 ] || return 0
  chown -R "$(id -u "$SERVE_USER"):$(id -g "$SERVE_USER")" "$@"
}
