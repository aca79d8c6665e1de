"""Who may open datasets and evaluations in the admin, and add runs to a dataset: the roles of
tenants/roles.py, as docs/configuration.md's roles table says."""

from __future__ import annotations

import pytest
from django.test import Client

from evals import services
from runs.models import Run, RunStatus
from runs.services import start_run
from tenants.roles import permissions_for
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)

PAGES = {
    "datasets": "/admin/evals/dataset/",
    "dataset versions": "/admin/evals/datasetversion/",
    "evaluations": "/admin/evals/evaluation/",
    "add runs": "/admin/evals/dataset/add-runs/",
    "aliases": "/admin/agents/alias/",
}


def _with_role(tenant, name: str, role: str):
    user = factories.make_user(tenant, name, staff=True)
    user.user_permissions.set(permissions_for([role]))
    client = Client()
    client.force_login(user)
    return client


def test_supervisors_and_operators_keep_datasets_support_does_not(tenant, asha):
    services.save_dataset(
        tenant=tenant,
        dataset="smoke",
        cases=[{"name": "answers", "input": {}, "user": "asha", "checks": [{"status": "succeeded"}]}],
    )
    endpoint = factories.make_endpoint(tenant, config={"turns": [{"text": "done"}]})
    factories.make_agent(tenant, name="helper", endpoint=endpoint)
    run, _ = start_run(user=asha, agent="helper", input={})
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
    opens = {}
    for role in ("supervisor", "support", "operator"):
        client = _with_role(tenant, f"as-{role}", role)
        opens[role] = {page for page, url in PAGES.items() if client.get(url).status_code == 200}
        runs_list = client.get("/admin/runs/run/").content.decode()
        added = client.post(
            "/admin/evals/dataset/add-runs/", {"dataset": f"from-{role}", "runs": str(run.pk)}
        )
        opens[role] |= {"add_to_dataset action"} if 'value="add_to_dataset"' in runs_list else set()
        opens[role] |= {"added a run"} if added.status_code == 302 else set()

    keeps = {
        "datasets",
        "dataset versions",
        "evaluations",
        "add runs",
        "add_to_dataset action",
        "added a run",
    }
    assert opens["supervisor"] == keeps
    assert opens["operator"] == keeps | {"aliases"}
    assert opens["support"] == set()
    assert sorted(
        services.dataset_version(tenant=tenant, dataset="from-supervisor").cases.values_list(
            "source_run_id", flat=True
        )
    ) == [run.pk]
