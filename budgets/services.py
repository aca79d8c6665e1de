"""Budget ledger: reserve before every call, settle after, hold what is unknown.

Rules (DESIGN.md section 6):
- Balances move only through conditional UPDATEs with F() expressions; PostgreSQL re-checks the
  WHERE clause on the newest row version after waiting for the row lock, so two reservations
  can never both pass a check that only one of them fits.
- Accounts are touched in one fixed order (tenant day, user day, run) and always in their own
  short transaction, never while a run row is locked, so budget and run locks cannot deadlock.
- A reservation closes exactly once (conditional update on its status), so a late worker and a
  recovering worker cannot both settle or both hold it.
"""
from __future__ import annotations

import datetime as dt

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from agentplatform.errors import DomainError
from budgets.models import BudgetAccount, LedgerEntry, Reservation

Scope = BudgetAccount.Scope
Status = Reservation.Status
Kind = LedgerEntry.Kind


class BudgetExceeded(DomainError):
    def __init__(self, scope: str, amount: int, remaining: int):
        super().__init__(f"{scope} budget exceeded: needs {amount} micros, {max(remaining, 0)} left",
                         code=f"{scope}_budget_exhausted", status=429)
        self.scope = scope


def local_day(tenant, now: dt.datetime | None = None) -> dt.date:
    return (now or timezone.now()).astimezone(tenant.zone).date()


def next_local_midnight(tenant, now: dt.datetime | None = None) -> dt.datetime:
    day = local_day(tenant, now) + dt.timedelta(days=1)
    return dt.datetime.combine(day, dt.time(0, 0), tzinfo=tenant.zone)


def _get_or_create_account(tenant, *, scope: str, day: dt.date, user=None) -> BudgetAccount:
    limit = tenant.daily_budget_micros if scope == Scope.TENANT_DAY else tenant.user_daily_budget_micros
    lookup = {"tenant": tenant, "scope": scope, "day": day, "user": user}
    try:
        with transaction.atomic():
            account, _ = BudgetAccount.objects.get_or_create(**lookup, defaults={"limit_micros": limit})
    except IntegrityError:  # a concurrent first reservation of the day created it
        account = BudgetAccount.objects.get(**lookup)
    return account


def tenant_day_account(tenant, day: dt.date) -> BudgetAccount:
    return _get_or_create_account(tenant, scope=Scope.TENANT_DAY, day=day)


def create_run_account(*, run, limit_micros: int) -> BudgetAccount:
    return BudgetAccount.objects.create(tenant_id=run.tenant_id, scope=Scope.RUN, run=run,
                                        limit_micros=limit_micros)


def _take(account: BudgetAccount, amount: int) -> None:
    fits = F("reserved_micros") + F("spent_micros") + F("held_micros") + amount
    updated = BudgetAccount.objects.filter(pk=account.pk, limit_micros__gte=fits).update(
        reserved_micros=F("reserved_micros") + amount)
    if not updated:
        account.refresh_from_db()
        raise BudgetExceeded(account.scope, amount, account.remaining_micros)


def reserve(*, tenant, amount_micros: int, purpose: str, run=None, user=None,
            now: dt.datetime | None = None, note: str = "") -> Reservation:
    """Reserve amount on the tenant's day, the user's day (if limited) and the run, or raise."""
    if amount_micros < 0:
        raise ValueError("amount must not be negative")
    day = local_day(tenant, now)
    day_account = tenant_day_account(tenant, day)
    user_account = None
    if user is not None and tenant.user_daily_budget_micros is not None:
        user_account = _get_or_create_account(tenant, scope=Scope.USER_DAY, day=day, user=user)
    run_account = BudgetAccount.objects.get(run=run) if run is not None else None
    accounts = [a for a in (day_account, user_account, run_account) if a is not None]
    with transaction.atomic():
        for account in accounts:
            _take(account, amount_micros)
        reservation = Reservation.objects.create(
            tenant=tenant, run=run, purpose=purpose, day=day, amount_micros=amount_micros,
            day_account=day_account, user_account=user_account, run_account=run_account, note=note)
        LedgerEntry.objects.bulk_create([
            LedgerEntry(account=a, reservation=reservation, kind=Kind.RESERVE, amount_micros=amount_micros)
            for a in accounts])
    return reservation


def _close(reservation_id, *, from_status: str, to_status: str, actual: int | None,
           moves: dict, entries: list[tuple[str, int]], actor=None, note: str = "") -> bool:
    """Close a reservation once; move balances on all its accounts in lock order."""
    with transaction.atomic():
        updated = Reservation.objects.filter(pk=reservation_id, status=from_status).update(
            status=to_status, actual_micros=actual, closed_at=timezone.now(), closed_by=actor,
            overage=bool(actual is not None and moves.get("overage_micros")))
        if not updated:
            return False
        reservation = Reservation.objects.get(pk=reservation_id)
        for account_id in reservation.accounts():
            BudgetAccount.objects.filter(pk=account_id).update(
                **{field: F(field) + delta for field, delta in moves.items() if delta})
        LedgerEntry.objects.bulk_create([
            LedgerEntry(account_id=account_id, reservation=reservation, kind=kind, amount_micros=amount,
                        actor=actor, note=note)
            for account_id in reservation.accounts() for kind, amount in entries if amount])
    return True


def _amount(reservation_id) -> int:
    return Reservation.objects.values_list("amount_micros", flat=True).get(pk=reservation_id)


def settle(reservation_id, *, actual_micros: int, note: str = "") -> bool:
    """Record the actual cost and release the rest. An overage is recorded and flagged."""
    amount = _amount(reservation_id)
    overage = max(actual_micros - amount, 0)
    return _close(reservation_id, from_status=Status.OPEN, to_status=Status.SETTLED, actual=actual_micros,
                  moves={"reserved_micros": -amount, "spent_micros": actual_micros,
                         "overage_micros": overage},
                  entries=[(Kind.SETTLE, actual_micros), (Kind.RELEASE, max(amount - actual_micros, 0)),
                           (Kind.OVERAGE, overage)], note=note)


def release(reservation_id, *, note: str = "") -> bool:
    """The call was provably not made: give the whole reservation back."""
    amount = _amount(reservation_id)
    return _close(reservation_id, from_status=Status.OPEN, to_status=Status.RELEASED, actual=0,
                  moves={"reserved_micros": -amount}, entries=[(Kind.RELEASE, amount)], note=note)


def hold(reservation_id, *, note: str = "") -> bool:
    """The call may have been charged and we cannot know: keep the money out of reach."""
    amount = _amount(reservation_id)
    return _close(reservation_id, from_status=Status.OPEN, to_status=Status.HELD, actual=None,
                  moves={"reserved_micros": -amount, "held_micros": amount},
                  entries=[(Kind.HOLD, amount)], note=note)


def reconcile(reservation_id, *, actual_micros: int, actor, note: str) -> bool:
    """Clear a hold with the provider's actual usage for the lost call."""
    if not note:
        raise DomainError("a reason is required", fields={"note": ["This field is required."]})
    amount = _amount(reservation_id)
    overage = max(actual_micros - amount, 0)
    return _close(reservation_id, from_status=Status.HELD, to_status=Status.RECONCILED, actual=actual_micros,
                  moves={"held_micros": -amount, "spent_micros": actual_micros, "overage_micros": overage},
                  entries=[(Kind.RECONCILE, actual_micros), (Kind.OVERAGE, overage)], actor=actor, note=note)


def write_off(reservation_id, *, actor, note: str) -> bool:
    """Clear a hold without provider usage: nothing is counted as spent; the reason is kept."""
    if not note:
        raise DomainError("a reason is required", fields={"note": ["This field is required."]})
    amount = _amount(reservation_id)
    return _close(reservation_id, from_status=Status.HELD, to_status=Status.WRITTEN_OFF, actual=0,
                  moves={"held_micros": -amount}, entries=[(Kind.WRITE_OFF, amount)], actor=actor, note=note)
