"""Every API error, whatever caused it, answers the one JSON body; input the database cannot hold is a 400.

Each probe here was an HTTP 500 with Django's HTML page before (found by schemathesis and by hand).
"""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from budgets import services as budgets
from runs.models import Run
from runs.services import start_run
from tests import factories

pytestmark = pytest.mark.django_db


def api(user=None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_authenticate(user)
    return client


def raw(client: APIClient, method: str, path: str, body: bytes | str):
    return client.generic(method, path, body, content_type="application/json")


def assert_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture
def agent(tenant, builtins):
    return factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])


def test_text_the_database_cannot_hold_is_refused_in_bodies_and_query_strings(asha, agent):
    nul = api(asha).post("/v1/runs", {"agent": "agent", "input": {"q": "a\u0000b"}}, format="json")
    assert "input.q" in assert_error(nul, 400, "parse_error")["message"]
    surrogate = raw(api(asha), "POST", "/v1/runs", '{"agent": "agent", "input": "\\ud800"}')
    assert_error(surrogate, 400, "parse_error")
    key = raw(api(asha), "POST", "/v1/runs", '{"agent": "agent", "input": {"a\\u0000": 1}}')
    assert_error(key, 400, "parse_error")
    assert_error(api(asha).get("/v1/runs?agent=a%00b"), 400, "bad_request")
    assert_error(api(asha).get("/v1/approvals?tool=%00"), 400, "bad_request")
    assert not Run.objects.exists()


def test_deep_large_and_non_finite_json_is_refused(asha, agent, settings):
    deep = "[" * 5000 + "]" * 5000
    assert_error(
        raw(api(asha), "POST", "/v1/runs", f'{{"agent": "agent", "input": {deep}}}'), 400, "parse_error"
    )
    nested = json.dumps({"agent": "agent", "input": json.loads("[" * 70 + "]" * 70)})
    assert "nested more than 64" in assert_error(raw(api(asha), "POST", "/v1/runs", nested), 400)["message"]
    for number in ("NaN", "Infinity", "-Infinity", "1e400"):
        body = f'{{"agent": "agent", "input": {{"x": {number}}}}}'
        assert_error(raw(api(asha), "POST", "/v1/runs", body), 400, "parse_error")
    settings.API_MAX_BODY_BYTES = 10_000
    big = json.dumps({"agent": "agent", "input": "x" * 20_000})
    assert_error(raw(api(asha), "POST", "/v1/runs", big), 413, "too_large")
    assert_error(raw(api(asha), "POST", "/v1/runs", "{not json"), 400, "parse_error")
    assert not Run.objects.exists()


def test_numbers_in_query_strings_are_bounded(asha, agent):
    run = api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json").json()
    # "²".isdigit() is True but int("²") raises: both were 500s.
    assert (
        "after"
        in assert_error(api(asha).get(f"/v1/runs/{run['id']}/events?after=²"), 400, "invalid")["fields"]
    )
    assert "days" in assert_error(api(asha).get("/v1/usage?days=²"), 400, "invalid")["fields"]
    assert (
        "after" in assert_error(api(asha).get(f"/v1/runs/{run['id']}/events?after={10**30}"), 400)["fields"]
    )
    assert "limit" in assert_error(api(asha).get(f"/v1/runs?limit={10**30}"), 400, "invalid")["fields"]
    assert "offset" in assert_error(api(asha).get(f"/v1/runs?offset={10**30}"), 400, "invalid")["fields"]
    assert "limit" in assert_error(api(asha).get("/v1/reservations?limit=0"), 400, "invalid")["fields"]
    assert "status" in assert_error(api(asha).get("/v1/runs?status=nope"), 400, "invalid")["fields"]
    page = api(asha).get("/v1/runs?limit=200&offset=0")
    assert page.status_code == 200 and page.json()["count"] == 1


def test_names_longer_than_their_columns_are_a_400(asha, ravi, agent):
    long_alias = api(ravi).put("/v1/agents/agent/aliases/" + "a" * 51, {"version": 1}, format="json")
    assert assert_error(long_alias, 400, "invalid")["fields"] == {"alias": ["at most 50 characters"]}
    long_agent = api(asha).post("/v1/runs", {"agent": "a" * 101, "input": {}}, format="json")
    assert "agent" in assert_error(long_agent, 400, "invalid")["fields"]
    spec = {"model": "scripted", "instructions": "x"}
    assert_error(
        api(ravi).post(f"/v1/agents/{'b' * 101}/versions", {"spec": spec}, format="json"), 400, "invalid"
    )
    huge_version = api(ravi).put("/v1/agents/agent/aliases/prod", {"version": 10**30}, format="json")
    assert "version" in assert_error(huge_version, 400, "invalid")["fields"]


def test_a_reconciled_charge_is_bounded(tenant, asha, ravi, agent):
    started, _ = start_run(user=asha, agent="agent", input={})
    held = budgets.reserve(tenant=tenant, run=started, user=asha, amount_micros=5_000, purpose="model")
    budgets.hold(held.pk)
    path = f"/v1/reservations/{held.pk}/reconcile"
    for actual in (10**30, 9e18, 9_000_000_000_000_000_000):
        answer = api(ravi).post(path, {"actual_micros": actual, "note": "usage export"}, format="json")
        assert "actual_micros" in assert_error(answer, 400, "invalid")["fields"]
    too_much = api(ravi).post(path, {"actual_micros": 50_001, "note": "usage export"}, format="json")
    assert "actual_micros" in assert_error(too_much, 400, "invalid")["fields"]
    held.refresh_from_db()
    assert held.status == "held"
    ok = api(ravi).post(path, {"actual_micros": 50_000, "note": "usage export"}, format="json")
    assert ok.status_code == 200 and ok.json()["actual_micros"] == 50_000


def test_routes_methods_and_authentication_errors_have_the_json_body(asha):
    assert_error(api(asha).get("/v1/no-such-route"), 404, "not_found")
    assert_error(api().get("/v1/runs/x/y/z"), 404, "not_found")
    assert_error(api(asha).delete("/v1/runs"), 405, "method_not_allowed")
    assert_error(api().get("/v1/runs"), 401, "not_authenticated")
    bad_token = APIClient()
    bad_token.credentials(HTTP_AUTHORIZATION="Bearer nope")
    assert_error(bad_token.get("/v1/runs"), 401, "authentication_failed")
    form = api(asha).post("/v1/runs", "agent=x", content_type="application/x-www-form-urlencoded")
    assert_error(form, 415, "unsupported_media_type")
    assert_error(api(asha).get("/v1/runs/not-a-uuid"), 404, "not_found")


def test_an_unexpected_error_is_a_logged_json_500_without_a_traceback(asha, monkeypatch, caplog):
    from runs import selectors

    def broken(*args, **kwargs):
        raise RuntimeError("database exploded: secret detail")

    monkeypatch.setattr(selectors, "runs_for", broken)
    answer = api(asha).get("/v1/runs")
    error = assert_error(answer, 500, "internal_error")
    assert "secret detail" not in json.dumps(error) and "Traceback" not in answer.content.decode()
    assert "database exploded" in caplog.text


def test_django_level_errors_under_v1_are_json_and_elsewhere_html(rf):
    from django.core.exceptions import RequestDataTooBig, SuspiciousOperation

    from core import errors

    assert errors.bad_request(rf.post("/v1/runs"), RequestDataTooBig()).status_code == 413
    assert (
        json.loads(errors.bad_request(rf.get("/v1/runs"), SuspiciousOperation()).content)["error"]["code"]
        == "bad_request"
    )
    assert json.loads(errors.server_error(rf.get("/v1/runs")).content)["error"]["code"] == "internal_error"
    assert json.loads(errors.page_not_found(rf.get("/v1/x"), None).content)["error"]["code"] == "not_found"
    assert b"<" in errors.page_not_found(rf.get("/admin/x"), None).content


@pytest.mark.parametrize("field", ["input", "metadata"])
@pytest.mark.parametrize("value", ["refund TXN-1001", [1, 2], 7, None])
def test_run_input_and_metadata_that_are_not_json_objects_are_refused_by_field(asha, agent, field, value):
    body = {"agent": "agent", "input": {"q": "hello"}, field: value}
    error = assert_error(api(asha).post("/v1/runs", body, format="json"), 400, "invalid")
    assert list(error["fields"]) == [field]
    assert not Run.objects.exists()
