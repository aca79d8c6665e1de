"""Retention of runs' content (docs/history.md, "Retention").

    due_runs(tenant, now, limit)   the tenant's ended runs whose content period is over, oldest
                                   first, not yet purged
    purge_due(now, batch)          remove the content of at most `batch` due runs per tenant,
                                   each in a transaction of its own, skipping what a legal hold
                                   covers; the beat runs it every HISTORY_PURGE_SECONDS

A tenant's period is `tenant.retention.content` in the configuration file, an agent's own under
`tenant.retention.agents` (by agent name); none: kept for ever. Only ended runs are purged (a run
ends before its period starts). Purging never blocks the step path: the runs it touches ended,
so no engine step locks them; each run is locked and purged in its own short transaction, and a
batch bounds how long a pass runs.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from history import content, holds
from history.models import ContentRemoval, HoldScope, LegalHold
from runs.models import TERMINAL, Run
from runs.transitions import atomic_with_events
from tenants.models import Tenant


@dataclass
class PurgeReport:
    purged: list = field(default_factory=list)  # run ids
    held: list = field(default_factory=list)  # run ids due but under a legal hold


def due_runs(tenant: Tenant, now: dt.datetime, limit: int) -> list:
    """Ids of the tenant's ended runs past their content period, not purged yet, oldest first."""
    overrides = tenant.content_retention_by_agent or {}
    due = Q()
    if tenant.content_retention_seconds is not None:
        cutoff = now - dt.timedelta(seconds=tenant.content_retention_seconds)
        due |= Q(finished_at__lt=cutoff) & ~Q(agent__name__in=list(overrides))
    for name, seconds in overrides.items():
        due |= Q(agent__name=name, finished_at__lt=now - dt.timedelta(seconds=seconds))
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
