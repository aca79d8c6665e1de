"""Regions (DESIGN.md section 9): where a tenant may run, and the escrow of its day budget.

Home side (the tenant's home region keeps these): `SliceMove`, one row per grant or return a
region asked for, unique by the region's request id (a repeated request finds its row and gets
the same answer), and `RegionDay`, per tenant, region and day the running totals the home lends
by (outstanding = granted - returned) and what the region last reported spending and holding.

Region side (every other region keeps these): `SliceRequest`, one row per grant or return this
region asked of the home, pending until the home answered; the region's tenant-day accounts
(budgets/) have as their limit exactly the slices it was granted less what it returned.
`HomeLink` is this region's view of the link to a tenant's home (up or down, since when, the
home's free room at its last answer).
"""

from __future__ import annotations

import datetime as dt
import uuid

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone


def here() -> str:
    """This deployment's region name; "" for a deployment with no regions (every tenant is home)."""
    return settings.REGION_NAME


class TenantRegions(models.Model):
    """Where a tenant's runs may execute and which region's ledger is authoritative.

    A tenant without this row lives wherever the deployment is: home everywhere, as before regions.
    """

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="regions")
    home = models.CharField(max_length=40)
    allowed = models.JSONField(
        default=list, help_text="region names where runs may start (the home included)"
    )
    # How much a region asks for at once, and keeps at hand; 0: a tenth of the daily budget.
    slice_micros = models.BigIntegerField(default=0)
    # The most of the day one region other than the home may hold at once (outstanding slices),
    # in percent of the daily budget: no region can take the whole day from the others.
    away_share_percent = models.PositiveSmallIntegerField(
        default=50, validators=[MinValueValidator(1), MaxValueValidator(100)]
    )
    # The oldest copy of authority a non-home region may act on (DESIGN.md section 9).
    revocation_reach_seconds = models.FloatField(default=5.0)

    class Meta:
        verbose_name_plural = "tenant regions"

    def __str__(self) -> str:
        return f"{self.tenant_id}: home {self.home}, runs in {', '.join(self.allowed)}"

    def clean(self) -> None:
        if self.home not in self.allowed:
            raise ValidationError({"allowed": f"the home region {self.home!r} must be among the allowed"})

    @classmethod
    def of(cls, tenant) -> TenantRegions | None:
        return cls.objects.filter(tenant_id=tenant.pk).first()

    def slice_size(self, daily_budget_micros: int) -> int:
        return self.slice_micros or max(daily_budget_micros // 10, 1)

    def user_slice_size(self, daily_budget_micros: int, user_daily_budget_micros: int) -> int:
        """A user's slice: the tenant's slice (sized to carry several calls), at most the user's day."""
        return max(min(self.slice_size(daily_budget_micros), user_daily_budget_micros), 1)


def is_home(tenant) -> bool:
    """Whether this deployment's ledger is authoritative for the tenant's day."""
    if not here():  # a deployment without regions: no query on the step path
        return True
    config = TenantRegions.of(tenant)
    return config is None or config.home == here()


class Heartbeat(models.Model):
    """A region's heartbeat, written at home every REGION_HEARTBEAT_SECONDS and replicated to the
    other regions with the authority tables (regions/replication.py): a region's copy of its
    home's authority is as old as the newest home heartbeat it holds."""

    # Keyed by the region's name, not a local sequence: a region holds its own row and, by
    # replication, its home's, and two sequences would hand out the same id.
    region = models.CharField(max_length=40, primary_key=True)
    beat_at = models.DateTimeField()


def authority_age(config: TenantRegions) -> float | None:
    """Seconds since the home's newest heartbeat this region holds (None: none yet)."""
    beat_at = Heartbeat.objects.filter(region=config.home).values_list("beat_at", flat=True).first()
    return None if beat_at is None else max((timezone.now() - beat_at).total_seconds(), 0.0)


class SliceMove(models.Model):
    """Home side: one grant or return a region asked for, by its request id (idempotency).

    With `user`, a slice of that user's day (Tenant.user_daily_budget_micros) instead of the
    tenant's: the same escrow, on the user's day account."""

    class Kind(models.TextChoices):
        GRANT = "grant"
        RETURN = "return"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    region = models.CharField(max_length=40)
    day = models.DateField()
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    kind = models.CharField(max_length=8, choices=Kind.choices)
    request_id = models.UUIDField()
    asked_micros = models.BigIntegerField()
    moved_micros = models.BigIntegerField()  # a grant may give less than asked, down to 0
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["region", "request_id"], name="uniq_slice_move_request"),
            models.CheckConstraint(condition=models.Q(moved_micros__gte=0), name="slice_move_gte_0"),
        ]
        indexes = [models.Index(fields=["tenant", "region", "day"], name="slice_move_day")]


class RegionDay(models.Model):
    """Home side: what a region holds of a tenant's day (or, with `user`, of that user's day).
    Moved with F() in the move's transaction."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    region = models.CharField(max_length=40)
    day = models.DateField()
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    granted_micros = models.BigIntegerField(default=0)
    returned_micros = models.BigIntegerField(default=0)
    # The region's own figures at its last report (its slice's spent, reserved, held).
    reported_spent_micros = models.BigIntegerField(default=0)
    reported_reserved_micros = models.BigIntegerField(default=0)
    reported_held_micros = models.BigIntegerField(default=0)
    reported_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "region", "day"], condition=models.Q(user=None), name="uniq_region_day"
            ),
            models.UniqueConstraint(
                fields=["tenant", "region", "day", "user"],
                condition=models.Q(user__isnull=False),
                name="uniq_region_user_day",
            ),
            models.CheckConstraint(
                condition=models.Q(returned_micros__lte=models.F("granted_micros")),
                name="region_day_returned_lte_granted",
            ),
        ]

    @property
    def outstanding_micros(self) -> int:
        """Lent and not given back: counted as spent at home until returned."""
        return self.granted_micros - self.returned_micros


class SliceRequest(models.Model):
    """Region side: a grant or return asked of the home; pending until its answer is applied."""

    class Status(models.TextChoices):
        PENDING = "pending"
        APPLIED = "applied"

    TRANSITIONS = {Status.PENDING: {Status.APPLIED}, Status.APPLIED: set()}

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)  # the request id
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    day = models.DateField()
    user = models.ForeignKey(  # a slice of this user's day; None: of the tenant's
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    kind = models.CharField(max_length=8, choices=SliceMove.Kind.choices)
    asked_micros = models.BigIntegerField()
    moved_micros = models.BigIntegerField(null=True, blank=True)  # the home's answer
    # What the home had left to lend (of the user's day, for a user's slice) after answering:
    # 0 says the user's day is spent everywhere (runs refused on it follow the tenant's rule).
    home_free_micros = models.BigIntegerField(null=True, blank=True)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["tenant", "created_at"],
                name="slice_request_pending",
                condition=models.Q(status="pending"),
            )
        ]


class HomeLink(models.Model):
    """Region side: the link to a tenant's home as last seen by this region's slice keeper."""

    class State(models.TextChoices):
        UP = "up"
        DOWN = "down"

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    state = models.CharField(max_length=4, choices=State.choices, default=State.UP)
    since = models.DateTimeField()
    last_ok_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    # The home's free room for the day at its last answer: 0 means the tenant's day is spent
    # everywhere, not that the link is slow.
    home_free_micros = models.BigIntegerField(null=True, blank=True)
    home_day = models.DateField(null=True, blank=True)
    refill_ms = models.FloatField(null=True, blank=True)  # the last grant's round trip


class HomeAnswer(models.Model):
    """Region side: what the home answered for one tool call asked while this region's copy of
    its authority was older than the tenant's reach (regions.services.ask_home). The claim acts on
    it (runs/authority_copy.home_answer) until `asked_at` + the reach: the home decided after
    this region asked, so the answer is at least as fresh as a copy that age."""

    class Verdict(models.TextChoices):
        ACT = "act"  # granted at home, no switch on, the policies here are the home's version
        DENY = "deny"  # not held at home: the call is denied with `reason`
        WAIT = "wait"  # a switch on at home, or a change not yet here: wait for the copy

    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="+")
    step_seq = models.PositiveIntegerField()
    asked_at = models.DateTimeField()
    verdict = models.CharField(max_length=4, choices=Verdict.choices)
    reason = models.TextField(blank=True)
    # The tenant's policy version the home answered with (None: it has none); the claim acts only
    # while this region's copy holds the same version (its policies are then the home's).
    policy_version = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        # One answer per call, the latest: a call that waits is asked again on each keeper pass.
        constraints = [models.UniqueConstraint(fields=["run", "step_seq"], name="uniq_home_answer_call")]


def of_user(user_id: int | None) -> models.Q:
    """The rows of one user's day (None: the tenant's day's, which name no user)."""
    return models.Q(user__isnull=True) if user_id is None else models.Q(user_id=user_id)


def user_home_free(tenant, day: dt.date, user_id: int) -> int | None:
    """What the home had left of the user's day at its last answer today (None: not asked yet)."""
    return (
        SliceRequest.objects.filter(
            tenant=tenant,
            day=day,
            user_id=user_id,
            kind=SliceMove.Kind.GRANT,
            status=SliceRequest.Status.APPLIED,
        )
        .order_by("-answered_at")
        .values_list("home_free_micros", flat=True)
        .first()
    )
