"""Settings: everything comes from the environment, with defaults that need nothing installed.

AGENTPLATFORM_ENV=production makes SECRET_KEY, SECRET_ENCRYPTION_KEYS, DATABASE_URL,
CONTENT_KEYS_DATABASE_URL and the URLs the platform publishes (ASSERTION_ISSUER, PUBLIC_BASE_URL)
required,
refuses to start with a weak SECRET_KEY, an invalid encryption key or DEBUG on, and turns on
HTTPS-only behaviour (HSTS, redirect to HTTPS, secure cookies): `manage.py check --deploy` passes.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path
from typing import Any

import dj_database_url

from core.env import (
    ConfigError,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_pairs,
    env_rate,
    env_required,
    env_str,
    fernet_keys,
    public_url,
    strong_secret_key,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("AGENTPLATFORM_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

PRODUCTION = env_str("AGENTPLATFORM_ENV", "dev") == "production"
# Several test sessions may share one PostgreSQL and one Redis: each gets its own test
# database and its own queue so they never consume each other's messages.
TESTING = "pytest" in sys.modules


def _dev_file_secret(name: str, make) -> str:
    """A secret generated once per checkout for the demo; production must set it explicitly."""
    path = VAR_DIR / name
    if not path.exists():
        path.write_text(make())
        path.chmod(0o600)
    return path.read_text().strip()


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


def _django_key() -> str:
    import secrets

    return secrets.token_urlsafe(50)


if PRODUCTION:
    # Both are checked now: a bad key would otherwise surface only when first used (a session
    # signed, a secret decrypted), in the middle of serving.
    SECRET_KEY = strong_secret_key("SECRET_KEY", env_required("SECRET_KEY"))
    SECRET_ENCRYPTION_KEYS = fernet_keys(
        "SECRET_ENCRYPTION_KEYS",
        env_list("SECRET_ENCRYPTION_KEYS", []) or [env_required("SECRET_ENCRYPTION_KEYS")],
    )
    env_required("DATABASE_URL")
    if env_bool("DEBUG", False):
        raise ConfigError("DEBUG must not be on in production: it shows settings and stack traces to anyone")
    DEBUG = False
    # HTTPS only. Behind a proxy that terminates TLS, name the header it sets (X-Forwarded-Proto)
    # in SECURE_PROXY_SSL_HEADER; set it only if the proxy always overwrites that header.
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600)
    if SECURE_HSTS_SECONDS <= 0:
        raise ConfigError("SECURE_HSTS_SECONDS must be greater than 0 in production (HSTS stays on)")
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    _proxy_header = env_str("SECURE_PROXY_SSL_HEADER")
    if _proxy_header:
        SECURE_PROXY_SSL_HEADER = ("HTTP_" + _proxy_header.upper().replace("-", "_"), "https")
else:
    SECRET_KEY = env_str("SECRET_KEY") or _dev_file_secret("django-secret.key", _django_key)
    SECRET_ENCRYPTION_KEYS = fernet_keys(
        "SECRET_ENCRYPTION_KEYS",
        env_list("SECRET_ENCRYPTION_KEYS", []) or [_dev_file_secret("encryption.key", _fernet_key)],
    )
    DEBUG = env_bool("DEBUG", True)
# Run content sealed at rest (vault/): the keys that wrap each run's data key, the first wrapping
# new ones (default: the secrets' keys, from which each tenant's key is derived under its own
# label), and the key store's database, apart from the platform's so that dumps and backups of
# the one do not hold the keys of the other (docs/history.md, "Sealed content").
CONTENT_KEYS = fernet_keys("CONTENT_KEYS", env_list("CONTENT_KEYS", []) or SECRET_ENCRYPTION_KEYS)
CONTENT_KEYS_DATABASE_URL = env_str("CONTENT_KEYS_DATABASE_URL", "")
# Connections a process keeps to the key store, and how long a thread waits for one (vault/store.py).
CONTENT_KEYS_POOL_MAX = env_int("CONTENT_KEYS_POOL_MAX", 4, minimum=1, maximum=100)
CONTENT_KEYS_POOL_TIMEOUT = env_float("CONTENT_KEYS_POOL_TIMEOUT", 5.0)
if PRODUCTION:
    # Derived beside the platform's database, the keys would share its server's backups: named.
    if not CONTENT_KEYS_DATABASE_URL:
        raise ConfigError(
            "CONTENT_KEYS_DATABASE_URL must be set in production: the content key store, a database "
            "whose backups are not the platform database's (docs/history.md, 'Sealed content')"
        )
    _where = [dj_database_url.parse(u) for u in (CONTENT_KEYS_DATABASE_URL, env_str("DATABASE_URL", ""))]
    if len({(w.get("HOST"), w.get("PORT"), w.get("NAME")) for w in _where}) == 1:
        raise ConfigError("CONTENT_KEYS_DATABASE_URL must not be the platform's own database (DATABASE_URL)")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here (no CDN)
    "guardian",
    "tenants",
    "agents",
    "llm",
    "authority",
    "tools",
    "budgets",
    "runs",
    "approvals",
    "observability",
    "configuration",
    "notifications",
    "artifacts",
    "connections",
    "history",
    "evals",
    "regions",
]

MIDDLEWARE = [
    # /healthz, /readyz and /metrics: answered before host validation (probes and scrapers address
    # the process by IP) and before sessions and auth, which they do not need.
    "observability.middleware.ProbeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "core.middleware.ContentSecurityPolicy",  # every response below here, pages with a nonce
    "whitenoise.middleware.WhiteNoiseMiddleware",  # admin static files under gunicorn
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "core.middleware.ApiInputGuard",  # NUL in /v1/ paths and query strings: 400
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "agentplatform.urls"
WSGI_APPLICATION = "agentplatform.wsgi.application"
AUTH_USER_MODEL = "tenants.User"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def _database() -> dict[str, Any]:
    url = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'agentplatform.sqlite3'}")
    db: dict[str, Any] = dict(dj_database_url.parse(url))
    if db["ENGINE"] == "django.db.backends.sqlite3":
        # Immediate transactions take the write lock at BEGIN, so concurrent writers queue
        # instead of failing with "database is locked" halfway through a transaction.
        db["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 30}
    else:
        # Health checks let workers and the API survive a PostgreSQL restart.
        db["CONN_HEALTH_CHECKS"] = True
        # Django's own queries bind parameters on the client and are never prepared; a threshold
        # lets the budget ledger's hot statements (budgets.services._execute, prepare=True) be
        # parsed and planned once per connection instead of on every call. With the psycopg
        # default Django passes (None), prepare=True is silently ignored.
        db["OPTIONS"] = {"prepare_threshold": 5}
        # The engine's prepared statements are keyed by a run or a row's id, for which one generic
        # plan serves every call. Left to choose, PostgreSQL re-plans those that read the steps
        # table (partitioned by month: history/partitions.py) on every call, since the generic
        # plan's estimate counts every month's partition: 0.6 ms a step window. "" leaves it to
        # the server (a pooler that refuses startup options: set it with ALTER ROLE instead).
        plan_cache_mode = env_str("DB_PLAN_CACHE_MODE", "force_generic_plan")
        if plan_cache_mode:
            db["OPTIONS"]["options"] = f"-c plan_cache_mode={plan_cache_mode}"
        pool_max = env_int("DB_POOL_MAX", 0)
        if pool_max:
            # Pooled connections are returned on close(); workers close before network calls
            # so a thread waiting on a model holds no database connection.
            db["CONN_MAX_AGE"] = 0
            db["OPTIONS"]["pool"] = {"min_size": 1, "max_size": pool_max, "timeout": 30}
            # The pool checks a connection each time it hands one out: an empty statement, a round
            # trip that commits, twice per engine step. Workers turn it off (DB_POOL_CHECK=0, set
            # by scripts/serve.sh for the worker): everything they do with the database is retried
            # from scratch on a lost connection (the task's autoretry; recording an outcome through
            # runs.engine.dispatch.through_database_outage), and a dead connection is dropped by
            # the pool when it is handed back, so after a PostgreSQL restart each stale one fails
            # once. The API keeps the check: a request has no retry of its own.
            db["CONN_HEALTH_CHECKS"] = env_bool("DB_POOL_CHECK", True)
        else:
            db["CONN_MAX_AGE"] = env_int("DB_CONN_MAX_AGE", 60)
    if TESTING and db["ENGINE"] != "django.db.backends.sqlite3":
        db["TEST"] = {"NAME": env_str("TEST_DATABASE_NAME") or f"test_{db['NAME']}_{os.getpid()}"}
    return db


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
ANONYMOUS_USER_NAME = None  # guardian: no anonymous user row

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
# One date format on every admin page, Django's own columns included (core/formats).
FORMAT_MODULE_PATH = ["core.formats"]
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)  # WhiteNoise expects it even before collectstatic

# --- API input bounds (core/parsers.py) ---
API_MAX_BODY_BYTES = env_int("API_MAX_BODY_BYTES", 1_048_576, minimum=1024, maximum=50 * 1_048_576)
API_MAX_JSON_DEPTH = env_int("API_MAX_JSON_DEPTH", 64, minimum=4, maximum=500)
DATA_UPLOAD_MAX_MEMORY_SIZE = API_MAX_BODY_BYTES
# A multipart request (a run started with files): its whole body, files included.
API_MAX_UPLOAD_BYTES = env_int(
    "API_MAX_UPLOAD_BYTES", 64 * 1_048_576, minimum=1_048_576, maximum=1024 * 1_048_576
)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.auth.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["core.parsers.StrictJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_SCHEMA_CLASS": "core.schema.AutoSchema",
    "EXCEPTION_HANDLER": "core.errors.exception_handler",
    "DEFAULT_PAGINATION_CLASS": "core.api.Pagination",
    "PAGE_SIZE": 50,
    # Client address for rate limits: REMOTE_ADDR, or the n-th address from the right of
    # X-Forwarded-For behind n trusted proxies.
    "NUM_PROXIES": env_int("TRUSTED_PROXY_COUNT", 0, minimum=0, maximum=5) or None,
    "DEFAULT_THROTTLE_RATES": {
        "token_username": env_rate("TOKEN_RATE_PER_USERNAME", "10/min"),
        "token_address": env_rate("TOKEN_RATE_PER_ADDRESS", "30/min"),
        "run_start": env_rate("RUN_START_RATE_PER_USER", "60/min"),
    },
}

# --- API tokens (tenants/tokens.py) ---
API_TOKEN_TTL_SECONDS = env_int("API_TOKEN_TTL_SECONDS", 8 * 3600, minimum=60, maximum=7 * 24 * 3600)
# A token can be refreshed until this long after the password sign-in it descends from.
API_TOKEN_MAX_AGE_SECONDS = env_int(
    "API_TOKEN_MAX_AGE_SECONDS", 7 * 24 * 3600, minimum=60, maximum=90 * 24 * 3600
)


def _published_url(name: str) -> str:
    """A URL other parties are given: required in production, like SECRET_KEY. A default there
    would be published silently (an issuer that serves no keys, a localhost OAuth callback)."""
    if PRODUCTION:
        return public_url(name, env_required(name), production=True)
    return public_url(name, env_str(name, "http://127.0.0.1:8000"), production=False)


# --- delegated authority (authority/, docs/authority.md) ---
# The `iss` of the platform's signed assertions: its public base URL, where providers find the key
# set at /.well-known/jwks.json.
ASSERTION_ISSUER = _published_url("ASSERTION_ISSUER")
# How long an assertion is good for: a call is sent at once, so a short life bounds a replay.
ASSERTION_TTL_SECONDS = env_int("ASSERTION_TTL_SECONDS", 120, minimum=10, maximum=600)
# The longest a provider may cache the key set: its Cache-Control max-age, and the bound
# docs/authority.md gives providers (the verification snippet's cache_seconds).
JWKS_CACHE_SECONDS = env_int("JWKS_CACHE_SECONDS", 300, minimum=1, maximum=24 * 3600)
# A new signing key is published this long before it signs, so verifiers caching the key set hold
# it before it signs: at least twice the cache bound (a verifier's copy may come from a proxy that
# cached it for as long), never less (authority/keys.py refuses a shorter rotation too).
SIGNING_KEY_LEAD_SECONDS = env_int(
    "SIGNING_KEY_LEAD_SECONDS", max(600, 2 * JWKS_CACHE_SECONDS), maximum=7 * 24 * 3600
)
if SIGNING_KEY_LEAD_SECONDS < 2 * JWKS_CACHE_SECONDS:
    raise ConfigError(
        f"SIGNING_KEY_LEAD_SECONDS must be at least twice JWKS_CACHE_SECONDS ({2 * JWKS_CACHE_SECONDS}), "
        f"got {SIGNING_KEY_LEAD_SECONDS}: providers caching the key set would refuse the new key's calls"
    )

SPECTACULAR_SETTINGS = {
    "TITLE": "Agent platform API",
    "VERSION": "1.0.0",
    "DESCRIPTION": (
        "Start and watch agent runs, decide approvals, resolve unknown outcomes. Sign in with "
        "POST /v1/auth/token and send `Authorization: Bearer <token>` (or `Token <token>`). Every "
        "error has the Error body. A quick start with curl is docs/api.md in the repository."
    ),
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "COMPONENT_SPLIT_REQUEST": True,
    # A run's status is also a filter of bulk pause/resume requests: one enum, under its own name.
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "runs.models.RunStatus",
        # Two fields are named scope: a legal hold's and a kill switch's (the latter's name kept).
        "HoldScopeEnum": "history.models.HoldScope",
        "ScopeEnum": "runs.models.KillSwitch.Scope",
        # A bulk action's kind and its preview's: one set of choices in two components.
        "BulkActionKindEnum": "runs.models.BulkAction.Kind",
    },
    # /v1/docs loads Swagger UI from our own static files (drf-spectacular-sidecar, pinned in
    # requirements.txt): it works on a network with no internet. No validator badge (it calls out).
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "displayOperationId": True, "validatorUrl": None},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "core.schema.add_error_responses",
    ],
}

# --- Celery (DESIGN.md section 3) ---
# memory://localhost/ rather than memory://: kombu warns "No hostname was supplied" for the latter.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "memory://localhost/")
if CELERY_BROKER_URL == "memory://":
    CELERY_BROKER_URL = "memory://localhost/"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_DEFAULT_QUEUE_TYPE = "classic"  # quorum on RabbitMQ (below)
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 330)
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 360)
# Longer than the longest step (hard limit above), so Redis never redelivers a live task.
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, float] = {
    "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600)
}
if CELERY_BROKER_URL.startswith("memory://"):
    # The in-process broker polls its queues once a second by default: each step of the demo
    # then waits up to a second for its message. 50 ms keeps the story at the engine's pace.
    CELERY_BROKER_TRANSPORT_OPTIONS["polling_interval"] = 0.05
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
if CELERY_BROKER_URL.startswith(("amqp://", "amqps://", "pyamqp://")):
    # RabbitMQ: quorum queues (replicated, kept through the broker's restarts and fsynced before a
    # publish is confirmed), publishes confirmed, and topic exchanges, which Celery's native
    # delayed delivery needs for countdowns on quorum queues (a quorum queue refuses the worker's
    # old way of holding a countdown message unacknowledged). Celery turns off the global prefetch
    # a quorum queue does not support; prefetch stays one message per worker thread.
    _queue_type = env_choice("CELERY_QUEUE_TYPE", "quorum", ("quorum", "classic"))
    CELERY_TASK_DEFAULT_QUEUE_TYPE = _queue_type
    CELERY_TASK_CREATE_MISSING_QUEUE_TYPE = _queue_type
    CELERY_TASK_DEFAULT_EXCHANGE_TYPE = "topic"
    CELERY_TASK_CREATE_MISSING_QUEUE_EXCHANGE_TYPE = "topic"
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
CELERY_TASK_DEFAULT_QUEUE = env_str("CELERY_QUEUE") or (f"runs-test-{os.getpid()}" if TESTING else "runs")
# The sweeper has its own queue, so a backed-up runs queue never delays recovery (workers consume
# both: scripts/serve.sh); its task sends no monitoring events, so Flower lists the engine's tasks.
SWEEP_QUEUE = env_str("CELERY_SWEEP_QUEUE") or f"{CELERY_TASK_DEFAULT_QUEUE}.sweeper"
# Notifications ride on the sweeper's queue: a periodic pass like it, consumed by the same workers.
CELERY_TASK_ROUTES = {
    "runs.tasks.sweep": {"queue": SWEEP_QUEUE},
    "notifications.tasks.notify": {"queue": SWEEP_QUEUE},
    "regions.tasks.tend_slices": {"queue": SWEEP_QUEUE},
    "regions.tasks.heartbeat": {"queue": SWEEP_QUEUE},
    "evals.tasks.watch_canaries": {"queue": SWEEP_QUEUE},
}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Where Flower answers, for the admin run page's link to a run's tasks (scripts/serve.sh sets it).
FLOWER_URL = (env_str("FLOWER_URL") or "").rstrip("/")
# Survives a Redis restart that kombu 5.7 would turn into a worker exit (see agentplatform/celery.py).
CELERY_WORKER_CONSUMER = "agentplatform.celery:Consumer"
# Celery's shape: an entry's values are a task name, a schedule and options; ours are seconds.
CELERY_BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "sweep": {"task": "runs.tasks.sweep", "schedule": env_float("SWEEP_INTERVAL_SECONDS", 5.0)},
    "notify": {"task": "notifications.tasks.notify", "schedule": env_float("NOTIFY_INTERVAL_SECONDS", 5.0)},
    # Signed checkpoints over the runs' chain heads (history/checkpoints.py): a database
    # administrator's rewrite of a run's chain goes unnoticed at most this long (docs/history.md).
    "history_checkpoint": {
        "task": "history.tasks.checkpoint",
        "schedule": env_float("HISTORY_CHECKPOINT_SECONDS", 600.0),
    },
    # Retention's purge of runs' content (history/retention.py): at most a batch of runs per
    # tenant a pass, each run in its own short transaction.
    "history_purge": {"task": "history.tasks.purge", "schedule": env_float("HISTORY_PURGE_SECONDS", 300.0)},
    # The data subject search's index (history/subjects.py): the runs ended since the last pass.
    # Until a run is indexed, an erasure's search reads it whole.
    "history_subject_index": {
        "task": "history.tasks.index_subjects",
        "schedule": env_float("HISTORY_SUBJECT_INDEX_SECONDS", 60.0),
    },
    # The content keys a removal could not destroy, and those of runs deleted whole
    # (history/shredding.py): a read of the whole key store, so not on every purge.
    "history_shred_keys": {
        "task": "history.tasks.shred_keys",
        "schedule": env_float("HISTORY_SHRED_SECONDS", 3600.0),
    },
    # The month partitions of steps, events and the ledger (history/partitions.py), made ahead.
    "history_partitions": {
        "task": "history.tasks.prepare_partitions",
        "schedule": env_float("HISTORY_PARTITIONS_SECONDS", 86_400.0),
    },
    "watch_canaries": {
        "task": "evals.tasks.watch_canaries",
        "schedule": env_float("CANARY_WATCH_SECONDS", 30.0),
    },
}
# The regions' keeper and heartbeat (regions/tasks.py), on the sweeper's queue and only in a
# deployment that names its region: one without regions sends no task every half second.
if env_str("REGION", ""):
    CELERY_BEAT_SCHEDULE["regions"] = {
        "task": "regions.tasks.tend_slices",
        "schedule": env_float("REGION_TEND_SECONDS", 1.0),
    }
    CELERY_BEAT_SCHEDULE["heartbeat"] = {
        "task": "regions.tasks.heartbeat",
        "schedule": env_float("REGION_HEARTBEAT_SECONDS", 0.5),
    }
CELERY_TASK_ROUTES["regions.tasks.tend_slices"] = {"queue": SWEEP_QUEUE}
CELERY_TASK_ROUTES["regions.tasks.heartbeat"] = {"queue": SWEEP_QUEUE}
HISTORY_PURGE_BATCH = env_int("HISTORY_PURGE_BATCH", 100, minimum=1, maximum=10_000)
# How many ended runs a pass of the subject index reads, each in its own short transaction.
HISTORY_SUBJECT_INDEX_BATCH = env_int("HISTORY_SUBJECT_INDEX_BATCH", 500, minimum=1, maximum=100_000)
# How long making or dropping a month partition waits for its brief exclusive lock on a history
# table before it gives up until the next pass (the step path's statements queue behind it).
HISTORY_PARTITION_LOCK_TIMEOUT_MS = env_int(
    "HISTORY_PARTITION_LOCK_TIMEOUT_MS", 200, minimum=10, maximum=60_000
)
# How many months ahead the beat makes partitions for.
HISTORY_PARTITION_MONTHS_AHEAD = env_int("HISTORY_PARTITION_MONTHS_AHEAD", 2, minimum=1, maximum=24)

# --- Regions (regions/, docs/regions.md) ---
# This deployment's region; "" (the default): no regions, every tenant is at home here.
REGION_NAME = env_str("REGION", "")
# The other regions: REGION_PEERS="mumbai=https://mumbai.example,frankfurt=https://..." and the key
# each pair of regions shares to sign its requests: REGION_KEYS="mumbai=...,frankfurt=...".
REGION_PEERS = env_pairs("REGION_PEERS")
REGION_KEYS = env_pairs("REGION_KEYS")
REGION_TIMEOUT_SECONDS = env_float("REGION_TIMEOUT_SECONDS", 2.0)  # a call to a home, connect to last byte

# --- Webhook notifications (notifications/, docs/notifications.md) ---
NOTIFY_TIMEOUT_SECONDS = env_float("NOTIFY_TIMEOUT_SECONDS", 10.0)  # whole POST, connect to last byte
NOTIFY_MAX_ATTEMPTS = env_int("NOTIFY_MAX_ATTEMPTS", 8, minimum=1, maximum=100)
NOTIFY_BACKOFF_SECONDS = env_float("NOTIFY_BACKOFF_SECONDS", 10.0)  # before the 2nd attempt; doubles
NOTIFY_BACKOFF_MAX_SECONDS = env_float("NOTIFY_BACKOFF_MAX_SECONDS", 3600.0)
NOTIFY_EXPIRING_WITHIN_SECONDS = env_int("NOTIFY_EXPIRING_WITHIN_SECONDS", 900, minimum=0)
# Events committed late (their transaction began before a later one that committed first) are
# still found when at most this old.
NOTIFY_LOOKBACK_SECONDS = env_int("NOTIFY_LOOKBACK_SECONDS", 300, minimum=0)


def _cache() -> dict:
    """Rate limits count in the cache, so it must be shared by every API process in production."""
    url = env_str("CACHE_URL") or (
        CELERY_BROKER_URL
        if PRODUCTION and CELERY_BROKER_URL.startswith(("redis://", "rediss://"))
        else "locmem://"
    )
    if url.startswith(("redis://", "rediss://")):
        return {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": url,
            "KEY_PREFIX": "agentplatform",
        }
    if url != "locmem://":
        raise ConfigError(f"CACHE_URL must be redis://… or locmem://, got {url!r}")
    if PRODUCTION:
        raise ConfigError(
            "production needs a cache shared by all processes (rate limits): set CACHE_URL=redis://… "
            "or use a Redis CELERY_BROKER_URL"
        )
    return {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}


CACHES = {"default": _cache()}


def _quota_redis_url() -> str:
    """Model endpoint quotas count in Redis, shared by every worker (llm/quotas.py)."""
    url = env_str("QUOTA_REDIS_URL") or next(
        (
            candidate
            for candidate in (env_str("CACHE_URL") or "", CELERY_BROKER_URL)
            if candidate.startswith(("redis://", "rediss://"))
        ),
        "",
    )
    if url and not url.startswith(("redis://", "rediss://")):
        raise ConfigError(f"QUOTA_REDIS_URL must be redis://… or rediss://…, got {url!r}")
    if PRODUCTION and not url:
        raise ConfigError(
            "production needs a Redis shared by all workers for model endpoint quotas: set "
            "QUOTA_REDIS_URL=redis://… or use a Redis CELERY_BROKER_URL"
        )
    return url


QUOTA_REDIS_URL = _quota_redis_url()
# The period an endpoint's requests_per_minute and tokens_per_minute are counted over; tests
# shorten it so a quota fills in seconds.
QUOTA_WINDOW_SECONDS = env_float("QUOTA_WINDOW_SECONDS", 60.0)
if QUOTA_WINDOW_SECONDS <= 0:
    raise ConfigError(f"QUOTA_WINDOW_SECONDS must be positive, got {QUOTA_WINDOW_SECONDS}")
# How long the limiter may take to answer before the call goes ahead unlimited (Redis down).
QUOTA_TIMEOUT_SECONDS = env_float("QUOTA_TIMEOUT_SECONDS", 0.25)

# --- Platform ---
LEASE_SECONDS = env_int("LEASE_SECONDS", 60)  # model steps; tool steps: tool timeout + margin
LEASE_MARGIN_SECONDS = env_int("LEASE_MARGIN_SECONDS", 15)
# Sub-accounts per tenant day on PostgreSQL (SQLite: always 1). Every process of a deployment
# must use the same value: a day's sub-accounts are opened by whichever process reserves first.
# A settle waits for its own sub-account when another step's transaction holds it: with 20 runs
# of one tenant at once, 8 gave lock waits in 12-30% of samples, 32 in none; with 100 runs, 32
# gave 3.9-7.9% and 64 gave 1.8% and 3.2% at the same CPU per step (bench/peers.py).
# A call larger than a sub-account's room takes the pooled path (every sub-account locked), so
# a tenant whose day holds fewer than this many calls' worth queues as on one row.
BUDGET_DAY_SHARDS = env_int("BUDGET_DAY_SHARDS", 64)
QUEUED_TOO_LONG_SECONDS = env_int("QUEUED_TOO_LONG_SECONDS", 30)
MAX_STEP_CRASHES = env_int("MAX_STEP_CRASHES", 3)
TOOL_RESULT_MODEL_CHARS = env_int("TOOL_RESULT_MODEL_CHARS", 8000)
VISIBLE_TOOLS_MAX = env_int("VISIBLE_TOOLS_MAX", 30)
# The demo runs a worker thread inside the same process (in-memory broker).
INPROCESS_WORKER = CELERY_BROKER_URL.startswith("memory://")

# --- Observability (docs/operations.md) ---
# Every line carries tenant, run id, step seq and tool where the engine knows them (a filter reads
# them from the context the engine binds at claim time); LOG_FORMAT=json writes JSON lines.
LOG_FORMAT = env_str("LOG_FORMAT", "plain")
if LOG_FORMAT not in ("plain", "json"):
    raise ConfigError(f"LOG_FORMAT must be plain or json, got {LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "run_context": {"()": "observability.logs.RunContextFilter"},
        "quiet_periodic": {"()": "observability.logs.QuietPeriodicTasks"},
    },
    "formatters": {
        "plain": {"()": "observability.logs.PlainFormatter"},
        "json": {"()": "observability.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            # LOG_QUIET_PERIODIC=0 keeps the periodic passes' "nothing found" lines (a test counts them).
            "filters": ["run_context", "quiet_periodic"]
            if env_bool("LOG_QUIET_PERIODIC", True)
            else ["run_context"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
}
# What a /metrics scrape adds to the recorded counters: gauges computed now from the store and the
# broker (agentplatform/gauges.py reads every app, so the scrape names it here instead of importing it).
METRICS_COLLECTORS = ["agentplatform.gauges.DatabaseCollector", "agentplatform.gauges.BrokerCollector"]
# /metrics: a bearer token or an address allowlist (either suffices when both are). It shows tenant
# names, run counts and spend, so production serves it to no one until one of them is set; dev
# leaves it open with neither.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
if PRODUCTION and METRICS_TOKEN and len(METRICS_TOKEN) < 32:
    raise ConfigError(
        f"METRICS_TOKEN must be at least 32 characters in production, got {len(METRICS_TOKEN)} "
        "(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
    )
METRICS_ALLOW_FROM = env_list("METRICS_ALLOW_FROM", [])
for _network in METRICS_ALLOW_FROM:
    try:
        ipaddress.ip_network(_network, strict=False)
    except ValueError:
        raise ConfigError(f"METRICS_ALLOW_FROM: {_network!r} is not an address or network") from None
# Set, every process writes its counters there and /metrics adds them up (gunicorn workers,
# Celery workers): the directory must be shared by them and emptied before they start.
PROMETHEUS_MULTIPROC_DIR = env_str("PROMETHEUS_MULTIPROC_DIR", "")
# A Celery worker that shares no PROMETHEUS_MULTIPROC_DIR with the API (another host or container)
# serves its own counters on this port (0: off), under the same token and allowlist.
WORKER_METRICS_PORT = env_int("WORKER_METRICS_PORT", 0)
WORKER_METRICS_ADDR = env_str("WORKER_METRICS_ADDR", "0.0.0.0")
# /readyz and the queue-depth gauge: how long to wait for the database and the broker.
READY_TIMEOUT_SECONDS = env_float("READY_TIMEOUT_SECONDS", 3.0)

# --- Live run stream (runs/front/stream.py, runs/front/stream_feed.py; docs/api.md "Run stream") ---
# A comment line every this many seconds keeps idle streams open through proxies and tells the
# client the server is alive.
RUN_STREAM_HEARTBEAT_SECONDS = env_float("RUN_STREAM_HEARTBEAT_SECONDS", 15.0)
# PostgreSQL: the streams of one process read new events through a pool of at most this many
# connections (plus one LISTEN connection); no stream holds a connection while it waits.
RUN_STREAM_DB_POOL_MAX = env_int("RUN_STREAM_DB_POOL_MAX", 4, minimum=1, maximum=100)
# SQLite (the demo) has no LISTEN/NOTIFY: each stream looks for new events this often.
RUN_STREAM_POLL_SECONDS = env_float("RUN_STREAM_POLL_SECONDS", 0.5)

# --- Artifacts and the sandbox runner (artifacts/, sandbox/, docs/sandbox.md) ---
# Defaults for a tenant without an ArtifactLimits row.
ARTIFACT_MAX_BYTES = env_int("ARTIFACT_MAX_BYTES", 32 * 1_048_576, minimum=1024)
ARTIFACT_MAX_RUN_BYTES = env_int("ARTIFACT_MAX_RUN_BYTES", 256 * 1_048_576, minimum=1024)
ARTIFACT_MAX_RUN_COUNT = env_int("ARTIFACT_MAX_RUN_COUNT", 200, minimum=1)
# Where run_python's executions go: the runner process (python -m sandbox.runner), loopback only.
SANDBOX_RUNNER_URL = env_str("SANDBOX_RUNNER_URL", "http://127.0.0.1:8790")
# The shared secret the runner answers to (sandbox/runner.py): SANDBOX_RUNNER_TOKEN, else the
# file the runner made (read at each call: the runner may start after the platform).
SANDBOX_RUNNER_TOKEN = env_str("SANDBOX_RUNNER_TOKEN", "")
SANDBOX_RUNNER_TOKEN_FILE = env_str("SANDBOX_RUNNER_TOKEN_FILE", str(VAR_DIR / "sandbox-runner.token"))
# Where people's browsers reach this platform: the OAuth callback of per-user connections to MCP
# servers (registered with each authorization server) and the links to connect (docs/authority-oauth.md).
PUBLIC_BASE_URL = _published_url("PUBLIC_BASE_URL")
# run_python's prices (tools/run_python.py): per CPU second used and per GiB of memory limit held
# per wall second, in micro-units of the tenant's currency.
SANDBOX_PRICE_CPU_SECOND_MICROS = env_int("SANDBOX_PRICE_CPU_SECOND_MICROS", 50, minimum=0)
SANDBOX_PRICE_GIB_SECOND_MICROS = env_int("SANDBOX_PRICE_GIB_SECOND_MICROS", 10, minimum=0)
