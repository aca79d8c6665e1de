# Sourced by scripts/serve.sh: the user the platform's processes run as.
#
# Started as root (a container's default, `sudo make serve`), serve.sh runs uvicorn, the Celery
# worker, beat and Flower as SERVE_USER (default `agentplatform`), with no capabilities and
# no_new_privs: a bug in request handling or in a tool's answer parsing then runs as a user that
# owns nothing. Only the sandbox runner stays root (docs/sandbox.md says why). Create the user
# once, with no login and no home:
#     useradd --system --no-create-home --shell /usr/sbin/nologin agentplatform
# The checkout and its virtualenv (and the Python it links to) must be readable by that user.
# If they are not, production mode refuses to start, unless SERVE_AS_ROOT=1 says that running as
# root is accepted (a machine whose only Python lives under /root); development mode warns and
# goes on as root. Started as another user, serve.sh runs everything as that user.

SERVE_USER=${SERVE_USER:-agentplatform}
service_prefix=()

# Why SERVE_USER cannot run the platform's Python here ("" when it can).
service_user_problem() {
  if ! id -u "$SERVE_USER" >/dev/null 2>&1; then
    echo "no user $SERVE_USER (useradd --system --no-create-home --shell /usr/sbin/nologin $SERVE_USER, or set SERVE_USER)"
    return
  fi
  if ! setpriv --reuid="$(id -u "$SERVE_USER")" --regid="$(id -g "$SERVE_USER")" --clear-groups \
      -- "$PY" -c "import agentplatform" >/dev/null 2>&1; then
    echo "$SERVE_USER cannot run $PY with this checkout (the checkout, the virtualenv and the Python it links to must be readable by $SERVE_USER)"
  fi
}

# Set service_prefix: the command that runs a service as SERVE_USER (empty: as the current user).
# $1: production or development. Exits 2 when production cannot drop root and SERVE_AS_ROOT is unset.
choose_service_user() {
  service_prefix=()
  [ "$(id -u)" = 0 ] || return 0
  local problem
  problem=$(service_user_problem)
  if [ -z "$problem" ]; then
    service_prefix=(setpriv --reuid="$(id -u "$SERVE_USER")" --regid="$(id -g "$SERVE_USER")" --clear-groups
                    --inh-caps=-all --bounding-set=-all --no-new-privs --)
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
