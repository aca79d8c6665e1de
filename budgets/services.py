"""Budget ledger: reserve before every call, settle after, hold what is unknown.

Rules (DESIGN.md section 6):
- Balances move only inside one statement per operation (budgets.statements: `RESERVE_*`,
  `CLOSE`) that first locks the reservation's accounts in one fixed order (tenant-day
  sub-accounts by shard, user day, run). A reservation takes `amount` only if every account has
  `spent + reserved + held + amount <= limit`, judged on the newest row versions (read under the
  lock), so two reservations can never both pass a check that only one of them fits; if any
  account has no room, nothing moves.
- Budget work runs in its own short statement, or as the one ledger statement of one of the
  engine's two transactions per step, after that transaction locked its run (the lock order and
  why it cannot deadlock: runs/engine/__init__.py). A transaction that holds budget accounts
  never waits for a run.
- A reservation closes exactly once (conditional update on its status), so a late worker and a
  recovering worker cannot both settle or both hold it.
- Every movement writes a LedgerEntry on its reservation (it moves all the reservation's accounts
  alike); budgets.selectors.ledger_mismatches recomputes each account's balances from them.

The tenant day is the hottest account of the platform (every call of every run of a tenant
moves it), so on PostgreSQL it is split into BUDGET_DAY_SHARDS sub-accounts whose limits add up
to the daily budget (DESIGN.md section 9). A reservation takes the first sub-account with room
that no one else holds, starting from its run's own (`RESERVE_ANY`, SKIP LOCKED), so concurrent
runs do not queue behind each other. When none is free with room (the day nearly spent, or every
sub-account busy), that attempt has locked nothing, and `RESERVE_POOLED` locks all of them in
shard order, decides on the day's total room, and spreads the free room evenly again: the day is
never overspent (no sub-account goes over its own limit and the limits add up), and a refusal is
never spurious (it is decided with the whole day locked). A transaction waits for a sub-account
of the day only while it holds no budget account, which is what keeps the waits in one order
(an earlier form waited for the run's own sub-account first and then swept the day from shard 0
while holding it: two runs short on the day could deadlock).

Each reserve and each close is one SQL statement (`RESERVE_*`, `CLOSE`), prepared once per
connection, with no round trip to the client inside the lock. The engine runs them inside its
claim and record transactions (the reservation commits with the step it pays for, the settle
with the outcome it pays for), so there the accounts stay locked until that commit; the
sub-accounts of the day are picked with SKIP LOCKED, so concurrent runs do not queue on them.
Alone (outside a transaction), reserve, settle and hold commit with `synchronous_commit = off`:
PostgreSQL flushes WAL in order, so the caller's next synchronous commit makes the change
durable too, and a crash inside that window loses it together with everything after it. release,
reconcile and write_off are rare and commit synchronously. (SQLite, for the demo, runs the same steps with the
ORM in one transaction.)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import random

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, IntegrityError, connection, connections, transaction
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from budgets.models import BudgetAccount, LedgerEntry, Reservation
from budgets.statements import CLOSE, RESERVE_ANY, RESERVE_OWN, RESERVE_POOLED
from core.errors import DomainError
from regions.models import RegionDay, here, is_home, of_user

Scope = BudgetAccount.Scope
Status = Reservation.Status
Kind = LedgerEntry.Kind
LOCK_ORDER = (Scope.TENANT_DAY, Scope.USER_DAY, Scope.RUN)


class BudgetExceeded(DomainError):
    def __init__(self, scope: str, amount: int, remaining: int):
        super().__init__(
            f"{scope} budget exceeded: needs {amount} micros, {max(remaining, 0)} left",
            code=f"{scope}_budget_exhausted",
            status=429,
        )
        self.scope = scope


def clock() -> dt.datetime:
    """The budget clock: what "today" means for tenant-day accounts (tests move it)."""
    return timezone.now()


def local_day(tenant, now: dt.datetime | None = None) -> dt.date:
    return (now or clock()).astimezone(tenant.zone).date()


def next_local_midnight(tenant, now: dt.datetime | None = None) -> dt.datetime:
    day = local_day(tenant, now) + dt.timedelta(days=1)
    return dt.datetime.combine(day, dt.time(0, 0), tzinfo=tenant.zone)


def day_shards() -> int:
    """Sub-accounts per tenant day: the setting on PostgreSQL, one on SQLite (writers queue anyway)."""
    return max(settings.BUDGET_DAY_SHARDS, 1) if connection.vendor == "postgresql" else 1


def _open_day(tenant, day: dt.date) -> None:
    """Create the day's sub-accounts, the daily budget split between them, in one INSERT.

    Concurrent first reservations of the day insert the same rows; the conflicts are skipped, so
    the limits are set once. (A sub-account added later, after BUDGET_DAY_SHARDS grew, starts with
    no limit of its own and gets room when the day's room is next spread.)
    """
    n = day_shards()
    existing = set(
        BudgetAccount.objects.filter(tenant=tenant, scope=Scope.TENANT_DAY, day=day).values_list(
            "shard", flat=True
        )
    )
    # A region that is not the tenant's home opens the day empty: it spends only the slices the
    # home grants it (regions/services.py raises the limit by each). The home opens it with the
    # daily budget less what it has already lent out for the day.
    limit = tenant.daily_budget_micros - _lent_out(tenant, day) if is_home(tenant) else 0
    BudgetAccount.objects.bulk_create(
        [
            BudgetAccount(
                tenant=tenant,
                scope=Scope.TENANT_DAY,
                day=day,
                shard=shard,
                limit_micros=0 if existing else limit // n + (limit % n if shard == 0 else 0),
            )
            for shard in range(n)
            if shard not in existing
        ],
        ignore_conflicts=True,
    )


def _open_user_day(tenant, day: dt.date, user) -> None:
    """Open the user's day: at home with the user's daily budget less what other regions hold of
    it; in another region empty (it spends the slices of the user's day the home grants it)."""
    user_id = getattr(user, "pk", user)
    lookup = {"tenant": tenant, "scope": Scope.USER_DAY, "day": day, "user_id": user_id}
    if BudgetAccount.objects.filter(**lookup).exists():
        return
    limit = (
        tenant.user_daily_budget_micros - _lent_out(tenant, day, user_id=user_id) if is_home(tenant) else 0
    )
    try:
        with transaction.atomic():
            BudgetAccount.objects.get_or_create(**lookup, defaults={"limit_micros": limit})
    except IntegrityError:  # a concurrent first reservation of the day created it
        pass


def tenant_day_account(tenant, day: dt.date) -> BudgetAccount:
    """The tenant's day as one account (unsaved): the sums of its sub-accounts, opened if need be."""
    totals = _day_totals(tenant, day)
    if not totals["shards"]:
        _open_day(tenant, day)
        totals = _day_totals(tenant, day)
    del totals["shards"]
    return BudgetAccount(tenant=tenant, scope=Scope.TENANT_DAY, day=day, **totals)


def _day_totals(tenant, day: dt.date) -> dict:
    return BudgetAccount.objects.filter(tenant=tenant, scope=Scope.TENANT_DAY, day=day).aggregate(
        shards=Count("id"), **{f: Coalesce(Sum(f), 0) for f in BudgetAccount.BALANCES}
    )


def _lent_out(tenant, day: dt.date, *, user_id: int | None = None) -> int:
    """What the home has granted other regions of the day (of one user's day, with `user_id`)
    and not had back (0 with no regions)."""
    if not here():
        return 0
    totals = RegionDay.objects.filter(of_user(user_id), tenant=tenant, day=day).aggregate(
        granted=Coalesce(Sum("granted_micros"), 0), returned=Coalesce(Sum("returned_micros"), 0)
    )
    return totals["granted"] - totals["returned"]


def move_day_limit(tenant, day: dt.date, by_micros: int) -> int:
    """Raise the day's limit by `by_micros`, or lower it by at most its free room; the amount moved.

    This is how slices move (regions/services.py): a home lends by lowering its own limit and is
    given back by raising it; a region is granted by raising its limit and returns by lowering
    it. Lowering never takes what is reserved, spent or held: only free room leaves. The
    sub-accounts are locked in shard order (the ledger's lock order) and the free room spread
    evenly again, as set_day_limit does. Call it inside the transaction that records the move.
    """
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        raise RuntimeError("move_day_limit must run in the transaction that records the move")
    _open_day(tenant, day)
    shards = list(
        BudgetAccount.objects.select_for_update()
        .filter(tenant=tenant, scope=Scope.TENANT_DAY, day=day)
        .order_by("shard")
    )
    used = [a.reserved_micros + a.spent_micros + a.held_micros for a in shards]
    free = sum(a.limit_micros for a in shards) - sum(used)
    moved = by_micros if by_micros >= 0 else -min(-by_micros, max(free, 0))
    if moved == 0:
        return 0
    share, rest = divmod(max(free + moved, 0), len(shards))
    for i, account in enumerate(shards):
        room = share + (rest if i == 0 else 0) if free + moved >= 0 else (free + moved if i == 0 else 0)
        BudgetAccount.objects.filter(pk=account.pk).update(limit_micros=used[i] + room)
    return moved


def move_user_day_limit(tenant, day: dt.date, user_id: int, by_micros: int) -> int:
    """move_day_limit for one user's day (one account, no shards): raise by `by_micros`, or lower
    by at most its free room; the amount moved. Call it in the transaction recording the move."""
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        raise RuntimeError("move_user_day_limit must run in the transaction that records the move")
    account = lock_user_day_account(tenant, day, user_id)
    moved = by_micros if by_micros >= 0 else -min(-by_micros, max(account.remaining_micros, 0))
    if moved:
        BudgetAccount.objects.filter(pk=account.pk).update(limit_micros=F("limit_micros") + moved)
    return moved


def lock_user_day_account(tenant, day: dt.date, user_id: int) -> BudgetAccount:
    """The user's day account, opened if need be and locked (FOR UPDATE) until the transaction ends."""
    _open_user_day(tenant, day, user_id)
    return BudgetAccount.objects.select_for_update().get(
        tenant=tenant, scope=Scope.USER_DAY, day=day, user_id=user_id
    )


def user_day_account(tenant, day: dt.date, user_id: int) -> BudgetAccount:
    """The user's day account, opened (empty away from home) if need be."""
    lookup = {"tenant": tenant, "scope": Scope.USER_DAY, "day": day, "user_id": user_id}
    account = BudgetAccount.objects.filter(**lookup).first()
    if account is None:
        _open_user_day(tenant, day, user_id)
        account = BudgetAccount.objects.get(**lookup)
    return account


def set_user_day_limits(tenant, day: dt.date, limit_micros: int) -> list[BudgetAccount]:
    """Move every user's limit for `day` to `limit_micros` less what other regions hold of that
    user's day (the home only: elsewhere a user's limit is the slices granted). The accounts moved."""
    if not is_home(tenant):
        return []
    lent: dict = {}
    if here():  # what each user's day has out in other regions, in one query
        for user_id, granted, returned in (
            RegionDay.objects.filter(tenant=tenant, day=day, user__isnull=False)
            .values("user_id")
            .annotate(granted=Sum("granted_micros"), returned=Sum("returned_micros"))
            .values_list("user_id", "granted", "returned")
        ):
            lent[user_id] = granted - returned
    moved = []
    with transaction.atomic():
        for account in (
            BudgetAccount.objects.select_for_update(of=("self",))
            .filter(tenant=tenant, day=day, scope=Scope.USER_DAY)
            .select_related("user")
            .order_by("pk")
        ):
            limit = limit_micros - lent.get(account.user_id, 0)
            if account.limit_micros != limit:
                BudgetAccount.objects.filter(pk=account.pk).update(limit_micros=limit)
                moved.append(account)
    return moved


def set_day_limit(tenant, day: dt.date, limit_micros: int) -> bool:
    """Move the tenant's limit for `day` (an open day keeps the limit it opened with otherwise).

    With the sub-accounts locked in shard order, the free room under the new limit is spread
    evenly again. A limit below what is already used leaves no sub-account any room: the
    shortfall sits on sub-account 0. (Lowering just one sub-account would not do: another one
    would still have room of its own and the day would go over its limit.) Regions: a region
    that is not the tenant's home keeps the limit its slices make; the home's is the new
    budget less what it has lent out for the day.
    """
    if not is_home(tenant):
        return False
    with transaction.atomic():
        shards = list(
            BudgetAccount.objects.select_for_update()
            .filter(tenant=tenant, scope=Scope.TENANT_DAY, day=day)
            .order_by("shard")
        )
        limit_micros -= _lent_out(tenant, day)  # read under the day's lock, which every lending takes first
        if not shards or sum(a.limit_micros for a in shards) == limit_micros:
            return False
        used = [a.reserved_micros + a.spent_micros + a.held_micros for a in shards]
        free = limit_micros - sum(used)
        share, rest = divmod(max(free, 0), len(shards))
        for i, account in enumerate(shards):
            room = share + (rest if i == 0 else 0) if free >= 0 else (free if i == 0 else 0)
            BudgetAccount.objects.filter(pk=account.pk).update(limit_micros=used[i] + room)
    return True


def create_run_account(*, run, limit_micros: int) -> BudgetAccount:
    return BudgetAccount.objects.create(
        tenant_id=run.tenant_id, scope=Scope.RUN, run=run, limit_micros=limit_micros
    )


def _make_day_accounts(tenant, *, day: dt.date, user) -> None:
    _open_day(tenant, day)
    if user is not None and tenant.user_daily_budget_micros is not None:
        _open_user_day(tenant, day, user)


def _execute(sql: str, params: dict) -> tuple:
    """Run one of the statements above as a prepared statement on Django's connection.

    Django binds parameters on the client, so PostgreSQL would parse and plan these statements
    on every call; prepared (server-side binding, cached per connection) they are planned once.
    A connection pooler in front of PostgreSQL must therefore support prepared statements.
    """
    db = connections[DEFAULT_DB_ALIAS]  # one thread-local lookup, not one per attribute
    db.ensure_connection()
    with db.wrap_database_errors, psycopg.Cursor(db.connection) as cursor:
        cursor.execute(sql, params, prepare=True)
        row = cursor.fetchone()
    if row is None:  # each statement above answers with one row, whatever it finds
        raise DatabaseError("a budget statement returned no row")
    return row


def _relaxed_commit() -> bool:
    """Commit without waiting for the WAL flush, unless the statement runs in a caller's transaction."""
    return not connection.in_atomic_block


class Reserved(enum.Enum):
    """An attempt that is not short: RESERVED (the reservation is written), MISSING (an account
    it needs does not exist yet), NONE_FREE (asking for any free sub-account of the day with
    room, none was, and nothing was locked)."""

    RESERVED = "reserved"
    MISSING = "missing"
    NONE_FREE = "none_free"


RESERVED, MISSING, NONE_FREE = Reserved.RESERVED, Reserved.MISSING, Reserved.NONE_FREE


@dataclasses.dataclass(frozen=True)
class Short:
    """An attempt refused: the first account (in lock order) without room, and the room it had."""

    scope: str
    room_micros: int


Attempt = Reserved | Short  # what one way of reserving answers


def reserve(
    *,
    tenant,
    amount_micros: int,
    purpose: str,
    run=None,
    user=None,
    step=None,
    now: dt.datetime | None = None,
    note: str = "",
) -> Reservation:
    """Reserve amount on the tenant's day, the user's day (if limited) and the run, or raise.

    `step`: the step the reservation pays for, linked in the same statement (the engine reserves
    in the transaction that commits the step as dispatching).
    """
    if amount_micros < 0:
        raise ValueError("amount must not be negative")
    day = local_day(tenant, now)
    if tenant.user_daily_budget_micros is None:
        user = None
    reservation = Reservation(
        tenant=tenant, run=run, step=step, purpose=purpose, day=day, amount_micros=amount_micros, note=note
    )
    shards = day_shards()
    shard = _shard_for(reservation, shards)
    attempt = _attempt(reservation, user=user, shard=shard, shards=shards)
    if attempt is MISSING:  # the first reservation of the day (or of this user's day) opens its accounts
        _make_day_accounts(tenant, day=day, user=user)
        attempt = _attempt(reservation, user=user, shard=shard, shards=shards)
    if attempt is MISSING:
        raise BudgetAccount.DoesNotExist("the budget accounts of this reservation are missing")
    if isinstance(attempt, Short):
        raise BudgetExceeded(attempt.scope, amount_micros, attempt.room_micros)
    return reservation


def open_evaluation_account(*, tenant, limit_micros: int) -> BudgetAccount:
    """An evaluation's own budget (evals/): what its runs' calls may spend, apart from the tenant's day."""
    return BudgetAccount.objects.create(tenant=tenant, scope=Scope.EVALUATION, limit_micros=limit_micros)


def reserve_on(*, account_id: int, run=None, step=None, amount_micros: int, purpose: str) -> Reservation:
    """Reserve on an evaluation's account and the run's (if any: a judge's call has none), or raise
    BudgetExceeded; the tenant's day and the user's day are not touched (an evaluation's spend is
    not the tenant's usage).

    The evaluation's account takes the reservation's day-account place, so settle, release and
    hold (the CLOSE statement) move it like any account. Locks: the evaluation's account, then the
    run's, in the caller's transaction (the engine's claim, after its run lock). Runs of one
    evaluation share its account; each holds only its own run account besides, which no other
    transaction locks while waiting for the evaluation's, so the two cannot wait on each other.
    """
    if amount_micros < 0:
        raise ValueError("amount must not be negative")
    account = BudgetAccount.objects.select_related("tenant").get(pk=account_id)
    run_account = None
    if run is not None:
        run_account = BudgetAccount.objects.filter(run_id=run.pk).values_list("pk", flat=True).first()
        if run_account is None:
            raise BudgetAccount.DoesNotExist(f"run {run.pk} has no budget account")
    reservation = Reservation(
        tenant_id=account.tenant_id,
        run=run,
        step=step,
        purpose=purpose,
        day=local_day(account.tenant),
        amount_micros=amount_micros,
        day_account_id=account_id,
        run_account_id=run_account,
    )
    accounts = [account_id] + ([run_account] if run_account is not None else [])
    with transaction.atomic():
        reservation.save(force_insert=True)
        LedgerEntry.objects.create(reservation=reservation, kind=Kind.RESERVE, amount_micros=amount_micros)
        moved = _move_portable(accounts, reserved=amount_micros, within_limit=True)
        if len(moved) == len(accounts):
            return reservation
        transaction.set_rollback(True)
    short = BudgetAccount.objects.get(pk=next(a for a in accounts if a not in moved))
    raise BudgetExceeded(short.scope, amount_micros, short.remaining_micros)


def _attempt(reservation: Reservation, *, user, shard: int, shards: int) -> Attempt:
    """One attempt at the reservation: any free sub-account of the day with room; when none is
    (and so nothing was locked), the whole day in shard order. One sub-account a day: that one."""
    if connection.vendor != "postgresql":
        return _reserve_portable(reservation, user=user, shard=shard)
    if shards == 1:
        return _reserve_in_one_statement(reservation, user=user, shard=shard)
    attempt = _reserve_in_one_statement(reservation, user=user, shard=shard, any_free=True)
    if attempt is NONE_FREE:
        attempt = _reserve_pooled(reservation, user=user, shard=shard)
    return attempt


def _shard_for(reservation: Reservation, shards: int) -> int:
    """A run always uses the same sub-account of the day; other reservations any of them."""
    if shards == 1:
        return 0
    return reservation.run_id.int % shards if reservation.run_id else random.randrange(shards)


def _params(reservation: Reservation, *, user, shard: int) -> dict:
    return {
        "tenant": reservation.tenant_id,
        "day": reservation.day,
        "user": user.pk if user else None,
        "run": reservation.run_id,
        "step": reservation.step_id,
        "wanted": 1 + (user is not None) + (reservation.run_id is not None),
        "amount": reservation.amount_micros,
        "id": reservation.pk,
        "purpose": reservation.purpose,
        "note": reservation.note,
        "shard": shard,
        "shards": day_shards(),
        "relaxed": _relaxed_commit(),
    }


def _reserved(reservation: Reservation, created_at, day_account, user_account, run_account) -> Attempt:
    reservation.created_at = created_at
    reservation.day_account_id, reservation.user_account_id = day_account, user_account
    reservation.run_account_id = run_account
    return RESERVED


def _reserve_in_one_statement(
    reservation: Reservation, *, user, shard: int, any_free: bool = False
) -> Attempt:
    """RESERVED; MISSING: an account is missing; NONE_FREE (any_free): no sub-account of the day
    was free with room, and the statement locked nothing; else Short: the first scope without
    room and its room."""
    params = _params(reservation, user=user, shard=shard)
    fits, found, created_at, day_account, user_account, run_account, short_scopes, short_rooms, _ = _execute(
        RESERVE_ANY if any_free else RESERVE_OWN, params
    )
    if fits:
        return _reserved(reservation, created_at, day_account, user_account, run_account)
    if any_free and day_account is None:
        return NONE_FREE
    if found < params["wanted"]:
        # A sub-account of the day is held now: the caller opens the user's day and asks again,
        # and that sub-account (still this transaction's, with its room) answers the second ask.
        return _missing(reservation)
    return Short(short_scopes[0], short_rooms[0])  # `locked` keeps lock order: the first account refused


def _reserve_pooled(reservation: Reservation, *, user, shard: int) -> Attempt:
    """The day as a whole decides (budgets.statements.RESERVE_POOLED); answers as _reserve_in_one_statement."""
    params = _params(reservation, user=user, shard=shard)
    fits, free, created_at, day_account, user_account, run_account, short_scopes, short_rooms, found, _ = (
        _execute(RESERVE_POOLED, params)
    )
    if fits:
        return _reserved(reservation, created_at, day_account, user_account, run_account)
    # `found` counts the user-day and run accounts: every account wanted but the day's sub-account
    if day_account is None or found < params["wanted"] - 1:
        return _missing(reservation)
    if free < reservation.amount_micros:
        return Short(Scope.TENANT_DAY, free)
    return Short(short_scopes[0], short_rooms[0])


def _missing(reservation: Reservation) -> Attempt:
    """MISSING: an account of the day is to be opened. A run's own account is opened with the run,
    never here: without it the reservation cannot be made at all."""
    if (
        reservation.run_id is not None
        and not BudgetAccount.objects.filter(run_id=reservation.run_id).exists()
    ):
        raise BudgetAccount.DoesNotExist(f"run {reservation.run_id} has no budget account")
    return MISSING


def _reserve_portable(reservation: Reservation, *, user, shard: int) -> Attempt:
    lookup = Q(tenant_id=reservation.tenant_id, scope=Scope.TENANT_DAY, day=reservation.day, shard=shard)
    if user is not None:
        lookup |= Q(tenant_id=reservation.tenant_id, scope=Scope.USER_DAY, day=reservation.day, user=user)
    if reservation.run_id is not None:
        lookup |= Q(run_id=reservation.run_id)
    by_scope = {a.scope: a for a in BudgetAccount.objects.filter(lookup)}
    if reservation.run_id is not None and Scope.RUN not in by_scope:
        raise BudgetAccount.DoesNotExist(f"run {reservation.run_id} has no budget account")
    if Scope.TENANT_DAY not in by_scope or (user is not None and Scope.USER_DAY not in by_scope):
        return MISSING
    accounts = [by_scope[scope] for scope in LOCK_ORDER if scope in by_scope]
    reservation.day_account = by_scope[Scope.TENANT_DAY]
    reservation.user_account, reservation.run_account = by_scope.get(Scope.USER_DAY), by_scope.get(Scope.RUN)
    with transaction.atomic():
        reservation.save(force_insert=True)
        LedgerEntry.objects.create(
            reservation=reservation, kind=Kind.RESERVE, amount_micros=reservation.amount_micros
        )
        moved = _move_portable(
            [a.pk for a in accounts], reserved=reservation.amount_micros, within_limit=True
        )
        short = next((a for a in accounts if a.pk not in moved), None)
        if short is None:
            return RESERVED
        transaction.set_rollback(True)
    short.refresh_from_db()
    return Short(short.scope, short.remaining_micros)


def _move_portable(
    account_ids: list[int],
    *,
    reserved: int = 0,
    spent: int = 0,
    held: int = 0,
    overage: int = 0,
    within_limit: bool = False,
) -> set[int]:
    """The movement of budgets.statements' RESERVE_*/CLOSE, one conditional UPDATE per account (SQLite).

    SQLite runs with immediate transactions, so writers are already serialised.
    """
    moved = set()
    for account_id in account_ids:
        accounts = BudgetAccount.objects.filter(pk=account_id)
        if within_limit:
            accounts = accounts.filter(
                limit_micros__gte=F("reserved_micros") + F("spent_micros") + F("held_micros") + reserved
            )
        if accounts.update(
            reserved_micros=F("reserved_micros") + reserved,
            spent_micros=F("spent_micros") + spent,
            held_micros=F("held_micros") + held,
            overage_micros=F("overage_micros") + overage,
        ):
            moved.add(account_id)
    return moved


def _movement(amount: int, actual: int | None, *, from_status: str, to_status: str, kind: str):
    """How closing a reservation moves its accounts, and the ledger entries it writes."""
    actual = actual or 0
    settles = kind in (Kind.SETTLE, Kind.RECONCILE)
    moves = {
        "reserved": -amount if from_status == Status.OPEN else 0,
        "held": amount if to_status == Status.HELD else -amount if from_status == Status.HELD else 0,
        "spent": actual,
        "overage": max(actual - amount, 0),
    }
    entries = [
        (kind, actual if settles else amount),
        (Kind.RELEASE, max(amount - actual, 0) if settles else 0),
        (Kind.OVERAGE, max(actual - amount, 0)),
    ]
    return moves, [(k, a) for k, a in entries if a]


def _close(reservation_id, **how) -> bool:
    """Close a reservation once; move balances on all its accounts in lock order. False: not closed."""
    return _close_reporting(reservation_id, **how)[0]


def _close_reporting(
    reservation_id,
    *,
    from_status: str,
    to_status: str,
    kind: str,
    actual: int | None,
    actor=None,
    note: str = "",
    durable: bool = True,
    unlinked_only: bool = False,
) -> tuple[bool, tuple[int, int, int, int] | None]:
    """_close, and the run account's (limit, reserved, spent, held) after the move (PostgreSQL:
    returned by the same statement; None where it was not closed or has no run account)."""
    if connection.vendor == "postgresql":
        closed, _, balances = _execute(
            CLOSE,
            {
                "id": reservation_id,
                "from_status": from_status,
                "to_status": to_status,
                "kind": str(kind),
                "actual": actual,
                "actor": actor.pk if actor else None,
                "note": note,
                "unlinked_only": unlinked_only,
                "relaxed": not durable and _relaxed_commit(),
            },
        )
        return closed == 1, tuple(balances) if closed == 1 and balances else None
    with transaction.atomic():
        reservation = Reservation.objects.filter(pk=reservation_id).first()
        unlinked = {"step__isnull": True} if unlinked_only else {}
        if reservation is None or not Reservation.objects.filter(
            pk=reservation_id, status=from_status, **unlinked
        ).update(
            status=to_status,
            actual_micros=actual,
            closed_at=timezone.now(),
            closed_by=actor,
            overage=(actual or 0) > reservation.amount_micros,
        ):
            return False, None
        moves, entries = _movement(
            reservation.amount_micros, actual, from_status=from_status, to_status=to_status, kind=kind
        )
        LedgerEntry.objects.bulk_create(
            [
                LedgerEntry(reservation=reservation, kind=k, amount_micros=a, actor=actor, note=note)
                for k, a in entries
            ]
        )
        _move_portable(reservation.accounts(), **moves)
    balances = (
        BudgetAccount.objects.filter(pk=reservation.run_account_id)
        .values_list("limit_micros", "reserved_micros", "spent_micros", "held_micros")
        .first()
        if reservation.run_account_id is not None
        else None
    )
    return True, balances


def settle(reservation_id, *, actual_micros: int, note: str = "") -> bool:
    """Record the actual cost and release the rest. An overage is recorded and flagged."""
    return _close(
        reservation_id,
        from_status=Status.OPEN,
        to_status=Status.SETTLED,
        kind=Kind.SETTLE,
        actual=actual_micros,
        note=note,
        durable=False,
    )


def settle_reporting(reservation_id, *, actual_micros: int) -> tuple[bool, tuple[int, int, int, int] | None]:
    """settle, and the run account's balances after it (limit, reserved, spent, held) from the same
    statement: the engine's budget event reports them without reading the account again."""
    return _close_reporting(
        reservation_id,
        from_status=Status.OPEN,
        to_status=Status.SETTLED,
        kind=Kind.SETTLE,
        actual=actual_micros,
        durable=False,
    )


def release(reservation_id, *, note: str = "") -> bool:
    """The call was provably not made: give the whole reservation back."""
    return _close(
        reservation_id,
        from_status=Status.OPEN,
        to_status=Status.RELEASED,
        kind=Kind.RELEASE,
        actual=0,
        note=note,
    )


def hold(reservation_id, *, note: str = "") -> bool:
    """The call may have been charged and we cannot know: keep the money out of reach."""
    return _close(
        reservation_id,
        from_status=Status.OPEN,
        to_status=Status.HELD,
        kind=Kind.HOLD,
        actual=None,
        note=note,
        durable=False,
    )


# A reservation is the call's worst case; a charge this many times larger is a typing mistake
# (9e18 micros was once accepted and blocked the tenant's budget for the rest of the day).
RECONCILE_MAX_FACTOR = 10


def reconcile(reservation_id, *, actual_micros: int, actor, note: str) -> bool:
    """Clear a hold with the provider's actual usage for the lost call."""
    if not note:
        raise DomainError("a reason is required", fields={"note": ["This field is required."]})
    amount = Reservation.objects.filter(pk=reservation_id).values_list("amount_micros", flat=True).first()
    if amount is not None and actual_micros > max(amount, 1) * RECONCILE_MAX_FACTOR:
        raise DomainError(
            "the actual charge is implausibly large",
            fields={
                "actual_micros": [f"at most {RECONCILE_MAX_FACTOR} times the reservation ({amount} micros)"]
            },
        )
    return _close(
        reservation_id,
        from_status=Status.HELD,
        to_status=Status.RECONCILED,
        kind=Kind.RECONCILE,
        actual=actual_micros,
        actor=actor,
        note=note,
    )


def write_off(reservation_id, *, actor, note: str) -> bool:
    """Clear a hold without provider usage: nothing is counted as spent; the reason is kept."""
    if not note:
        raise DomainError("a reason is required", fields={"note": ["This field is required."]})
    return _close(
        reservation_id,
        from_status=Status.HELD,
        to_status=Status.WRITTEN_OFF,
        kind=Kind.WRITE_OFF,
        actual=0,
        actor=actor,
        note=note,
    )


def release_orphans(
    *, now: dt.datetime | None = None, older_than: dt.timedelta = dt.timedelta(minutes=15)
) -> int:
    """Release run reservations that never got a step: their worker died before dispatching.

    The engine links a reservation to its step in the same transaction that commits the step as
    `dispatching`, before any call is made; an old open reservation with no step therefore paid
    for a call that was never sent. (Reservations with a step are recovery's business: held.)
    """
    cutoff = (now or timezone.now()) - older_than
    orphans = Reservation.objects.filter(
        status=Status.OPEN, step__isnull=True, run__isnull=False, created_at__lt=cutoff
    ).values_list("pk", flat=True)[:500]
    return sum(
        _close(
            pk,
            from_status=Status.OPEN,
            to_status=Status.RELEASED,
            kind=Kind.RELEASE,
            actual=0,
            note="never dispatched: its worker stopped before the call",
            unlinked_only=True,
        )
        for pk in orphans
    )
