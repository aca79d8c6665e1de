"""Evaluations (docs/evaluations.md, DESIGN.md section 13): datasets of cases, versioned; an
evaluation runs one agent version on every case of one dataset version and keeps each case's
result, check by check."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class Dataset(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="datasets")
    name = models.SlugField(max_length=100)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_dataset_name")]

    def __str__(self) -> str:
        return self.name


class DatasetVersion(models.Model):
    """Immutable once stored, like an agent version: a change to the cases inserts the next one."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    content_hash = models.CharField(max_length=64)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["dataset", "number"], name="uniq_dataset_version")]
        ordering = ["dataset", "number"]

    def __str__(self) -> str:
        return f"{self.dataset.name} v{self.number}"


class Case(models.Model):
    """A run input, the user it runs as, the tool results its calls are answered with, how its
    approvals are decided, and the checks its run must pass (evals/checks.py)."""

    version = models.ForeignKey(DatasetVersion, on_delete=models.CASCADE, related_name="cases")
    name = models.SlugField(max_length=100)
    input = models.JSONField()
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    # [{"tool": ..., "arguments": {...}, "result": {"text", "structured", "is_error"}} or "error": ...]
    recordings = models.JSONField(default=list, blank=True)
    # {"bank__issue_refund": "approve", "*": "deny"}: how each approval the run asks for is decided
    approvals = models.JSONField(default=dict, blank=True)
    approver = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    checks = models.JSONField(default=list, blank=True)
    tags = models.JSONField(default=list, blank=True)
    # The finished run the case was made from (add_run), if any.
    source_run = models.ForeignKey(
        "runs.Run", null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_constraint=False
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["version", "name"], name="uniq_case_name")]
        ordering = ["version", "id"]

    def __str__(self) -> str:
        return self.name


class Evaluation(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        FINISHED = "finished"
        FAILED = "failed"

    TRANSITIONS: dict[str, set[str]] = {
        Status.QUEUED: {Status.RUNNING, Status.FAILED},
        Status.RUNNING: {Status.FINISHED, Status.FAILED},
        Status.FINISHED: set(),
        Status.FAILED: set(),
    }

    class Uncovered(models.TextChoices):
        ERROR = "error"
        NEAREST = "nearest"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="evaluations")
    agent_version = models.ForeignKey("agents.AgentVersion", on_delete=models.PROTECT, related_name="+")
    dataset_version = models.ForeignKey(DatasetVersion, on_delete=models.PROTECT, related_name="evaluations")
    # The evaluation of the other version this one is compared with (both on one dataset version).
    against = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="compared_by"
    )
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED)
    uncovered = models.CharField(max_length=8, choices=Uncovered.choices, default=Uncovered.ERROR)
    budget_micros = models.BigIntegerField()
    budget_account = models.ForeignKey(
        "budgets.BudgetAccount", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    started_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    # pass rate, cases, checks, cost, steps, latency (evals.services.totals_of)
    totals = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "created_at"], name="evaluation_tenant_created")]

    def __str__(self) -> str:
        return f"{self.agent_version} on {self.dataset_version}"


class CaseResult(models.Model):
    evaluation = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="results")
    case = models.ForeignKey(Case, on_delete=models.PROTECT, related_name="+")
    run = models.ForeignKey("runs.Run", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    run_status = models.CharField(max_length=24, blank=True)
    passed = models.BooleanField(default=False)  # every deterministic check passed
    # [{"check": name, "kind": ..., "passed": bool, "detail": ..., "graded": bool}]
    checks = models.JSONField(default=list)
    uncovered = models.JSONField(default=list, blank=True)  # calls no recording covered
    cost_micros = models.BigIntegerField(default=0)
    steps = models.PositiveIntegerField(default=0)
    latency_ms = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["evaluation", "case"], name="uniq_case_result")]
        ordering = ["evaluation", "case_id"]

    def __str__(self) -> str:
        return f"{self.case.name}: {'passed' if self.passed else 'failed'}"
