from __future__ import annotations

import uuid

from core.errors import NotFound
from evals.models import DatasetVersion, Evaluation


def latest_versions(*, tenant):
    """Each dataset of the tenant at its latest version, by name."""
    return (
        DatasetVersion.objects.filter(dataset__tenant=tenant)
        .order_by("dataset__name", "dataset_id", "-number")
        .distinct("dataset__name", "dataset_id")
        .select_related("dataset")
    )


def evaluations_of(*, tenant):
    return Evaluation.objects.filter(tenant=tenant).select_related(
        "agent_version__agent", "dataset_version__dataset", "against"
    )


def get_evaluation(*, tenant, evaluation_id) -> Evaluation:
    try:
        return evaluations_of(tenant=tenant).get(pk=uuid.UUID(str(evaluation_id)))
    except (Evaluation.DoesNotExist, ValueError):
        raise NotFound("evaluation") from None
