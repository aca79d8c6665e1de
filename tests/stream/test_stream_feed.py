"""runs.front.stream_feed on the real database: a committed event wakes the streams of its run, and only them."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from django.db import connection

from runs.front import stream_feed
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
        feed = stream_feed.Feed()
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


def streamed_rows(process: str) -> list[tuple]:
    """The runs `process` holds a row for (other tests' servers may have left rows of their own)."""
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f'SELECT run_id, lease_until > now() FROM "{stream_feed.STREAMED}" WHERE process = %s',
                [process],
            )
            return [(str(run), live) for run, live in cursor.fetchall()]
    finally:
        connection.close()  # this thread's own connection


def test_a_run_nobody_streams_sends_no_notify_and_a_closed_feed_leaves_no_row(tenant, asha, builtins):
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    watched, _ = start_run(user=asha, agent="agent", input={})
    unwatched, _ = start_run(user=asha, agent="agent", input={})

    async def scenario():
        feed = stream_feed.Feed()
        heard: list[str] = []
        listener = await psycopg.AsyncConnection.connect(**stream_feed._connect_params(), autocommit=True)
        try:
            await listener.execute(f"LISTEN {stream_feed.CHANNEL}")
            feed.subscribe(watched.pk)
            await asyncio.wait_for(feed.connected.wait(), 10)
            rows = await asyncio.to_thread(streamed_rows, feed.process)
            # Notifications arrive in commit order: once the watched run's is heard, the unwatched
            # run's, committed first, would have been heard before it.
            await asyncio.to_thread(note, unwatched.pk)
            await asyncio.to_thread(note, watched.pk)
            async for notification in listener.notifies(timeout=10):
                heard.append(notification.payload.partition(":")[0])
                if heard[-1] == str(watched.pk):
                    break
            return rows, heard, feed.process
        finally:
            await listener.close()
            await feed.close()

    rows, heard, process = asyncio.run(scenario())
    assert rows == [(str(watched.pk), True)]
    assert heard == [str(watched.pk)]
    assert streamed_rows(process) == []


def test_a_lapsed_lease_is_ignored_by_the_trigger(tenant, asha, builtins):
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    other, _ = start_run(user=asha, agent="agent", input={})
    with connection.cursor() as cursor:  # a process that died a while ago streamed the run
        cursor.execute(
            f"INSERT INTO \"{stream_feed.STREAMED}\" VALUES (%s, 'dead', now() - interval '1 second')",
            [run.pk],
        )

    async def scenario():
        feed = stream_feed.Feed()
        heard: list[str] = []
        listener = await psycopg.AsyncConnection.connect(**stream_feed._connect_params(), autocommit=True)
        try:
            await listener.execute(f"LISTEN {stream_feed.CHANNEL}")
            feed.subscribe(other.pk)
            await asyncio.wait_for(feed.connected.wait(), 10)
            await asyncio.to_thread(note, run.pk)
            await asyncio.to_thread(note, other.pk)
            async for notification in listener.notifies(timeout=10):
                heard.append(notification.payload.partition(":")[0])
                if heard[-1] == str(other.pk):
                    break
            return heard
        finally:
            await listener.close()
            await feed.close()

    assert asyncio.run(scenario()) == [str(other.pk)]


def test_a_notification_for_the_event_already_sent_wakes_the_stream_to_read_the_status_again(
    tenant, asha, builtins
):
    # A read takes the status, then the events: the run's last commit can land between the two, so
    # the stream sends the last event with a status older than it; that event's notification must
    # make it read again, or it never learns the run ended (seen in CI: no end within 90 s).
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    seen = Run.objects.get(pk=run.pk).event_seq

    async def scenario():
        feed = stream_feed.Feed()
        try:
            following = feed.subscribe(run.pk)
            await asyncio.wait_for(feed.connected.wait(), 10)
            assert await feed.wait(following, after=seen, timeout=1)  # the listener's first wake-up
            await asyncio.to_thread(note, run.pk)
            # The notification of seq + 1 is delivered while (as if) a read sent that event already.
            deadline = asyncio.get_running_loop().time() + 10
            while following.notified <= seen and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            return await feed.wait(following, after=seen + 1, timeout=1)
        finally:
            await feed.close()

    assert asyncio.run(scenario()) is True
