"""Removing a run's content and keeping its skeleton: the one place that knows which columns are
which (docs/history.md, "Content and skeleton"). Erasure (history/erasure.py) and retention
(history/retention.py) call it with the run locked, inside `atomic_with_events`.

Content: the run's input, metadata, final output and error; every step's arguments, request,
result, observation, error and resolution; its approvals' arguments and people's texts (the
decider's, the corrector's and each dual-control vote's reason); its
artifacts' bytes and names; its events' messages and data but for the skeleton keys below.
Skeleton: everything else (ids, who, when, statuses, tools, effect classes, costs, approvals and
their deciders, policies and versions, idempotency keys, every digest, the chain).

The removal writes a `content_removed` event into the run's chain naming what went and why, so
the verifier skips those items' content check and nothing else; and a `ContentRemoval` row, so
retention does not visit the run again.
"""

from __future__ import annotations

from django.db import connection, transaction

from approvals.models import Approval, ApprovalVote
from artifacts.models import Artifact
from history import shredding, subjects
from history.models import ContentRemoval
from history.verify import REMOVED_KIND
from runs.models import Run, RunEvent, Step
from runs.transitions import record_event

ERASED = "[erased]"
# Event data the platform writes about state, never about what was said: kept by retention.
SKELETON_DATA = frozenset(
    {
        "from",
        "to",
        "step_kind",
        "tool",
        "content",
        "agent",
        "version",
        "alias",
        "expected_cost_micros",
        "decision",
        "scope",
        "approval",
        "certificate",
        "hold",
        # an identity assertion presented (runs/engine/tool_step.py): who, to whom, its jti
        "jti",
        "subject",
        "audience",
        "token_subject",
    }
)


def remove_content(
    run: Run, *, why: str, actor=None, events: list[int] | None, certificate=None, note: str
) -> None:
    """Remove the run's content. `events`: the seqs of the events to blank (erasure: those carrying
    the identifier), or None for every event's content but its skeleton keys (retention)."""
    Run.objects.filter(pk=run.pk).update(input={}, metadata={}, final_output="", error="")
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
    Artifact.objects.filter(run=run).update(content=b"", name=ERASED, sealed=False, words=[])
    # The run's key goes once this is committed (a failed erasure must not lose the content it
    # kept); if the key store cannot be reached then, history.shredding's pass destroys it later.
    transaction.on_commit(lambda: shredding.shred_quietly([run.pk]))
    if events is None:
        blanked = _blank_events(run)
    else:
        blanked = sorted(events)
        marker = {"erased": str(certificate.pk)} if certificate is not None else {}
        RunEvent.objects.filter(run=run, seq__in=blanked).update(message=ERASED, data=marker)
    record_event(
        run.pk,
        REMOVED_KIND,
        note,
        actor=actor,
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


def _blank_events(run: Run) -> list[int]:
    """Every event's message and data but its skeleton keys removed; the seqs blanked. One
    statement on PostgreSQL (a run of a thousand steps has thousands of events: one UPDATE each
    made retention's purge of a million steps take hours), an UPDATE an event elsewhere."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                """
                UPDATE runs_runevent SET message = '', data = CASE
                    WHEN jsonb_typeof(data) = 'object' THEN (
                        SELECT coalesce(jsonb_object_agg(key, value), '{}'::jsonb)
                        FROM jsonb_each(data) WHERE key = ANY(%s)
                    )
                    ELSE '{}'::jsonb END
                WHERE run_id = %s RETURNING seq
                """,
                [sorted(SKELETON_DATA), run.pk],
            )
            return sorted(seq for (seq,) in cursor.fetchall())
    blanked = []
    for event in RunEvent.objects.filter(run=run).only("pk", "seq", "data").order_by("seq"):
        data = event.data if isinstance(event.data, dict) else {}
        kept = {key: value for key, value in data.items() if key in SKELETON_DATA}
        RunEvent.objects.filter(pk=event.pk).update(message="", data=kept)
        blanked.append(event.seq)
    return blanked
