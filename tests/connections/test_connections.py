"""Per-user OAuth connections to MCP servers (docs/authority-oauth.md), driven in-process against a
real authorization server and an MCP server that requires its tokens (tests/oauth_servers.py)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from budgets.models import Reservation
from connections.models import Connection, ConnectionStatus, ProtectedServer
from runs.models import Run, RunEvent, RunStatus, Step, StepStatus
from runs.recovery.sweeper import sweep
from runs.services import start_run
from tests.conftest import drive
from tests.connections.conftest import connect, statements_agent, statements_tool

pytestmark = pytest.mark.django_db(transaction=True)


def _tool_step(run) -> Step:
    return Step.objects.get(run=run, kind="tool")


def test_it_waits_for_the_users_connection_holding_nothing_then_resumes_and_finishes(
    tenant, asha, oauth_bank
):
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    statements_agent(tenant, tool)
    run, _ = start_run(user=asha, agent="cards-agent", input={})

    run = drive(run.pk)

    assert run.status == RunStatus.WAITING_AUTHORIZATION
    assert run.lease_token is None
    assert not Reservation.objects.filter(run_id=run.pk, status=Reservation.Status.OPEN).exists()
    assert _tool_step(run).status == StepStatus.AWAITING_AUTHORIZATION
    assert oauth_bank.calls() == []  # the server's 401 came at the handshake: no tool ran
    assert ProtectedServer.objects.get(server=tool.server).resource_metadata_url.endswith(
        "/.well-known/oauth-protected-resource/mcp"
    )
    waiting = RunEvent.objects.get(run=run, kind="status", skeleton__to=RunStatus.WAITING_AUTHORIZATION)
    link = f"/admin/connections/connection/connect/{tool.server_id}/"
    assert waiting.data["connect_url"].endswith(link) and link in waiting.message
    api = APIClient()
    api.force_authenticate(asha)
    streamed = api.get(f"/v1/runs/{run.pk}/events").json()
    assert any(link in event.get("message", "") for event in streamed)

    answer = connect(asha, oauth_bank)

    assert answer == {"connected": True, "server": "cards", "scopes": "statements:read", "runs_resumed": 1}
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert _tool_step(run).result["structured"]["subject"] == "asha"
    (call,) = oauth_bank.calls()
    assert call["subject"] == "asha" and call["resource"] == oauth_bank.mcp_url  # RFC 8707: its audience
    connection = Connection.objects.get(user=asha, status=ConnectionStatus.ACTIVE)
    assert connection.scopes == "statements:read" and connection.connected_at and connection.last_used_at
    # The timeline names the identity presented, so the platform's audit and the provider's join.
    presented = f"as asha through connection {connection.pk} (audience {oauth_bank.mcp_url})"
    assert any(presented in event.message for event in RunEvent.objects.filter(run=run))


def test_a_connection_made_before_the_run_is_used_at_once(tenant, asha, oauth_bank):
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    statements_agent(tenant, tool)
    connect(asha, oauth_bank)

    run, _ = start_run(user=asha, agent="cards-agent", input={})
    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert [c["subject"] for c in oauth_bank.calls()] == ["asha"]


def test_a_revoked_connection_denies_the_next_call_and_a_new_run_waits(tenant, asha, oauth_bank):
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    statements_agent(tenant, tool)
    connect(asha, oauth_bank)
    run, _ = start_run(user=asha, agent="cards-agent", input={})
    api = APIClient()
    api.force_authenticate(asha)
    (listed,) = api.get("/v1/connections").json()
    assert listed["server"] == "cards" and listed["status"] == "active" and listed["since"]

    revoked = api.delete(f"/v1/connections/{listed['id']}")

    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED  # the model was told, and answered
    step = _tool_step(run)
    assert step.status == StepStatus.DENIED and "revoked" in step.observation
    assert oauth_bank.calls() == []
    later, _ = start_run(user=asha, agent="cards-agent", input={}, idempotency_key="later")
    assert drive(later.pk).status == RunStatus.WAITING_AUTHORIZATION


def test_a_refresh_the_authorization_server_refuses_denies_the_call_and_ends_the_connection(
    tenant, asha, oauth_bank
):
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    statements_agent(tenant, tool)
    connect(asha, oauth_bank)
    Connection.objects.filter(user=asha).update(access_expires_at=timezone.now() - dt.timedelta(minutes=1))
    oauth_bank.forget_tokens_of("asha")
    run, _ = start_run(user=asha, agent="cards-agent", input={})

    run = drive(run.pk)

    step = _tool_step(run)
    assert step.status == StepStatus.FAILED and "refused to refresh" in step.error
    connection = Connection.objects.get(user=asha)
    assert (
        connection.status == ConnectionStatus.REVOKED and "refused the refresh" in connection.revoked_reason
    )
    assert connection.refresh_ciphertext == "" and connection.access_ciphertext == ""
    assert oauth_bank.calls() == []


def test_an_expired_access_token_is_refreshed_before_the_call(tenant, asha, oauth_bank):
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    statements_agent(tenant, tool)
    connect(asha, oauth_bank)
    before = Connection.objects.get(user=asha)
    Connection.objects.filter(pk=before.pk).update(access_expires_at=timezone.now() - dt.timedelta(minutes=1))
    run, _ = start_run(user=asha, agent="cards-agent", input={})

    assert drive(run.pk).status == RunStatus.SUCCEEDED
    after = Connection.objects.get(pk=before.pk)
    assert Connection.unseal(after.access_ciphertext) != Connection.unseal(before.access_ciphertext)
    assert after.access_expires_at > timezone.now()


def test_a_run_waiting_for_a_connection_stops_at_its_deadline(tenant, asha, oauth_bank):
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    statements_agent(tenant, tool)
    run, _ = start_run(user=asha, agent="cards-agent", input={})
    assert drive(run.pk).status == RunStatus.WAITING_AUTHORIZATION
    Run.objects.filter(pk=run.pk).update(deadline_at=timezone.now() - dt.timedelta(seconds=1))

    sweep()

    run.refresh_from_db()
    assert run.status == RunStatus.STOPPED and run.stop_reason == "deadline"
    assert _tool_step(run).status == StepStatus.SKIPPED


def test_grants_are_checked_before_the_connection(tenant, asha, ravi, oauth_bank):
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])  # ravi holds no use_tool
    statements_agent(tenant, tool)
    ProtectedServer.objects.create(tenant=tenant, server=tool.server)
    run, _ = start_run(user=ravi, agent="cards-agent", input={})

    run = drive(run.pk)

    assert _tool_step(run).status == StepStatus.DENIED  # refused by the grant: no link to connect
    assert not RunEvent.objects.filter(run=run, skeleton__to=RunStatus.WAITING_AUTHORIZATION).exists()


def test_a_callback_with_an_unknown_or_used_state_is_refused(tenant, asha, oauth_bank):
    statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    response = APIClient().get("/v1/connections/callback?state=nope&code=x")
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {"state": ["unknown or already used"]}


# --- the canary: no token in clear anywhere ------------------------------------------------------


def _database_dump() -> str:
    """Every row of every table, as text: what a database dump would hold."""
    from django.db import connection as db

    with db.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [row[0] for row in cursor.fetchall()]
        dump = []
        for table in tables:
            cursor.execute(f'SELECT row_to_json(t)::text FROM "{table}" t')
            dump += [row[0] for row in cursor.fetchall()]
    return "\n".join(dump)


def test_canary_refresh_and_access_tokens_stay_out_of_steps_events_logs_api_admin_and_the_database(
    tenant, asha, oauth_bank, caplog
):
    import logging

    from django.urls import reverse

    from connections.services import _client_info
    from tenants.models import User

    caplog.set_level(logging.DEBUG)
    tool = statements_tool(tenant, oauth_bank.mcp_url, users=[asha])
    statements_agent(tenant, tool, calls=2)
    first = connect(asha, oauth_bank)
    assert first["connected"]
    before = Connection.objects.get(user=asha)
    # The first call refreshes: both the first and the refreshed tokens are canaries.
    Connection.objects.filter(pk=before.pk).update(access_expires_at=timezone.now() - dt.timedelta(minutes=1))
    run, _ = start_run(user=asha, agent="cards-agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    after = Connection.objects.get(pk=before.pk)
    canaries = {
        "access token": Connection.unseal(before.access_ciphertext),
        "refresh token": Connection.unseal(before.refresh_ciphertext),
        "refreshed access token": Connection.unseal(after.access_ciphertext),
        "refreshed refresh token": Connection.unseal(after.refresh_ciphertext),
        "client secret": _client_info(ProtectedServer.objects.get(server=tool.server)).get(
            "client_secret", ""
        ),
    }
    assert all(len(value) > 16 for value in canaries.values()), canaries.keys()
    assert canaries["access token"] != canaries["refreshed access token"]

    places = {}
    for step in Step.objects.filter(run=run):
        places[f"step {step.seq}"] = str(
            [step.arguments, step.request, step.result, step.observation, step.error]
        )
    places["events"] = str([[e.message, e.data] for e in RunEvent.objects.filter(run=run)])
    places["logs"] = caplog.text + "".join(str(r.args) for r in caplog.records)
    api = APIClient()
    api.force_authenticate(asha)
    for path in ("/v1/connections", f"/v1/runs/{run.pk}/steps", f"/v1/runs/{run.pk}/events"):
        places[path] = api.get(path).content.decode()
    operator = User.objects.create_superuser(username="ops", password="pw")
    web = APIClient()
    web.force_login(operator)
    for url in (
        reverse("admin:connections_connection_changelist"),
        reverse("admin:connections_connection_change", args=[after.pk]),
    ):
        page = web.get(url)
        assert page.status_code == 200, url
        places[url] = page.content.decode()
    assert "statements:read" in places[reverse("admin:connections_connection_changelist")]
    places["database dump"] = _database_dump()

    leaks = [
        f"{what} in {where}"
        for what, value in canaries.items()
        for where, text in places.items()
        if value in text
    ]
    assert not leaks, f"credentials leaked: {', '.join(leaks)}"
