"""Tenant scoping on every page, write-only secrets, immutable versions, tools and their grants."""

from __future__ import annotations

from django.contrib.auth.models import Permission
from guardian.shortcuts import get_perms

from agents.models import AgentVersion, Alias
from tenants.models import Secret
from tests import factories
from tools.models import Tool

PLAINTEXT = "sk-live-very-secret-value-42"


def test_a_secret_is_write_only(as_ravi, acme):
    response = as_ravi.post(
        "/admin/tenants/secret/add/", {"tenant": acme.tenant.pk, "name": "bank-token", "value": PLAINTEXT}
    )
    assert response.status_code == 302, response.context["adminform"].form.errors
    secret = Secret.objects.get(tenant=acme.tenant, name="bank-token")
    assert secret.reveal() == PLAINTEXT

    html = as_ravi.get(f"/admin/tenants/secret/{secret.pk}/change/").content.decode()
    listing = as_ravi.get("/admin/tenants/secret/").content.decode()

    for page in (html, listing):
        assert PLAINTEXT not in page
        assert secret.ciphertext not in page
    assert 'type="password"' in html


def test_an_empty_value_keeps_the_secret_and_a_new_one_replaces_it(as_ravi, acme):
    secret = Secret(tenant=acme.tenant, name="bank-token")
    secret.set_value(PLAINTEXT)
    secret.save()
    url = f"/admin/tenants/secret/{secret.pk}/change/"

    as_ravi.post(url, {"tenant": acme.tenant.pk, "name": "bank-token", "value": ""})
    secret.refresh_from_db()
    assert secret.reveal() == PLAINTEXT

    as_ravi.post(url, {"tenant": acme.tenant.pk, "name": "bank-token", "value": "rotated-value"})
    secret.refresh_from_db()
    assert secret.reveal() == "rotated-value"


def test_a_secret_cannot_be_added_to_another_tenant(as_ravi, acme, globex):
    response = as_ravi.post(
        "/admin/tenants/secret/add/", {"tenant": globex.tenant.pk, "name": "x", "value": "abcd"}
    )

    assert response.status_code == 200
    assert "tenant" in response.context["adminform"].form.errors
    assert not Secret.objects.filter(name="x").exists()


def test_an_agent_version_cannot_be_modified(client, operator, acme):
    version = AgentVersion.objects.get(agent__tenant=acme.tenant, agent__name="refunder")
    client.force_login(operator)
    url = f"/admin/agents/agentversion/{version.pk}/change/"

    page = client.get(url)
    refused = client.post(url, {"number": 99, "spec": "{}"})

    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert refused.status_code == 403
    version.refresh_from_db()
    assert version.number == 1
    assert client.post(f"/admin/agents/agentversion/{version.pk}/delete/", {"post": "yes"}).status_code == 403
    assert client.get("/admin/agents/agentversion/add/").status_code == 403


def test_lists_and_choices_hold_only_the_users_tenant(as_ravi, acme, globex):
    factories.make_endpoint(globex.tenant, name="their-model")
    theirs = Secret(tenant=globex.tenant, name="their-secret")
    theirs.set_value("abcd1234")
    theirs.save()
    acme.ravi.user_permissions.add(Permission.objects.get(codename="add_toolserver"))

    tools = as_ravi.get("/admin/tools/tool/").context["cl"].result_list
    form = as_ravi.get("/admin/tenants/secret/add/").context["adminform"].form

    assert {t.tenant_id for t in tools} == {acme.tenant.pk}
    assert list(form.fields["tenant"].queryset) == [acme.tenant]
    # Servers are destinations: only operators add them (tests/admin/test_destinations.py).
    assert as_ravi.get("/admin/tools/toolserver/add/").status_code == 403
    assert as_ravi.get(f"/admin/tenants/secret/{theirs.pk}/change/").status_code == 404
    assert as_ravi.get(f"/admin/tenants/user/{globex.bob.pk}/change/").status_code == 404


def test_an_operator_sees_every_tenant(client, operator, acme, globex):
    client.force_login(operator)

    tools = client.get("/admin/tools/tool/").context["cl"].result_list

    assert {t.tenant_id for t in tools} == {acme.tenant.pk, globex.tenant.pk}


def test_the_tool_page_shows_hints_and_releases_quarantine_after_review(as_ravi, acme):
    echo = acme.tools["echo"]
    Tool.objects.filter(pk=echo.pk).update(quarantined=True, quarantine_reason="the server changed this tool")

    listing = as_ravi.get("/admin/tools/tool/").content.decode()
    assert "the server changed this tool" in listing
    assert '<span class="hint">readOnly: yes</span>' in listing

    response = as_ravi.post(
        "/admin/tools/tool/", {"action": "release_selected", "_selected_action": [echo.pk]}, follow=True
    )

    assert "released 1 tool(s) from quarantine" in [str(m) for m in response.context["messages"]]
    echo.refresh_from_db()
    assert (echo.quarantined, echo.quarantine_reason) == (False, "")


def test_an_invalid_approval_policy_is_refused(as_ravi, acme):
    echo = acme.tools["echo"]
    data = {
        "enabled": "on",
        "effect_class": "read_only",
        "approval_policy": "amount >",
        "timeout_seconds": 30,
        "price_micros": 0,
        "max_attempts": 3,
        "backoff_seconds": 1,
    }

    response = as_ravi.post(f"/admin/tools/tool/{echo.pk}/change/", data)

    assert "approval_policy" in response.context["adminform"].form.errors
    echo.refresh_from_db()
    assert echo.approval_policy == "always"


def test_tool_grants_are_made_in_the_admin_within_the_tenant(as_ravi, acme, globex):
    noop = acme.tools["noop"]
    url = f"/admin/tools/tool/{noop.pk}/permissions/user-manage/{acme.asha.pk}/"

    response = as_ravi.post(url, {"permissions": ["use_tool", "approve_tool"]})

    assert response.status_code == 302
    assert set(get_perms(acme.asha, noop)) >= {"use_tool", "approve_tool"}
    assert (
        as_ravi.get(f"/admin/tools/tool/{noop.pk}/permissions/user-manage/{globex.bob.pk}/").status_code
        == 404
    )
    picked = as_ravi.post(
        f"/admin/tools/tool/{noop.pk}/permissions/", {"user": "bob", "submit_manage_user": "1"}
    )
    assert picked.status_code == 200 and picked.context["user_form"].errors


def test_a_tenant_admin_cannot_promote_anyone_to_superuser(client, acme):
    admin_user = factories.make_user(acme.tenant, "ada", staff=True)
    admin_user.user_permissions.add(*Permission.objects.filter(codename__in=["view_user", "change_user"]))
    client.force_login(admin_user)

    form = client.get(f"/admin/tenants/user/{acme.asha.pk}/change/").context["adminform"].form

    assert "is_superuser" not in form.fields and "user_permissions" not in form.fields
    assert list(form.fields["groups"].queryset.values_list("name", flat=True)) == ["acme:supervisors"]


def test_an_alias_moves_through_the_service_and_only_to_an_existing_version(as_ravi, acme):
    acme.ravi.user_permissions.add(*Permission.objects.filter(codename__in=["view_alias", "change_alias"]))
    alias = Alias.objects.get(agent__tenant=acme.tenant, agent__name="refunder", name="prod")
    factories.make_agent(
        acme.tenant,
        name="refunder",
        alias="canary",
        tools=[acme.tools["echo"]],
        endpoint=alias.version.model_endpoint,
        instructions="Second version.",
    )
    url = f"/admin/agents/alias/{alias.pk}/change/"

    refused = as_ravi.post(url, {"version_number": 7})
    moved = as_ravi.post(url, {"version_number": 2})

    assert "version_number" in refused.context["adminform"].form.errors
    assert moved.status_code == 302
    alias.refresh_from_db()
    assert alias.version.number == 2


def test_an_approval_rule_in_the_retired_language_is_refused_with_the_cedar_to_write(as_ravi, acme):
    echo = acme.tools["echo"]
    data = {
        "enabled": "on",
        "effect_class": "read_only",
        "approval_policy": "x > 1",
        "timeout_seconds": 30,
        "price_micros": 0,
        "max_attempts": 3,
        "backoff_seconds": 1,
    }

    response = as_ravi.post(f"/admin/tools/tool/{echo.pk}/change/", data)

    [error] = response.context["adminform"].form.errors["approval_policy"]
    assert "retired expression language" in error
    assert f'permit (principal, action == Action::"{echo.name}", resource)' in error
    assert "context.arguments.x > 1" in error
    echo.refresh_from_db()
    assert (echo.approval_policy, echo.policy_version) == ("always", 1)


def test_a_policy_change_in_the_admin_bumps_the_policy_version(as_ravi, acme):
    echo = acme.tools["echo"]
    rule = f'@approval("x above 1")\npermit (principal, action == Action::"{echo.name}", resource)\nwhen {{ context.arguments.x > 1 }};'
    data = {
        "enabled": "on",
        "effect_class": "read_only",
        "approval_policy": rule,
        "timeout_seconds": 30,
        "price_micros": 0,
        "max_attempts": 3,
        "backoff_seconds": 1,
    }

    response = as_ravi.post(f"/admin/tools/tool/{echo.pk}/change/", data)

    assert response.status_code == 302
    echo.refresh_from_db()
    assert (echo.approval_policy, echo.policy_version) == (rule, 2)
    as_ravi.post(f"/admin/tools/tool/{echo.pk}/change/", dict(data, timeout_seconds=31))
    echo.refresh_from_db()
    assert (echo.timeout_seconds, echo.policy_version) == (31, 2)


def test_run_agent_is_granted_in_the_admin_within_the_tenant(client, acme, globex):
    from agents.models import AgentDefinition
    from agents.selectors import may_run_agent

    ada = factories.make_user(acme.tenant, "ada", staff=True)
    ada.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_agentdefinition", "change_agentdefinition"])
    )
    client.force_login(ada)
    refunder = AgentDefinition.objects.get(tenant=acme.tenant, name="refunder")
    bea = factories.make_user(acme.tenant, "bea")
    base = f"/admin/agents/agentdefinition/{refunder.pk}/permissions"
    assert not may_run_agent(bea, refunder.pk)

    response = client.post(f"{base}/user-manage/{bea.pk}/", {"permissions": ["run_agent"]})

    assert response.status_code == 302
    assert may_run_agent(bea, refunder.pk)
    assert client.get(f"{base}/user-manage/{globex.bob.pk}/").status_code == 404
    theirs = AgentDefinition.objects.get(tenant=globex.tenant, name="refunder")
    assert client.get(f"/admin/agents/agentdefinition/{theirs.pk}/permissions/").status_code == 404
