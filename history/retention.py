"""Retention of runs' content and of their skeleton (docs/history.md, "Retention").

    due_runs(tenant, now, limit)   the tenant's ended runs whose content period is over, oldest
                                   first, not yet purged
    purge_due(now, batch)          remove the content of at most `batch` due runs per tenant,
                                   each in a transaction of its own, skipping what a legal hold
                                   covers; the beat runs it every HISTORY_PURGE_SECONDS

    purge_skeletons(now, batch)    delete at most `batch` runs per tenant past their skeleton
                                   period (the run, its steps, events, approvals, artifacts,
                                   reservations), each leaving a RunTombstone; only runs whose
                                   final chain head a signed checkpoint holds
    drop_due_months(now)           first, whole months of such runs, by dropping their step,
                                   event and ledger partitions (history/partitions.py)

A tenant's period is `tenant.retention.content` in the configuration file, an agent's own under
`tenant.retention.agents` (by agent name); `skeleton` and `skeleton_agents` likewise for the whole
run; none: kept for ever. Only ended runs are purged (a run
ends before its period starts). Purging never blocks the step path: the runs it touches ended,
so no engine step locks them; each run is locked and purged in its own short transaction, and a
batch bounds how long a pass runs.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field

from django.db import OperationalError, transaction
from django.db.models import Exists, OuterRef, Q, Sum
from django.utils import timezone

from budgets.models import LedgerEntry, Reservation
from core.ids import month_floor
from history import content, holds, partitions
from history.models import CheckpointLeaf, ContentRemoval, HoldScope, LegalHold, RunTombstone
from runs.models import TERMINAL, Run, Step
from runs.transitions import atomic_with_events
from tenants.models import Tenant


@dataclass
class PurgeReport:
    purged: list = field(default_factory=list)  # run ids
    held: list = field(default_factory=list)  # run ids due but under a legal hold
    unsigned: list = field(default_factory=list)  # skeleton due, final head not checkpointed yet
    months: list = field(default_factory=list)  # (year, month) deleted whole (drop_due_months)


def _past_period(seconds: int | None, by_agent: dict, now: dt.datetime) -> Q:
    """Runs that ended longer ago than their period: the tenant's, or their agent's own (an empty
    Q when neither is set)."""
    due = Q()
    if seconds is not None:
        due |= Q(finished_at__lt=now - dt.timedelta(seconds=seconds)) & ~Q(agent__name__in=list(by_agent))
    for name, own in by_agent.items():
        due |= Q(agent__name=name, finished_at__lt=now - dt.timedelta(seconds=own))
    return due


def due_runs(tenant: Tenant, now: dt.datetime, limit: int) -> list:
    """Ids of the tenant's ended runs past their content period, not purged yet, oldest first."""
    due = _past_period(tenant.content_retention_seconds, tenant.content_retention_by_agent or {}, now)
    if not due:
        return []
    removed = ContentRemoval.objects.filter(run_id=OuterRef("pk"))
    return list(
        Run.objects.filter(due, tenant=tenant, status__in=TERMINAL)
        .filter(~Exists(removed))
        .order_by("finished_at")
        .values_list("pk", flat=True)[:limit]
    )


def purge_due(*, now: dt.datetime | None = None, batch: int = 100) -> PurgeReport:
    now = now or timezone.now()
    report = PurgeReport()
    tenants = Tenant.objects.filter(
        Q(content_retention_seconds__isnull=False) | ~Q(content_retention_by_agent={})
    )
    for tenant in tenants:
        if LegalHold.objects.filter(tenant=tenant, scope=HoldScope.TENANT, lifted_at__isnull=True).exists():
            continue
        run_ids = due_runs(tenant, now, batch)
        covered = holds.holds_over(tenant.pk, run_ids)
        for run_id in run_ids:
            if run_id in covered:
                report.held.append(run_id)
                continue
            if _purge(tenant.pk, run_id):
                report.purged.append(run_id)
    return report


def _purge(tenant_id, run_id) -> bool:
    with atomic_with_events():
        holds.tenant_hold_lock(tenant_id)  # a hold placed meanwhile is seen
        if holds.holds_over(tenant_id, [run_id]):
            return False
        run = Run.objects.select_for_update().filter(pk=run_id, status__in=TERMINAL).first()
        if run is None or ContentRemoval.objects.filter(run_id=run_id).exists():
            return False
        content.remove_content(
            run,
            why=ContentRemoval.Why.RETENTION,
            events=None,
            note="content purged: its retention period ended",
        )
    return True


def _period(seconds: int | None, by_agent: dict, agent: str) -> int | None:
    return by_agent.get(agent, seconds)


def skeleton_due(tenant: Tenant, now: dt.datetime, limit: int) -> list[tuple]:
    """(run id, agent name, period) of the tenant's ended runs past their skeleton period, oldest
    first."""
    overrides = tenant.skeleton_retention_by_agent or {}
    due = _past_period(tenant.skeleton_retention_seconds, overrides, now)
    if not due:
        return []
    rows = (
        Run.objects.filter(due, tenant=tenant, status__in=TERMINAL)
        .order_by("finished_at")
        .values_list("pk", "agent__name")[:limit]
    )
    return [(pk, agent, _period(tenant.skeleton_retention_seconds, overrides, agent)) for pk, agent in rows]


def purge_skeletons(*, now: dt.datetime | None = None, batch: int = 100) -> PurgeReport:
    now = now or timezone.now()
    report = PurgeReport(months=drop_due_months(now=now).dropped)
    tenants = Tenant.objects.filter(
        Q(skeleton_retention_seconds__isnull=False) | ~Q(skeleton_retention_by_agent={})
    )
    for tenant in tenants:
        if LegalHold.objects.filter(tenant=tenant, scope=HoldScope.TENANT, lifted_at__isnull=True).exists():
            continue
        due = skeleton_due(tenant, now, batch)
        covered = holds.holds_over(tenant.pk, [run_id for run_id, _, _ in due])
        for run_id, _agent, period in due:
            if run_id in covered:
                report.held.append(run_id)
                continue
            outcome = _delete(tenant.pk, run_id, period, now)
            if outcome == "purged":
                report.purged.append(run_id)
            elif outcome == "unsigned":
                report.unsigned.append(run_id)
    return report


def _delete(tenant_id, run_id, period: int, now: dt.datetime) -> str:
    """Delete one ended run and leave its tombstone, in one short transaction: 'purged', 'held',
    'unsigned' (its final head is in no checkpoint yet: the next pass after one), or 'gone'."""
    with transaction.atomic():
        holds.tenant_hold_lock(tenant_id)  # a hold placed meanwhile is seen
        if holds.holds_over(tenant_id, [run_id]):
            return "held"
        run = (
            Run.objects.select_for_update(of=("self",))
            .select_related("agent", "created_by")
            .filter(pk=run_id, status__in=TERMINAL)
            .first()
        )
        if run is None:
            return "gone"
        if RunTombstone.objects.filter(run_id=run_id).exists():
            # Tombstoned by a month's drop (drop_due_months) that stopped before deleting it.
            Run.objects.filter(pk=run_id).delete()
            return "purged"
        # The tombstone names the checkpoint that signed the run's final head: the verifier then
        # tells this deletion from one behind the platform's back.
        leaf = CheckpointLeaf.objects.filter(run_id=run_id).order_by("-checkpoint__number").first()
        head = bytes(run.chain_head)
        if leaf is None or (leaf.event_seq, bytes(leaf.head)) != (run.event_seq, head):
            return "unsigned"
        cost = run.steps.aggregate(total=Sum("cost_micros"))["total"] or 0
        _tombstone(run, leaf.checkpoint_id, cost, period, now).save()
        # Django's cascade: steps, events, approvals, artifacts, reservations and their ledger
        # entries, the run's budget account, its content-removal row.
        Run.objects.filter(pk=run_id).delete()
    return "purged"


def _tombstone(run: Run, checkpoint_id, cost: int, period: int, now: dt.datetime) -> RunTombstone:
    return RunTombstone(
        run_id=run.pk,
        tenant_id=run.tenant_id,
        agent=run.agent.name,
        created_by=run.created_by.get_username(),
        status=run.status,
        created_at=run.created_at,
        finished_at=run.finished_at,
        cost_micros=cost,
        steps=run.step_count,
        event_seq=run.event_seq,
        chain_head=bytes(run.chain_head),
        checkpoint_id=checkpoint_id,
        period_seconds=period,
        purged_at=now,
    )


@dataclass
class MonthReport:
    dropped: list = field(default_factory=list)  # (year, month) whose partitions went whole
    kept: dict = field(default_factory=dict)  # (year, month): why not (its runs go one by one)


def drop_due_months(*, now: dt.datetime | None = None) -> MonthReport:
    """Delete whole months of runs past their skeleton period by dropping their partitions
    (history/partitions.py) instead of deleting their steps and events row by row.

    A month (of the runs' ids: the month each run was made in) goes whole only when it is over
    and every run of it is ended, past its own skeleton period, under no legal hold and signed
    (its final head in a checkpoint): the same conditions as a run's own deletion, for each of
    its runs. Then, in order, each step short: every run's tombstone; the month's step and event
    partitions detached and dropped (a brief lock on each parent, given up after the lock
    timeout); the month's ledger partition too when its every reservation is of those runs; and
    the runs' rows deleted with what Django cascades (approvals, artifacts, reservations, ...),
    a thousand at a time. Interrupted, the next pass finds the month's runs already tombstoned
    and carries on. A month that fails a condition is left to purge_skeletons' run-by-run pass.
    """
    report = MonthReport()
    if not partitions.active():
        return report
    now = now or timezone.now()
    periods = [
        seconds
        for own, by_agent in Tenant.objects.values_list(
            "skeleton_retention_seconds", "skeleton_retention_by_agent"
        )
        for seconds in [own, *(by_agent or {}).values()]
        if seconds is not None
    ]
    if not periods:
        return report
    # A month whose last run ended less than the shortest period ago cannot be due yet: no pass
    # reads its runs (the beat runs this every few minutes, over years of months).
    cutoff = now - dt.timedelta(seconds=min(periods))
    for year, month in partitions.months("runs_step"):
        low, high = partitions.bounds(year, month)
        if high > month_floor(cutoff.year, cutoff.month):
            break  # this month and later ones are not over, or not past the shortest period
        why = _month_blocked(low, high, now)
        if not why and not _drop_month_of_runs(year, month, low, high, now):
            why = "a legal hold was placed, or its partitions were busy: the next pass tries again"
        if why:
            report.kept[(year, month)] = why
        else:
            report.dropped.append((year, month))
    # A month's ledger partition kept at its runs' drop (it held reservations of the month before's
    # runs) goes once its last entry has gone with them.
    steps_months = set(partitions.months("runs_step"))
    for year, month in partitions.months("budgets_ledgerentry"):
        low, high = partitions.bounds(year, month)
        if high > month_floor(cutoff.year, cutoff.month):
            break
        if (year, month) not in steps_months and not LedgerEntry.objects.filter(
            reservation_id__gte=low, reservation_id__lt=high
        ).exists():
            try:
                partitions.drop_month(year, month, ("budgets_ledgerentry",))
            except OperationalError:
                pass  # the next pass
    return report


def _month_blocked(low, high, now: dt.datetime) -> str:
    """Why the month's runs cannot all go now ("" when they can)."""
    runs = Run.objects.filter(pk__gte=low, pk__lt=high)
    if runs.exclude(status__in=TERMINAL).exists():
        return "a run of the month has not ended"
    for tenant in Tenant.objects.filter(pk__in=runs.values("tenant_id").distinct()):
        overrides = tenant.skeleton_retention_by_agent or {}
        due = _past_period(tenant.skeleton_retention_seconds, overrides, now)
        mine = runs.filter(tenant=tenant)
        if not due or mine.exclude(due).exists():
            return f"a run of tenant {tenant.name} is within its skeleton period"
        if LegalHold.objects.filter(tenant=tenant, scope=HoldScope.TENANT, lifted_at__isnull=True).exists():
            return f"tenant {tenant.name} is under a legal hold"
        if holds.holds_over(tenant.pk, list(mine.values_list("pk", flat=True))):
            return f"a run of tenant {tenant.name} is under a legal hold"
    signed = CheckpointLeaf.objects.filter(run_id=OuterRef("pk"), event_seq=OuterRef("event_seq"))
    if runs.filter(event_seq__gt=0).exclude(Exists(signed.filter(head=OuterRef("chain_head")))).exists():
        return "a run's final head is in no checkpoint yet"
    return ""


def _drop_month_of_runs(year: int, month: int, low, high, now: dt.datetime) -> bool:
    """Tombstone the month's runs, then drop their step and event partitions (a few tries: the
    lock is had between two of the step path's transactions, or not at all within the timeout);
    then its ledger partition and the runs' rows. A hold placed meanwhile, or no lock had, takes
    the tombstones back. Whether the month went."""
    runs = Run.objects.filter(pk__gte=low, pk__lt=high)
    _write_tombstones(runs, now)
    outcome = "busy"
    for attempt in range(DROP_ATTEMPTS):
        if attempt:
            time.sleep(DROP_PAUSE_SECONDS)
        outcome = _drop_run_partitions(year, month, runs)
        if outcome != "busy":
            break
    if outcome != "dropped":
        RunTombstone.objects.filter(run_id__in=runs.values("pk")).delete()
        return False
    # The month's ledger goes whole when every reservation of it is of this month's runs (a run
    # made on the month's last day may have reservations in the next month: those go by cascade).
    strays = Reservation.objects.filter(pk__gte=low, pk__lt=high).exclude(run_id__gte=low, run_id__lt=high)
    if not strays.exists():
        try:
            partitions.drop_month(year, month, ("budgets_ledgerentry",))
        except OperationalError:
            pass  # its entries go with their reservations, by cascade
    _delete_tombstoned(runs)
    return True


DROP_ATTEMPTS = 5
DROP_PAUSE_SECONDS = 0.5


def _drop_run_partitions(year: int, month: int, runs) -> str:
    """'dropped', 'held' (a hold covers a run now) or 'busy' (the lock timeout)."""
    with transaction.atomic():
        for tenant_id in sorted(set(runs.values_list("tenant_id", flat=True))):
            holds.tenant_hold_lock(tenant_id)  # a hold placed meanwhile is seen
            if holds.holds_over(
                tenant_id, list(runs.filter(tenant_id=tenant_id).values_list("pk", flat=True))
            ):
                return "held"
        try:
            partitions.drop_month(year, month, partitions.RUN_TABLES)
        except OperationalError:
            transaction.set_rollback(True)
            return "busy"
    return "dropped"


def _write_tombstones(runs, now: dt.datetime) -> None:
    """A tombstone for each of `runs`, a thousand to a transaction (written again: kept)."""
    for start in range(0, runs.count(), 1000):
        batch = list(
            runs.select_related("agent", "created_by", "tenant").order_by("pk")[start : start + 1000]
        )
        ids = [run.pk for run in batch]
        costs = dict(
            Step.objects.filter(run_id__in=ids)
            .values("run_id")
            .annotate(total=Sum("cost_micros"))
            .values_list("run_id", "total")
        )
        leaves: dict = {}
        for run_id, checkpoint_id in (
            CheckpointLeaf.objects.filter(run_id__in=ids)
            .order_by("run_id", "-checkpoint__number")
            .values_list("run_id", "checkpoint_id")
        ):
            leaves.setdefault(run_id, checkpoint_id)
        tenant = {run.pk: run.tenant for run in batch}
        RunTombstone.objects.bulk_create(
            [
                _tombstone(
                    run,
                    leaves.get(run.pk),
                    costs.get(run.pk) or 0,
                    _period(
                        tenant[run.pk].skeleton_retention_seconds,
                        tenant[run.pk].skeleton_retention_by_agent or {},
                        run.agent.name,
                    )
                    or 0,
                    now,
                )
                for run in batch
            ],
            ignore_conflicts=True,
        )


def _delete_tombstoned(runs) -> None:
    """Delete runs whose tombstones are written, a thousand at a time (Django's cascade)."""
    while True:
        ids = list(
            runs.filter(pk__in=RunTombstone.objects.values("run_id")).values_list("pk", flat=True)[:1000]
        )
        if not ids:
            return
        with transaction.atomic():
            Run.objects.filter(pk__in=ids).delete()
