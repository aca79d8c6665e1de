"""The content key store's server restarts: the process's pooled connections to it all break, and
the next key asked for is still served (a connection found lost closes the idle ones with it, so
the retry makes a new one instead of taking another broken one), not refused with 503."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.recovery.conftest import restart_postgres
from vault import store

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.usefixtures("own_services")
def test_after_the_key_stores_server_restarts_the_next_key_is_served(settings):
    ids = [str(uuid.uuid4()) for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:  # the pool's connections all made and idle
        list(pool.map(lambda run_id: store.put(run_id, "t", b"key-" + run_id.encode()), ids))

    restart_postgres()  # the key store lives beside the test database, on the throwaway cluster

    assert store.get(ids[0]) == b"key-" + ids[0].encode()
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(store.get, ids)) == [b"key-" + run_id.encode() for run_id in ids]
