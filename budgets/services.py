"""Budget ledger: reserve before every call, settle after, hold what is unknown.

Rules (DESIGN.md section 6):
- Balances move only in one UPDATE per operation (`_MOVE`) that first locks the reservation's
  accounts in one fixed order (tenant day, user day, run) and, for a reservation, adds only
  where `spent + reserved + held + amount <= limit`. PostgreSQL re-checks that condition on
  the newest row version after waiting for the lock, so two reservations can never both pass a
  check that only one of them fits. If any account has no room, nothing moves.
- Budget work always runs in its own short transaction, never while a run row is locked, so
  budget and run locks cannot deadlock.
- A reservation closes exactly once (conditional update on its status), so a late worker and a
  recovering worker cannot both settle or both hold it.
- Every movement writes LedgerEntry rows; budgets.selectors.ledger_mismatches recomputes the
  balances from them.

The tenant-day row is the hottest row of the platform (every call of every run of a tenant
updates it), so the locked phase is kept to one statement and the commit: the reservation and
its ledger rows are inserted before the accounts are locked, and reserve/settle/hold commit with
`synchronous_commit = off`, so the row lock is released without waiting for the WAL flush.
That is safe because PostgreSQL flushes WAL in order: the caller's next synchronous commit (the
engine commits the step as `dispatching` before it calls anything, and records the outcome
after settle/hold) makes the budget change durable too. A database crash inside that window
loses the budget change together with everything after it: a lost reservation had no call
made against it yet; a lost settle or hold leaves an open reservation on a `dispatching` step,
which recovery holds. release, reconcile and write_off are rare and commit synchronously.
"""
from __future__ import annotations

import datetime as dt
from contextlib import contextmanager

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from agentplatform.errors import DomainError
from budgets.models import BudgetAccount, LedgerEntry, Reservation

Scope = BudgetAccount.Scope
Status = Reservation.Status
Kind = LedgerEntry.Kind
LOCK_ORDER = (Scope.TENANT_DAY, Scope.USER_DAY, Scope.RUN)

_ACCOUNTS = BudgetAccount._meta.db_table
# One statement: lock the accounts in the given order, then move every balance by its delta;
# with within_limit, only accounts with room for `reserved` move (the caller rolls back a partial).
_MOVE = f"""
UPDATE {_ACCOUNTS} AS a
   SET reserved_micros = a.reserved_micros + %(reserved)s, spent_micros = a.spent_micros + %(spent)s,
       held_micros = a.held_micros + %(held)s, overage_micros = a.overage_micros + %(overage)s
  FROM (SELECT id FROM {_ACCOUNTS} WHERE id = ANY(%(ids)s::bigint[])
        ORDER BY array_position(%(ids)s::bigint[], id) FOR NO KEY UPDATE) AS locked
 WHERE a.id = locked.id
   AND (NOT %(within_limit)s
        OR a.limit_micros >= a.reserved_micros + a.spent_micros + a.held_micros + %(reserved)s)
RETURNING a.id
"""


class BudgetExceeded(DomainError):
    def __init__(self, scope: str, amount: int, remaining: int):
        super().__init__(f"{scope} budget exceeded: needs {amount} micros, {max(remaining, 0)} left",
                         code=f"{scope}_budget_exhausted", status=429)
        self.scope = scope


def clock() -> dt.datetime:
    """The budget clock: what "today" means for tenant-day accounts (tests move it)."""
    return timezone.now()


def local_day(tenant, now: dt.datetime | None = None) -> dt.date:
    return (now or clock()).astimezone(tenant.zone).date()


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


def _accounts_for(tenant, *, day: dt.date, user, run) -> list[BudgetAccount]:
    """The accounts a reservation draws on, in lock order; day accounts are made on first use."""
    with_user = user is not None and tenant.user_daily_budget_micros is not None
    wanted = Q(tenant=tenant, scope=Scope.TENANT_DAY, day=day)
    if with_user:
        wanted |= Q(tenant=tenant, scope=Scope.USER_DAY, day=day, user=user)
    if run is not None:
        wanted |= Q(run=run)
    found = {account.scope: account for account in BudgetAccount.objects.filter(wanted)}
    if Scope.TENANT_DAY not in found:
        found[Scope.TENANT_DAY] = tenant_day_account(tenant, day)
    if with_user and Scope.USER_DAY not in found:
        found[Scope.USER_DAY] = _get_or_create_account(tenant, scope=Scope.USER_DAY, day=day, user=user)
    if run is not None and Scope.RUN not in found:
        raise BudgetAccount.DoesNotExist(f"run {run.pk} has no budget account")
    return [found[scope] for scope in LOCK_ORDER if scope in found]


@contextmanager
def _budget_transaction(*, durable: bool):
    owns = not connection.in_atomic_block
    with transaction.atomic():
        # Never change how a caller's own transaction commits; SQLite (the demo) has no such knob.
        if owns and not durable and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
        yield


def _move(account_ids: list[int], *, reserved: int = 0, spent: int = 0, held: int = 0, overage: int = 0,
          within_limit: bool = False) -> set[int]:
    if connection.vendor != "postgresql":
        return _move_portable(account_ids, reserved=reserved, spent=spent, held=held, overage=overage,
                              within_limit=within_limit)
    with connection.cursor() as cursor:
        cursor.execute(_MOVE, {"ids": account_ids, "reserved": reserved, "spent": spent, "held": held,
                               "overage": overage, "within_limit": within_limit})
        return {row[0] for row in cursor.fetchall()}


def _move_portable(account_ids: list[int], *, reserved: int, spent: int, held: int, overage: int,
                   within_limit: bool) -> set[int]:
    """The same movement as _MOVE, one conditional UPDATE per account (SQLite: the demo).

    SQLite runs with immediate transactions, so writers are already serialised.
    """
    moved = set()
    for account_id in account_ids:
        accounts = BudgetAccount.objects.filter(pk=account_id)
        if within_limit:
            accounts = accounts.filter(limit_micros__gte=F("reserved_micros") + F("spent_micros")
                                       + F("held_micros") + reserved)
        if accounts.update(reserved_micros=F("reserved_micros") + reserved, spent_micros=F("spent_micros") + spent,
                           held_micros=F("held_micros") + held, overage_micros=F("overage_micros") + overage):
            moved.add(account_id)
    return moved


def reserve(*, tenant, amount_micros: int, purpose: str, run=None, user=None,
            now: dt.datetime | None = None, note: str = "") -> Reservation:
    """Reserve amount on the tenant's day, the user's day (if limited) and the run, or raise."""
    if amount_micros < 0:
        raise ValueError("amount must not be negative")
    day = local_day(tenant, now)
    accounts = _accounts_for(tenant, day=day, user=user, run=run)
    by_scope = {a.scope: a for a in accounts}
    user_account, run_account = by_scope.get(Scope.USER_DAY), by_scope.get(Scope.RUN)
    reservation = Reservation(tenant=tenant, run=run, purpose=purpose, day=day, amount_micros=amount_micros,
                              day_account=by_scope[Scope.TENANT_DAY], user_account=user_account,
                              run_account=run_account, note=note)
    with _budget_transaction(durable=False):
        reservation.save(force_insert=True)
        LedgerEntry.objects.bulk_create([
            LedgerEntry(account=a, reservation=reservation, kind=Kind.RESERVE, amount_micros=amount_micros)
            for a in accounts])
        moved = _move([a.pk for a in accounts], reserved=amount_micros, within_limit=True)
        short = next((a for a in accounts if a.pk not in moved), None)
        if short is not None:
            transaction.set_rollback(True)
    if short is not None:
        short.refresh_from_db()
        raise BudgetExceeded(short.scope, amount_micros, short.remaining_micros)
    return reservation


def _load(reservation_id) -> Reservation:
    return Reservation.objects.only("amount_micros", "day_account_id", "user_account_id", "run_account_id") \
        .get(pk=reservation_id)


def _close(reservation: Reservation, *, from_status: str, to_status: str, actual: int | None,
           moves: dict[str, int], entries: list[tuple[str, int]], actor=None, note: str = "",
           durable: bool = True, **conditions) -> bool:
    """Close a reservation once; move balances on all its accounts in lock order."""
    overage = moves.get("overage", 0)
    with _budget_transaction(durable=durable):
        updated = Reservation.objects.filter(pk=reservation.pk, status=from_status, **conditions).update(
            status=to_status, actual_micros=actual, closed_at=timezone.now(), closed_by=actor,
            overage=overage > 0)
        if not updated:
            return False
        accounts = reservation.accounts()
        LedgerEntry.objects.bulk_create([
            LedgerEntry(account_id=account_id, reservation=reservation, kind=kind, amount_micros=amount,
                        actor=actor, note=note)
            for account_id in accounts for kind, amount in entries if amount])
        _move(accounts, **moves)
    return True


def settle(reservation_id, *, actual_micros: int, note: str = "") -> bool:
    """Record the actual cost and release the rest. An overage is recorded and flagged."""
    reservation = _load(reservation_id)
    amount = reservation.amount_micros
    overage = max(actual_micros - amount, 0)
    return _close(reservation, from_status=Status.OPEN, to_status=Status.SETTLED, actual=actual_micros,
                  moves={"reserved": -amount, "spent": actual_micros, "overage": overage},
                  entries=[(Kind.SETTLE, actual_micros), (Kind.RELEASE, max(amount - actual_micros, 0)),
                           (Kind.OVERAGE, overage)], note=note, durable=False)


def release(reservation_id, *, note: str = "") -> bool:
    """The call was provably not made: give the whole reservation back."""
    reservation = _load(reservation_id)
    amount = reservation.amount_micros
    return _close(reservation, from_status=Status.OPEN, to_status=Status.RELEASED, actual=0,
                  moves={"reserved": -amount}, entries=[(Kind.RELEASE, amount)], note=note)


def hold(reservation_id, *, note: str = "") -> bool:
    """The call may have been charged and we cannot know: keep the money out of reach."""
    reservation = _load(reservation_id)
    amount = reservation.amount_micros
    return _close(reservation, from_status=Status.OPEN, to_status=Status.HELD, actual=None,
                  moves={"reserved": -amount, "held": amount}, entries=[(Kind.HOLD, amount)], note=note,
                  durable=False)


def reconcile(reservation_id, *, actual_micros: int, actor, note: str) -> bool:
    """Clear a hold with the provider's actual usage for the lost call."""
    if not note:
        raise DomainError("a reason is required", fields={"note": ["This field is required."]})
    reservation = _load(reservation_id)
    amount = reservation.amount_micros
    overage = max(actual_micros - amount, 0)
    return _close(reservation, from_status=Status.HELD, to_status=Status.RECONCILED, actual=actual_micros,
                  moves={"held": -amount, "spent": actual_micros, "overage": overage},
                  entries=[(Kind.RECONCILE, actual_micros), (Kind.RELEASE, max(amount - actual_micros, 0)),
                           (Kind.OVERAGE, overage)], actor=actor, note=note)


def write_off(reservation_id, *, actor, note: str) -> bool:
    """Clear a hold without provider usage: nothing is counted as spent; the reason is kept."""
    if not note:
        raise DomainError("a reason is required", fields={"note": ["This field is required."]})
    reservation = _load(reservation_id)
    amount = reservation.amount_micros
    return _close(reservation, from_status=Status.HELD, to_status=Status.WRITTEN_OFF, actual=0,
                  moves={"held": -amount}, entries=[(Kind.WRITE_OFF, amount)], actor=actor, note=note)


def release_orphans(*, now: dt.datetime | None = None, older_than: dt.timedelta = dt.timedelta(minutes=15)) -> int:
    """Release run reservations that never got a step: their worker died before dispatching.

    The engine links a reservation to its step in the same transaction that commits the step as
    `dispatching`, before any call is made; an old open reservation with no step therefore paid
    for a call that was never sent. (Reservations with a step are recovery's business: held.)
    """
    cutoff = (now or timezone.now()) - older_than
    orphans = Reservation.objects.filter(status=Status.OPEN, step__isnull=True, run__isnull=False,
                                         created_at__lt=cutoff).values_list("pk", flat=True)[:500]
    released = 0
    for pk in orphans:
        reservation = _load(pk)
        released += _close(reservation, from_status=Status.OPEN, to_status=Status.RELEASED, actual=0,
                           moves={"reserved": -reservation.amount_micros},
                           entries=[(Kind.RELEASE, reservation.amount_micros)],
                           note="never dispatched: its worker stopped before the call", step__isnull=True)
    return released
