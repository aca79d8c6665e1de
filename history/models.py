"""The run history's own records (docs/history.md): signed checkpoints over every run's chain
head, legal holds, and erasure certificates, all skeleton; and the data subject search's index,
hashes of a run's words, which go when its content goes (history/subjects.py)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from core.words import WordHashes


class Checkpoint(models.Model):
    """A signed statement: the Merkle root over every run's latest checkpointed chain head.

    `statement` is the exact text signed (canonical JSON: version, number, at, size, root,
    previous); `previous` is the SHA-256 of the previous checkpoint's statement, so the
    checkpoints form a chain of their own, and one trusted checkpoint vouches for all before it.
    The public key is kept with it: the published set drops keys an hour or so after they retire
    (authority/keys.py), a checkpoint is verified for years.
    """

    number = models.PositiveIntegerField(unique=True)
    at = models.DateTimeField()
    size = models.PositiveIntegerField()  # leaves in the tree: runs with at least one event
    root = models.CharField(max_length=64)
    previous = models.CharField(max_length=64, blank=True)
    statement = models.TextField()
    kid = models.CharField(max_length=64)
    public_jwk = models.JSONField()
    signature = models.CharField(max_length=200)  # base64url Ed25519 over `statement`

    class Meta:
        ordering = ["-number"]
        # Who may take a signed export of a tenant's runs (history/export.py).
        permissions = [("export_history", "Export signed run history")]

    def __str__(self) -> str:
        return f"checkpoint {self.number} ({self.size} runs)"


class CheckpointLeaf(models.Model):
    """A run's chain head as a checkpoint took it; written only when it moved since the run's
    previous leaf, so a checkpoint costs rows in proportion to the activity since the last one.
    No foreign key to the run: a leaf outlives a run deleted behind the platform's back, which is
    how the verifier names it."""

    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.PROTECT, related_name="leaves")
    run_id = models.UUIDField()
    event_seq = models.PositiveIntegerField()
    head = models.BinaryField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run_id", "checkpoint"], name="uniq_leaf_per_checkpoint")
        ]


class HoldScope(models.TextChoices):
    RUN = "run"
    TENANT = "tenant"
    SUBJECT = "subject"  # every run carrying the subject's identifier


class LegalHold(models.Model):
    """Suspends retention's purge and refuses erasure for what it covers, until lifted.

    Placing and lifting are the row's audit (who, when, why); a lift is one conditional update
    (lifted_at null -> set), and a run-scoped hold also writes an event into the run's chain.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    scope = models.CharField(max_length=8, choices=HoldScope.choices)
    # No database reference: the skeleton's retention deletes a run years after a hold on it was
    # lifted, and the hold's row (its audit) outlives it, naming the run's tombstone.
    run = models.ForeignKey(
        "runs.Run",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="+",
    )
    subject = models.CharField(max_length=500, blank=True)  # the exact identifier held
    reason = models.TextField()  # e.g. the matter or case number
    placed_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    placed_at = models.DateTimeField(auto_now_add=True)
    lifted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    lifted_at = models.DateTimeField(null=True, blank=True)
    lift_reason = models.TextField(blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant"], name="hold_active", condition=models.Q(lifted_at__isnull=True))
        ]
        ordering = ["-placed_at"]

    def __str__(self) -> str:
        what = {"run": f"run {self.run_id}", "tenant": "the tenant", "subject": "a data subject"}[self.scope]
        return f"legal hold {self.pk} on {what}: {self.reason}"

    @property
    def is_active(self) -> bool:
        return self.lifted_at is None


class ErasureCertificate(models.Model):
    """What one data subject request erased, when, by whom, under which request id.

    The identifier itself is not kept (keeping it would keep what was erased); its SHA-256 is, so
    that a second request for the same identifier can be shown to be the same subject. Each run
    erased also carries a `content_removed` event in its chain naming this certificate and the
    items erased.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    request_ref = models.CharField(max_length=200)  # the requester's own reference (a DSR ticket)
    identifier_digest = models.CharField(max_length=64)
    reason = models.TextField(blank=True)
    erased_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    erased_at = models.DateTimeField(auto_now_add=True)
    runs = models.JSONField(default=list)  # the run ids erased
    counts = models.JSONField(default=dict)  # items found carrying the identifier, by kind

    class Meta:
        constraints = [
            # Retried requests find the certificate the first one made.
            models.UniqueConstraint(fields=["tenant", "request_ref"], name="uniq_erasure_request")
        ]
        ordering = ["-erased_at"]

    def __str__(self) -> str:
        return f"erasure {self.request_ref} ({len(self.runs)} runs)"


class ContentRemoval(models.Model):
    """A run whose content was removed (history/content.py), by erasure or by retention."""

    class Why(models.TextChoices):
        ERASURE = "erasure"
        RETENTION = "retention"

    run = models.OneToOneField("runs.Run", on_delete=models.CASCADE, primary_key=True, related_name="+")
    why = models.CharField(max_length=12, choices=Why.choices)
    certificate = models.ForeignKey(ErasureCertificate, null=True, blank=True, on_delete=models.PROTECT)
    removed_at = models.DateTimeField(auto_now=True)


class RunTombstone(models.Model):
    """A run whose skeleton retention deleted it (history/retention.py, `purge_skeletons`).

    What remains of the run: who, what, when, its last event and chain head, and the signed
    checkpoint that first took that head. The verifier accepts the run's absence only when this
    row's head is the run's latest checkpointed leaf and that checkpoint's signed time is at least
    `period_seconds` before the purge: a run deleted behind the platform's back, or one younger
    than its period, is still named (docs/history.md, "Skeleton retention").
    """

    run_id = models.UUIDField(primary_key=True)  # no reference: the run is gone
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    agent = models.CharField(max_length=100)
    created_by = models.CharField(max_length=150)  # the username
    status = models.CharField(max_length=24)
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)
    cost_micros = models.BigIntegerField(default=0)
    steps = models.PositiveIntegerField(default=0)
    event_seq = models.PositiveIntegerField()
    chain_head = models.BinaryField()
    # The checkpoint that first took the run's final head (null: the run had no event to chain).
    checkpoint = models.ForeignKey(Checkpoint, null=True, on_delete=models.PROTECT, related_name="+")
    period_seconds = models.PositiveBigIntegerField()  # the skeleton period it was purged under
    purged_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["tenant", "finished_at"], name="tombstone_tenant_time")]
        ordering = ["-purged_at"]

    def __str__(self) -> str:
        return f"run {self.run_id} (purged {self.purged_at:%Y-%m-%d})"


class SubjectWords(models.Model):
    """The data subject search's index row of a run: the 64-bit hashes of the words of every text
    the search reads, and the run's `event_seq` when they were read. Every run has one from its
    insert (a trigger); `event_seq` null means not covered (the run is live, was never indexed,
    changed since, or its content was removed): the search reads that run whole."""

    run = models.OneToOneField("runs.Run", on_delete=models.CASCADE, primary_key=True, related_name="+")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, db_index=False, related_name="+")
    event_seq = models.PositiveIntegerField(null=True)
    words = WordHashes()

    class Meta:
        db_table = "history_subject_words"

    def __str__(self) -> str:
        return f"words of run {self.run_id}"
