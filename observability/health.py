"""Liveness and readiness checks: cheap, bounded in time, and honest about what failed.

The database is checked on a connection of its own with a short connect timeout, not through
the process's pool: a pool waits up to its own timeout for a free or new connection, which would
make a probe hang instead of answer.
"""

from __future__ import annotations

import threading

from django.conf import settings
from django.db import connection

_migrations_applied = False
_lock = threading.Lock()


class CheckFailed(Exception):
    pass


def _describe(exc: Exception) -> str:
    # First line only: driver errors can run long; they never carry the password.
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def check_database() -> set[tuple[str, str]]:
    """Reach the database and return the applied migrations."""
    timeout = settings.READY_TIMEOUT_SECONDS
    try:
        if connection.vendor == "postgresql":
            import psycopg

            params = connection.get_connection_params()
            params.pop("cursor_factory", None)
            params.pop("context", None)
            with psycopg.connect(**params, connect_timeout=max(int(timeout), 1), autocommit=True) as raw:
                raw.execute(f"SET statement_timeout = {int(timeout * 1000)}")
                return set(raw.execute("SELECT app, name FROM django_migrations").fetchall())
        with connection.cursor() as cursor:
            cursor.execute("SELECT app, name FROM django_migrations")
            return set(cursor.fetchall())
    except Exception as exc:  # any failure to reach or read it means: not ready
        raise CheckFailed(_describe(exc)) from exc


def check_migrations(applied: set[tuple[str, str]]) -> None:
    """Every migration on disk is applied. Once true it stays true for this process's code."""
    global _migrations_applied
    if _migrations_applied:
        return
    from django.db.migrations.loader import MigrationLoader

    with _lock:
        on_disk = set(MigrationLoader(None, ignore_no_migrations=True).disk_migrations)
    missing = sorted(on_disk - applied)
    if missing:
        raise CheckFailed(f"{len(missing)} migration(s) not applied, first {missing[0][0]}.{missing[0][1]}")
    _migrations_applied = True


def broker_connection():
    from kombu import Connection

    timeout = settings.READY_TIMEOUT_SECONDS
    return Connection(
        settings.CELERY_BROKER_URL,
        connect_timeout=timeout,
        transport_options={
            **settings.CELERY_BROKER_TRANSPORT_OPTIONS,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "max_retries": 0,
        },
    )


def check_broker() -> None:
    try:
        with broker_connection() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=settings.READY_TIMEOUT_SECONDS)
    except Exception as exc:
        raise CheckFailed(_describe(exc)) from exc


def readiness() -> tuple[bool, dict[str, str]]:
    checks: dict[str, str] = {}
    try:
        applied = check_database()
        checks["database"] = "ok"
        try:
            check_migrations(applied)
            checks["migrations"] = "ok"
        except CheckFailed as exc:
            checks["migrations"] = str(exc)
    except CheckFailed as exc:
        checks["database"] = str(exc)
        checks["migrations"] = "unknown: database unreachable"
    try:
        check_broker()
        checks["broker"] = "ok"
    except CheckFailed as exc:
        checks["broker"] = str(exc)
    return all(value == "ok" for value in checks.values()), checks
