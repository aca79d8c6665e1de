"""Removing a run's content and keeping its skeleton: the one place that knows which columns are
which (docs/history.md, "Content and skeleton"). Erasure (history/erasure.py) and retention
(history/retention.py) call it with the run locked, inside `atomic_with_events`.

Content: the run's input, metadata (and the search's keyed words of them), final output and
error; every step's arguments, request, result, observation, error and resolution; its approvals'
arguments and people's texts (the decider's, the corrector's and each dual-control vote's reason);
its artifacts' bytes and names; its events' messages and data (their keys about the platform's own
state are kept apart in the clear: runs.models.EVENT_SKELETON, the events' `skeleton`).
Skeleton: everything else (ids, who, when, statuses, tools, effect classes, costs, approvals and
their deciders, policies and versions, idempotency keys, every digest, the chain).

The removal writes a `content_removed` event into the run's chain naming what went and why, so
the verifier skips those items' content check and nothing else; and a `ContentRemoval` row, so
retention does not visit the run again.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import CharField
from django.db.models.functions import Cast

from approvals.models import Approval, ApprovalVote
from artifacts.models import Artifact
from history import shredding, subjects
from history.models import ContentRemoval
from history.verify import REMOVED_KIND
from runs.models import Run, RunEvent, Step
from runs.transitions import record_event


def remove_content(
    run: Run, *, why: str, actor=None, events: list[int] | None, certificate=None, note: str
) -> None:
    """Remove the run's content. Every event's message and data go (its skeleton stays);
    `events`: the seqs of the events whose skeleton goes too, for the certificate's marker
    (erasure: those carrying the identifier), or None (retention)."""
    Run.objects.filter(pk=run.pk).update(input={}, metadata={}, search_words=None, final_output="", error="")
    steps = list(Step.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    Step.objects.filter(run=run).update(
        arguments=None, request=None, result=None, observation="", error="", resolution=""
    )
    approvals = [str(a) for a in Approval.objects.filter(run=run).values_list("pk", flat=True)]
    Approval.objects.filter(run=run).update(
        arguments={}, original_arguments=None, decision_reason="", correction_reason="", void_reason=""
    )
    ApprovalVote.objects.filter(approval__run=run).update(reason="")
    artifacts = [str(a) for a in Artifact.objects.filter(run=run).values_list("pk", flat=True)]
    # The name's keyed digest goes too (the tenant's word key outlives the run's): its own id
    # keeps the row unique beside an artifact of the same bytes and step.
    Artifact.objects.filter(run=run).update(
        content=b"", name="", name_key=Cast("id", CharField()), sealed=False, words=[]
    )
    # The run's key goes once this is committed (a failed erasure must not lose the content it
    # kept); if the key store cannot be reached then, history.shredding's pass destroys it later.
    transaction.on_commit(lambda: shredding.shred_quietly([run.pk]))
    of_run = RunEvent.objects.filter(run=run)
    blanked = sorted(of_run.values_list("seq", flat=True))
    of_run.update(message="", data={})
    if events:
        marker = {"erased": str(certificate.pk)} if certificate is not None else {}
        of_run.filter(seq__in=events).update(skeleton=marker)
    # All skeleton (its note too): the run's key goes, and what stays must still match its digest.
    record_event(
        run.pk,
        REMOVED_KIND,
        actor=actor,
        note=note,
        why=why,
        certificate=str(certificate.pk) if certificate is not None else None,
        run=True,
        steps=steps,
        events=blanked,
        approvals=approvals,
        artifacts=artifacts,
    )
    ContentRemoval.objects.update_or_create(run_id=run.pk, defaults={"why": why, "certificate": certificate})
    subjects.forget(run.pk)
