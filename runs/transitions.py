"""Writes on runs and steps: guarded transitions, each one conditional UPDATE plus an event, the run
row locked with what a step reads, and the events batched into one statement at the end of the
transaction (`atomic_with_events`, `write_run_at_end`, `at_end`); ending a run, and withdrawing
the approvals it can no longer use. The engine (runs/engine/) and the services write through here."""

from __future__ import annotations

import functools
import json
import threading
import uuid
from contextlib import contextmanager

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from agents.models import AgentDefinition, AgentVersion
from approvals import services as approvals
from approvals.models import Approval, TenantPolicies
from core import chain, sql
from core.errors import IllegalTransition
from llm.models import ModelEndpoint
from observability import observe
from regions.models import Heartbeat, TenantRegions, here
from runs import statements
from runs.models import (
    READY,
    RUN_TRANSITIONS,
    STEP_TRANSITIONS,
    TERMINAL,
    WAITING,
    ClaimReads,
    KillSwitch,
    Run,
    RunEvent,
    Step,
    StepStatus,
)
from tenants.models import Tenant, TenantGroup, User
from tenants.permissions import held_sql
from vault.fields import SealedJSONField, seal, sealed_names

_batch = threading.local()
# The step's columns sealed at rest (vault/fields.py), and those of them holding JSON: sealed as
# the text their digest was made of.
_SEALED_STEP_COLUMNS = frozenset(sealed_names(Step))
_SEALED_RUN_COLUMNS = frozenset(sealed_names(Run))
_JSON_STEP_COLUMNS = frozenset(
    name for name in _SEALED_STEP_COLUMNS if isinstance(Step._meta.get_field(name), SealedJSONField)
)


def record_event(
    run_id, kind: str, message: str = "", *, step_seq: int | None = None, actor=None, **data
) -> RunEvent:
    """Append an event; inside `atomic_with_events` it is inserted with the others at the end."""
    event = sql.new(
        RunEvent,
        run_id=run_id,
        kind=kind,
        message=message,
        step_seq=step_seq,
        actor=actor,
        data=data,
        at=timezone.now(),
    )
    pending = getattr(_batch, "events", None)
    if pending is None:
        write_events([event])
    else:
        pending.append(event)
    return event


def write_events(events: list[RunEvent]) -> None:
    """Number the events per run, in order, and INSERT each run's in one statement.

    An event's `seq` is its number within its run (what the API shows as its id). The statement
    (runs.statements.write_run) moves the run's counter and inserts in one round trip; the
    counter's UPDATE holds the run row until commit, so writers of one run number in turn (the
    engine already holds that row anyway).
    """
    _flush(events, {})


def _flush(events: list[RunEvent], run_writes: dict, step_writes: dict | None = None) -> None:
    step_writes = step_writes or {}
    by_run: dict = {run_id: [] for run_id in [*run_writes, *step_writes]}
    for event in events:
        by_run.setdefault(event.run_id, []).append(event)
    for run_id, of_run in by_run.items():
        sets, adds = run_writes.get(run_id, ({}, {}))
        statements.write_run(run_id, of_run, sets=sets, adds=adds, steps=step_writes.get(run_id, ()))


def write_run_at_end(run: Run, *, adds: dict | None = None, **values) -> None:
    """Write columns of a run the caller holds locked: inside `atomic_with_events` in the one
    statement that writes its events at the end of the transaction, else now.

    For columns nothing in the transaction reads back from the database (the lease, the step
    counters, the enqueue time); `run` (the instance) is updated at once.
    """
    adds = adds or {}
    for name, value in values.items():
        setattr(run, name, value)
    for name, n in adds.items():
        setattr(run, name, getattr(run, name) + n)
    write_run_columns_at_end(run.pk, adds, values)


def write_run_columns_at_end(run_id, adds: dict, values: dict) -> None:
    pending = getattr(_batch, "run_writes", None)
    if pending is None:
        statements.write_run(run_id, [], sets=values, adds=adds)
        return
    sets, added = pending.setdefault(run_id, ({}, {}))
    sets.update(values)
    for name, n in adds.items():
        added[name] = added.get(name, 0) + n


@contextmanager
def atomic_with_events():
    """A transaction whose events are inserted in one statement, in order, just before it commits
    (with the run columns deferred to then: write_run_at_end).

    An event written inside is not visible to queries inside (nothing here reads events back).
    Nested inside another such block, it joins the outer one.
    """
    if getattr(_batch, "events", None) is not None:
        with transaction.atomic():
            yield
        return
    pending: list[RunEvent] = []
    run_writes: dict = {}
    step_writes: dict = {}
    last: list = []
    _batch.events, _batch.run_writes, _batch.step_writes, _batch.last = pending, run_writes, step_writes, last
    try:
        with transaction.atomic():
            yield
            for write in last:  # at_end: just before the events, with them still batched
                write()
            _batch.events = _batch.run_writes = _batch.step_writes = _batch.last = None
            _flush(pending, run_writes, step_writes)  # one statement per run, in order
    finally:
        _batch.events = _batch.run_writes = _batch.step_writes = _batch.last = None


def at_end(write) -> None:
    """Run `write()` at the end of the current `atomic_with_events` block, just before its events
    statement and COMMIT (now, outside one). The engine closes a step's reservation so: the
    budget accounts' rows (a tenant-day shard is shared by every run of the tenant) are then
    locked for the last two statements of the transaction only."""
    last = getattr(_batch, "last", None)
    if last is None:
        write()
    else:
        last.append(write)


def transition_run(
    run: Run, to: str, *, message: str = "", actor=None, event_data: dict | None = None, **fields
) -> None:
    """Move a run from its current status to `to`, or raise. One conditional UPDATE plus an event."""
    old = run.status
    if to not in RUN_TRANSITIONS[old]:
        raise IllegalTransition("run", old, to)
    now = timezone.now()
    if to in TERMINAL:
        fields.setdefault("finished_at", now)
    if to in TERMINAL or to in WAITING:
        # Nobody works on a run that waits or has ended: the next claim must not find a lease.
        fields.update(lease_token=None, lease_expires_at=None)
    written = fields | {
        name: seal(Run, name, run.pk, value, tenant=run.tenant_id)
        for name, value in fields.items()
        if name in _SEALED_RUN_COLUMNS
    }
    if not update_row(Run, run.pk, where={"status": old}, status=to, **written):
        raise IllegalTransition("run", old, to)
    run.status = to
    for name, value in fields.items():
        setattr(run, name, value)
    record_event(
        run.pk,
        "status",
        message or f"{old} → {to}",
        actor=actor,
        **{"from": old, "to": to, **(event_data or {}), **_content(fields, chain.RUN_CONTENT)},
    )
    observe.run_moved(run, old, to, reason=fields.get("stop_reason", ""), message=message)


def transition_step(
    step: Step, to: str, *, message: str = "", actor=None, defer: bool = False, **fields
) -> RunEvent:
    """Move a step from its current status to `to`, or raise. One conditional UPDATE plus an event,
    which it returns (inside `atomic_with_events` it is inserted at the end: a caller may still
    add to it, as the record adds the settle's figures).

    `defer`: inside `atomic_with_events`, the UPDATE goes into the run's one statement at the end
    of the transaction (runs.statements.StepWrite), its guard checked there: for the engine's
    last write of a step in a transaction, when nothing after it reads the step's row back.
    """
    old = step.status
    if to not in STEP_TRANSITIONS.get(old, set()):
        raise IllegalTransition("step", old, to)
    deferred = getattr(_batch, "step_writes", None) if defer else None
    plain = not any(hasattr(v, "resolve_expression") for v in fields.values())
    # The content columns serialised once: their texts are digested into the event and written.
    texts = chain.content_texts(fields)
    written = _as_texts(fields, texts, step.run_id)
    if deferred is not None and plain:
        deferred.setdefault(step.run_id, []).append(
            statements.StepWrite(step.pk, step.run_id, old, {"status": to, **written})
        )
    # With the run: steps are partitioned by it (history/partitions.py), and it names the one
    # partition the row is in.
    elif not update_row(Step, step.pk, where={"run_id": step.run_id, "status": old}, status=to, **written):
        raise IllegalTransition("step", old, to)
    step.status = to
    for name, value in fields.items():
        setattr(step, name, value)
    label = step.tool_name or step.kind
    event = record_event(
        step.run_id,
        "step",
        message or f"step {step.seq} {label}: {old} → {to}",
        step_seq=step.seq,
        actor=actor,
        # The digests of the content it writes bind that content into the run's chain (core/chain.py).
        **{"from": old, "to": to, "step_kind": step.kind, "tool": step.tool_name},
        **({"content": chain.digests_of(texts)} if texts else {}),
    )
    observe.step_moved(step, old, to, error=fields.get("error", ""), message=message)
    return event


def _as_texts(fields: dict, texts: dict[str, bytes], run_id) -> dict:
    """`fields` with each content column's value sealed with the run's key, a JSON one from the
    canonical text its digest was made of (not serialised twice)."""
    return fields | _sealed(run_id, fields, texts)


def _sealed(run_id, values: dict, texts: dict[str, bytes] | None = None) -> dict:
    """The sealed columns among a step write's `values`, as the column stores them."""
    texts = texts or {}
    return {
        name: seal(
            Step,
            name,
            run_id,
            value,
            tenant=functools.partial(statements.tenant_of, run_id),
            plaintext=texts.get(name) if name in _JSON_STEP_COLUMNS else None,
        )
        for name, value in values.items()
        if name in _SEALED_STEP_COLUMNS
    }


def _content(fields: dict, names: tuple[str, ...]) -> dict:
    digests = chain.content_of(fields, names)
    return {"content": digests} if digests else {}


def insert_steps(steps: list[Step], *, defer: bool = False) -> None:
    """INSERT new steps now, or with `defer` (inside `atomic_with_events`) in the run's one
    statement at the end of the transaction: then nothing in the transaction may read them back
    and they get no primary key in memory."""
    deferred = getattr(_batch, "step_writes", None) if defer else None
    if deferred is None or not steps:
        sql.insert(steps)
        return
    deferred.setdefault(steps[0].run_id, []).append(statements.StepInsert(steps))


def write_step(step: Step, **values) -> None:
    """Write columns of a step without moving it: into its deferred write of this transaction
    when it has one (transition_step(defer=True): that write would otherwise overwrite these
    columns at the end), else now. `step` (the instance) is updated at once."""
    for name, value in values.items():
        setattr(step, name, value)
    values = values | _sealed(step.run_id, values)
    for write in (getattr(_batch, "step_writes", None) or {}).get(step.run_id, []):
        if isinstance(write, statements.StepWrite) and write.step_id == step.pk:
            write.values.update(values)
            return
    update_row(Step, step.pk, where={"run_id": step.run_id}, **values)


def update_row(model, pk, *, where: dict | None = None, **values) -> int:
    """One conditional UPDATE by primary key; in SQL written here unless a value is an expression."""
    if any(hasattr(v, "resolve_expression") for v in values.values()):
        return model.objects.filter(pk=pk, **(where or {})).update(**values)
    return sql.update(model, pk, where=where, **values)


@functools.cache
def _lock_run_row_sql() -> str:
    # With the tenant's secrets generation: the record redacts with it (tenants/secrets.py).
    return (
        f"SELECT {sql.columns(Run, 'r')}, (SELECT t.secrets_generation FROM {sql.table(Tenant)} t "
        f"WHERE t.id = r.tenant_id) FROM {sql.table(Run)} r WHERE r.id = %(run)s {sql.for_update('r')}"
    )


@functools.cache
def _lock_run_sql(for_step: bool, regions: bool = False) -> str:
    """LOCK_RUN (built once: the column lists come from the models' metadata).

    For a step, the same statement also reads what the claim would otherwise ask in statements
    of their own (ClaimReads): the tenant's policy version, whether a tool or endpoint switch of
    the tenant is on, the creator's groups and run_agent grant, and the agent; in a deployment
    with regions, also the tenant's home, its revocation reach and the age of the home's newest
    heartbeat here (runs/authority_copy.py), in the snapshot the switches and policies are read in.
    """
    joins = (
        f"JOIN {sql.table(Tenant)} t ON t.id = r.tenant_id "
        f"JOIN {sql.table(AgentVersion)} v ON v.id = r.version_id "
    )
    select = f"{sql.columns(Run, 'r')}, {sql.columns(Tenant, 't')}, {sql.columns(AgentVersion, 'v')}"
    if for_step:
        joins += (
            f"JOIN {sql.table(User)} u ON u.id = r.created_by_id "
            f"JOIN {sql.table(ModelEndpoint)} e ON e.id = v.model_endpoint_id "
            f"JOIN {sql.table(AgentDefinition)} a ON a.id = r.agent_id "
        )
        groups = (
            f"SELECT g.name FROM {sql.table(TenantGroup)} g JOIN {sql.table(User.groups.through)} m "
            "ON m.group_id = g.group_id WHERE m.user_id = r.created_by_id ORDER BY g.name"
        )
        select += (
            f", {sql.columns(User, 'u')}, {sql.columns(ModelEndpoint, 'e')}, {sql.columns(AgentDefinition, 'a')}"
            f", (SELECT p.version FROM {sql.table(TenantPolicies)} p WHERE p.tenant_id = r.tenant_id)"
            f", EXISTS (SELECT 1 FROM {sql.table(KillSwitch)} k WHERE k.tenant_id = r.tenant_id "
            f"""AND k."on" AND k.scope IN ('{KillSwitch.Scope.TOOL}', '{KillSwitch.Scope.ENDPOINT}'))"""
            f", {_names_array(groups)}"
            ", u.is_active AND "
            + held_sql("agents", "agentdefinition", "run_agent", column="r.agent_id").replace(
                "%(user)s", "r.created_by_id"
            )
            + f", EXISTS (SELECT 1 FROM {sql.table(Approval)} ap WHERE ap.run_id = r.id "
            "AND ap.decided_by_id IS NOT NULL)"
        )
        if regions:
            homes = f"{sql.table(TenantRegions)} rr WHERE rr.tenant_id = r.tenant_id"
            select += (
                f", (SELECT rr.home FROM {homes}), (SELECT rr.revocation_reach_seconds FROM {homes})"
                # clock_timestamp(), not now(): the age at this statement, not at the transaction's start
                f", (SELECT EXTRACT(EPOCH FROM clock_timestamp() - h.beat_at) FROM {sql.table(Heartbeat)} h "
                f"JOIN {sql.table(TenantRegions)} rr ON rr.home = h.region WHERE rr.tenant_id = r.tenant_id)"
            )
    return f"SELECT {select} FROM {sql.table(Run)} r {joins}WHERE r.id = %(run)s {sql.for_update('r')}"


def _names_array(query: str) -> str:
    """A subquery's one column as a list: an array in PostgreSQL, a JSON array in SQLite (the demo)."""
    if connection.vendor == "postgresql":
        return f"ARRAY({query})"
    return f"(SELECT json_group_array(name) FROM ({query}))"


def lock_run(run_id, *, for_step: bool = False, like: Run | None = None) -> Run:
    """The run row locked FOR UPDATE, with its tenant and version (and for a step: the user who
    started it, the version's model endpoint, the agent and its ClaimReads), read fresh in one
    statement.

    `like`: the same run as this worker read it earlier in the step (the claim): only the run
    row is read (fresh, locked), with the tenant's secrets generation; its tenant, version and
    user are taken from `like`.
    """
    try:
        run_id = uuid.UUID(str(run_id))
    except ValueError:
        raise Run.DoesNotExist(f"no run {run_id}") from None
    if like is not None:
        found = sql.fetch_with_rest(_lock_run_row_sql(), {"run": run_id}, Run)
        if not found:
            raise Run.DoesNotExist(f"no run {run_id}")
        (run,), (generation,) = found[0]
        run.tenant, run.version, run.created_by = like.tenant, like.version, like.created_by
        run.tenant.secrets_generation = generation
        return run
    models = [Run, Tenant, AgentVersion] + ([User, ModelEndpoint, AgentDefinition] if for_step else [])
    regions = for_step and bool(here())
    found = sql.fetch_with_rest(_lock_run_sql(for_step, regions), {"run": run_id}, *models)
    if not found:
        raise Run.DoesNotExist(f"no run {run_id}")
    (run, tenant, version, *more), rest = found[0]
    run.tenant, run.version = tenant, version
    if more:
        run.created_by, version.model_endpoint, run.agent = more
        policy_version, switches_on, groups, may_run_agent, people_decided, *authority = rest
        if isinstance(groups, str):  # SQLite's JSON array
            groups = json.loads(groups)
        run.claim_reads = ClaimReads(
            policy_version,
            switches_on,
            tuple(groups),
            bool(may_run_agent),
            bool(people_decided),
            (authority[0], authority[1], None if authority[2] is None else max(float(authority[2]), 0.0))
            if regions
            else None,
        )
    return run


def end_run(
    run: Run, status: str, *, reason: str = "", error: str = "", actor=None, message: str = "", **fields
) -> None:
    """Finish a run: skip steps that will never run and void approvals that can no longer be used.

    `fields`: more columns of the run to write in the same UPDATE (final_output, say)."""
    fields.update(stop_reason=reason, error=error)
    transition_run(
        run, status, actor=actor, message=message, event_data={"reason": reason, "error": error}, **fields
    )
    waiting = {StepStatus.AWAITING_APPROVAL, StepStatus.AWAITING_AUTHORIZATION}
    for step in Step.objects.filter(run=run, status__in=READY | waiting):
        transition_step(step, StepStatus.SKIPPED, message=f"step {step.seq} skipped: run {status}")
    void_open_approvals(run, reason=f"run {status}" + (f" ({reason})" if reason else ""))


def bump_counters(run: Run, **counters: int) -> None:
    Run.objects.filter(pk=run.pk).update(**{name: F(name) + n for name, n in counters.items()})
    for name, n in counters.items():
        setattr(run, name, getattr(run, name) + n)


def void_approval(step: Step, *, reason: str) -> None:
    """Withdraw the step's open approval, if any, with an event."""
    if approvals.void_for_step(step, reason=reason):
        record_event(
            step.run_id,
            "approval_voided",
            f"approval for step {step.seq} voided: {reason}",
            step_seq=step.seq,
            reason=reason,
        )


def void_open_approvals(run: Run, *, reason: str) -> None:
    for step_id, seq in approvals.open_approval_steps(run):
        void_approval(Step(pk=step_id, seq=seq, run_id=run.pk), reason=reason)
