"""The engine's per-step writes to a run row touch none of its indexes (PostgreSQL HOT updates).

A run row carries twenty indexes, one a GIN index over its input and metadata. An update that
changes an indexed column writes a new entry into every one of them; the claim and the record
change the lease, the counters and the event sequence on every step, so no index may hold those
(runs/migrations/0017_hot_run_updates.py, docs/performance.md).
"""

from __future__ import annotations

import pytest
from django.db import connection

from runs.models import RunStatus
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def _updates() -> tuple[int, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")  # this backend's counts, published now
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'runs_run'")
        return cursor.fetchone()


def test_a_run_of_forty_steps_updates_its_row_in_place(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    turns = [{"tool_calls": [{"name": echo.name, "arguments": {"say": f"call {n}"}}]} for n in range(20)]
    factories.make_agent(tenant, tools=[echo], turns=[*turns, {"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={"customer": "asha@example.com", "amount": 12})
    before = _updates()

    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    updated, hot = (after - first for after, first in zip(_updates(), before, strict=True))
    assert updated >= 80  # a claim and a record for each of the 41 steps
    # Only the status changes (queued -> running -> succeeded) touch the indexes.
    assert updated - hot <= 3, f"{updated - hot} of {updated} updates of the run row touched its indexes"
