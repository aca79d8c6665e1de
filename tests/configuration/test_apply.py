"""`manage.py apply`: declarative tenant configuration (configuration/)."""

from __future__ import annotations

import socket
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.contrib.auth.models import Group
from django.core.management import CommandError, call_command
from guardian.models import GroupObjectPermission, UserObjectPermission
from guardian.shortcuts import get_objects_for_user

from agents.models import AgentDefinition, AgentVersion, Alias
from budgets.models import BudgetAccount
from budgets.services import local_day, tenant_day_account
from configuration.apply import ConfigError, apply_config, load_file
from llm.models import ModelEndpoint
from tenants.models import Secret, Tenant, TenantGroup, User
from tools.builtin import BUILTINS
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
SLUG = "acme-test"
# The ticket tool's approval rule: a high-priority ticket waits (a missing priority too).
HIGH_PRIORITY = """@approval("high-priority tickets wait for a supervisor")
permit (principal, action == Action::"crm__create_ticket", resource)
when { !(context.arguments has priority && context.arguments.priority != "high") };"""


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def spec(*tools: str, **extra) -> dict:
    return {
        "model": "scripted",
        "instructions": "You help support agents.",
        "tools": list(tools),
        "limits": {"max_steps": 10, "max_cost_micros": 1_000_000},
        **extra,
    }


def config() -> dict:
    """A valid file using builtin and http tools only (no tool server process needed)."""
    return {
        "tenant": {
            "slug": SLUG,
            "name": "Acme Test",
            "time_zone": "Asia/Kolkata",
            "daily_budget": 25.0,
            "on_budget_exhausted": "stop",
            "quotas": {"max_active_runs": 10},
            "caps": {"max_steps": 50, "max_cost": 5.0},
        },
        "secrets": [{"name": "crm-token", "value": "tok-initial-1234"}],
        "groups": [{"name": "support-agents"}, {"name": "supervisors"}],
        "users": [
            {
                "username": "asha",
                "email": "asha@example.com",
                "password": "pw-asha",
                "groups": ["support-agents"],
            },
            {"username": "ravi", "password": "pw-ravi", "groups": ["supervisors"], "staff": True},
        ],
        "model_endpoints": [
            {
                "name": "scripted",
                "kind": "scripted",
                "prices": {"input": 3.0, "cached_input": 0.3, "cache_write": 3.75, "output": 15.0},
                "config": {"turns": [{"text": "hello"}]},
            }
        ],
        "tool_servers": [
            {"name": "platform", "kind": "builtin"},
            {"name": "crm", "kind": "http", "url": "http://127.0.0.1:9/crm", "secret": "crm-token"},
        ],
        "tools": [
            {"server": "platform", "name": "echo", "enabled": True, "effect": "read_only"},
            {
                "server": "crm",
                "name": "create_ticket",
                "enabled": True,
                "effect": "unsafe",
                "approval": HIGH_PRIORITY,
                "price": 0.01,
                "description": "Open a ticket.",
                "input_schema": {"type": "object", "properties": {"priority": {"type": "string"}}},
            },
        ],
        "grants": [
            {"tool": "platform__echo", "use": ["group:support-agents", "user:ravi"]},
            {"tool": "crm__create_ticket", "use": ["group:support-agents"], "approve": ["group:supervisors"]},
        ],
        "agents": [
            {
                "name": "helper",
                "versions": [spec("platform__echo"), spec("platform__echo", "crm__create_ticket")],
                "aliases": {"prod": 2, "canary": 1},
            }
        ],
    }


SNAPSHOT_MODELS = {
    Tenant: (),
    Secret: ("updated_at",),
    Group: (),
    TenantGroup: (),
    User: ("last_login",),
    User.groups.through: (),
    ModelEndpoint: (),
    ToolServer: ("last_synced_at",),
    Tool: (),
    AgentDefinition: (),
    AgentVersion: (),
    Alias: ("updated_at",),
    BudgetAccount: (),
    UserObjectPermission: (),
    GroupObjectPermission: (),
}


def snapshot() -> dict:
    """Every row the apply command may write, minus timestamps."""
    return {
        model.__name__: [
            {k: v for k, v in row.items() if k not in skip} for row in model.objects.order_by("pk").values()
        ]
        for model, skip in SNAPSHOT_MODELS.items()
    }


def rejected(data: dict, **kwargs) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        apply_config(data, **kwargs)
    return caught.value.errors


def zero_changes(report) -> bool:
    return all(c["created"] == c["updated"] == c["removed"] == 0 for c in map(report.counts, report.outcomes))


def can(user: User, perm: str, tool_name: str) -> bool:
    """A fresh guardian query, as the tool gateway does (no checker cache)."""
    fresh = User.objects.get(pk=user.pk)
    tools = Tool.objects.filter(tenant__slug=SLUG, name=tool_name)
    return get_objects_for_user(
        fresh, perm, klass=tools, with_superuser=False, accept_global_perms=False
    ).exists()


def test_it_applies_a_file_twice_and_changes_nothing_the_second_time():
    first = apply_config(config())
    assert first.counts("tools") == {
        "created": 6,
        "updated": 0,
        "unchanged": 0,
        "removed": 0,
    }  # 4 builtin + 1 http
    assert first.counts("versions")["created"] == 2 and first.counts("grants")["created"] == 4
    before = snapshot()

    second = apply_config(config())

    assert zero_changes(second) and not second.changed
    assert second.counts("users") == {"created": 0, "updated": 0, "unchanged": 2, "removed": 0}
    assert "changes:\n  none" in second.render()
    assert snapshot() == before


def test_it_stores_the_file_values():
    apply_config(config())
    tenant = Tenant.objects.get(slug=SLUG)
    assert (tenant.daily_budget_micros, tenant.max_cost_micros_cap, tenant.max_active_runs) == (
        25_000_000,
        5_000_000,
        10,
    )
    ticket = Tool.objects.get(tenant=tenant, name="crm__create_ticket")
    assert (ticket.price_micros, ticket.effect_class, ticket.enabled) == (10_000, "unsafe", True)
    assert ticket.approval_policy == HIGH_PRIORITY
    asha = User.objects.get(username="asha")
    assert asha.tenant == tenant and asha.check_password("pw-asha")
    assert list(asha.groups.values_list("name", flat=True)) == [f"{SLUG}:support-agents"]
    assert User.objects.get(username="ravi").is_staff
    aliases = {a.name: a.version.number for a in Alias.objects.filter(agent__tenant=tenant)}
    assert aliases == {"prod": 2, "canary": 1}
    assert ModelEndpoint.objects.get(tenant=tenant).price_cache_write == pytest.approx(3.75)


def test_it_stores_the_tenants_choices_for_pauses_and_kill_switches():
    apply_config(config())
    tenant = Tenant.objects.get(slug=SLUG)
    assert (tenant.on_killed_tool, tenant.paused_time_counts) == ("pause", False)  # the defaults
    data = config()
    data["tenant"]["pauses"] = {"on_killed_tool": "unavailable", "paused_time_counts": True}
    apply_config(data)
    tenant.refresh_from_db()
    assert (tenant.on_killed_tool, tenant.paused_time_counts) == ("unavailable", True)
    data["tenant"]["pauses"] = {"on_killed_tool": "ignore", "paused_time_counts": "sometimes"}
    errors = dict(rejected(data))
    assert errors["tenant.pauses.on_killed_tool"] == "must be one of pause, unavailable"
    assert "tenant.pauses.paused_time_counts" in errors


def test_it_reports_every_bad_field_and_writes_nothing():
    data = config()
    data["tenant"]["time_zone"] = "Mars/Olympus"
    data["users"][0]["email"] = "not-an-email"
    data["tools"][0]["effect"] = "sometimes"
    data["tools"][1]["approval"] = "amount >"
    data["grants"][0]["use"][1] = "group:nobody"
    data["agents"][0]["versions"][1]["tools"] = ["platform__clock", "crm__nothing"]
    data["agents"].append({"name": "other", "versions": [spec()], "aliases": {"prod": 9}})
    before = snapshot()

    errors = rejected(data)

    assert set(errors) >= {
        ("tenant.time_zone", "unknown time zone 'Mars/Olympus'; use an IANA name such as Asia/Kolkata"),
        ("users[0].email", "must be an email address"),
        ("tools[0].effect", "must be one of read_only, idempotent, reconcilable, unsafe"),
        ("tools[1].approval", "Cedar cannot parse it: unexpected token `>`"),
        ("grants[0].use[1]", "no group named 'nobody'"),
        ("agents[0].versions[1].tools[1]", "no tool named 'crm__nothing' in this tenant"),
        ("agents[1].aliases.prod", "agent 'other' has no version 9"),
    }, errors
    # tools[1] was left out for its bad rule: the references to it are not reported again.
    assert not [path for path, _ in errors if path.startswith("grants[1]")]
    assert snapshot() == before
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_it_rolls_back_everything_when_only_the_last_field_is_bad():
    apply_config(config())
    before = snapshot()
    data = config()
    data["tenant"]["daily_budget"] = 99
    data["secrets"][0]["value"] = "tok-changed-5678"
    data["grants"][0]["use"] = ["user:asha"]
    data["agents"][0]["versions"].append(spec("platform__noop"))
    data["agents"][0]["aliases"] = {"prod": 3, "canary": 7}

    assert rejected(data) == [("agents[0].aliases.canary", "agent 'helper' has no version 7")]
    assert snapshot() == before


def test_it_writes_nothing_for_a_new_tenant_whose_last_field_is_bad():
    data = config()
    data["agents"][0]["aliases"] = {"prod": 5}

    assert rejected(data) == [("agents[0].aliases.prod", "agent 'helper' has no version 5")]
    assert not Tenant.objects.filter(slug=SLUG).exists()
    assert not Group.objects.filter(name__startswith=f"{SLUG}:").exists()


def test_it_reports_unknown_fields_and_missing_values():
    data = config()
    data["tenant"]["quotas"]["max_runs"] = 3
    data["tools"].append({"server": "crm", "enabled": "yes"})
    data["secrets"].append({"name": "from-env", "value_env": "APPLY_TEST_UNSET_VARIABLE"})
    data["grants"].append({"tool": "crm__create_ticket", "use": ["asha"]})

    errors = dict(rejected(data))

    assert errors["tenant.quotas.max_runs"].startswith("unknown field; one of max_active_runs")
    assert errors["tools[2].name"] == "required"
    assert errors["tools[2].enabled"] == "must be true or false"
    assert errors["secrets[1].value_env"] == "environment variable APPLY_TEST_UNSET_VARIABLE is not set"
    assert errors["grants[2]"] == "'crm__create_ticket' is already defined at grants[1]"


def test_it_grants_object_permissions_and_removes_holders_dropped_from_the_file():
    apply_config(config())
    asha, ravi = User.objects.get(username="asha"), User.objects.get(username="ravi")
    assert can(asha, "tools.use_tool", "platform__echo")  # through group:support-agents
    assert can(ravi, "tools.use_tool", "platform__echo")  # directly
    assert can(ravi, "tools.approve_tool", "crm__create_ticket")
    assert not can(asha, "tools.approve_tool", "crm__create_ticket")
    assert not can(ravi, "tools.use_tool", "platform__noop")  # discovered, never granted

    data = config()
    data["grants"][0]["use"] = ["group:support-agents"]
    report = apply_config(data)

    assert report.counts("grants") == {"created": 0, "updated": 0, "unchanged": 3, "removed": 1}
    assert "removed grants platform__echo use_tool user:ravi" in report.changes
    assert not can(ravi, "tools.use_tool", "platform__echo")
    assert can(asha, "tools.use_tool", "platform__echo")


def test_it_removes_grants_on_a_listed_tool_that_the_file_does_not_name():
    apply_config(config())
    data = config()
    data["grants"][1] = {"tool": "crm__create_ticket"}

    apply_config(data)

    asha, ravi = User.objects.get(username="asha"), User.objects.get(username="ravi")
    assert not can(asha, "tools.use_tool", "crm__create_ticket")
    assert not can(ravi, "tools.approve_tool", "crm__create_ticket")


def test_it_reencrypts_a_secret_only_when_its_value_changes():
    apply_config(config())
    stored = Secret.objects.get(tenant__slug=SLUG, name="crm-token").ciphertext
    assert "tok-initial-1234" not in stored

    assert apply_config(config()).counts("secrets")["unchanged"] == 1
    assert Secret.objects.get(tenant__slug=SLUG, name="crm-token").ciphertext == stored

    data = config()
    data["secrets"][0]["value"] = "tok-rotated-5678"
    report = apply_config(data)

    secret = Secret.objects.get(tenant__slug=SLUG, name="crm-token")
    assert report.counts("secrets")["updated"] == 1
    assert secret.ciphertext != stored and secret.reveal() == "tok-rotated-5678"
    assert "tok-rotated-5678" not in secret.ciphertext and "tok-rotated-5678" not in report.render()


def test_it_imports_builtin_tools_disabled_unless_enabled_in_the_file():
    report = apply_config(config())

    tools = {t.remote_name: t for t in Tool.objects.filter(server__name="platform", tenant__slug=SLUG)}
    assert set(tools) == set(BUILTINS)
    assert [name for name, tool in tools.items() if tool.enabled] == ["echo"]
    assert tools["echo"].effect_class == "read_only" and tools["clock"].effect_class == "unsafe"
    assert "tool platform__clock was discovered and stays disabled until configured" in report.notes


def test_it_bumps_the_policy_version_only_when_the_policy_changes():
    apply_config(config())
    assert Tool.objects.get(name="crm__create_ticket").policy_version == 1

    data = config()
    # The same rule in another layout, with a comment and its own @id: the same rule.
    data["tools"][1]["approval"] = '@id("crm__create_ticket.approval")\n// ours\n' + " ".join(
        HIGH_PRIORITY.split()
    )
    apply_config(data)
    assert Tool.objects.get(name="crm__create_ticket").policy_version == 1

    data["tools"][1]["approval"] = "always"
    report = apply_config(data)
    tool = Tool.objects.get(name="crm__create_ticket")
    assert (tool.approval_policy, tool.policy_version) == ("always", 2)
    assert "updated tools crm__create_ticket (approval_policy)" in report.changes


def test_it_leaves_quarantine_to_an_admin():
    apply_config(config())
    Tool.objects.filter(name="platform__echo").update(quarantined=True, quarantine_reason="schema changed")

    report = apply_config(config())

    tool = Tool.objects.get(name="platform__echo")
    assert tool.quarantined and tool.enabled
    assert any("platform__echo is enabled but quarantined" in note for note in report.notes)


def test_it_quarantines_a_builtin_whose_schema_changed_since_the_last_sync():
    apply_config(config())
    Tool.objects.filter(name="platform__noop").update(schema_hash="0" * 64)

    report = apply_config(config())

    assert Tool.objects.get(name="platform__noop").quarantined
    assert report.outcomes["tools"]["platform__noop"] == "updated"


def test_a_dry_run_reports_changes_and_writes_nothing():
    before = snapshot()

    report = apply_config(config(), dry_run=True)

    assert report.dry_run and report.counts("tenant")["created"] == 1
    assert "dry run, nothing written" in report.render()
    assert snapshot() == before


def test_it_moves_the_limit_of_todays_tenant_account_with_the_daily_budget():
    apply_config(config())
    tenant = Tenant.objects.get(slug=SLUG)
    account = tenant_day_account(tenant, local_day(tenant))
    assert account.limit_micros == 25_000_000

    data = config()
    data["tenant"]["daily_budget"] = "40.5"
    report = apply_config(data)

    account = tenant_day_account(tenant, local_day(tenant))
    assert account.limit_micros == 40_500_000
    assert report.counts("budgets")["updated"] == 1


def test_it_substitutes_environment_variables(monkeypatch):
    monkeypatch.setenv("APPLY_TEST_CRM_URL", "http://127.0.0.1:9/other")
    monkeypatch.delenv("APPLY_TEST_MISSING", raising=False)
    data = config()
    data["tool_servers"][1]["url"] = "${APPLY_TEST_CRM_URL:-http://127.0.0.1:9/default}"
    data["tenant"]["name"] = "${APPLY_TEST_MISSING:-Acme Default}"
    data["model_endpoints"][0]["config"] = {"note": "$${literal}", "turns": [{"text": "$input.x"}]}

    apply_config(data)

    assert ToolServer.objects.get(name="crm").url == "http://127.0.0.1:9/other"
    assert Tenant.objects.get(slug=SLUG).name == "Acme Default"
    assert ModelEndpoint.objects.get(name="scripted").config == {
        "note": "${literal}",
        "turns": [{"text": "$input.x"}],
    }

    data["users"][0]["password"] = "${APPLY_TEST_MISSING}"
    assert ("users[0].password", "environment variable APPLY_TEST_MISSING is not set") in rejected(data)


def test_it_refuses_a_username_of_another_tenant():
    other = Tenant.objects.create(slug="other", name="Other")
    User.objects.create_user(username="asha", password="x", tenant=other)

    errors = rejected(config())

    assert ("users[0].username", "this username belongs to another tenant or to an operator") in errors
    assert User.objects.get(username="asha").tenant == other


def test_an_edited_version_becomes_a_new_version_and_old_ones_are_reused():
    apply_config(config())
    data = config()
    data["agents"][0]["versions"][1] = spec("platform__echo", "crm__create_ticket", description="edited")
    data["agents"][0]["aliases"] = {"prod": 3, "canary": 1}

    report = apply_config(data)

    assert sorted(report.outcomes["versions"].items()) == [
        ("helper v1", "unchanged"),
        ("helper v3", "created"),
    ]
    assert report.outcomes["aliases"] == {"helper@prod": "updated", "helper@canary": "unchanged"}
    assert AgentVersion.objects.filter(agent__name="helper").count() == 3


def test_the_command_prints_the_report_and_exits_with_errors(tmp_path):
    path = tmp_path / "tenant.yaml"
    path.write_text(yaml.safe_dump(config()))
    out = StringIO()

    call_command("apply", str(path), "--dry-run", stdout=out)
    assert "tenant acme-test: dry run, nothing written" in out.getvalue()
    assert not Tenant.objects.filter(slug=SLUG).exists()

    bad = config()
    bad["tools"][0]["effect"] = "sometimes"
    path.write_text(yaml.safe_dump(bad))
    err = StringIO()
    with pytest.raises(CommandError, match="1 error"):
        call_command("apply", str(path), stdout=StringIO(), stderr=err)
    assert "tools[0].effect: must be one of read_only, idempotent, reconcilable, unsafe" in err.getvalue()


def test_load_file_names_the_line_of_a_yaml_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("tenant:\n  slug: [unclosed\n")

    with pytest.raises(ConfigError) as caught:
        load_file(path)

    assert caught.value.errors[0][0].startswith("line ")


# --- against the example bank MCP server ---

needs_bank = pytest.mark.skipif(
    not (ROOT / "examples" / "bank_server.py").exists(), reason="examples/bank_server.py is not there"
)


@needs_bank
def test_the_dispute_example_applies_against_the_bank_server(bank, monkeypatch):
    monkeypatch.setenv("BANK_MCP_URL", bank.mcp_url)
    data = load_file(ROOT / "examples" / "dispute.yaml")

    first = apply_config(data)
    second = apply_config(data)

    assert first.counts("tools")["created"] == 7 and not second.changed
    tools = {t.remote_name: t for t in Tool.objects.filter(tenant__slug="acme-bank")}
    assert not tools["refund_status"].enabled and tools["transfer_funds"].enabled
    assert tools["issue_refund"].effect_class == "idempotent"
    asha, ravi = User.objects.get(username="asha"), User.objects.get(username="ravi")
    usable = get_objects_for_user(
        asha,
        "tools.use_tool",
        klass=Tool.objects.filter(tenant__slug="acme-bank"),
        with_superuser=False,
        accept_global_perms=False,
    )
    assert sorted(usable.values_list("remote_name", flat=True)) == [
        "issue_refund",
        "lookup_transaction",
        "search_tickets",
        "send_customer_email",
    ]
    approvable = get_objects_for_user(
        ravi, "tools.approve_tool", klass=Tool.objects.all(), with_superuser=False, accept_global_perms=False
    )
    assert sorted(approvable.values_list("remote_name", flat=True)) == ["issue_refund", "send_customer_email"]
    prod = Alias.objects.get(agent__tenant__slug="acme-bank", agent__name="dispute-agent", name="prod")
    assert prod.version.number == 2 and "bank__issue_refund" in prod.version.spec["tools"]


@needs_bank
def test_it_sends_a_secret_new_in_the_file_to_discovery():
    from tests.servers import BankServer

    server = BankServer("bank", "--require-token", "tok-bank-9876").start()
    try:
        data = {
            "tenant": {"slug": SLUG},
            "secrets": [{"name": "bank-token", "value": "tok-bank-9876"}],
            "tool_servers": [
                {
                    "name": "bank",
                    "kind": "mcp",
                    "url": f"{server.url}/mcp",
                    "secret": "bank-token",
                    "discover": True,
                }
            ],
        }
        assert apply_config(data).counts("tools")["created"] == 7

        data["secrets"][0]["value"] = "tok-wrong-0000"
        errors = rejected(data)
    finally:
        server.stop()
    assert [path for path, _ in errors] == ["tool_servers[0].url"]
    assert "tok-wrong-0000" not in errors[0][1]


def test_an_unreachable_server_is_an_error_at_its_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = config()
    data["tool_servers"].append(
        {"name": "bank", "kind": "mcp", "url": f"http://127.0.0.1:{port}/mcp", "discover": True}
    )
    data["tools"].append({"server": "bank", "name": "issue_refund", "enabled": True})

    errors = rejected(data)

    assert [path for path, _ in errors] == ["tool_servers[2].url"]
    assert errors[0][1].startswith("cannot list the server's tools")
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_it_does_not_repeat_an_error_through_the_references_to_the_bad_item():
    data = config()
    data["model_endpoints"][0]["kind"] = "gpt"

    errors = rejected(data)

    assert errors == [("model_endpoints[0].kind", "must be one of openai, anthropic, scripted")]


def test_the_report_has_a_one_line_summary():
    assert (
        str(apply_config(config()))
        == "tenant acme-test: applied (created 24, updated 0, unchanged 0, removed 0)"
    )


def test_the_documented_fallback_form_with_a_bare_on_applies(tmp_path):
    # YAML 1.1 (PyYAML's default) reads a bare `on` as true; the file is read with YAML 1.2's
    # booleans (true/false only), so docs/configuration.md's flow form applies as written.
    data = config()
    data["model_endpoints"].append({**data["model_endpoints"][0], "name": "azure-backup"})
    data["agents"][0]["versions"] = [spec("platform__echo")]
    data["agents"][0]["aliases"] = {"prod": 1}
    text = yaml.safe_dump(data, sort_keys=False).replace(
        "  - model: scripted\n",
        "  - model: scripted\n"
        "    fallbacks:\n"
        "      - {model: azure-backup, on: [rate_limited, server_error, timeout], rate_limit_retries: 2}\n",
        1,
    )
    path = tmp_path / "tenant.yaml"
    path.write_text(text)

    apply_config(load_file(path))

    stored = AgentVersion.objects.get(agent__tenant__slug=SLUG, number=1).spec["fallbacks"]
    assert stored[0]["model"] == "azure-backup"
    assert stored[0]["on"] == ["rate_limited", "server_error", "timeout"]


def test_yes_no_on_and_off_are_text_not_booleans(tmp_path):
    data = config()
    data["tools"][0]["enabled"] = "__ENABLED__"
    path = tmp_path / "tenant.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False).replace("'__ENABLED__'", "yes"))

    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))

    assert any(where == "tools[0].enabled" for where, _ in caught.value.errors), caught.value.errors
