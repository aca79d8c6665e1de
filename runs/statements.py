"""The engine's hand-written SQL, one named statement per job, for the writes every step makes.

Everything else about runs goes through the ORM. These are the statements a step sends on its
hot path, where building a query with the ORM costs more CPU than the round trip it makes
(docs/performance.md); each says why it is written by hand. Row instances are built with
`core.sql` (the same conversions the ORM applies).

PostgreSQL gets one statement per job; SQLite (the demo) gets the same effect in plain steps.
"""

from __future__ import annotations

import base64
import functools
import json
import uuid
from dataclasses import dataclass

from django.db import DEFAULT_DB_ALIAS, connections, models

from core import chain, sql
from core.errors import IllegalTransition
from core.partitions import located
from runs.models import OPEN, Run, RunEvent, Step, StepKind, StepStatus, skeleton_of
from vault.fields import SealedField

RUNS = sql.table(Run)
STEPS = Step._meta.db_table  # unquoted: core.partitions.located names the table or its month
EVENTS = sql.table(RunEvent)


def _field(model, name: str) -> models.Field:
    field = model._meta.get_field(name)
    if not isinstance(field, models.Field):
        raise TypeError(f"{model.__name__}.{name} is a relation's reverse side, not a column")
    return field


_EVENT_MESSAGE = RunEvent._meta.get_field("message")
_EVENT_DATA = RunEvent._meta.get_field("data")
_EVENT_SKELETON = RunEvent._meta.get_field("skeleton")
assert isinstance(_EVENT_MESSAGE, SealedField) and isinstance(_EVENT_DATA, SealedField)
assert isinstance(_EVENT_SKELETON, models.JSONField)
# message and data: the sealed values, base64 (vault/fields.py)
_EVENT_COLUMNS = (
    "i integer, at timestamptz, kind text, step_seq integer, actor_id bigint, message text, data text, "
    "skeleton jsonb, content_digest text"
)


@dataclass(frozen=True)
class StepWrite:
    """A guarded step UPDATE deferred to the run's one statement at the end of the transaction
    (runs.transitions.transition_step(defer=True))."""

    step_id: int
    run_id: uuid.UUID  # steps are partitioned by run: the run names the one partition to look in
    status: str  # the status it was read in: the guard
    values: dict  # columns to write, by field name

    def guard(self) -> dict:
        return {"run_id": self.run_id, "status": self.status}

    def sql(self) -> tuple[str, list, int]:
        into = located(STEPS, self.run_id)
        text, params = sql.update_sql(Step, self.step_id, where=self.guard(), into=into, **self.values)
        return text, params, 1


@dataclass(frozen=True)
class StepInsert:
    """New steps whose INSERT is deferred to the run's one statement (runs.transitions.insert_steps)."""

    steps: list[Step]

    def sql(self) -> tuple[str, list, int]:
        text, params = sql.insert_sql(self.steps)
        return text, params, len(self.steps)


@functools.cache
def _insert_events_sql(
    count: int, sets: tuple[str, ...], adds: tuple[str, ...], guarded: tuple[str, ...]
) -> str:
    """INSERT_EVENTS for `count` events of one run, and the run's own columns written with them.

    The run's event counter moves and the events are inserted in one statement: the UPDATE
    locks the run row (the engine holds it already), so writers of one run number in turn. The
    same UPDATE writes what the transaction deferred to its end (runs.transitions.write_run_at_end:
    the lease, the step counters, the enqueue time), so a step's run row is written once.
    `guarded`: the texts of deferred step writes (StepWrite, StepInsert), run in the same
    statement; it returns how many rows they wrote, so a guard that failed is seen before COMMIT.
    """
    assignments = [f"event_seq = event_seq + {count}"]
    if count:
        # The chain (core/chain.py): linked from the head on the row this UPDATE locks, so writers
        # of one run chain in turn as they number; the old head comes back as chain_prev.
        assignments += [
            "chain_prev = chain_head",
            f"chain_head = (run_event_chain(chain_head, event_seq + 1, %s::bytea[]))[{count}]",
        ]
    assignments += [f"{sql.quote(column)} = %s" for column in sets]
    assignments += [f"{sql.quote(column)} = {sql.quote(column)} + %s" for column in adds]
    update = f"UPDATE {RUNS} SET {', '.join(assignments)} WHERE id = %s"
    ctes = [f"s{i} AS ({text} RETURNING 1)" for i, text in enumerate(guarded)]
    moved = " + ".join(f"(SELECT count(*) FROM s{i})" for i in range(len(guarded)))
    if count == 0:
        if not guarded:
            return update
        return f"WITH {', '.join(ctes)} {update} RETURNING {moved}"
    # The events travel as one JSON parameter, not six each: psycopg caches the parsing of a
    # statement's text only up to 50 parameters, and parsing this one again cost 0.5 ms a step.
    counter = f"counter AS ({update} RETURNING event_seq, chain_prev)"
    chain = f"chain AS (SELECT run_event_chain(chain_prev, event_seq - {count} + 1, %s::bytea[]) AS h FROM counter)"
    return f"""
WITH {", ".join([*ctes, counter, chain])}
INSERT INTO {EVENTS} (run_id, seq, at, kind, step_seq, actor_id, message, data, skeleton, content_digest,
                       chain_hash)
SELECT %s, counter.event_seq - {count} + v.i, v.at, v.kind, v.step_seq, v.actor_id,
       decode(v.message, 'base64'), decode(v.data, 'base64'), v.skeleton, v.content_digest, chain.h[v.i]
  FROM counter, chain, jsonb_to_recordset(%s::jsonb) AS v({_EVENT_COLUMNS})
RETURNING id, seq{", " + moved if guarded else ""}
"""


def _events_json(events: list[RunEvent]) -> tuple[str, list[bytes]]:
    """The events as INSERT_EVENTS reads them: one JSON array of objects, `i` numbering them from
    1, message and data sealed with the run's key; and their chain bodies (core/chain.py), which
    the statement links. Sets each event's content digest and skeleton."""
    rows, bodies = [], []
    tenant = functools.partial(tenant_of, events[0].run_id) if events else None
    for i, event in enumerate(events, 1):
        at = event.at
        event.content_digest = chain.content_digest(event.message, event.data)
        event.skeleton = skeleton_of(event.data)
        bodies.append(
            chain.event_body(
                event.run_id, at, event.kind, event.step_seq, event.actor_id, event.content_digest
            )
        )
        rows.append(
            {
                "i": i,
                "at": at.isoformat(),
                "kind": event.kind,
                "step_seq": event.step_seq,
                "actor_id": event.actor_id,
                "message": _sealed_b64(_EVENT_MESSAGE, event.run_id, event.message, tenant),
                "data": _sealed_b64(_EVENT_DATA, event.run_id, event.data, tenant),
                "skeleton": event.skeleton,
                "content_digest": event.content_digest,
            }
        )
    return json.dumps(rows, cls=_EVENT_SKELETON.encoder), bodies


def _sealed_b64(field: SealedField, run_id, value, tenant) -> str | None:
    sealed = field.seal(run_id, value, tenant=tenant)
    return base64.b64encode(sealed).decode("ascii") if sealed is not None else None


def tenant_of(run_id):
    """The run's tenant: asked only when a run's first content is sealed (its key is made)."""
    return Run.objects.filter(pk=run_id).values_list("tenant_id", flat=True).get()


def write_run(
    run_id,
    events: list[RunEvent],
    *,
    sets: dict | None = None,
    adds: dict | None = None,
    steps: list[StepWrite | StepInsert] | tuple = (),
) -> None:
    """Number one run's events after its latest and INSERT them, writing `sets` (field: value) and
    adding `adds` (field: n) to the run's row, and the deferred step writes `steps`, in the same
    statement (PostgreSQL; SQLite: in steps). A step write whose guard fails raises IllegalTransition."""
    sets, adds = sets or {}, adds or {}
    if not events and not sets and not adds and not steps:
        return
    db = connections[DEFAULT_DB_ALIAS]  # not the proxy: one thread-local lookup per attribute
    if db.vendor != "postgresql":
        for write in steps:
            if isinstance(write, StepInsert):
                sql.insert(write.steps)
            elif not sql.update(Step, write.step_id, where=write.guard(), **write.values):
                raise _moved(write)
        if sets:
            sql.update(Run, run_id, **sets)
        for name, n in adds.items():
            sql.take(Run, run_id, name, n)
        if events:
            _chain_in_steps(run_id, events)
            sql.insert(events)
        return
    params: list = []
    guarded = []
    expected = 0
    for write in steps:
        text, step_params, rows = write.sql()
        guarded.append(text)
        params += step_params
        expected += rows
    set_fields = [_field(Run, name) for name in sets]
    add_fields = [_field(Run, name) for name in adds]
    statement = _insert_events_sql(
        len(events), tuple(f.column for f in set_fields), tuple(f.column for f in add_fields), tuple(guarded)
    )
    run = sql.adapt(run_id)
    if events:
        rows_json, bodies = _events_json(events)
        params.append(bodies)
    params += [field.get_db_prep_save(value, db) for field, value in zip(set_fields, sets.values())]
    params += list(adds.values())
    params.append(run)
    if events:
        params += [bodies, run, rows_json]
    with sql.prepared_cursor() as cursor:
        cursor.execute(statement, params)
        rows = cursor.fetchall() if events or steps else []
    if steps:
        moved = rows[0][-1] if rows else 0
        if moved != expected:
            raise _moved(next((w for w in steps if isinstance(w, StepWrite)), None))
    if not events:
        return
    ids = {row[1]: row[0] for row in rows}
    if len(ids) != len(events):
        raise Run.DoesNotExist(f"no run {run_id}")
    first = min(ids)
    for i, event in enumerate(events):
        event.seq = first + i
        event.pk = ids[event.seq]
        event._state.adding = False
        event._state.db = db.alias


def _chain_in_steps(run_id, events: list[RunEvent]) -> None:
    """Number and chain one run's events in plain statements (SQLite, the demo): the counter's
    UPDATE locks the run first, as the one statement does on PostgreSQL."""
    count = len(events)
    first = sql.take(Run, run_id, "event_seq", count) - count + 1
    head = bytes(Run.objects.filter(pk=run_id).values_list("chain_head", flat=True).get())
    prev = head
    for i, event in enumerate(events):
        event.seq = first + i
        event.content_digest = chain.content_digest(event.message, event.data)
        event.skeleton = skeleton_of(event.data)
        body = chain.event_body(
            run_id, event.at, event.kind, event.step_seq, event.actor_id, event.content_digest
        )
        event.chain_hash = head = chain.link(head, event.seq, body)
    sql.update(Run, run_id, chain_prev=prev, chain_head=head)


def _moved(write: StepWrite | None) -> IllegalTransition:
    """A deferred step write found its step no longer in the status it was read in."""
    if write is None:
        return IllegalTransition("step", "new", "proposed")
    return IllegalTransition("step", write.status, write.values.get("status", "?"))


@functools.cache
def _step_window_sql(steps: str) -> str:
    """STEP_WINDOW. The first open step comes through the partial index `step_open`, the proposing
    model call and the last tool call through the (run, seq) index read backwards from the run's
    newest step; the rows are then read from the (run, seq) index starting at the least of those,
    so the statement reads a handful of rows at step 200 as at step 2.

    Each bound is an ORDER BY ... LIMIT 1, not a min() or max(): in the generic plan of the
    prepared statement PostgreSQL aggregated max() over every step of the run, and the OR of the
    four conditions was a filter over all of them too (bench/profile_step.py --stagger: 0.21 ms
    of PostgreSQL's time a step over steps 1-25, 0.53 ms over steps 176-201).

    `steps`: the quoted table the run's steps are in (core.partitions.located)."""
    open_statuses = ", ".join(f"'{status}'" for status in sorted(OPEN))
    first_open = (
        f"SELECT o.seq FROM {steps} o WHERE o.run_id = %(run)s AND o.status IN ({open_statuses}) "
        "ORDER BY o.seq LIMIT 1"
    )
    last_tool = (
        f"SELECT t.seq FROM {steps} t WHERE t.run_id = %(run)s AND t.kind = '{StepKind.TOOL}' "
        "ORDER BY t.seq DESC LIMIT 1"
    )
    last_model = (
        f"SELECT m.seq FROM {steps} m WHERE m.run_id = %(run)s AND m.kind = '{StepKind.MODEL}' "
        f"AND m.status = '{StepStatus.SUCCEEDED}' ORDER BY m.seq DESC LIMIT 1"
    )
    # A run with no open step or no answer yet bounds by the rest (`after` is never NULL), one with
    # no tool call yet reads from its start. No bound is NULL, so SQLite's many-argument min() (the
    # demo's) gives what PostgreSQL's LEAST does.
    least = "LEAST" if connections[DEFAULT_DB_ALIAS].vendor == "postgresql" else "MIN"
    start = (
        f"{least}(COALESCE(({first_open}), %(after)s), COALESCE(({last_tool}), 0), "
        f"COALESCE(({last_model}), %(after)s), %(after)s)"
    )
    return (
        f"SELECT {sql.columns(Step, 's')} FROM {steps} s WHERE s.run_id = %(run)s AND s.seq >= {start} "
        f"AND (s.status IN ({open_statuses}) OR s.seq >= COALESCE(({last_tool}), 0) OR s.seq = ({last_model}) "
        "OR s.seq > %(after)s) ORDER BY s.seq"
    )


def step_window(run: Run, *, after: int | None = None) -> list[Step]:
    """STEP_WINDOW: what the claim's decision reads of the step log, in order, each attached to `run`.

    The steps whose status will still change (runs.models.OPEN), every step since the last tool
    call (the model calls that failed in a row, the reply that ended the run), and the latest
    successful model call (which proposed the open tool calls, with the tools it was offered).
    Finished steps before those never change what a claim decides. `after`: also every step after
    that seq (the turns this process has not yet added to the run's conversation:
    runs/engine/conversation.py), so a model call reads its history's new turns in the same
    statement; None adds none.
    """
    params = {"run": run.pk, "after": 2**31 if after is None else after}
    text = _step_window_sql(located(STEPS, run.pk))
    steps = [step for (step,) in sql.fetch(text, params, Step)]
    for step in steps:
        step.run = run
    return steps


@functools.cache
def _steps_after_sql(steps: str) -> str:
    return f"SELECT {sql.columns(Step, 's')} FROM {steps} s WHERE s.run_id = %(run)s AND s.seq > %(after)s ORDER BY s.seq"


def steps_after(run: Run, after: int) -> list[Step]:
    """STEPS_AFTER: the run's steps after seq `after`, in order (the conversation's new turns)."""
    text = _steps_after_sql(located(STEPS, run.pk))
    return [step for (step,) in sql.fetch(text, {"run": run.pk, "after": after}, Step)]
