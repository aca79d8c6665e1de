from __future__ import annotations

import datetime as dt
import uuid

from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce

from budgets.models import BudgetAccount, LedgerEntry, Reservation
from budgets.services import local_day
from core.errors import NotFound
from runs.models import Run


def tenant_days(tenant, *, days: int = 30) -> list[BudgetAccount]:
    """One unsaved account per day with the sums of that day's sub-accounts, oldest first."""
    since = local_day(tenant) - dt.timedelta(days=days - 1)
    fields = BudgetAccount.BALANCES
    rows = (
        BudgetAccount.objects.filter(tenant=tenant, scope=BudgetAccount.Scope.TENANT_DAY, day__gte=since)
        .values("day")
        .annotate(**{f"total_{f}": Sum(f) for f in fields})
        .order_by("day")
    )
    return [
        BudgetAccount(
            tenant=tenant,
            scope=BudgetAccount.Scope.TENANT_DAY,
            day=row["day"],
            **{f: row[f"total_{f}"] for f in fields},  # type: ignore[literal-required]  # annotated names
        )
        for row in rows
    ]


def per_agent(tenant, *, days: int = 30) -> list[dict]:
    since = local_day(tenant) - dt.timedelta(days=days - 1)
    rows = (
        Reservation.objects.filter(tenant=tenant, day__gte=since, run__isnull=False)
        .values("run__agent__name")
        .annotate(
            spent=Sum("actual_micros", filter=Q(status__in=["settled", "reconciled"])),
            held=Sum("amount_micros", filter=Q(status="held")),
            reserved=Sum("amount_micros", filter=Q(status="open")),
            runs=Count("run", distinct=True),
        )
        .order_by("run__agent__name")
    )
    return [
        {
            "agent": r["run__agent__name"],
            "spent_micros": r["spent"] or 0,
            "held_micros": r["held"] or 0,
            "reserved_micros": r["reserved"] or 0,
            "runs": r["runs"],
        }
        for r in rows
    ]


def top_runs(tenant, *, days: int = 30, limit: int = 10):
    since = dt.datetime.combine(
        local_day(tenant) - dt.timedelta(days=days - 1), dt.time(0, 0), tzinfo=tenant.zone
    )
    return (
        Run.objects.filter(tenant=tenant, created_at__gte=since, budget__isnull=False)
        .select_related("budget", "agent", "created_by")
        .order_by("-budget__spent_micros")[:limit]
    )


def reservations_for(user, *, status: str | None = None):
    reservations = Reservation.objects.filter(tenant_id=user.tenant_id).select_related("run", "step")
    return reservations.filter(status=status) if status else reservations


def get_reservation(user, reservation_id) -> Reservation:
    try:
        return reservations_for(user).get(pk=uuid.UUID(str(reservation_id)))
    except (Reservation.DoesNotExist, ValueError):
        raise NotFound("reservation") from None


def ledger_mismatches(account: BudgetAccount) -> dict[str, tuple[int, int]]:
    """Recompute the account's balances from its ledger; {field: (balance, ledger)} where they differ.

    An entry moves every account of its reservation, so an account's ledger is the entries of the
    reservations that name it.

    Entry kinds move balances like this: reserve +reserved; settle +spent; hold reserved -> held;
    release, settle and reconcile close a reservation (what closed = settle/reconcile + release -
    overage); write_off clears a hold. A reservation's status says which balance its closing
    entries came out of (reconciled and written_off: held; settled and released: reserved).
    """
    K = LedgerEntry.Kind
    from_held = Q(reservation__status__in=[Reservation.Status.RECONCILED, Reservation.Status.WRITTEN_OFF])

    def total(*kinds, extra=Q()):
        return Coalesce(Sum("amount_micros", filter=Q(kind__in=kinds) & extra), 0)

    if account.scope == BudgetAccount.Scope.RUN:
        of_account = Q(reservation__run_id=account.run_id, reservation__run_account=account)
    elif (
        account.scope == BudgetAccount.Scope.EVALUATION
    ):  # an evaluation's reservations name it in the day's place
        of_account = Q(reservation__tenant_id=account.tenant_id, reservation__day_account=account)
    else:  # the reservations of that tenant day, then the ones naming this (sub-)account
        of_account = Q(reservation__tenant_id=account.tenant_id, reservation__day=account.day) & (
            Q(reservation__day_account=account) | Q(reservation__user_account=account)
        )
    sums = LedgerEntry.objects.filter(of_account).aggregate(
        reserve=total(K.RESERVE),
        settle=total(K.SETTLE),
        reconcile=total(K.RECONCILE),
        release=total(K.RELEASE),
        overage=total(K.OVERAGE),
        write_off=total(K.WRITE_OFF),
        hold=total(K.HOLD),
        held_closed=total(K.RECONCILE, K.RELEASE, K.WRITE_OFF, extra=from_held),
        held_overage=total(K.OVERAGE, extra=from_held),
    )
    held = sums["hold"] - sums["held_closed"] + sums["held_overage"]
    open_total = (
        sums["reserve"]
        - sums["settle"]
        - sums["reconcile"]
        - sums["release"]
        - sums["write_off"]
        + sums["overage"]
    )
    expected = {
        "spent_micros": sums["settle"] + sums["reconcile"],
        "overage_micros": sums["overage"],
        "held_micros": held,
        "reserved_micros": open_total - held,
    }
    return {
        name: (getattr(account, name), value)
        for name, value in expected.items()
        if getattr(account, name) != value
    }
