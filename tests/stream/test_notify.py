"""runs.notify on the real database: a committed event wakes the streams of its run, and only them."""

from __future__ import annotations

import asyncio

import pytest
from django.db import connection

from runs import notify
from runs.models import Run
from runs.services import start_run
from runs.transitions import record_event
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def note(run_id) -> None:
    try:
        record_event(run_id, "note", "a supervisor looked")
    finally:
        connection.close()  # this thread's own connection


def test_a_committed_event_wakes_the_streams_of_its_run_and_only_them(tenant, asha, builtins):
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    first, _ = start_run(user=asha, agent="agent", input={})
    other, _ = start_run(user=asha, agent="agent", input={})
    seen = Run.objects.get(pk=first.pk).event_seq

    async def scenario():
        feed = notify.Feed()
        try:
            following, elsewhere = feed.subscribe(first.pk), feed.subscribe(other.pk)
            await asyncio.wait_for(feed.connected.wait(), 10)
            # Connected, the listener wakes every stream once to re-read (nothing was notified before).
            assert await feed.wait(following, after=seen, timeout=1)
            assert await feed.wait(elsewhere, after=0, timeout=1)
            await asyncio.to_thread(note, first.pk)
            woken = await feed.wait(following, after=seen, timeout=10)
            untouched = await feed.wait(elsewhere, after=0, timeout=0.5)
            status, rows = await feed.read(following, after=seen, limit=10)
            return woken, untouched, status, rows
        finally:
            await feed.close()

    woken, untouched, status, rows = asyncio.run(scenario())
    assert woken and status == "queued"
    assert [(row.seq, row.kind, row.message) for row in rows] == [(seen + 1, "note", "a supervisor looked")]
    assert untouched is False  # the other run's stream slept through it
