"""Who may start an agent (run_agent) and who may read a run (its creator, view_runs) (issue #12, item 4)."""

from __future__ import annotations

import pytest
from guardian.shortcuts import remove_perm
from rest_framework.test import APIClient

from budgets.models import Reservation
from runs.engine import advance
from runs.models import Run, RunStatus, Step, StopReason
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def agents(tenant):
    return factories.make_group(tenant, "support-agents")


def test_starting_an_agent_needs_run_agent(tenant, asha, agents):
    version = factories.make_agent(tenant, turns=[{"text": "hi"}], runners=())
    body = {"agent": "agent", "input": {"q": 1}}

    refused = api(asha).post("/v1/runs", body, format="json")

    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "not_permitted"
    assert not Run.objects.exists() and not Reservation.objects.exists()
    factories.grant_run_agent(version.agent, agents)  # through a group
    asha.groups.add(agents)
    assert api(asha).post("/v1/runs", body, format="json").status_code == 201


def test_a_run_whose_user_lost_run_agent_stops_before_its_next_model_call(tenant, asha, agents, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    asha.groups.add(agents)
    version = factories.make_agent(
        tenant,
        tools=[echo],
        runners=[agents],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"say": "one"}}]}, {"text": "all done"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    advance(run.pk)  # the first model call proposes the tool call
    assert list(Step.objects.filter(run=run).values_list("kind", flat=True)) == ["model", "tool"]

    remove_perm("agents.run_agent", agents, version.agent)
    run = drive(run.pk)

    assert (run.status, run.stop_reason) == (RunStatus.STOPPED, StopReason.RUN_AGENT_REVOKED)
    assert [(s.kind, s.status) for s in Step.objects.filter(run=run).order_by("seq")] == [
        ("model", "succeeded"),
        ("tool", "succeeded"),
    ]  # no second model call
    assert Reservation.objects.filter(run=run, purpose="model").count() == 1  # nothing reserved for it
    assert run.budget.reserved_micros == 0


def test_a_run_is_readable_by_its_creator_and_by_view_runs_holders_only(tenant, asha, builtins):
    factories.make_agent(tenant, turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    bea = factories.make_user(tenant, "bea")  # same tenant, no view_runs
    kiran = factories.make_user(tenant, "kiran", staff=True, view_runs=False)
    meera = factories.make_user(tenant, "meera", view_runs=True)  # a supervisor

    for path in ("", "/steps", "/events"):
        assert api(asha).get(f"/v1/runs/{run.pk}{path}").status_code == 200
        assert api(meera).get(f"/v1/runs/{run.pk}{path}").status_code == 200
        for outsider in (bea, kiran):
            response = api(outsider).get(f"/v1/runs/{run.pk}{path}")
            assert response.status_code == 404, (outsider, path)
            assert response.json()["error"]["code"] == "not_found"
    assert api(bea).post(f"/v1/runs/{run.pk}/cancel", {}, format="json").status_code == 404
    assert api(bea).get("/v1/runs").json()["count"] == 0
    assert [r["id"] for r in api(meera).get("/v1/runs").json()["results"]] == [str(run.pk)]


def test_view_runs_granted_to_a_group_reads_every_run_of_the_tenant(tenant, asha):
    supervisors = factories.make_group(tenant, "supervisors")
    factories.grant_view_runs(tenant, supervisors)
    bea = factories.make_user(tenant, "bea")
    factories.make_agent(tenant, turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    assert api(bea).get(f"/v1/runs/{run.pk}").status_code == 404

    bea.groups.add(supervisors)

    assert api(bea).get(f"/v1/runs/{run.pk}").status_code == 200


def test_the_admin_shows_run_pages_only_to_the_creator_and_view_runs_holders(client, tenant, asha):
    from django.contrib.auth.models import Permission

    factories.make_agent(tenant, turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    perms = Permission.objects.filter(codename__in=["view_run", "change_run"])
    kiran = factories.make_user(tenant, "kiran", staff=True, view_runs=False)
    meera = factories.make_user(tenant, "meera", staff=True)
    for user in (kiran, meera):
        user.user_permissions.add(*perms)
    pages = [f"/admin/runs/run/{run.pk}/change/", f"/admin/runs/run/{run.pk}/history/"]

    client.force_login(kiran)
    assert [client.get(url).status_code for url in pages] == [404, 404]
    assert client.post(f"/admin/runs/run/{run.pk}/steps/1/resolve/").status_code == 404
    assert list(client.get("/admin/runs/run/").context["cl"].result_list) == []
    client.force_login(meera)
    assert [client.get(url).status_code for url in pages] == [200, 200]
    assert list(client.get("/admin/runs/run/").context["cl"].result_list) == [run]
