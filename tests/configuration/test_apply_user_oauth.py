"""`manage.py apply` for an MCP server that takes each user's own OAuth token (`user_oauth: true`,
docs/authority-oauth.md): its tools are declared in the file, since their list needs a user's token;
runs call them with the user's connection; a later listing that differs is reported, not copied in.
The example is the doc's own text; the server is tests/oauth_servers.py."""

from __future__ import annotations

import copy

import pytest

from configuration.apply import apply_config
from configuration.loading import load_text
from runs.models import RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.models import Tenant, User
from tests.configuration.test_apply import SLUG, config, rejected
from tests.configuration.test_doc_examples import BLOCK, DOCS
from tests.conftest import drive
from tests.connections.conftest import connect, statements_agent
from tests.oauth_servers import OAuthServers
from tools.catalog import refresh, sync_server
from tools.models import Tool, ToolServer
from tools.types import RemoteTool

pytestmark = pytest.mark.django_db

NOWHERE = "http://127.0.0.1:9/mcp"  # apply must not contact it: nothing listens there


@pytest.fixture
def oauth_bank():
    servers = OAuthServers().start()
    yield servers
    servers.stop()


def doc_example() -> dict:
    [found] = [b for b in BLOCK.findall(DOCS["authority-oauth.md"]) if "user_oauth: true" in b]
    return load_text(found)


def with_example(url: str = NOWHERE, edit=None) -> dict:
    example = copy.deepcopy(doc_example())
    example["tool_servers"][0]["url"] = url
    if edit:
        edit(example)
    data = config()
    for section in ("tool_servers", "tools", "grants"):
        data[section] += example[section]
    return data


def test_apply_stores_the_declared_tools_as_written_without_contacting_the_server():
    report = apply_config(with_example())

    assert "created tools cards__list_statements" in " ".join(report.changes)
    server = ToolServer.objects.get(tenant__slug=SLUG, name="cards")
    assert server.user_oauth and server.last_synced_at is None  # declared, not discovered
    tool = Tool.objects.get(server=server, remote_name="list_statements")
    declared = doc_example()["tools"][0]
    assert (tool.declared, tool.description, tool.input_schema) == (
        True,
        declared["description"],
        declared["input_schema"],
    )
    assert tool.enabled and not tool.quarantined and tool.effect_class == "read_only"
    assert not apply_config(with_example()).changed

    def longer(example):
        example["tools"][0]["description"] += " (last 24 months)"

    changed = apply_config(with_example(edit=longer))
    assert "updated tools cards__list_statements (description)" in changed.changes
    tool.refresh_from_db()
    assert tool.description.endswith("(last 24 months)") and not tool.quarantined


def test_bad_declarations_get_field_level_errors():
    def no_schema(example):
        del example["tools"][0]["input_schema"]

    [(path, message)] = rejected(with_example(edit=no_schema))
    assert path == "tools[2].input_schema" and message.startswith(
        "required: this server's tools are declared"
    )

    def bad_schema(example):
        example["tools"][0]["input_schema"] = {"type": "objekt"}

    [(path, message)] = rejected(with_example(edit=bad_schema))
    assert path == "tools[2].input_schema" and "not a valid JSON schema" in message

    def with_oauth_block(example):
        example["tool_servers"][0]["oauth"] = {
            "token_url": "https://login.bank.example/token",
            "client_id": "platform",
            "client_secret": "crm-token",
        }

    errors = dict(rejected(with_example(edit=with_oauth_block)))
    assert "oauth block" in errors["tool_servers[2].user_oauth"]

    def on_http(example):
        example["tool_servers"][0]["kind"] = "http"

    errors = dict(rejected(with_example(edit=on_http)))
    assert "only for mcp servers over streamable_http" in errors["tool_servers[2].user_oauth"]

    def secret_in_authorization(example):
        example["tool_servers"][0]["secret"] = "crm-token"

    errors = dict(rejected(with_example(edit=secret_in_authorization)))
    assert "Authorization header" in errors["tool_servers[2].user_oauth"]

    assert not Tool.objects.filter(tenant__slug=SLUG, name="cards__list_statements").exists()

    def not_user_oauth(example):
        del example["tool_servers"][0]["user_oauth"]

    errors = dict(rejected(with_example(edit=not_user_oauth)))
    assert "user_oauth: true" in errors["tools[2].description"]
    assert "user_oauth: true" in errors["tools[2].input_schema"]


def test_a_declaration_that_differs_from_a_tool_the_server_listed_is_refused_field_by_field():
    data = with_example()
    apply_config(data)
    # As a discovery that could read the list left it: the server's own description and schema.
    Tool.objects.filter(name="cards__list_statements").update(
        declared=False, description="Statements", input_schema={"type": "object"}
    )

    errors = dict(rejected(data))

    assert "differs from what server 'cards' lists" in errors["tools[2].description"]
    assert "differs from what server 'cards' lists" in errors["tools[2].input_schema"]
    tool = Tool.objects.get(name="cards__list_statements")
    assert tool.description == "Statements"  # not replaced


def test_a_later_listing_that_differs_or_lacks_a_declared_tool_is_reported_not_copied_in():
    def two_tools(example):
        example["tools"].append(
            {"server": "cards", "name": "get_statement", "input_schema": {"type": "object"}}
        )

    apply_config(with_example(edit=two_tools))
    server = ToolServer.objects.get(tenant__slug=SLUG, name="cards")
    declared = Tool.objects.get(server=server, remote_name="list_statements")
    listed = RemoteTool("list_statements", "Card statements", {"type": "object"}, {})

    sync = sync_server(server, [listed])

    assert (sync.differs, sync.missing) == (["list_statements"], ["get_statement"])
    tool = Tool.objects.get(pk=declared.pk)
    assert tool.quarantined and not tool.offerable
    assert (tool.description, tool.input_schema) == (declared.description, declared.input_schema)
    assert "Card statements" in tool.quarantine_reason
    # The same declaration listed as declared is no difference.
    again = sync_server(server, [RemoteTool("list_statements", tool.description, tool.input_schema, {})])
    assert again.unchanged == ["list_statements"] and again.differs == []


@pytest.mark.django_db(transaction=True)
def test_a_connected_user_runs_the_declared_tool_and_the_server_sees_one_call_as_that_user(oauth_bank):
    apply_config(with_example(oauth_bank.mcp_url))
    tenant = Tenant.objects.get(slug=SLUG)
    asha = User.objects.get(username="asha")
    tool = Tool.objects.get(tenant=tenant, name="cards__list_statements")
    statements_agent(tenant, tool)
    connect(asha, oauth_bank)

    run = drive(start_run(user=asha, agent="cards-agent", input={})[0].pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    step = Step.objects.get(run=run, kind="tool")
    assert step.result["structured"] == {"subject": "asha", "month": "2026-01", "statements": 2}
    assert [(c["tool"], c["subject"]) for c in oauth_bank.calls()] == [("list_statements", "asha")]

    # The admin's Sync lists the server with the admin's own connection: the bank's server
    # describes `month` without the declared description, so the tool is reported and quarantined.
    sync = refresh(tool.server, asha.pk)
    assert sync.differs == ["list_statements"] and sync.missing == []
    tool.refresh_from_db()
    assert tool.quarantined and tool.declared
    assert tool.input_schema == doc_example()["tools"][0]["input_schema"]


@pytest.mark.django_db(transaction=True)
def test_a_user_without_a_connection_waits_for_one_and_nothing_reaches_the_server(oauth_bank):
    apply_config(with_example(oauth_bank.mcp_url))
    tenant = Tenant.objects.get(slug=SLUG)
    asha = User.objects.get(username="asha")
    tool = Tool.objects.get(tenant=tenant, name="cards__list_statements")
    statements_agent(tenant, tool)

    run = drive(start_run(user=asha, agent="cards-agent", input={})[0].pk)

    assert run.status == RunStatus.WAITING_AUTHORIZATION
    assert Step.objects.get(run=run, kind="tool").status == StepStatus.AWAITING_AUTHORIZATION
    waiting = RunEvent.objects.get(run=run, kind="status", skeleton__to=RunStatus.WAITING_AUTHORIZATION)
    assert waiting.data["connect_url"].endswith(f"/admin/connections/connection/connect/{tool.server_id}/")
    assert oauth_bank.calls() == []

    connect(asha, oauth_bank)
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert [c["subject"] for c in oauth_bank.calls()] == ["asha"]
