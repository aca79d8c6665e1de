"""Supervisors cannot change where a tool's calls go or which secret they carry (issue #12, item 1)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission

from llm.models import ModelEndpoint
from tenants.models import Secret
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db(transaction=True)


def _change_form(client, url: str) -> dict:
    """The change form's current values, as the browser would post them back."""
    response = client.get(url)
    assert response.status_code == 200
    form = response.context["adminform"].form
    data = {}
    for name, field in form.fields.items():
        value = field.prepare_value(form[name].value())
        if value is not None:
            data[name] = value
    return data


@pytest.fixture
def http_server(acme):
    secret = Secret(tenant=acme.tenant, name="crm-token")
    secret.set_value("crm-secret-value")
    secret.save()
    server = ToolServer.objects.create(
        tenant=acme.tenant,
        name="crm",
        kind=ToolServer.Kind.HTTP,
        url="https://crm.acme.example/api",
        secret=secret,
    )
    tool = Tool.objects.create(
        tenant=acme.tenant,
        server=server,
        name="crm__open",
        remote_name="open",
        input_schema={"type": "object"},
        enabled=True,
    )
    return server, tool


def test_a_supervisor_cannot_point_a_tool_at_another_url(as_ravi, acme, http_server):
    _, tool = http_server
    url = f"/admin/tools/tool/{tool.pk}/change/"
    data = {
        **_change_form(as_ravi, url),
        "http_url": "http://attacker.example/collect",
        "status_url": "http://attacker.example/s/{key}",
        "timeout_seconds": "12",
    }

    response = as_ravi.post(url, data)

    assert response.status_code == 302, response.content[:2000]
    tool.refresh_from_db()
    assert (tool.http_url, tool.status_url) == ("", "")
    assert tool.timeout_seconds == 12  # the rest of the form still saves


def test_a_supervisor_with_change_permission_on_servers_cannot_change_their_destination(
    client, acme, http_server
):
    server, _ = http_server
    acme.ravi.user_permissions.add(
        *Permission.objects.filter(
            codename__in=[
                "change_toolserver",
                "view_toolserver",
                "change_modelendpoint",
                "add_toolserver",
                "add_modelendpoint",
            ]
        )
    )
    client.force_login(acme.ravi)
    other = Secret(tenant=acme.tenant, name="other")
    other.set_value("other-secret-value")
    other.save()
    url = f"/admin/tools/toolserver/{server.pk}/change/"
    data = {
        **_change_form(client, url),
        "url": "http://attacker.example/",
        "secret": other.pk,
        "auth_header": "X-Leak",
        "kind": "http",
        "status_tool": "open",
    }

    client.post(url, data)

    server.refresh_from_db()
    assert (server.url, server.secret_id, server.auth_header) == (
        "https://crm.acme.example/api",
        server.secret_id,
        "Authorization",
    )
    assert (server.secret.name, server.status_tool) == ("crm-token", "")
    assert client.get("/admin/tools/toolserver/add/").status_code == 403
    assert client.get("/admin/llm/modelendpoint/add/").status_code == 403


def test_a_supervisor_cannot_change_a_model_endpoints_url_or_key(client, acme):
    endpoint = ModelEndpoint.objects.filter(tenant=acme.tenant).first()
    acme.ravi.user_permissions.add(
        *Permission.objects.filter(codename__in=["change_modelendpoint", "view_modelendpoint"])
    )
    client.force_login(acme.ravi)
    url = f"/admin/llm/modelendpoint/{endpoint.pk}/change/"
    data = {
        **_change_form(client, url),
        "base_url": "http://attacker.example/v1",
        "kind": "openai",
        "timeout_seconds": "45",
    }

    response = client.post(url, data)

    assert response.status_code == 302, response.content[:3000]

    endpoint.refresh_from_db()
    assert (endpoint.base_url, endpoint.kind, endpoint.timeout_seconds) == ("", "scripted", 45)


def test_an_operator_may_change_a_tools_url(client, operator, http_server):
    _, tool = http_server
    client.force_login(operator)
    url = f"/admin/tools/tool/{tool.pk}/change/"
    data = {**_change_form(client, url), "http_url": "https://crm.acme.example/api/v2/open"}

    response = client.post(url, data)

    assert response.status_code == 302, response.content[:2000]
    tool.refresh_from_db()
    assert tool.http_url == "https://crm.acme.example/api/v2/open"
