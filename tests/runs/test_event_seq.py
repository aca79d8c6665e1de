"""Event ids are per run: 1, 2, 3, ... whatever other runs and tenants do meanwhile (issue #12, item 6)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from runs.models import Run, RunEvent
from runs.services import start_run
from runs.transitions import atomic_with_events, record_event
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def _events(user, run_id, **params) -> list[dict]:
    client = APIClient()
    client.force_authenticate(user)
    response = client.get(f"/v1/runs/{run_id}/events", params)
    assert response.status_code == 200, response.content
    return response.json()


def _start(tenant, user):
    factories.make_agent(tenant, turns=[{"text": "done"}])
    run, _ = start_run(user=user, agent="agent", input={})
    return run


def test_a_runs_event_ids_count_from_one_without_gaps_from_other_tenants(tenant, asha):
    other = factories.make_tenant("globex")
    bob = factories.make_user(other, "bob")
    mine, theirs = _start(tenant, asha), _start(other, bob)
    # The two runs' events are written interleaved: one global sequence would leave gaps.
    for _ in range(3):
        record_event(theirs.pk, "note", "their activity")
        record_event(mine.pk, "note", "my activity")
    drive(theirs.pk)
    drive(mine.pk)

    events = _events(asha, mine.pk)

    ids = [e["id"] for e in events]
    assert ids == list(range(1, len(ids) + 1)) and len(ids) >= 6
    assert [e["seq"] for e in events] == ids
    assert Run.objects.get(pk=mine.pk).event_seq == len(ids)
    assert [e["id"] for e in _events(asha, mine.pk, after=4)] == ids[4:]
    assert [e["message"] for e in _events(asha, mine.pk, after=1)][:3] == ["my activity"] * 3


def test_concurrent_writers_of_one_run_get_distinct_consecutive_numbers(tenant, asha):
    run = _start(tenant, asha)
    before = Run.objects.get(pk=run.pk).event_seq
    barrier = threading.Barrier(8)
    errors = []

    def write(n: int) -> None:
        try:
            barrier.wait()
            if n % 2:
                with atomic_with_events():  # the engine's batched writer
                    record_event(run.pk, "note", f"batch {n} a")
                    record_event(run.pk, "note", f"batch {n} b")
            else:
                with transaction.atomic():  # a writer that holds no run lock
                    record_event(run.pk, "note", f"single {n}")
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    seqs = sorted(RunEvent.objects.filter(run=run).values_list("seq", flat=True))
    assert seqs == list(range(1, before + 12 + 1))
    # A batch keeps its events together and in order.
    by_message = {event.message: event.seq for event in RunEvent.objects.filter(run=run)}
    for n in (1, 3, 5, 7):
        assert by_message[f"batch {n} b"] == by_message[f"batch {n} a"] + 1
