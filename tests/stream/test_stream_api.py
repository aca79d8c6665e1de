"""Opening GET /v1/runs/{id}/stream: the same authentication, visibility and JSON errors as the rest of
the API, and resume points that are validated before anything is streamed."""

from __future__ import annotations

import uuid

import pytest
from rest_framework.test import APIClient

from runs.services import start_run
from tenants.tokens import issue_token
from tests import factories


@pytest.fixture
def run(asha, builtins, tenant):
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={"q": "hello"})
    return run


def get(path, *, token=None, scheme="Bearer", **headers):
    client = APIClient()
    if token:
        headers["HTTP_AUTHORIZATION"] = f"{scheme} {token}"
    return client.get(path, **headers)


def error_of(response) -> dict:
    assert response["Content-Type"] == "application/json", response["Content-Type"]
    return response.json()["error"]


@pytest.mark.parametrize("scheme", ["Bearer", "Token"])
def test_it_opens_an_event_stream_with_either_token_scheme(run, asha, scheme):
    response = get(
        f"/v1/runs/{run.pk}/stream",
        token=issue_token(user=asha).token,
        scheme=scheme,
        HTTP_ACCEPT="text/event-stream",
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    assert response["Cache-Control"] == "no-cache"
    assert response.streaming


def test_it_answers_401_in_json_without_a_token_or_with_a_bad_one(run):
    missing = get(f"/v1/runs/{run.pk}/stream", HTTP_ACCEPT="text/event-stream")
    assert missing.status_code == 401
    assert error_of(missing)["code"] == "not_authenticated"
    assert missing["WWW-Authenticate"].startswith("Bearer")
    bad = get(f"/v1/runs/{run.pk}/stream", token="ap_not-a-token")
    assert bad.status_code == 401
    assert error_of(bad)["code"] == "authentication_failed"


def test_it_answers_404_for_a_run_the_caller_may_not_see(run, tenant):
    colleague = factories.make_user(tenant, "kiran")  # same tenant, no view_runs, not the creator
    outsider = factories.make_user(factories.make_tenant("other-bank"), "olga", view_runs=True)
    for user in (colleague, outsider):
        response = get(f"/v1/runs/{run.pk}/stream", token=issue_token(user=user).token)
        assert response.status_code == 404
        assert error_of(response) == {"code": "not_found", "message": "run not found"}


def test_it_streams_any_run_of_the_tenant_to_a_holder_of_view_runs(run, ravi):
    assert get(f"/v1/runs/{run.pk}/stream", token=issue_token(user=ravi).token).status_code == 200


def test_it_answers_404_for_an_unknown_or_malformed_run_id(asha, tenant):
    token = issue_token(user=asha).token
    for run_id in (uuid.uuid4(), "not-a-uuid"):
        response = get(f"/v1/runs/{run_id}/stream", token=token)
        assert response.status_code == 404
        assert error_of(response)["code"] == "not_found"


def test_it_answers_403_to_a_user_of_no_tenant(run, db):
    from tenants.models import User

    operator = User.objects.create_user(username="ops", password="pw", tenant=None)
    response = get(f"/v1/runs/{run.pk}/stream", token=issue_token(user=operator).token)
    assert response.status_code == 403
    assert error_of(response)["code"] == "no_tenant"


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "", "99999999999999999999"])
def test_it_refuses_a_last_event_id_that_is_not_an_event_id(run, asha, value):
    response = get(f"/v1/runs/{run.pk}/stream", token=issue_token(user=asha).token, HTTP_LAST_EVENT_ID=value)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid"
    assert list(error["fields"]) == ["Last-Event-ID"]


def test_it_refuses_an_after_parameter_that_is_not_an_event_id(run, asha):
    response = get(f"/v1/runs/{run.pk}/stream?after=x", token=issue_token(user=asha).token)
    assert response.status_code == 400
    assert list(error_of(response)["fields"]) == ["after"]


def test_the_schema_documents_the_stream_as_server_sent_events(db):
    schema = APIClient().get("/v1/schema?format=json").json()
    operation = schema["paths"]["/v1/runs/{run_id}/stream"]["get"]
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert {p["name"] for p in operation["parameters"]} >= {"after", "Last-Event-ID"}
