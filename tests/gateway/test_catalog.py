"""The catalogue the model sees (issue #3): quarantine, large catalogues, result size, refresh."""

from __future__ import annotations

from io import StringIO

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from runs.models import RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.crypto import REDACTED
from tenants.models import Secret
from tests import factories
from tests.conftest import drive
from tools import offer
from tools.catalog import fetch_remote, release_quarantine, sync_server
from tools.models import Tool, ToolServer
from tools.types import RemoteTool

pytestmark = pytest.mark.django_db(transaction=True)


def tool_steps(run) -> list[Step]:
    return list(Step.objects.filter(run=run, kind="tool").order_by("seq"))


def offered_names(run) -> list[str]:
    return [spec.name for spec in offer.offered_tools(run)]


# --- quarantine ------------------------------------------------------------------------------


def test_it_quarantines_a_tool_whose_schema_changed_until_a_person_releases_it(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"say": "hi"}}]}, {"text": "ok"}],
    )
    before, _ = start_run(user=asha, agent="agent", input={})
    assert offered_names(before) == [echo.name]
    changed = [
        RemoteTool(
            r.name, r.description, {**r.input_schema, "properties": {"cc": {"type": "string"}}}, r.annotations
        )
        if r.name == "echo"
        else r
        for r in fetch_remote(echo.server)
    ]

    report = sync_server(echo.server, changed)

    assert report.quarantined == ["echo"] and "echo" not in report.unchanged and report.added == []
    echo.refresh_from_db()
    assert echo.quarantined and echo.input_schema["properties"] == {"cc": {"type": "string"}}
    assert offered_names(before) == []
    run = drive(before.pk)
    [step] = tool_steps(run)
    assert step.status == StepStatus.DENIED and "quarantined" in step.error
    assert step.result is None  # nothing ran
    # The same (changed) schema again is no new change; the tool stays quarantined.
    assert sync_server(echo.server, changed).unchanged == sorted(r.name for r in changed)
    assert Tool.objects.get(pk=echo.pk).quarantined

    release_quarantine(echo)

    after, _ = start_run(user=asha, agent="agent", input={})
    assert offered_names(after) == [echo.name]
    after = drive(after.pk)
    [step] = tool_steps(after)
    assert step.status == StepStatus.SUCCEEDED and step.result["structured"] == {"say": "hi"}


def test_it_redacts_a_credential_a_server_echoes_into_its_tool_list(tenant):
    secret = Secret(tenant=tenant, name="token")
    secret.set_value("tok-3b9d71c2e5")
    secret.save()
    server = ToolServer.objects.create(
        tenant=tenant, name="crm", kind=ToolServer.Kind.MCP, url="http://x", secret=secret
    )
    sync_server(
        server,
        [
            RemoteTool(
                "lookup",
                "Look up. Auth: Bearer tok-3b9d71c2e5",
                {"type": "object", "description": "tok-3b9d71c2e5"},
            )
        ],
    )
    tool = Tool.objects.get(server=server)
    assert tool.description == f"Look up. Auth: Bearer {REDACTED}"
    assert tool.input_schema["description"] == REDACTED
    assert not tool.enabled


# --- large catalogues ------------------------------------------------------------------------

TOPICS = [
    "card replacement",
    "address change",
    "cheque book order",
    "loan prepayment",
    "fixed deposit",
    "standing instruction",
    "kyc document upload",
    "branch locator",
    "atm pin reset",
    "upi dispute",
    "emi conversion",
    "nominee update",
    "tax certificate",
    "mobile number change",
    "credit limit",
    "statement download",
    "reward catalogue",
    "insurance claim",
    "mandate cancel",
    "forex card",
]


def _big_catalogue(tenant, asha, permitted: int):
    """`permitted` tools asha may use, plus allowlisted ones she may not; all answer like echo."""
    server = ToolServer.objects.create(tenant=tenant, name="kb", kind=ToolServer.Kind.BUILTIN)

    def tool(name, description):
        return Tool.objects.create(
            tenant=tenant,
            server=server,
            name=f"kb__{name}",
            remote_name="echo",
            description=description,
            input_schema={"type": "object"},
            enabled=True,
            effect_class="read_only",
        )

    mine = [
        tool(f"topic_{i:03d}", f"Answer questions about {TOPICS[i % len(TOPICS)]} (set {i}).")
        for i in range(permitted - 3)
    ]
    mine += [
        tool("loyalty_points_balance", "Show the customer's loyalty points balance."),
        tool("zz_currency_rates", "Today's currency exchange rates for foreign currency."),
        tool("zz_currency_convert", "Convert an amount between currency pairs at exchange rates."),
    ]
    theirs = [
        tool("loyalty_points_override", "Override loyalty points balance: loyalty points adjust."),
        tool("currency_exchange_desk", "Book currency exchange currency rates at the desk."),
    ]
    for t in mine:
        factories.grant(t, use=[asha])
    return mine, theirs


def test_it_narrows_a_large_catalogue_by_relevance_and_adds_search_tools(tenant, asha):
    limit = settings.VISIBLE_TOOLS_MAX
    mine, theirs = _big_catalogue(tenant, asha, limit + 10)
    factories.make_agent(tenant, tools=mine + theirs)
    run, _ = start_run(user=asha, agent="agent", input={"ask": "what is my loyalty points balance?"})

    names = offered_names(run)

    assert len(names) == limit and names[-1] == offer.SEARCH_TOOLS
    assert names[:-1] == sorted(names[:-1]) and len(set(names)) == limit
    assert "kb__loyalty_points_balance" in names
    assert not {t.name for t in theirs} & set(names)
    assert set(names[:-1]) <= {t.name for t in mine}
    assert offered_names(run) == names  # byte-stable between steps


def test_it_reveals_only_permitted_tools_through_search_tools(tenant, asha):
    mine, theirs = _big_catalogue(tenant, asha, settings.VISIBLE_TOOLS_MAX + 10)
    factories.make_agent(
        tenant,
        tools=mine + theirs,
        turns=[
            {"tool_calls": [{"name": offer.SEARCH_TOOLS, "arguments": {"query": "currency exchange rates"}}]},
            {"tool_calls": [{"name": "kb__zz_currency_rates", "arguments": {"pair": "USD/INR"}}]},
            {"text": "ok"},
        ],
    )
    run, _ = start_run(user=asha, agent="agent", input={"ask": "what is my loyalty points balance?"})
    assert "kb__zz_currency_rates" not in offered_names(run)

    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    search, rates = tool_steps(run)
    assert search.status == StepStatus.SUCCEEDED
    assert {"kb__zz_currency_rates", "kb__zz_currency_convert"} <= set(run.revealed_tools)
    assert set(run.revealed_tools) <= {t.name for t in mine}
    assert "currency_exchange_desk" not in search.observation
    assert "kb__zz_currency_rates" in Step.objects.get(run=run, seq=3).request["tools"]
    assert rates.status == StepStatus.SUCCEEDED and rates.result["structured"] == {"pair": "USD/INR"}


def test_it_denies_search_tools_when_it_was_not_offered(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[
            {"tool_calls": [{"name": offer.SEARCH_TOOLS, "arguments": {"query": "anything"}}]},
            {"text": "ok"},
        ],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    [step] = tool_steps(run)
    assert step.status == StepStatus.DENIED and "not offered" in step.error
    assert run.revealed_tools == []


# --- result size -----------------------------------------------------------------------------


def test_it_truncates_a_large_result_for_the_model_and_stores_it_in_full(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    limit = settings.TOOL_RESULT_MODEL_CHARS
    blob = "ledger-line " * (limit // 6)
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"blob": blob}}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})

    run = drive(run.pk)

    [step] = tool_steps(run)
    assert step.result["structured"] == {"blob": blob} and len(step.result["text"]) > 2 * limit
    head, marker = step.observation[:limit], step.observation[limit:]
    assert head == step.result["text"][:limit]
    assert marker == (
        f"\n[truncated by the platform: showing {limit} of {len(step.result['text'])} characters; "
        "the full result is stored]"
    )


# --- refresh_tools ---------------------------------------------------------------------------


def test_refresh_tools_reports_added_quarantined_unchanged_and_missing(tenant, builtins):
    other = factories.make_tenant("globex")
    fresh = ToolServer.objects.create(tenant=other, name="platform", kind=ToolServer.Kind.BUILTIN)
    out = StringIO()

    call_command("refresh_tools", tenant="globex", stdout=out)

    assert (
        out.getvalue()
        == "globex/platform: added 5 (clock, echo, noop, run_python, sleep); quarantined 0; unchanged 0; "
        "missing 0\n"
    )
    assert Tool.objects.filter(server=fresh, enabled=False).count() == 5
    Tool.objects.filter(pk=builtins["echo"].pk).update(schema_hash="an older schema")
    Tool.objects.create(
        tenant=tenant,
        server=builtins["echo"].server,
        name="platform__retired",
        remote_name="retired",
        schema_hash="x",
    )
    crm = ToolServer.objects.create(tenant=tenant, name="crm", kind=ToolServer.Kind.HTTP, url="http://crm")
    declared = Tool.objects.create(
        tenant=tenant,
        server=crm,
        name="crm__lookup",
        remote_name="lookup",
        enabled=True,
        input_schema={"type": "object"},
    )
    out = StringIO()

    call_command("refresh_tools", stdout=out)

    assert out.getvalue().splitlines() == [
        "acme/crm: added 0; quarantined 0; unchanged 1; missing 0",  # declared, not discovered
        "acme/platform: added 0; quarantined 1 (echo); unchanged 4; missing 1 (retired)",
        "globex/platform: added 0; quarantined 0; unchanged 5; missing 0",
    ]
    assert Tool.objects.get(pk=builtins["echo"].pk).quarantined
    declared.refresh_from_db()
    assert declared.enabled and not declared.quarantined


def test_refresh_tools_goes_on_past_an_unreachable_server_and_fails_at_the_end(tenant, builtins):
    ToolServer.objects.create(
        tenant=tenant,
        name="down",
        kind=ToolServer.Kind.MCP,
        transport=ToolServer.Transport.STREAMABLE_HTTP,
        url="http://127.0.0.1:9/mcp",
    )
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match="1 server"):
        call_command("refresh_tools", tenant="acme", stdout=out, stderr=err)
    assert "acme/down: not refreshed" in err.getvalue()
    assert out.getvalue() == "acme/platform: added 0; quarantined 0; unchanged 5; missing 0\n"
    with pytest.raises(CommandError, match="no tool server"):
        call_command("refresh_tools", server="nope")
