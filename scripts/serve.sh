#!/usr/bin/env bash
# Production shape on one machine: gunicorn (API + admin), celery worker, celery beat, flower.
# Configure with environment variables (see README "Configuration"); defaults target local services.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export DATABASE_URL=${DATABASE_URL:-postgres://root@127.0.0.1:5432/agentplatform}
export CELERY_BROKER_URL=${CELERY_BROKER_URL:-redis://127.0.0.1:6379/0}
export DB_POOL_MAX=${DB_POOL_MAX:-20}
BIND=${BIND:-127.0.0.1:8000}
FLOWER_PORT=${FLOWER_PORT:-5555}
WORKER_CONCURRENCY=${WORKER_CONCURRENCY:-64}
GUNICORN_WORKERS=${GUNICORN_WORKERS:-2}

case "$DATABASE_URL" in postgres*) ;; *) echo "serve needs PostgreSQL (DATABASE_URL)"; exit 2;; esac
case "$CELERY_BROKER_URL" in redis*|amqp*) ;; *) echo "serve needs Redis or RabbitMQ (CELERY_BROKER_URL)"; exit 2;; esac

dbname=${DATABASE_URL##*/}; dbname=${dbname%%\?*}
psql "${DATABASE_URL%/*}/postgres" -tAc "SELECT 1 FROM pg_database WHERE datname='$dbname'" | grep -q 1 \
  || psql "${DATABASE_URL%/*}/postgres" -c "CREATE DATABASE \"$dbname\"" >/dev/null

$PY manage.py migrate --noinput
$PY manage.py collectstatic --noinput -v 0

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait || true; }
trap cleanup EXIT INT TERM

$PY -m gunicorn agentplatform.wsgi --bind "$BIND" --workers "$GUNICORN_WORKERS" --threads 8 \
  --access-logfile - & pids+=($!)
# Threads: steps spend their time waiting on models and tools, and the engine returns its
# pooled database connection before every call, so one process keeps many runs in flight.
# No gossip, mingle or heartbeat: the platform coordinates through PostgreSQL, not between
# workers, and gossip's Redis pub/sub consumer is one more way a Redis restart reaches kombu's
# close bug (agentplatform/celery.py).
$PY -m celery -A agentplatform worker -P threads -c "$WORKER_CONCURRENCY" -Q "${CELERY_QUEUE:-runs}" \
  --without-gossip --without-mingle --without-heartbeat --loglevel INFO & pids+=($!)
$PY -m celery -A agentplatform beat --loglevel INFO --schedule "${VAR_DIR:-var}/celerybeat-schedule" & pids+=($!)
$PY -m celery -A agentplatform flower --port="$FLOWER_PORT" --address=127.0.0.1 & pids+=($!)
echo "API and admin on http://$BIND  (docs: /v1/docs, admin: /admin/), Flower on http://127.0.0.1:$FLOWER_PORT"
wait -n "${pids[@]}"
