"""Reads of artifacts. An artifact is readable by whoever may read its run: callers pass the run
(runs.selectors.get_run) or the runs the user may read (runs.selectors.runs_for), so the rule
stays the run selectors' own and another tenant's artifact answers 404."""

from __future__ import annotations

import uuid

from artifacts.models import Artifact
from core.errors import NotFound


def artifacts_of(run):
    return Artifact.objects.filter(run=run).defer("content").order_by("created_at", "pk")


def get_artifact(readable_runs, artifact_id, *, with_content: bool = False) -> Artifact:
    rows = Artifact.objects.filter(run__in=readable_runs)
    if not with_content:
        rows = rows.defer("content")
    try:
        return rows.get(pk=uuid.UUID(str(artifact_id)))
    except (Artifact.DoesNotExist, ValueError):
        raise NotFound("artifact") from None
