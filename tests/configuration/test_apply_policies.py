"""`apply` with Cedar policies: validated against the generated schema, errors at file and line
with Cedar's message, tests in the file run, nothing applied on error; `manage.py policy`."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command

from approvals.models import PolicySet, ShadowDecision, TenantPolicies
from configuration.apply import ConfigError, apply_config, load_file
from tenants.models import Tenant
from tests.configuration.test_apply import SLUG, config

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]

TICKETS = """\
// ticket rules
@id("no-urgent-from-support")
@reason("support agents do not open urgent tickets")
forbid (principal in Group::"support-agents", action == Action::"crm__create_ticket", resource)
when { context.arguments has priority && context.arguments.priority == "urgent" };
"""


def write_file(tmp_path, policies: dict, cedar: str | None = TICKETS, **changes) -> Path:
    data = {**config(), **changes, "policies": policies}
    if cedar is not None:
        (tmp_path / "tickets.cedar").write_text(cedar)
    path = tmp_path / "tenant.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sets(**extra) -> dict:
    return {"sets": [{"name": "tickets", "file": "tickets.cedar"}], **extra}


URGENT_TEST = {
    "name": "urgent is refused",
    "principal": "asha",
    "tool": "crm__create_ticket",
    "arguments": {"priority": "urgent"},
    "expect": "deny",
    "policy": "no-urgent-from-support",
}


def test_it_applies_a_cedar_file_beside_the_configuration_and_runs_its_tests(tmp_path):
    path = write_file(tmp_path, sets(tests=[URGENT_TEST]))
    report = apply_config(load_file(path))
    assert "created policy set tickets (enforce)" in report.changes
    tenant = Tenant.objects.get(slug=SLUG)
    stored = PolicySet.objects.get(tenant=tenant)
    assert stored.text == TICKETS and stored.source == str((tmp_path / "tickets.cedar").resolve())
    assert TenantPolicies.objects.get(tenant=tenant).group_roles == {"support-agents": [], "supervisors": []}
    again = apply_config(load_file(path))
    assert not [c for c in again.changes if "polic" in c]


def test_a_policy_the_validator_refuses_is_reported_at_its_file_and_line_and_nothing_is_applied(tmp_path):
    wrong = (
        TICKETS
        + '\n@id("typo")\nforbid (principal, action == Action::"crm__create_ticket", resource)\nwhen { context.arguments.prio == "x" };\n'
    )
    path = write_file(tmp_path, sets(), cedar=wrong)
    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))
    where, message = next((p, m) for p, m in caught.value.errors if "validator" in m)
    assert where == f"{(tmp_path / 'tickets.cedar').resolve()}:7"
    assert "prio" in message
    # The policy's @id, never Cedar's internal number for it.
    assert message.startswith("policy 'typo': ") and "policy0" not in message and "policy1" not in message
    assert not Tenant.objects.filter(slug=SLUG).exists()


@pytest.mark.parametrize(
    ("policy", "complaint"),
    [
        (
            'forbid (principal in Group::"support-agent", action, resource);',
            "no group 'support-agent' in this tenant (did you mean 'support-agents'?)",
        ),
        (
            'forbid (principal == User::"asah", action, resource);',
            "no user 'asah' in this tenant (did you mean 'asha'?)",
        ),
        (
            'forbid (principal, action, resource == Tool::"crm__create_tiket");',
            "no tool 'crm__create_tiket' in this tenant (did you mean 'crm__create_ticket'?)",
        ),
        (
            'forbid (principal, action == Action::"start_run", resource == Agent::"helpr");',
            "no agent 'helpr' in this tenant (did you mean 'helper'?)",
        ),
        (
            'forbid (principal, action, resource) when { context has agent && context.agent == Agent::"nobody" };',
            "no agent 'nobody' in this tenant",
        ),
        (
            "forbid (principal, action, resource) when { principal has department };",
            "principal has no attribute 'department'; declare it under policies.attributes",
        ),
        (
            'forbid (principal, action == Action::"crm__create_ticket", resource)'
            " when { context.arguments has priorty };",
            "no tool of this tenant has an argument 'priorty' (did you mean 'priority'?)",
        ),
        (
            'forbid (principal, action, resource) when { principal.roles.contains("refunder") };',
            "no group of this tenant gives the role 'refunder'",
        ),
    ],
    ids=["group", "user", "tool", "agent", "agent-in-condition", "has-attribute", "has-argument", "role"],
)
def test_a_policy_naming_what_the_tenant_does_not_have_is_refused_with_its_id_and_place(
    tmp_path, policy, complaint
):
    # Cedar's validator knows entity types, not which entities exist: each of these would match
    # nothing, so the rule it was written for would protect nothing, silently.
    path = write_file(tmp_path, sets(), cedar=TICKETS + f'\n@id("never-matches")\n{policy}\n')

    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))

    [(where, message)] = caught.value.errors
    assert where == f"{(tmp_path / 'tickets.cedar').resolve()}:7"
    assert message.startswith(f"policy 'never-matches': {complaint}"), message
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_an_inline_policy_naming_an_unknown_group_is_placed_at_its_line_in_the_yaml(tmp_path):
    path = tmp_path / "tenant.yaml"
    path.write_text(
        yaml.safe_dump(config(), sort_keys=False)
        + "policies:\n  sets:\n    - name: inline\n      text: |\n"
        + '        @id("no-refunds")\n'
        + '        forbid (principal in Group::"support-agent", action, resource);\n'
    )
    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))
    [(where, message)] = caught.value.errors
    line = path.read_text().splitlines().index('        @id("no-refunds")') + 1
    assert where == f"{path}:{line}"
    assert message.startswith("policy 'no-refunds': no group 'support-agent' in this tenant")


def test_declared_attributes_roles_and_existing_entities_are_accepted(tmp_path):
    fine = TICKETS + (
        '\n@id("known")\nforbid (principal in Group::"supervisors", action, resource == Tool::"platform__echo")'
        ' when { principal has desk && principal.desk == "x" && principal.roles.contains("supervisor") };\n'
    )
    path = write_file(
        tmp_path,
        sets(attributes={"user": {"desk": "string"}}),
        cedar=fine,
        groups=[{"name": "support-agents"}, {"name": "supervisors", "roles": ["supervisor"]}],
    )
    report = apply_config(load_file(path))
    assert "created policy set tickets (enforce)" in report.changes


def test_a_policy_for_a_group_with_no_active_member_is_reported_not_refused(tmp_path):
    lonely = TICKETS + '\n@id("auditors-only")\npermit (principal in Group::"auditors", action, resource);\n'
    path = write_file(
        tmp_path,
        sets(),
        cedar=lonely,
        groups=[{"name": "support-agents"}, {"name": "supervisors"}, {"name": "auditors"}],
    )
    report = apply_config(load_file(path))
    assert [note for note in report.notes if "polic" in note] == [
        f"{(tmp_path / 'tickets.cedar').resolve()}:7: policy 'auditors-only' applies to group 'auditors', "
        "which has no active member"
    ]
    assert "created policy set tickets (enforce)" in report.changes


def test_a_policy_that_does_not_parse_is_placed_too(tmp_path):
    path = write_file(
        tmp_path, sets(), cedar=TICKETS + '\n@id("broken")\nforbid (principal, action, resource) when { };\n'
    )
    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))
    assert any(p.endswith("tickets.cedar:7") and "cannot parse" in m for p, m in caught.value.errors)


def test_an_inline_policy_without_id_is_refused_at_its_line_in_the_yaml(tmp_path):
    inline = {"sets": [{"name": "inline", "text": "permit (principal, action, resource)\nwhen { true };"}]}
    path = write_file(tmp_path, inline, cedar=None)
    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))
    assert any("@id" in m and p.startswith(str(path)) for p, m in caught.value.errors), caught.value.errors


def test_a_failing_policy_test_refuses_the_apply(tmp_path):
    wrong_expectation = {**URGENT_TEST, "arguments": {"priority": "low"}}
    path = write_file(tmp_path, sets(tests=[wrong_expectation]))
    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))
    assert any("expected deny by no-urgent-from-support, got allow" in m for _, m in caught.value.errors)
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_an_old_approval_rule_without_a_cedar_equivalent_is_refused_with_why(tmp_path):
    data = config()
    data["tools"][1]["approval"] = "tags == ['a']"
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    assert any(
        p == "tools[1].approval"
        and "retired expression language" in m
        and "no Cedar equivalent" in m
        and "The nearest stricter Cedar policy" in m
        and 'permit (principal, action == Action::"crm__create_ticket", resource)' in m
        for p, m in caught.value.errors
    ), caught.value.errors


def test_an_old_approval_rule_is_refused_with_the_cedar_to_write(tmp_path):
    data = config()
    data["tools"][1]["approval"] = "priority == 'high'"
    data["agents"][0]["versions"][1]["approval_overrides"] = {"crm__create_ticket": "priority != 'low'"}
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    errors = dict(caught.value.errors)
    tool = errors["tools[1].approval"]
    assert "retired expression language" in tool and "Write:" in tool
    assert "@approval(\"policy: priority == 'high'\")" in tool
    assert 'context.arguments.priority == "high"' in tool
    override = errors["agents[0].versions[1].approval_overrides.crm__create_ticket"]
    assert '@id("crm__create_ticket.approval.override")' in override
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_the_tools_cedar_rule_decides_in_the_files_tests(tmp_path):
    # config()'s ticket tool has a Cedar rule: a high-priority ticket waits, a low one does not.
    high = {
        "name": "high waits",
        "principal": "asha",
        "tool": "crm__create_ticket",
        "arguments": {"priority": "high"},
        "expect": "approval",
        "policy": "crm__create_ticket.approval",
    }
    low = {**high, "name": "low goes", "arguments": {"priority": "low"}, "expect": "allow"}
    del low["policy"]
    path = write_file(tmp_path, sets(tests=[high, low]))
    apply_config(load_file(path))
    wrong = {**low, "expect": "approval"}
    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(write_file(tmp_path, sets(tests=[wrong]))))
    assert any("expected approval, got allow" in m for _, m in caught.value.errors)


def test_policy_convert_prints_the_cedar_of_rules_in_the_retired_language(tmp_path):
    path = write_file(tmp_path, sets())
    data = yaml.safe_load(path.read_text())
    data["tools"][1]["approval"] = "priority == 'high'"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    out = StringIO()
    call_command("policy", "convert", str(path), stdout=out)
    assert "// tools[1].approval (crm__create_ticket): priority == 'high'" in out.getvalue()
    assert "@approval(\"policy: priority == 'high'\")" in out.getvalue()
    assert 'context.arguments.priority == "high"' in out.getvalue()
    assert "// tools[0].approval" not in out.getvalue()  # no approval: given, nothing to convert
    data["tools"][1]["approval"] = "tags == ['a']"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    err = StringIO()
    with pytest.raises(CommandError, match="1 rule"):
        call_command("policy", "convert", str(path), stdout=StringIO(), stderr=err)
    assert "The nearest stricter Cedar policy" in err.getvalue()


def test_policy_test_command_runs_the_files_tests(tmp_path):
    path = write_file(tmp_path, sets(tests=[URGENT_TEST]))
    apply_config(load_file(path))
    out = StringIO()
    call_command("policy", "test", str(path), stdout=out)
    assert "1 policy test(s) passed" in out.getvalue()
    failing = write_file(tmp_path, sets(tests=[{**URGENT_TEST, "expect": "allow"}]))
    with pytest.raises(CommandError):
        call_command("policy", "test", str(failing), stdout=StringIO(), stderr=StringIO())


def test_policy_report_counts_shadow_decisions_by_policy(tmp_path):
    path = write_file(tmp_path, {"sets": [{"name": "trial", "file": "tickets.cedar", "mode": "shadow"}]})
    apply_config(load_file(path))
    tenant = Tenant.objects.get(slug=SLUG)
    from tests import factories

    agent_run = factories.make_agent(tenant, tools=[], turns=[{"text": "x"}])
    from runs.services import start_run

    run, _ = start_run(user=tenant.users.get(username="asha"), agent=agent_run.agent.name, input={})
    for outcome, ids in (
        ("deny", ["no-urgent-from-support"]),
        ("deny", ["no-urgent-from-support"]),
        ("allow", []),
    ):
        ShadowDecision.objects.create(
            tenant=tenant,
            run=run,
            step_seq=1,
            tool_name="crm__create_ticket",
            policy_set="trial",
            outcome=outcome,
            policies=ids,
        )
    out = StringIO()
    call_command("policy", "report", SLUG, "--last", "10", stdout=out)
    text = out.getvalue()
    assert "over the last 3 call(s)" in text
    assert "trial: deny 2" in text and "no-urgent-from-support: 2" in text and "trial: allow 1" in text


def test_every_policy_in_the_doc_is_one_the_examples_run():
    """docs/policies.md shows policies of examples/dispute.cedar, whose tests (examples/dispute.yaml)
    run at every apply of the example: a policy edited in one place and not the other fails here."""
    import re

    from approvals.policy_sets import statements

    doc = (ROOT / "docs" / "policies.md").read_text()
    example = " ".join((ROOT / "examples" / "dispute.cedar").read_text().split())
    blocks = re.findall(r"```cedar\n(.*?)```", doc, re.S)
    shown = [" ".join(text.split()) for block in blocks for _, text in statements(block)]
    assert len(shown) >= 7
    for policy in shown:
        body = (
            " ".join(line for line in policy.split("// ")[-1:] if line) if policy.startswith("//") else policy
        )
        assert body.split("@id", 1)[-1] in example, policy


def test_a_policy_test_with_a_key_it_does_not_know_is_refused(tmp_path):
    # `{name: approves at most INR 25,000, ...}`: the comma splits the name, `000` becomes a key.
    path = write_file(tmp_path, sets(), cedar=TICKETS)
    path.write_text(
        path.read_text()
        + "  tests:\n    - {name: at most INR 25,000, principal: asha, tool: crm__create_ticket, expect: allow}\n"
    )
    with pytest.raises(ConfigError) as caught:
        apply_config(load_file(path))
    assert any(
        where == "policies.tests[0]" and "unknown key 0" in message and "quote the name" in message
        for where, message in caught.value.errors
    ), caught.value.errors
