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

A tenant's period is `tenant.retention.content` in the configuration file, an agent's own under
`tenant.retention.agents` (by agent name); `skeleton` and `skeleton_agents` likewise for the whole
run; none: kept for ever. Only ended runs are purged (a run
ends before its period starts). Purging never blocks the step path: the runs it touches ended,
so no engine step locks them; each run is locked and purged in its own short transaction, and a
batch bounds how long a pass runs.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, Sum
from django.utils import timezone

from history import content, holds
from history.models import CheckpointLeaf, ContentRemoval, HoldScope, LegalHold, RunTombstone
from runs.models import TERMINAL, Run
from runs.transitions import atomic_with_events
from tenants.models import Tenant


@dataclass
class PurgeReport:
    purged: list = field(default_factory=list)  # run ids
    held: list = field(default_factory=list)  # run ids due but under a legal hold
    unsigned: list = field(default_factory=list)  # skeleton due, final head not checkpointed yet


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
    report = PurgeReport()
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
        # The tombstone names the checkpoint that signed the run's final head: the verifier then
        # tells this deletion from one behind the platform's back.
        leaf = CheckpointLeaf.objects.filter(run_id=run_id).order_by("-checkpoint__number").first()
        head = bytes(run.chain_head)
        if leaf is None or (leaf.event_seq, bytes(leaf.head)) != (run.event_seq, head):
            return "unsigned"
        RunTombstone.objects.create(
            run_id=run.pk,
            tenant_id=tenant_id,
            agent=run.agent.name,
            created_by=run.created_by.get_username(),
            status=run.status,
            created_at=run.created_at,
            finished_at=run.finished_at,
            cost_micros=run.steps.aggregate(total=Sum("cost_micros"))["total"] or 0,
            steps=run.step_count,
            event_seq=run.event_seq,
            chain_head=head,
            checkpoint_id=leaf.checkpoint_id,
            period_seconds=period,
            purged_at=now,
        )
        # Django's cascade: steps, events, approvals, artifacts, reservations and their ledger
        # entries, the run's budget account, its content-removal row.
        Run.objects.filter(pk=run_id).delete()
    return "purged"
