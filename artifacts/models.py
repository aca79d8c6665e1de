"""An artifact: one file of a run, its content stored once in PostgreSQL with its hash; and the
per-tenant limits on artifacts (the defaults in settings apply to a tenant without a row)."""

from __future__ import annotations

import uuid

from django.db import models

from core.words import WordHashes
from vault.fields import SealedTextField


class Artifact(models.Model):
    class Source(models.TextChoices):
        UPLOAD = "upload"
        TOOL = "tool"
        SANDBOX = "sandbox"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="artifacts")
    # The step that produced it (a tool call or run_python); none for an upload.
    step = models.ForeignKey(
        "runs.Step", null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_constraint=False
    )  # no database key: steps are partitioned by their run (history/partitions.py)
    source = models.CharField(max_length=16, choices=Source.choices)
    # Content, sealed at rest with the run's data key (vault/fields.py): a file's name can carry a
    # customer's (`statement_C-4471.pdf`). `name_key`: its keyed digest (vault.sealing.keyed_digest),
    # what the constraint below compares.
    name = SealedTextField(run="run_id", tenant="tenant_id")
    name_key = models.CharField(max_length=64, blank=True, default="")
    media_type = models.CharField(max_length=100)
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    content = models.BinaryField()
    # Sealed with the run's data key (vault/): `content` is ciphertext, read through
    # artifacts.services.content_of. False: stored before sealing, or emptied by content removal.
    sealed = models.BooleanField(default=False)
    # The keyed hashes of its words (vault.sealing.word_hashes), for the data subject search:
    # sealed bytes cannot be searched in SQL (history/subjects.py). None: too many to keep
    # (artifacts.services.MAX_WORDS), the search reads it whole.
    words = WordHashes(null=True, default=list)
    # Given with the run's start request: the model's first message describes it.
    given_at_start = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            # A retried step stores the same file again: it finds this row instead of a second one.
            models.UniqueConstraint(
                fields=["run", "step", "name_key", "sha256"], name="uniq_artifact_name_per_step"
            ),
        ]
        indexes = [models.Index(fields=["run", "created_at"])]

    def __str__(self):
        return f"{self.name} ({self.media_type}, {self.size} bytes)"


class ArtifactLimits(models.Model):
    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="artifact_limits")
    max_artifact_bytes = models.BigIntegerField()
    max_run_bytes = models.BigIntegerField()
    max_run_artifacts = models.PositiveIntegerField()
