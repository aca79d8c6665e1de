from __future__ import annotations

import zoneinfo

from django.conf import settings
from django.contrib.auth.models import AbstractUser, Group
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from tenants.crypto import decrypt, encrypt

QUOTA_WEIGHT_MAX = 1000


def validate_time_zone(value: str) -> None:
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValidationError(f"unknown time zone {value!r}") from None


class Tenant(models.Model):
    """Isolation boundary. Money is in micro-units of the budget currency (1 USD = 1,000,000)."""

    class OnBudgetExhausted(models.TextChoices):
        STOP = "stop"
        PAUSE = "pause"

    class OnKilledTool(models.TextChoices):
        PAUSE = "pause"  # the run waits, its call kept, until the switch goes off
        UNAVAILABLE = "unavailable"  # the call is answered "unavailable" and the model goes on

    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    time_zone = models.CharField(max_length=64, default="UTC", validators=[validate_time_zone])
    daily_budget_micros = models.BigIntegerField(default=50_000_000)
    # What its people read amounts in, at a fixed rate from the platform currency (core/money.py).
    currency = models.CharField(max_length=3, default="USD")
    exchange_rate = models.DecimalField(max_digits=18, decimal_places=6, default=1)
    user_daily_budget_micros = models.BigIntegerField(null=True, blank=True)
    on_budget_exhausted = models.CharField(
        max_length=8, choices=OnBudgetExhausted.choices, default=OnBudgetExhausted.STOP
    )
    # A kill switch on a tool: what a run about to call it does (runs/controls/kill_switches.py).
    on_killed_tool = models.CharField(max_length=12, choices=OnKilledTool.choices, default=OnKilledTool.PAUSE)
    # Whether time spent paused counts toward a run's max_wall_seconds (runs/controls/pausing.py).
    paused_time_counts = models.BooleanField(default=False)
    max_active_runs = models.PositiveIntegerField(default=100)
    max_starts_per_minute = models.PositiveIntegerField(default=60)  # per user
    approval_ttl_seconds = models.PositiveIntegerField(default=24 * 3600)
    # A reason is always needed to deny a call; with this, to approve one too (approvals/services.py).
    approval_reason_required = models.BooleanField(default=False)
    # Caps on what an agent version may ask for; runs are never unbounded.
    max_steps_cap = models.PositiveIntegerField(default=100)
    max_tool_calls_cap = models.PositiveIntegerField(default=50)
    max_wall_seconds_cap = models.PositiveIntegerField(default=3 * 24 * 3600)
    max_output_tokens_cap = models.PositiveIntegerField(default=8192)
    # Moved by a database trigger on every write of the tenant's secrets, in the writing transaction
    # (migration 0005): the workers' cache of decrypted values is keyed by it (tenants/secrets.py).
    secrets_generation = models.PositiveBigIntegerField(default=0, editable=False)
    max_cost_micros_cap = models.BigIntegerField(default=10_000_000)
    # The tenant's share of a model provider's quota when several tenants wait for it
    # (llm/quotas.py): a tenant of weight 2 gets twice the calls of a tenant of weight 1.
    quota_weight = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(QUOTA_WEIGHT_MAX)]
    )
    # Hosts the tenant's tool servers and model endpoints may reach (`host`, `host:port`,
    # `*.domain`), checked by `manage.py apply`; null: not restricted.
    egress_hosts = models.JSONField(null=True, blank=True)
    # Retention of runs' content (history/retention.py, docs/history.md): how long after a run
    # ends its content is kept (null: for ever), and per agent name a period of its own; the same
    # for the whole run (its skeleton: the run, its steps and events are deleted, a tombstone kept).
    content_retention_seconds = models.PositiveBigIntegerField(null=True, blank=True)
    content_retention_by_agent = models.JSONField(default=dict, blank=True)
    skeleton_retention_seconds = models.PositiveBigIntegerField(null=True, blank=True)
    skeleton_retention_by_agent = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        # Object permission on the tenant row: read every run of the tenant (supervisors).
        # Without it a user reads only the runs they started.
        permissions = [("view_runs", "Read every run of the tenant")]

    def __str__(self) -> str:
        return self.slug

    @property
    def zone(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.time_zone)


class User(AbstractUser):
    """A user belongs to one tenant; platform operators (superusers) may have none."""

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="users")


class TenantGroup(models.Model):
    """Ties a Django auth group to one tenant (group names are unique platform-wide)."""

    group = models.OneToOneField(Group, on_delete=models.CASCADE, related_name="tenant_link")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="groups")
    name = models.CharField(max_length=100)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_tenant_group")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"


class Secret(models.Model):
    """Encrypted at rest; referenced by name; decrypted only inside a gateway call."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="secrets")
    name = models.CharField(max_length=100)
    ciphertext = models.TextField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_secret_name")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    def set_value(self, plaintext: str) -> None:
        self.ciphertext = encrypt(plaintext, settings.SECRET_ENCRYPTION_KEYS)

    def reveal(self) -> str:
        return decrypt(self.ciphertext, settings.SECRET_ENCRYPTION_KEYS)


class ApiToken(models.Model):
    """An API bearer token. Only the sha256 of the token is stored; the token itself is shown once.

    A token authenticates while it has not expired, its user is active, and the user's password is
    the one it was issued under (`credentials`, a keyed fingerprint of the password hash), so a
    password change made anywhere (API, admin, `manage.py changepassword`, `apply`) ends it.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    digest = models.CharField(max_length=64, unique=True)
    credentials = models.CharField(max_length=64)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    # The password sign-in this token descends from; refreshes keep it, so refreshing has an end.
    signed_in_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["user", "expires_at"], name="apitoken_user_expiry")]

    def __str__(self) -> str:
        return f"token of {self.user_id} until {self.expires_at:%Y-%m-%d %H:%M}"
