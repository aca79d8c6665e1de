"""The runs and agents REST API: admission, idempotency, tenancy, errors, schema."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from core.errors import DomainError
from runs.models import Run
from runs.services import start_run
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def api(user=None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_authenticate(user)
    return client


@pytest.fixture
def agent(tenant, builtins):
    return factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])


def test_it_issues_a_token_and_rejects_wrong_passwords(asha):
    ok = api().post("/v1/auth/token", {"username": "asha", "password": "pw"}, format="json")
    assert ok.status_code == 200
    token = ok.json()["token"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/v1/runs").status_code == 200
    bad = api().post("/v1/auth/token", {"username": "asha", "password": "nope"}, format="json")
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_credentials"
    assert api().get("/v1/runs").status_code in (401, 403)


def test_it_replays_the_same_run_for_the_same_key_and_body(asha, agent):
    body = {"agent": "agent", "input": {"q": "refund"}}
    first = api(asha).post("/v1/runs", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    again = api(asha).post("/v1/runs", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert Run.objects.count() == 1


def test_it_refuses_the_same_key_with_a_different_body(asha, agent):
    api(asha).post(
        "/v1/runs", {"agent": "agent", "input": {"q": 1}}, format="json", HTTP_IDEMPOTENCY_KEY="k1"
    )
    other = api(asha).post(
        "/v1/runs", {"agent": "agent", "input": {"q": 2}}, format="json", HTTP_IDEMPOTENCY_KEY="k1"
    )
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert Run.objects.count() == 1


def test_it_scopes_keys_to_the_user(tenant, asha, agent):
    bea = factories.make_user(tenant, "bea")
    factories.grant_run_agent(agent.agent, bea)
    body = {"agent": "agent", "input": {"q": 1}}
    a = api(asha).post("/v1/runs", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    b = api(bea).post("/v1/runs", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]


def test_it_answers_409_to_a_concurrent_duplicate(asha, agent):
    inserted = threading.Event()
    outcome = {}

    def first():
        with transaction.atomic():
            start_run(user=asha, agent="agent", input={"q": 1}, idempotency_key="k1")
            inserted.set()
            threading.Event().wait(1.0)  # keep the insert uncommitted while the twin arrives
        connection.close()

    def second():
        inserted.wait(10)
        try:
            start_run(user=asha, agent="agent", input={"q": 1}, idempotency_key="k1")
            outcome["status"] = 201
        except DomainError as exc:
            outcome["status"], outcome["code"] = exc.status, exc.code
        finally:
            connection.close()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert outcome == {"status": 409, "code": "idempotency_key_in_flight"}
    assert Run.objects.count() == 1


def test_it_gives_field_errors_for_bad_input(asha, agent):
    response = api(asha).post("/v1/runs", {"alias": "prod", "version": 1, "input": {}}, format="json")
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert "agent" in fields
    both = api(asha).post(
        "/v1/runs", {"agent": "agent", "alias": "prod", "version": 1, "input": {}}, format="json"
    )
    assert both.status_code == 400 and "version" in both.json()["error"]["fields"]
    missing = api(asha).post("/v1/runs", {"agent": "nope", "input": {}}, format="json")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert Run.objects.count() == 0


def test_it_hides_other_tenants_runs(asha, agent):
    run = api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json").json()
    other_tenant = factories.make_tenant("globex")
    outsider = factories.make_user(other_tenant, "olga")
    for path in ("", "/steps", "/events"):
        response = api(outsider).get(f"/v1/runs/{run['id']}{path}")
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
    assert api(outsider).post(f"/v1/runs/{run['id']}/cancel", {}, format="json").status_code == 404
    assert api(outsider).get("/v1/runs").json()["count"] == 0
    assert api(asha).get("/v1/runs/not-a-uuid").status_code == 404


def test_it_filters_runs_by_status_agent_and_creator(tenant, asha, agent):
    api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json")
    assert api(asha).get("/v1/runs?status=queued").json()["count"] == 1
    assert api(asha).get("/v1/runs?status=succeeded").json()["count"] == 0
    assert api(asha).get("/v1/runs?agent=agent&created_by=asha").json()["count"] == 1
    assert api(asha).get("/v1/runs?created_by=someone").json()["count"] == 0


def test_it_pins_the_version_resolved_at_admission(tenant, asha, ravi, agent, builtins):
    run = api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json").json()
    assert run["version"] == 1
    spec = dict(agent.spec, instructions="Be brief.")
    created = api(ravi).post("/v1/agents/agent/versions", {"spec": spec}, format="json")
    assert created.status_code == 201 and created.json()["number"] == 2
    moved = api(ravi).put("/v1/agents/agent/aliases/prod", {"version": 2}, format="json")
    assert moved.status_code == 200
    assert api(asha).get(f"/v1/runs/{run['id']}").json()["version"] == 1
    assert api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json").json()["version"] == 2
    canary = api(asha).post("/v1/runs", {"agent": "agent", "version": 1, "input": {}}, format="json")
    assert canary.json()["version"] == 1


def test_it_validates_agent_specs_with_field_paths(tenant, ravi, asha, agent):
    bad = {
        "model": "missing",
        "instructions": "",
        "tools": ["platform__echo", "nope"],
        "limits": {"max_steps": 10_000, "max_tool_calls": -1},
    }
    response = api(ravi).post("/v1/agents/agent/versions", {"spec": bad}, format="json")
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert set(fields) >= {"model", "instructions", "tools[1]", "limits.max_steps", "limits.max_tool_calls"}
    assert "tenant cap" in fields["limits.max_steps"][0]
    assert api(asha).post("/v1/agents/agent/versions", {"spec": agent.spec}, format="json").status_code == 403
    same = api(ravi).post("/v1/agents/agent/versions", {"spec": agent.spec}, format="json")
    assert same.status_code == 200 and same.json()["number"] == 1
    listed = api(asha).get("/v1/agents/agent/versions").json()
    assert [v["number"] for v in listed] == [1] and listed[0]["content_hash"] == agent.content_hash
    assert api(asha).get("/v1/agents/agent/versions/1").json()["spec"] == agent.spec


def test_it_serves_the_openapi_schema_and_docs(asha):
    schema = api(asha).get("/v1/schema")
    assert schema.status_code == 200
    assert b"/v1/runs/{run_id}/cancel" in schema.content
    assert api(asha).get("/v1/docs").status_code == 200


def test_it_lets_only_the_creator_or_staff_cancel(tenant, asha, ravi, agent):
    run = api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json").json()
    bea = factories.make_user(tenant, "bea")  # may not even read the run
    assert api(bea).post(f"/v1/runs/{run['id']}/cancel", {}, format="json").status_code == 404
    reader = factories.make_user(tenant, "rita", view_runs=True)  # reads every run, is not staff
    refused = api(reader).post(f"/v1/runs/{run['id']}/cancel", {}, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_run_owner"
    assert Run.objects.get(pk=run["id"]).status == "queued"
    cancelled = api(asha).post(f"/v1/runs/{run['id']}/cancel", {"reason": "typo"}, format="json")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    again = api(ravi).post(f"/v1/runs/{run['id']}/cancel", {}, format="json")
    assert again.status_code == 200
