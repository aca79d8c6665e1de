"""Legal holds (docs/history.md, "Legal hold").

    place_hold(...)     a hold on a run, a tenant, or a data subject (an exact identifier)
    lift_hold(...)      one conditional update (lifted_at null -> now); a second lift is refused
    holds_over(...)     the active holds covering some runs of a tenant: what erasure refuses on
                        and what retention's purge skips

A hold is audited by its own row (who placed it, when, why; who lifted it, when, why); a
run-scoped hold also writes `legal_hold_placed` / `legal_hold_lifted` into the run's chain.
Placing a hold and erasing take the tenant's hold lock (`tenant_hold_lock`), so an erasure
either sees a hold placed at the same moment or finishes before it is placed.
"""

from __future__ import annotations

from django.db import connection, transaction
from django.utils import timezone

from core.errors import Conflict, DomainError
from history import subjects
from history.models import HoldScope, LegalHold
from runs.models import Run
from runs.transitions import record_event


def tenant_hold_lock(tenant_id) -> None:
    """Serialise hold placement with erasure for one tenant (until the transaction ends)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext('history.hold'), %s)", [int(tenant_id)])


def place_hold(*, tenant_id, scope: str, actor, reason: str, run_id=None, subject: str = "") -> LegalHold:
    if scope not in HoldScope.values:
        raise DomainError(f"scope must be one of {', '.join(HoldScope.values)}", code="invalid_scope")
    if not reason.strip():
        raise DomainError("a hold needs a reason (the matter or case it is for)", code="reason_required")
    subject = subject.strip()
    if scope == HoldScope.RUN:
        if run_id is None or not Run.objects.filter(pk=run_id, tenant_id=tenant_id).exists():
            raise DomainError("a run hold needs a run of the tenant", code="run_required")
    elif scope == HoldScope.SUBJECT and not subject:
        raise DomainError("a subject hold needs the subject's identifier", code="subject_required")
    with transaction.atomic():
        tenant_hold_lock(tenant_id)
        hold = LegalHold.objects.create(
            tenant_id=tenant_id,
            scope=scope,
            run_id=run_id if scope == HoldScope.RUN else None,
            subject=subject if scope == HoldScope.SUBJECT else "",
            reason=reason,
            placed_by=actor,
        )
        if hold.run_id:
            record_event(
                hold.run_id,
                "legal_hold_placed",
                f"legal hold placed: {reason}",
                actor=actor,
                hold=str(hold.pk),
            )
    return hold


def lift_hold(*, hold_id, actor, reason: str) -> LegalHold:
    if not reason.strip():
        raise DomainError("lifting a hold needs a reason", code="reason_required")
    with transaction.atomic():
        hold = LegalHold.objects.filter(pk=hold_id).first()
        if hold is None:
            raise Conflict("no such hold", code="not_found")
        lifted = LegalHold.objects.filter(pk=hold_id, lifted_at__isnull=True).update(
            lifted_at=timezone.now(), lifted_by=actor, lift_reason=reason
        )
        if not lifted:
            raise Conflict(f"legal hold {hold_id} was already lifted", code="already_lifted")
        if hold.run_id:
            record_event(
                hold.run_id,
                "legal_hold_lifted",
                f"legal hold lifted: {reason}",
                actor=actor,
                hold=str(hold.pk),
            )
        hold.refresh_from_db()
    return hold


def holds_over(tenant_id, run_ids: list) -> dict:
    """{run id: [active holds covering it]} for those of `run_ids` any active hold covers."""
    covered: dict = {}
    for hold in LegalHold.objects.filter(tenant_id=tenant_id, lifted_at__isnull=True).order_by("placed_at"):
        if hold.scope == HoldScope.TENANT:
            held = run_ids
        elif hold.scope == HoldScope.RUN:
            held = [r for r in run_ids if str(r) == str(hold.run_id)]
        else:
            carrying = subjects.runs_carrying(tenant_id, hold.subject, within=run_ids)
            held = [r for r in run_ids if r in carrying]
        for run_id in held:
            covered.setdefault(run_id, []).append(hold)
    return covered


class Held(Conflict):
    """An erasure refused: what it would erase is under legal hold."""

    def __init__(self, holds: list[LegalHold]):
        named = "; ".join(f"{h} (placed by {h.placed_by} on {h.placed_at:%Y-%m-%d})" for h in holds)
        super().__init__(f"refused: under legal hold: {named}", code="legal_hold")
        self.fields = {"holds": [str(h.pk) for h in holds]}
