"""The lease heartbeat: one thread per worker process that must never die while calls are in flight."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

from runs.engine import heartbeat


def _heartbeat_alive() -> bool:
    return any(t.name == "lease-heartbeat" and t.is_alive() for t in threading.enumerate())


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_outlives_a_tick_whose_connection_cannot_even_be_closed(django_db_blocker):
    run_id = uuid.uuid4()
    heartbeat.track(run_id, uuid.uuid4(), 3)  # extended every second
    try:
        time.sleep(heartbeat.TICK_SECONDS * 1.5)  # a tick has opened the thread's connection
        # Then every use of the database fails (pytest-django refuses it in every thread): the
        # tick's UPDATE fails, and so does closing its connection afterwards. A heartbeat that died
        # here would stop extending the lease of every call in flight on the process.
        with django_db_blocker.block():
            time.sleep(heartbeat.TICK_SECONDS * 2.5)
            assert _heartbeat_alive()
    finally:
        heartbeat.untrack(run_id)


@pytest.mark.django_db(transaction=True)
def test_a_tick_never_leaves_a_transaction_holding_the_runs_table(tenant):
    """Whatever left the thread's connection inside a transaction, the tick ends it: else its lock
    on runs_run would block every TRUNCATE, DDL and partition attach until the process ended."""
    from django.db import connection

    from runs.models import Run
    from tests.servers import database_url

    connection.set_autocommit(False)  # as if something had opened a transaction on it
    Run.objects.filter(pk=uuid.uuid4()).update(lease_expires_at=None)  # locks the table (ROW EXCLUSIVE)
    other = psycopg.connect(database_url().replace("postgres://", "postgresql://", 1), autocommit=True)
    try:
        with pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("SET lock_timeout = '100ms'; LOCK TABLE runs_run IN ACCESS EXCLUSIVE MODE")
        heartbeat.leave_no_transaction()
        with other.transaction():
            other.execute("SET LOCAL lock_timeout = '2s'")
            other.execute("LOCK TABLE runs_run IN ACCESS EXCLUSIVE MODE")
    finally:
        other.close()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_once_untrack_returns_the_lease_is_extended_no_more(tenant, asha, builtins):
    """An extension under way when the run is let go is waited out: a lease the caller then lets
    expire (a takeover to come) is not pushed forward behind its back."""
    import datetime as dt

    from django.db import connection, transaction
    from django.utils import timezone

    from runs.models import Run
    from runs.services import start_run
    from tests import factories
    from tests.servers import database_url

    factories.make_agent(tenant, tools=[], turns=[{"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    token = uuid.uuid4()
    Run.objects.filter(pk=run.pk).update(lease_token=token)
    blocker = psycopg.connect(database_url().replace("postgres://", "postgresql://", 1))
    try:
        blocker.execute("SELECT 1 FROM runs_run WHERE id = %s FOR UPDATE", [run.pk])  # the row held
        heartbeat.track(run.pk, token, 3)  # extended every second: its UPDATE now waits on the row
        deadline = time.monotonic() + 10
        while heartbeat._extending != str(run.pk):
            assert time.monotonic() < deadline, "the heartbeat never began extending the lease"
            time.sleep(0.05)
        letting_go = threading.Thread(target=heartbeat.untrack, args=(run.pk,))
        letting_go.start()
        letting_go.join(0.5)
        assert letting_go.is_alive(), "untrack returned while the extension was still under way"
        blocker.rollback()  # the extension goes through...
        letting_go.join(5)
        assert not letting_go.is_alive()  # ...and only then is the run let go
    finally:
        blocker.close()
        connection.close()
    with transaction.atomic():
        Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    time.sleep(heartbeat.TICK_SECONDS * 2.5)
    assert Run.objects.get(pk=run.pk).lease_expires_at < timezone.now()  # expired, and it stays so
