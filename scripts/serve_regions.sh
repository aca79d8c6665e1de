#!/usr/bin/env bash
# Two regions on one machine (docs/regions.md, "How to operate it"): the home (HOME_REGION, default
# mumbai) and a region away from it (AWAY_REGION, default frankfurt), each a whole deployment of its
# own, plus the link between them:
#   - a PostgreSQL cluster per region (initdb + pg_ctl under $AGENTPLATFORM_VAR_DIR/regions/<name>/pg,
#     wal_level = logical, trust auth on 127.0.0.1 only; reused when already initialised);
#   - a Redis per region (its broker and cache, nothing persisted: PostgreSQL is the only source of
#     truth and the sweeper re-sends what a restarted broker lost);
#   - the link (scripts/region_link.py): the away region reaches the home's API and PostgreSQL only
#     through it, so `scripts/region_link.py cut` partitions the two and `heal` joins them again;
#   - scripts/serve.sh per region (uvicorn, worker, beat, Flower, sandbox runner) with REGION,
#     REGION_PEERS, REGION_KEYS (one key, made once into a 0600 file), DATABASE_URL, CELERY_BROKER_URL;
#   - once both have migrated, the logical replication of the authority tables: published at the
#     home, subscribed to by the away region through the link as a role with REPLICATION only.
# Every line of output starts with the region's name (or pg, redis, link). Ctrl-C (or TERM) stops
# everything it started. Started as root, PostgreSQL runs as PG_OS_USER (initdb refuses root) and
# serve.sh drops the platform's processes to SERVE_USER (scripts/service_user.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PY=${PY:-.venv/bin/python}
HOME_REGION=${HOME_REGION:-mumbai}
AWAY_REGION=${AWAY_REGION:-frankfurt}
HOME_API_PORT=${HOME_API_PORT:-8000}
AWAY_API_PORT=${AWAY_API_PORT:-8001}
HOME_FLOWER_PORT=${HOME_FLOWER_PORT:-5555}
AWAY_FLOWER_PORT=${AWAY_FLOWER_PORT:-5556}
HOME_SANDBOX_PORT=${HOME_SANDBOX_PORT:-8790}
AWAY_SANDBOX_PORT=${AWAY_SANDBOX_PORT:-8791}
HOME_PG_PORT=${HOME_PG_PORT:-5433}
AWAY_PG_PORT=${AWAY_PG_PORT:-5434}
HOME_REDIS_PORT=${HOME_REDIS_PORT:-6380}
AWAY_REDIS_PORT=${AWAY_REDIS_PORT:-6381}
LINK_API_PORT=${LINK_API_PORT:-8100}
LINK_PG_PORT=${LINK_PG_PORT:-5435}
PG_OS_USER=${PG_OS_USER:-postgres}
REPLICATION_ROLE=${REPLICATION_ROLE:-replicator}
START_TIMEOUT=${START_TIMEOUT:-900}
VAR=${AGENTPLATFORM_VAR_DIR:-var}
mkdir -p "$VAR/regions"
VAR=$(realpath "$VAR")
DIR=$VAR/regions

# The filters outlive a Ctrl-C (the terminal signals the whole group): they end when their writers do.
named() { trap '' INT TERM; sed -u "s/^/$1 | /"; }
say() { echo "$*" | named regions; }
die() { echo "$*" | named regions >&2; exit 2; }

for name in "$HOME_REGION" "$AWAY_REGION"; do
  [[ $name =~ ^[a-z][a-z0-9-]*$ ]] || die "region names are lower-case letters, digits and dashes: '$name'"
done
[ "$HOME_REGION" != "$AWAY_REGION" ] || die "HOME_REGION and AWAY_REGION must differ"
command -v redis-server >/dev/null || die "redis-server not found (apt-get install redis-server)"
command -v curl >/dev/null || die "curl not found"
# The newest PostgreSQL server binaries installed (initdb, pg_ctl), else those on PATH.
PG_BIN=$(find /usr/lib/postgresql -path '*/bin/pg_ctl' 2>/dev/null | sort -V | tail -n 1 | xargs -r dirname)
[ -n "$PG_BIN" ] || PG_BIN=$(dirname "$(command -v pg_ctl || echo /nonexistent/pg_ctl)")
[ -x "$PG_BIN/initdb" ] || die "PostgreSQL server binaries (initdb, pg_ctl) not found"
# Every port must be free: a server already answering there is someone else's, never ours to use.
for port in "$HOME_API_PORT" "$AWAY_API_PORT" "$HOME_FLOWER_PORT" "$AWAY_FLOWER_PORT" "$HOME_SANDBOX_PORT" \
    "$AWAY_SANDBOX_PORT" "$HOME_PG_PORT" "$AWAY_PG_PORT" "$HOME_REDIS_PORT" "$AWAY_REDIS_PORT" \
    "$LINK_API_PORT" "$LINK_PG_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port is in use: set the *_PORT variables (docs/regions.md)"
  fi
done

# initdb and pg_ctl refuse root: as root they run as PG_OS_USER, which owns the clusters' folders
# (tests/services.py does the same). The superuser inside the cluster is named after this user.
if [ "$(id -u)" = 0 ]; then
  id -u "$PG_OS_USER" >/dev/null 2>&1 || die "no user $PG_OS_USER to run PostgreSQL as (set PG_OS_USER)"
  as_pg() { runuser -u "$PG_OS_USER" -- "$@"; }
else
  as_pg() { "$@"; }
fi
PG_SUPERUSER=$(id -un)

cluster() {  # initialise (once) and start region $1's cluster on port $2
  local data=$DIR/$1/pg
  mkdir -p "$data"
  [ "$(id -u)" != 0 ] || chown "$PG_OS_USER:" "$data"
  chmod 0700 "$data"
  as_pg test -w "$data" || die "$PG_OS_USER cannot write $data: every directory above it must be searchable by it"
  if [ ! -s "$data/PG_VERSION" ]; then
    as_pg "$PG_BIN/initdb" -D "$data" -U "$PG_SUPERUSER" --auth=trust -E UTF8 --locale=C --no-instructions \
      >/dev/null 2> >(named pg >&2)
    cat >>"$data/postgresql.conf" <<EOF
# scripts/serve_regions.sh: loopback only (trust auth: one machine), logical replication of authority
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
wal_level = logical
max_connections = 300
log_min_messages = warning
EOF
  fi
  # A cluster left running by a start that was killed: stopped first, so it serves this start's port.
  if as_pg "$PG_BIN/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    as_pg "$PG_BIN/pg_ctl" -D "$data" -m fast -w stop >/dev/null 2> >(named pg >&2)
  fi
  as_pg "$PG_BIN/pg_ctl" -D "$data" -l "$data/postgres.log" -o "-p $2" -w -t 120 start >/dev/null \
    2> >(named pg >&2) || die "PostgreSQL did not start: $data/postgres.log says why"
  started_clusters+=("$data")
  echo "$1: PostgreSQL on 127.0.0.1:$2 ($data)" | named pg
}

# Whether a process is left in any of these process groups (serve.sh itself stays a zombie until
# reaped, so kill -0 on its pid would say yes).
alive() {
  local groups=" $* "
  ps -e -o pgid=,stat= | {
    while read -r pgid stat; do
      if [[ $groups == *" $pgid "* && $stat != Z* ]]; then exit 0; fi
    done
    exit 1
  }
}

pids=() serve_pids=() started_clusters=() stopping=0
cleanup() {
  [ "$stopping" = 0 ] || return 0
  stopping=1
  trap - INT TERM
  say "stopping"
  local pid
  for pid in "${serve_pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 60); do  # serve.sh gives open streams 10 s (uvicorn's graceful shutdown)
    alive "${serve_pids[@]}" || break
    sleep 0.5
  done
  for pid in "${serve_pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  for pid in "${serve_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  local data
  for data in "${started_clusters[@]}"; do
    as_pg "$PG_BIN/pg_ctl" -D "$data" -m fast -w -t 60 stop >/dev/null 2>&1 || true
  done
  say "stopped"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The key the two regions share to sign their calls (regions/signing.py): made once, read by root only.
KEY_FILE=$DIR/region.key
if [ ! -s "$KEY_FILE" ]; then
  (umask 077 && "$PY" -c "import secrets; print(secrets.token_urlsafe(32))" >"$KEY_FILE")
fi
KEY=$(cat "$KEY_FILE")

cluster "$HOME_REGION" "$HOME_PG_PORT"
cluster "$AWAY_REGION" "$AWAY_PG_PORT"
home_db=postgres://$PG_SUPERUSER@127.0.0.1:$HOME_PG_PORT/$HOME_REGION
away_db=postgres://$PG_SUPERUSER@127.0.0.1:$AWAY_PG_PORT/$AWAY_REGION
psql_at() { psql "${1%/*}/${2:-postgres}" -v ON_ERROR_STOP=1 -qtAc "$3" 2> >(named psql >&2); }
# The subscription's role: it may open a replication connection and read the published tables only.
psql_at "$home_db" postgres "DO \$\$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$REPLICATION_ROLE') THEN
    CREATE ROLE \"$REPLICATION_ROLE\" WITH LOGIN REPLICATION;
  END IF; END \$\$"

for spec in "$HOME_REGION:$HOME_REDIS_PORT" "$AWAY_REGION:$AWAY_REDIS_PORT"; do
  mkdir -p "$DIR/${spec%%:*}/redis"
  redis-server --port "${spec##*:}" --bind 127.0.0.1 --save "" --appendonly no --dir "$DIR/${spec%%:*}/redis" \
    --loglevel warning > >(named "redis ${spec%%:*}") 2>&1 &
  pids+=($!)
done

mkdir -p "$DIR/link"
"$PY" scripts/region_link.py serve --state-dir "$DIR/link" \
  --route "$LINK_API_PORT=127.0.0.1:$HOME_API_PORT" --route "$LINK_PG_PORT=127.0.0.1:$HOME_PG_PORT" \
  > >(named link) 2>&1 &
pids+=($!)

# Each region's environment, also written to $DIR/<name>/env (mode 0600: it holds the key) for
# running manage.py against that region: (set -a; . var/regions/mumbai/env; .venv/bin/python manage.py ...)
region_env() {  # name api flower sandbox redis database peers-and-keys-of-the-other uid-base
  cat <<EOF
REGION=$1
REGION_PEERS=$7
REGION_KEYS=${7%%=*}=$KEY
DATABASE_URL=$6
CELERY_BROKER_URL=redis://127.0.0.1:$5/0
CACHE_URL=redis://127.0.0.1:$5/1
BIND=127.0.0.1:$2
FLOWER_PORT=$3
FLOWER_URL=http://127.0.0.1:$3
SANDBOX_RUNNER_PORT=$4
SANDBOX_RUNNER_URL=http://127.0.0.1:$4
SANDBOX_UID_BASE=$8
AGENTPLATFORM_VAR_DIR=$DIR/$1/serve
EOF
}
# The home reaches the away region's API directly; the away region reaches the home through the link.
# The sandbox runners' slot uids apart (RLIMIT_NPROC counts per uid across the machine).
(umask 077
 region_env "$HOME_REGION" "$HOME_API_PORT" "$HOME_FLOWER_PORT" "$HOME_SANDBOX_PORT" "$HOME_REDIS_PORT" \
   "$home_db" "$AWAY_REGION=http://127.0.0.1:$AWAY_API_PORT" 62000 >"$DIR/$HOME_REGION/env"
 region_env "$AWAY_REGION" "$AWAY_API_PORT" "$AWAY_FLOWER_PORT" "$AWAY_SANDBOX_PORT" "$AWAY_REDIS_PORT" \
   "$away_db" "$HOME_REGION=http://127.0.0.1:$LINK_API_PORT" 63000 >"$DIR/$AWAY_REGION/env")
# Started in a session of its own, each serve.sh is stopped as a whole (its process group). Its
# output filter is this script's child, opened here: made in the background command it would be
# serve.sh's child, and serve.sh's clean-up waits for all of its children.
for name in "$HOME_REGION" "$AWAY_REGION"; do
  mkdir -p "$DIR/$name/serve"
  chmod 0755 "$DIR" "$DIR/$name" "$DIR/$name/serve"  # the service user reaches its var directory
  mapfile -t vars <"$DIR/$name/env"
  exec {out}> >(named "$name")
  setsid env -u PROMETHEUS_MULTIPROC_DIR -u SANDBOX_RUNNER_TOKEN -u SANDBOX_RUNNER_TOKEN_FILE \
    -u SERVICE_PYTHON_DIR "${vars[@]}" bash scripts/serve.sh >&"$out" 2>&1 &
  serve_pids+=($!)
  exec {out}>&-
done

# Both APIs answer once their migrations are applied (serve.sh migrates before it starts uvicorn).
deadline=$((SECONDS + START_TIMEOUT))
for port in "$HOME_API_PORT" "$AWAY_API_PORT"; do
  until curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$port/healthz" 2>/dev/null; do
    for pid in "${serve_pids[@]}" "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || die "a process exited during start-up (its lines above say why)"
    done
    [ "$SECONDS" -lt "$deadline" ] || die "the APIs did not answer within $START_TIMEOUT s (START_TIMEOUT)"
    sleep 1
  done
done

# Logical replication of authority (regions/replication.py): published at the home, subscribed to by
# the away region through the link. Once subscribed, a restart keeps the subscription as it is.
manage() { (set -a && . "$DIR/$1/env" && set +a && shift && "$PY" manage.py "$@"); }
conninfo="host=127.0.0.1 port=$LINK_PG_PORT dbname=$HOME_REGION user=$REPLICATION_ROLE"
subscribed=$(psql_at "$away_db" "$AWAY_REGION" "SELECT count(*) FROM pg_subscription WHERE subname = 'authority_from_home'")
if [ "$subscribed" = 0 ]; then
  manage "$HOME_REGION" regions_replication publish | named "$HOME_REGION"
  psql_at "$home_db" "$HOME_REGION" "DO \$\$ DECLARE t record; BEGIN
    FOR t IN SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = 'authority' LOOP
      EXECUTE format('GRANT SELECT ON %I.%I TO %I', t.schemaname, t.tablename, '$REPLICATION_ROLE');
    END LOOP; END \$\$"
  manage "$AWAY_REGION" regions_replication subscribe "$conninfo" | named "$AWAY_REGION"
else
  # Subscribed by an earlier start: it goes on from its slot, through this start's link port.
  psql_at "$away_db" "$AWAY_REGION" "ALTER SUBSCRIPTION authority_from_home CONNECTION '$conninfo'"
  say "$AWAY_REGION already subscribed to $HOME_REGION's authority: resumed through the link"
fi

cat <<EOF | named regions

== two regions started; Ctrl-C stops everything
   $HOME_REGION (home)   API http://127.0.0.1:$HOME_API_PORT/v1/   Flower :$HOME_FLOWER_PORT   PostgreSQL :$HOME_PG_PORT   Redis :$HOME_REDIS_PORT
   $AWAY_REGION   API http://127.0.0.1:$AWAY_API_PORT/v1/   Flower :$AWAY_FLOWER_PORT   PostgreSQL :$AWAY_PG_PORT   Redis :$AWAY_REDIS_PORT
   link       $AWAY_REGION -> $HOME_REGION: API :$LINK_API_PORT, PostgreSQL :$LINK_PG_PORT (replication as $REPLICATION_ROLE)
== cut and heal the link:
   $PY scripts/region_link.py cut --state-dir $DIR/link      (heal; status)
== manage.py against a region (apply tenants, people and grants at $HOME_REGION):
   (set -a; . $DIR/$HOME_REGION/env; $PY manage.py apply FILE.yaml)
EOF
wait -n "${serve_pids[@]}" "${pids[@]}" || true
say "a process exited; stopping the rest"
exit 1
