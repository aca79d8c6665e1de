"""Settings: everything comes from the environment, with defaults that need nothing installed.

AGENTPLATFORM_ENV=production makes SECRET_KEY, SECRET_ENCRYPTION_KEYS and DATABASE_URL required.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import dj_database_url

from agentplatform.env import (env_bool, env_float, env_int, env_list, env_required,
                               env_str)

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
    SECRET_KEY = env_required("SECRET_KEY")
    SECRET_ENCRYPTION_KEYS = env_list("SECRET_ENCRYPTION_KEYS", []) or [env_required("SECRET_ENCRYPTION_KEYS")]
    env_required("DATABASE_URL")
else:
    SECRET_KEY = env_str("SECRET_KEY") or _dev_file_secret("django-secret.key", _django_key)
    SECRET_ENCRYPTION_KEYS = env_list("SECRET_ENCRYPTION_KEYS", []) or [
        _dev_file_secret("encryption.key", _fernet_key)]

DEBUG = env_bool("DEBUG", not PRODUCTION)
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
    "guardian",
    "tenants",
    "agents",
    "llm",
    "tools",
    "budgets",
    "runs",
    "approvals",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",   # admin static files under gunicorn
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "agentplatform.urls"
WSGI_APPLICATION = "agentplatform.wsgi.application"
AUTH_USER_MODEL = "tenants.User"

TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [BASE_DIR / "templates"],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]


def _database() -> dict:
    url = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'agentplatform.sqlite3'}")
    db = dj_database_url.parse(url)
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
        pool_max = env_int("DB_POOL_MAX", 0)
        if pool_max:
            # Pooled connections are returned on close(); workers close before network calls
            # so a thread waiting on a model holds no database connection.
            db["CONN_MAX_AGE"] = 0
            db["OPTIONS"]["pool"] = {"min_size": 1, "max_size": pool_max, "timeout": 30}
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
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)   # WhiteNoise expects it even before collectstatic

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "agentplatform.errors.exception_handler",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Agent platform API",
    "VERSION": "1.0.0",
    "DESCRIPTION": "Start and watch agent runs, decide approvals, resolve unknown outcomes.",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
}

# --- Celery (DESIGN.md section 3) ---
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "memory://")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 330)
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 360)
# Longer than the longest step (hard limit above), so Redis never redelivers a live task.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600)}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = env_str("CELERY_QUEUE") or (f"runs-test-{os.getpid()}" if TESTING else "runs")
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Survives a Redis restart that kombu 5.7 would turn into a worker exit (see agentplatform/celery.py).
CELERY_WORKER_CONSUMER = "agentplatform.celery:Consumer"
CELERY_BEAT_SCHEDULE = {
    "sweep": {"task": "runs.tasks.sweep", "schedule": env_float("SWEEP_INTERVAL_SECONDS", 5.0)},
}

# --- Platform ---
LEASE_SECONDS = env_int("LEASE_SECONDS", 60)          # model steps; tool steps: tool timeout + margin
LEASE_MARGIN_SECONDS = env_int("LEASE_MARGIN_SECONDS", 15)
# Sub-accounts per tenant day on PostgreSQL (SQLite: always 1). Every process of a deployment
# must use the same value: a day's sub-accounts are opened by whichever process reserves first.
BUDGET_DAY_SHARDS = env_int("BUDGET_DAY_SHARDS", 8)
QUEUED_TOO_LONG_SECONDS = env_int("QUEUED_TOO_LONG_SECONDS", 30)
MAX_STEP_CRASHES = env_int("MAX_STEP_CRASHES", 3)
TOOL_RESULT_MODEL_CHARS = env_int("TOOL_RESULT_MODEL_CHARS", 8000)
VISIBLE_TOOLS_MAX = env_int("VISIBLE_TOOLS_MAX", 30)
# The demo runs a worker thread inside the same process (in-memory broker).
INPROCESS_WORKER = CELERY_BROKER_URL.startswith("memory://")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
}
