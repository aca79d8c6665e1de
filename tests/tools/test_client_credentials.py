"""MCP servers that take the platform's own OAuth token (client credentials grant), configured with
`apply` (docs/configuration.md "OAuth-protected MCP servers"): apply lists their tools with a
token, runs on a real worker call them with a cached token, fetch a new one before expiry and once
after a 401, and no token reaches the database or the worker's log. Against the `mcp` SDK's
authorization server and bearer-checking MCP server on 127.0.0.1 (tests/oauth_servers.py), which
accept only tokens issued for the MCP server's own resource."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from configuration.apply import apply_config
from runs.models import Run, Step
from runs.services import start_run
from tenants.models import Secret, Tenant
from tests import factories
from tests.configuration.test_apply import SLUG, config, rejected
from tests.oauth_servers import MACHINE_CLIENT, MACHINE_SECRET, OAuthServers
from tests.servers import wait_for
from tools import client_credentials
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def bank():
    servers = OAuthServers().start()
    yield servers
    servers.stop()


@pytest.fixture(autouse=True)
def _client_secret_in_environment(monkeypatch):
    monkeypatch.setenv("CARDS_OAUTH_SECRET", MACHINE_SECRET)


def with_oauth(bank: OAuthServers, **oauth) -> dict:
    data = config()
    data["secrets"].append({"name": "cards-oauth", "value_env": "CARDS_OAUTH_SECRET"})
    data["tool_servers"].append(
        {
            "name": "cards",
            "kind": "mcp",
            "url": bank.mcp_url,
            "discover": True,
            "oauth": {
                "token_url": f"{bank.issuer}/oauth/client-token",
                "client_id": MACHINE_CLIENT,
                "client_secret": "cards-oauth",
                "scopes": ["statements:read"],
                "audience": bank.mcp_url,
                **oauth,
            },
        }
    )
    data["tools"].append(
        {"server": "cards", "name": "list_statements", "enabled": True, "effect": "read_only"}
    )
    data["grants"].append({"tool": "cards__list_statements", "use": ["group:support-agents"]})
    return data


def test_apply_lists_the_servers_tools_with_a_token_and_stores_the_settings_not_the_token(bank):
    apply_config(with_oauth(bank))

    tool = Tool.objects.get(tenant__slug=SLUG, name="cards__list_statements")
    assert tool.enabled and tool.description == "The signed-in customer's card statements"
    server = ToolServer.objects.get(tenant__slug=SLUG, name="cards")
    assert server.oauth_client_secret is not None
    assert (
        server.oauth_token_url,
        server.oauth_client_id,
        server.oauth_client_secret.name,
        server.oauth_client_secret.reveal(),
        server.oauth_scopes,
        server.oauth_audience,
    ) == (
        f"{bank.issuer}/oauth/client-token",
        MACHINE_CLIENT,
        "cards-oauth",
        MACHINE_SECRET,
        ["statements:read"],
        bank.mcp_url,
    )
    issued = bank.client_token_requests()
    assert issued["issued"] == 1 and _nowhere_in_the_database(issued["tokens"])

    assert not apply_config(with_oauth(bank)).changed
    # The block removed: the server takes no token any more (the file owns it, as its secret).
    data = with_oauth(bank)
    del data["tool_servers"][-1]["oauth"]
    data["tool_servers"][-1]["discover"] = False
    data["tools"].pop()
    data["grants"].pop()
    assert "oauth_token_url" in " ".join(apply_config(data).changes)
    server.refresh_from_db()
    assert server.oauth_token_url == "" and server.oauth_client_secret is None


def test_apply_refuses_bad_oauth_settings_field_by_field(bank, monkeypatch):
    missing = with_oauth(bank)
    del missing["tool_servers"][-1]["oauth"]["client_id"]
    missing["tool_servers"][-1]["oauth"]["grant"] = "password"
    missing["tool_servers"][-1]["oauth"]["client_auth"] = "jwt"
    missing["tool_servers"][-1]["oauth"]["token_url"] = "not a url"
    errors = dict(rejected(missing))
    at = "tool_servers[2].oauth"
    assert errors[f"{at}.client_id"] == "required"
    assert errors[f"{at}.grant"].startswith("unknown field; one of token_url, client_id, client_secret")
    assert errors[f"{at}.client_auth"].startswith("must be one of")
    assert errors[f"{at}.token_url"] == "must be an http(s) URL"

    unknown_secret = with_oauth(bank, client_secret="no-such-secret")
    assert dict(rejected(unknown_secret))[f"{at}.client_secret"] == "no secret named 'no-such-secret'"

    monkeypatch.setenv("CARDS_OAUTH_SECRET", "the-wrong-secret")
    wrong = dict(rejected(with_oauth(bank)))
    assert wrong[at] == (
        f"cannot get a token: denied before sending: the OAuth token endpoint {bank.issuer}/oauth/client-token "
        f"refused client '{MACHINE_CLIENT}': invalid_client (bad credentials)"
    )
    assert "the-wrong-secret" not in str(wrong)
    monkeypatch.setenv("CARDS_OAUTH_SECRET", MACHINE_SECRET)
    assert dict(rejected(with_oauth(bank, scopes=["payments:write"])))[at].endswith(": invalid_scope")

    http = with_oauth(bank)
    http["tool_servers"][1]["oauth"] = http["tool_servers"][-1]["oauth"]
    assert (
        "tool_servers[1].oauth",
        "only for mcp servers over streamable_http: the token goes in an HTTP header",
    ) in (rejected(http))
    both = with_oauth(bank)
    both["tool_servers"][-1]["secret"] = "crm-token"
    assert "which this server's secret already uses" in dict(rejected(both))[at]
    assert ToolServer.objects.filter(name="cards").count() == 0


def test_runs_use_a_cached_token_fetch_one_after_a_401_and_record_none(bank, workers):
    apply_config(with_oauth(bank))
    tenant = Tenant.objects.get(slug=SLUG)
    tool = Tool.objects.get(tenant=tenant, name="cards__list_statements")
    asha = _user("asha")
    factories.make_agent(
        tenant,
        name="cards-agent",
        tools=[tool],
        turns=[
            {"tool_calls": [{"name": tool.name, "arguments": {"month": "2026-01"}}]},
            {"tool_calls": [{"name": tool.name, "arguments": {"month": "2026-02"}}]},
            {"text": "done"},
        ],
    )
    worker = workers("w1", concurrency=2, ready_within=600)  # minutes on a loaded machine

    first = _finished(start_run(user=asha, agent="cards-agent", input={})[0].pk)
    assert first.status == "succeeded", first.error
    # Two calls, one token: apply's, then the worker's own, kept for the second call.
    assert [(c["subject"], c["resource"]) for c in bank.calls()] == [(MACHINE_CLIENT, bank.mcp_url)] * 2
    assert bank.client_token_requests()["issued"] == 2

    # The authorization server forgets the token: the next call meets a 401, the worker fetches a
    # new token once and sends the call again (it did not run the first time).
    bank.forget_tokens_of(MACHINE_CLIENT)
    second = _finished(start_run(user=asha, agent="cards-agent", input={})[0].pk)
    assert second.status == "succeeded", second.error
    assert len(bank.calls()) == 4
    assert bank.client_token_requests()["issued"] == 3
    steps = Step.objects.filter(run=second, kind="tool").order_by("seq")
    assert [s.attempts for s in steps] == [1, 1]

    tokens = bank.client_token_requests()["tokens"]
    assert _nowhere_in_the_database(tokens)
    assert not [t for t in tokens if t in worker.output()]


def test_a_token_is_fetched_again_before_it_expires_not_after(tenant):
    servers = OAuthServers("--token-seconds", "12").start()
    try:
        secret = stored_secret(tenant, "cards-oauth", MACHINE_SECRET)
        server = ToolServer.objects.create(
            tenant=tenant,
            name="cards",
            kind="mcp",
            transport="streamable_http",
            url=servers.mcp_url,
            oauth_token_url=f"{servers.issuer}/oauth/client-token",
            oauth_client_id=MACHINE_CLIENT,
            oauth_client_secret=secret,
            oauth_scopes=["statements:read"],
            oauth_audience=servers.mcp_url,
        )
        first = client_credentials.authorization(server)
        assert client_credentials.authorization(server) == first  # cached
        assert servers.client_token_requests()["issued"] == 1
        # A 12 s token is used for 6 s (margin: half of a short life), so no call carries one that
        # lapses on the way.
        time.sleep(6.5)
        again = client_credentials.authorization(server)
        assert again != first and servers.client_token_requests()["issued"] == 2

        # The server's secret rotated: a new key, a new token, at once.
        secret.set_value("the-wrong-secret")
        secret.save()
        with pytest.raises(client_credentials.ToolFailed, match="invalid_client"):
            client_credentials.authorization(ToolServer.objects.get(pk=server.pk))
    finally:
        servers.stop()


def stored_secret(tenant, name: str, value: str) -> Secret:
    secret = Secret(tenant=tenant, name=name)
    secret.set_value(value)
    secret.save()
    return secret


def _user(username: str):
    return get_user_model().objects.get(username=username)


def _finished(run_id) -> Run:
    return wait_for(lambda: (r := Run.objects.get(pk=run_id)).is_terminal and r, timeout=90, what="run end")


def _nowhere_in_the_database(tokens: list[str]) -> bool:
    """No token in any text or JSON column of any table (steps, events, servers, secrets...)."""
    assert tokens
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public' "
            "AND data_type IN ('text', 'character varying', 'jsonb', 'json')"
        )
        columns = cursor.fetchall()
        for table, column in columns:
            cursor.execute(
                f'SELECT 1 FROM "{table}" WHERE "{column}"::text LIKE ANY(%s) LIMIT 1',
                [[f"%{token}%" for token in tokens]],
            )
            if cursor.fetchone():
                raise AssertionError(f"a token is stored in {table}.{column}")
    return True
