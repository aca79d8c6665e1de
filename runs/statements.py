"""The engine's hand-written SQL, one named statement per job, for the writes every step makes.

Everything else about runs goes through the ORM. These are the statements a step sends on its
hot path, where building a query with the ORM costs more CPU than the round trip it makes
(docs/performance.md); each says why it is written by hand. Row instances are built with
`runs.rows` (the same conversions the ORM applies).

PostgreSQL gets one statement per job; SQLite (the demo) gets the same effect in plain steps.
"""

from __future__ import annotations

import functools

from django.db import connection

from runs import rows
from runs.models import Run, RunEvent, Step

RUNS = rows.table(Run)
STEPS = rows.table(Step)
EVENTS = rows.table(RunEvent)
_EVENT_FIELDS = [
    RunEvent._meta.get_field(name) for name in ("at", "kind", "step_seq", "actor", "message", "data")
]
_EVENT_CASTS = ("timestamptz", "text", "integer", "bigint", "text", "jsonb")


@functools.cache
def _insert_events_sql(count: int) -> str:
    """INSERT_EVENTS for `count` events of one run.

    The run's event counter moves and the events are inserted in one statement: the UPDATE
    locks the run row (the engine holds it already), so writers of one run number in turn.
    """
    first = "(1, " + ", ".join(f"%s::{cast}" for cast in _EVENT_CASTS) + ")"
    more = [f"({i}, " + ", ".join(["%s"] * len(_EVENT_CASTS)) + ")" for i in range(2, count + 1)]
    return f"""
WITH counter AS (
    UPDATE {RUNS} SET event_seq = event_seq + {count} WHERE id = %s RETURNING event_seq
)
INSERT INTO {EVENTS} (run_id, seq, at, kind, step_seq, actor_id, message, data)
SELECT %s, counter.event_seq - {count} + v.i, v.at, v.kind, v.step_seq, v.actor_id, v.message, v.data
  FROM counter, (VALUES {", ".join([first, *more])}) AS v(i, at, kind, step_seq, actor_id, message, data)
RETURNING id, seq
"""


def insert_events(run_id, events: list[RunEvent]) -> None:
    """Number one run's events after its latest and INSERT them: one statement on PostgreSQL."""
    if connection.vendor != "postgresql":
        count = len(events)
        first = rows.take(Run, run_id, "event_seq", count) - count + 1
        for i, event in enumerate(events):
            event.seq = first + i
        rows.insert(events)
        return
    run = rows.adapt(run_id)
    params = [run, run]
    for event in events:
        for field in _EVENT_FIELDS:
            params.append(field.get_db_prep_save(getattr(event, field.attname), connection))
    with connection.cursor() as cursor:
        cursor.execute(_insert_events_sql(len(events)), params)
        ids = dict((seq, pk) for pk, seq in cursor.fetchall())
    if len(ids) != len(events):
        raise Run.DoesNotExist(f"no run {run_id}")
    first = min(ids)
    for i, event in enumerate(events):
        event.seq = first + i
        event.pk = ids[event.seq]
        event._state.adding = False
        event._state.db = connection.alias


def take_lease(run: Run, token, expires, **counters: int) -> None:
    """TAKE_LEASE: the claim's one write to the run row it holds: the lease, and the counters of
    the step it commits (step_count, model_call_count, tool_call_count)."""
    sets = [f"{name} = {name} + %s" for name in counters]
    with connection.cursor() as cursor:
        rows.execute(
            cursor,
            f"UPDATE {RUNS} SET {', '.join(['lease_token = %s', 'lease_expires_at = %s', *sets])} "
            "WHERE id = %s",
            [token, expires, *counters.values(), run.pk],
        )
    run.lease_token, run.lease_expires_at = token, expires
    for name, n in counters.items():
        setattr(run, name, getattr(run, name) + n)


def step_log(run: Run) -> list[Step]:
    """STEP_LOG: the run's steps in order, each attached to `run` (what the decision reads)."""
    steps = [
        step
        for (step,) in rows.fetch(
            f"SELECT {rows.columns(Step, 's')} FROM {STEPS} s WHERE s.run_id = %s ORDER BY s.seq",
            [run.pk],
            Step,
        )
    ]
    for step in steps:
        step.run = run
    return steps
