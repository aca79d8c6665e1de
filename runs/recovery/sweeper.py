"""Periodic recovery (Celery beat): every run either progresses, waits for a person, or ends.

Each recovery writes a RunEvent saying what was found and what was done.
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import transaction
from django.db.models import (
    Count,
    DateTimeField,
    DurationField,
    Exists,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Q,
    Subquery,
    Value,
)
from django.db.models.functions import Coalesce, Power
from django.utils import timezone

from budgets import services as budgets
from budgets.models import Reservation
from runs import admission
from runs.approval_effects import expire_approvals, remind_approvals
from runs.authorization_effects import resume_authorized_waits
from runs.controls import pausing
from runs.models import TERMINAL, Run, RunEvent, RunStatus, StepStatus, StopReason
from runs.queueing import enqueue, resend
from runs.recovery import broker
from runs.transitions import atomic_with_events, end_run, lock_run, record_event, transition_run
from tenants.models import Tenant

BATCH = 500
# Re-sends of one run without it moving (at QUEUED_TOO_LONG_SECONDS x 1, 2, 4, ... : about half an
# hour at the default 30 s) before it fails for a person to look at.
MAX_RESENDS = 6


def sweep(now: dt.datetime | None = None) -> dict[str, int]:
    now = now or timezone.now()
    return {
        "expired_leases": _requeue_expired_leases(now),
        "lost_messages": _requeue_lost_messages(now),
        "deadlines": _stop_past_deadline(now),
        "budget_resumed": _resume_budget_waits(now),
        "admitted": _admit_waiting_runs(now),
        "settle_resumed": _resume_settle_waits(now),
        "pauses_ended": pausing.resume_due(now),
        "authorization_resumed": resume_authorized_waits(),
        "approvals_expired": expire_approvals(now=now),
        # After the expiry pass: an approval that just expired is neither reminded nor escalated.
        **{f"approvals_{key}": count for key, count in remind_approvals(now=now).items()},
        "orphan_reservations": budgets.release_orphans(now=now),
        "lost_attempts_held": _hold_lost_attempts(),
    }


def _requeue_expired_leases(now: dt.datetime) -> int:
    # Once per expiry: if that message goes unanswered too, it is a lost message (below).
    ids = list(
        Run.objects.filter(status=RunStatus.RUNNING, lease_expires_at__lt=now)
        .filter(Q(last_enqueued_at__isnull=True) | Q(last_enqueued_at__lt=F("lease_expires_at")))
        .values_list("pk", flat=True)[:BATCH]
    )
    for run_id in ids:
        with transaction.atomic():
            record_event(
                run_id,
                "recovery",
                "lease expired: the worker died or stalled; re-enqueued",
                action="requeue",
                found="expired_lease",
            )
            enqueue(run_id)
    return len(ids)


def _requeue_lost_messages(now: dt.datetime) -> int:
    """Runs that should have a message in the broker but were not touched for too long.

    The message is sent again as it was, not replaced: when the queue is only backed up, a
    replacement would go to its back and void the copy near its front. A run's message is sent
    again QUEUED_TOO_LONG_SECONDS after its last enqueue, then after twice that, four times, ...
    (its recovery events count the times), so a backlog is not fed faster than it drains.

    The event says what was seen: the run's task died (an engine error was recorded since the
    last enqueue), or the message was lost (nothing older is queued ahead of it). A run queued
    behind older messages is late, not lost: it is left alone. A run sent again
    MAX_RESENDS times without moving fails with what was seen, for a supervisor to look at.
    """
    wait = dt.timedelta(seconds=settings.QUEUED_TOO_LONG_SECONDS)
    resends = RunEvent.objects.filter(
        run=OuterRef("pk"),
        kind="recovery",
        skeleton__found="lost_message",
        at__gt=OuterRef("last_enqueued_at"),
    ).values("run")
    deaths = RunEvent.objects.filter(
        run=OuterRef("pk"), kind="engine_error", at__gt=OuterRef("last_enqueued_at")
    )
    times = Coalesce(Subquery(resends.annotate(n=Count("pk")).values("n")), 0)
    since = Coalesce(Subquery(resends.annotate(last=Max("at")).values("last")), F("last_enqueued_at"))
    due_at = ExpressionWrapper(
        since + ExpressionWrapper(Value(wait) * Power(2, times), output_field=DurationField()),
        output_field=DateTimeField(),
    )
    unleased = Q(lease_token__isnull=True) | Q(
        lease_expires_at__lt=now, last_enqueued_at__gte=F("lease_expires_at")
    )
    runs = list(
        Run.objects.filter(unleased, status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
        .alias(due_at=due_at)
        .annotate(times=times, died=Exists(deaths))
        .filter(Q(due_at__lte=now) | Q(last_enqueued_at__isnull=True))
        .values_list("pk", "last_enqueued_at", "times", "died")[:BATCH]
    )
    # A run enqueued no earlier than the oldest message still queued may be waiting behind it:
    # its message is late, not lost, and a copy would only lengthen the backlog.
    backlog_since = broker.oldest_queued_enqueue() if runs else None
    count = 0
    for run_id, enqueued_at, times, died in runs:
        if backlog_since is not None and enqueued_at is not None and enqueued_at >= backlog_since:
            continue
        count += 1
        silent = int((now - enqueued_at).total_seconds()) if enqueued_at else 0
        seen = (
            "its task died (see the engine_error event)"
            if died
            else "its message was lost: nothing older is queued"
        )
        with atomic_with_events():
            if times >= MAX_RESENDS:
                run = lock_run(run_id)
                if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
                    end_run(
                        run,
                        RunStatus.FAILED,
                        error=f"no progress for {silent}s after {times} re-sends: {seen}",
                        message="failed: no progress",
                    )
                continue
            record_event(
                run_id,
                "recovery",
                f"no progress for {silent}s ({seen}); sent again (time {times + 1})",
                action="requeue",
                found="lost_message",
            )
            if enqueued_at is None:
                enqueue(run_id)
            else:
                resend(run_id, enqueued_at=enqueued_at)
    return count


def _stop_past_deadline(now: dt.datetime) -> int:
    count = 0
    for run_id in (
        Run.objects.exclude(status__in=TERMINAL)
        # A pause counts toward the deadline only where the tenant says so (runs/controls/pausing.py).
        .exclude(status=RunStatus.PAUSED, tenant__paused_time_counts=False)
        .filter(deadline_at__lt=now)
        .values_list("pk", flat=True)[:BATCH]
    ):
        with transaction.atomic():
            run = lock_run(run_id)
            if run.is_terminal:
                continue
            if run.lease_token is not None and run.lease_expires_at and run.lease_expires_at > now:
                # The holder's next claim stops it (reason: deadline). A cancel flag here would
                # end it as `cancelled`, which nobody asked for.
                record_event(
                    run.pk,
                    "recovery",
                    "deadline passed during a call; the run stops after it",
                    action="stop_after_call",
                    found="deadline",
                )
                continue
            end_run(
                run,
                RunStatus.STOPPED,
                reason=StopReason.DEADLINE,
                message="stopped: deadline passed (sweeper)",
            )
            count += 1
    return count


def _resume_budget_waits(now: dt.datetime) -> int:
    return _resume_waits(RunStatus.WAITING_BUDGET, now, "resumed: a new budget day began")


def _admit_waiting_runs(now: dt.datetime) -> int:
    """Admit runs waiting for budget (runs/admission.py), per tenant in order of arrival, while the
    oldest one's expected cost fits (as admitted runs finish under their expectation, holds are
    settled, or a new local day begins), or alone when nothing of the tenant runs and budget
    remains (the progress rule). Each expectation is recomputed first: runs queued while their
    version was cold are admitted by what its finished runs have taught since."""
    tenant_ids = sorted(
        set(
            Run.objects.filter(status=RunStatus.WAITING_BUDGET, admitted_at__isnull=True)
            .values_list("tenant_id", flat=True)
            .distinct()
        )
    )
    return sum(admit_tenant(tenant_id, now) for tenant_id in tenant_ids)


def admit_tenant(tenant_id: int, now: dt.datetime) -> int:
    """One tenant's admission pass (the sweeper's, and the slice keeper's once a slice arrived
    for runs waiting to be admitted: they need not wait for the sweeper's next pass)."""
    admitted = 0
    with atomic_with_events():
        # The lock start_run takes: one admission decision at a time per tenant.
        tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant_id)
        room, remaining = admission.room_micros(tenant)
        alone = admission.may_start_alone(tenant, remaining, now)
        expectations: dict = {}
        for run in (
            admission.waiting_runs(tenant).select_related("version").order_by("created_at", "id")[:BATCH]
        ):
            if run.version_id not in expectations:
                expected, _ = admission.expectation(version=run.version, limits=run.limits, tenant=tenant)
                # Accepted when it fitted a day: a later, higher figure must not strand it.
                expectations[run.version_id] = min(expected, tenant.daily_budget_micros)
            expected = expectations[run.version_id]
            if expected <= room:
                how = f"admitted: {expected} micros expected, {room} micros of room"
            elif alone:
                how = (
                    f"admitted alone: {expected} micros expected, {room} micros of room, nothing "
                    f"of the tenant running and {remaining} micros left today"
                )
            else:
                break  # strictly in order of arrival: nobody overtakes the oldest
            run = lock_run(run.pk)
            if run.status != RunStatus.WAITING_BUDGET or run.admitted_at is not None:
                continue
            transition_run(
                run,
                RunStatus.QUEUED,
                admitted_at=now,
                resume_at=None,
                expected_cost_micros=expected,
                deadline_at=now + dt.timedelta(seconds=run.limits["max_wall_seconds"]),
                message=how,
                event_data={
                    "expected_cost_micros": expected,
                    "room_micros": room,
                    "alone": expected > room,
                },
            )
            enqueue(run.pk)
            room -= expected
            alone = False
            admitted += 1
    return admitted


def _resume_settle_waits(now: dt.datetime) -> int:
    return _resume_waits(RunStatus.WAITING_SETTLE, now, "resumed: the settle window has passed")


def _resume_waits(status: str, now: dt.datetime, message: str) -> int:
    """Runs parked as rows until resume_at (they hold no message): move them on once it passes."""
    count = 0
    for run_id in Run.objects.filter(status=status, resume_at__lte=now).values_list("pk", flat=True)[:BATCH]:
        with transaction.atomic():
            run = lock_run(run_id)
            if run.status != status:
                continue
            transition_run(run, RunStatus.RUNNING, message=message, resume_at=None)
            enqueue(run.pk)
            count += 1
    return count


def _hold_lost_attempts() -> int:
    """Hold reservations of attempts whose worker was lost after dispatching.

    A worker closes its reservation before it records the step's outcome, so an open reservation
    whose step has moved on belongs to an attempt that never came back: the call may have been
    charged. The engine holds these when it recovers the step; this catches any it could not.
    """
    lost = list(
        Reservation.objects.filter(status=Reservation.Status.OPEN, step__isnull=False)
        .exclude(step__status=StepStatus.DISPATCHING)
        .values_list("pk", "run_id", "step__seq", "amount_micros")[:BATCH]
    )
    held = 0
    for reservation_id, run_id, seq, amount in lost:
        if budgets.hold(reservation_id, note="attempt lost with its worker; it may have been charged"):
            record_event(
                run_id,
                "recovery",
                f"step {seq}: reservation of {amount} micros left open by a lost "
                "worker; held until reconciled",
                step_seq=seq,
                action="hold",
                found="open_reservation",
            )
            held += 1
    return held
