from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from core.ids import uuid7


class BudgetAccount(models.Model):
    """limit, reserved, spent and held in micro-units; moved only by conditional F() updates."""

    class Scope(models.TextChoices):
        RUN = "run"
        TENANT_DAY = "tenant_day"
        USER_DAY = "user_day"
        # An evaluation's own budget (evals/): its runs reserve here instead of the tenant's day.
        EVALUATION = "evaluation"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="budget_accounts")
    scope = models.CharField(max_length=12, choices=Scope.choices)
    run = models.OneToOneField(
        "runs.Run", null=True, blank=True, on_delete=models.CASCADE, related_name="budget"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    day = models.DateField(null=True, blank=True)
    # A tenant's day is split into BUDGET_DAY_SHARDS sub-accounts (DESIGN.md section 9) whose
    # limits add up to the daily budget: concurrent runs lock different rows. budgets.services
    # moves free room between them under a lock of all of them when one runs short.
    shard = models.PositiveSmallIntegerField(default=0)
    limit_micros = models.BigIntegerField()
    reserved_micros = models.BigIntegerField(default=0)
    spent_micros = models.BigIntegerField(default=0)
    held_micros = models.BigIntegerField(default=0)
    overage_micros = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(reserved_micros__gte=0), name="budget_reserved_gte_0"),
            models.CheckConstraint(condition=Q(spent_micros__gte=0), name="budget_spent_gte_0"),
            models.CheckConstraint(condition=Q(held_micros__gte=0), name="budget_held_gte_0"),
            models.UniqueConstraint(
                fields=["tenant", "day", "shard"],
                condition=Q(scope="tenant_day"),
                name="uniq_tenant_day_shard",
            ),
            models.UniqueConstraint(
                fields=["tenant", "user", "day"], condition=Q(scope="user_day"), name="uniq_user_day_account"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope} {self.day or self.run_id}" + (f" #{self.shard}" if self.shard else "")

    # The balance columns; a tenant day's are the sums over its sub-accounts.
    BALANCES = ("limit_micros", "reserved_micros", "spent_micros", "held_micros", "overage_micros")

    @property
    def remaining_micros(self) -> int:
        return self.limit_micros - self.reserved_micros - self.spent_micros - self.held_micros


class Reservation(models.Model):
    class Status(models.TextChoices):
        OPEN = "open"
        SETTLED = "settled"
        RELEASED = "released"
        HELD = "held"
        RECONCILED = "reconciled"
        WRITTEN_OFF = "written_off"

    # Time-ordered: the reservation and its ledger entries live in the partition of the month it
    # was made in (history/partitions.py).
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    # Reservations and their ledger entries are the platform's most frequent inserts. Indexes are
    # kept to what queries use (by tenant and status, run, step, account). The references written
    # by budgets.services' reserve statements carry no database FK check (db_constraint=False):
    # those ids come from the rows the same statement has just locked, and the deferred checks
    # cost about a seventh of PostgreSQL's CPU per reservation. Django still cascades deletes.
    tenant = models.ForeignKey(
        "tenants.Tenant", on_delete=models.CASCADE, related_name="+", db_index=False, db_constraint=False
    )
    run = models.ForeignKey(
        "runs.Run",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="reservations",
        db_constraint=False,
    )
    # Steps are partitioned by their run (history/partitions.py): no database key can point at a
    # step's id alone. Django still sets it to NULL when the step goes.
    step = models.ForeignKey(
        "runs.Step",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="reservations",
        db_constraint=False,
    )
    # Fixed lock order: day account, user-day account, run account. Nothing looks reservations
    # up by account except the ledger audit (budgets.selectors.ledger_mismatches, which narrows
    # by run or by tenant and day first), so these carry no index; an account is deleted only
    # with its run or tenant, whose own cascades delete the reservations (DO_NOTHING: no scan).
    day_account = models.ForeignKey(
        BudgetAccount, on_delete=models.DO_NOTHING, related_name="+", db_index=False, db_constraint=False
    )
    user_account = models.ForeignKey(
        BudgetAccount,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
    run_account = models.ForeignKey(
        BudgetAccount,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
    purpose = models.CharField(max_length=20)  # "model" | "tool"
    day = models.DateField()
    amount_micros = models.BigIntegerField()
    actual_micros = models.BigIntegerField(null=True, blank=True)
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.OPEN)
    overage = models.BooleanField(default=False)
    note = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    closed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
    )
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "status", "created_at"], name="reservation_tenant_status")]

    def accounts(self) -> list[int]:
        return [pk for pk in (self.day_account_id, self.user_account_id, self.run_account_id) if pk]


class LedgerEntry(models.Model):
    """Append-only audit: one entry per movement of a reservation.

    A movement moves every account of its reservation (tenant day, user day, run) by the same
    amount, so the entry names the reservation and the accounts follow from it: half the rows of
    one entry per account, on the platform's hottest write path.
    """

    class Kind(models.TextChoices):
        RESERVE = "reserve"
        SETTLE = "settle"
        RELEASE = "release"
        HOLD = "hold"
        RECONCILE = "reconcile"
        WRITE_OFF = "write_off"
        OVERAGE = "overage"

    reservation = models.ForeignKey(
        Reservation, on_delete=models.CASCADE, related_name="entries", db_constraint=False
    )  # written with its reservation (see Reservation)
    kind = models.CharField(max_length=12, choices=Kind.choices)
    amount_micros = models.BigIntegerField()
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
    )
    note = models.TextField(blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
