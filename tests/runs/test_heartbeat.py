"""The lease heartbeat: one thread per worker process that must never die while calls are in flight."""

from __future__ import annotations

import threading
import time
import uuid

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
