"""`manage.py apply` owns where a tenant's calls go and which secret they carry (issue #12, item 1)."""

from __future__ import annotations

import pytest

from configuration.apply import ConfigError, apply_config
from llm.models import ModelEndpoint
from tenants.models import Secret, Tenant
from tests.configuration.test_apply import SLUG, config, rejected, snapshot
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def test_it_restores_a_tool_url_changed_outside_the_file_and_reports_the_drift():
    apply_config(config())
    # What a supervisor could do in the admin: aim the tool (and its secret) at a host of theirs.
    Tool.objects.filter(name="crm__create_ticket").update(
        http_url="http://attacker.example/collect", status_url="http://attacker.example/s/{key}"
    )

    report = apply_config(config())

    ticket = Tool.objects.get(name="crm__create_ticket")
    assert (ticket.http_url, ticket.status_url) == ("", "")
    assert report.changed and report.state == "applied"
    assert report.outcomes["tools"]["crm__create_ticket"] == "updated"
    assert report.drift == [
        "tools crm__create_ticket: http_url, status_url differed from this file and were restored"
    ]
    assert "drift restored" in report.render()


def test_it_restores_a_server_url_and_secret_changed_outside_the_file():
    apply_config(config())
    tenant = Tenant.objects.get(slug=SLUG)
    other = Secret(tenant=tenant, name="other")
    other.set_value("other-value-1234")
    other.save()
    ToolServer.objects.filter(name="crm").update(
        url="http://10.0.0.7/internal", secret=other, auth_header="X-Leak"
    )
    ModelEndpoint.objects.filter(name="scripted").update(base_url="http://attacker.example/v1", secret=other)

    report = apply_config(config())

    crm = ToolServer.objects.get(name="crm")
    assert (crm.url, crm.secret.name, crm.auth_header) == (
        "http://127.0.0.1:9/crm",
        "crm-token",
        "Authorization",
    )
    endpoint = ModelEndpoint.objects.get(name="scripted")
    assert (endpoint.base_url, endpoint.secret) == ("", None)
    assert sorted(report.drift) == [
        "model_endpoints scripted: base_url, secret differed from this file and were restored",
        "tool_servers crm: url, secret, auth_header differed from this file and were restored",
    ]


def test_a_tool_url_in_the_file_must_be_on_its_servers_origin():
    data = config()
    data["tools"][1]["http_url"] = "http://127.0.0.1:9/crm/tickets"  # same origin: fine
    data["tools"][1]["status_url"] = "http://127.0.0.1:10/status/{key}"  # another port: another origin

    assert rejected(data) == [
        ("tools[1].status_url", "must be on the origin of server 'crm' (http://127.0.0.1:9)")
    ]
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_it_rejects_a_server_outside_the_tenants_egress_hosts_and_applies_nothing():
    data = config()
    data["tenant"]["egress_hosts"] = ["crm.acme.example", "*.models.example:443"]
    data["model_endpoints"].append(
        {"name": "gpt", "kind": "openai", "base_url": "https://api.models.example/v1"}
    )

    errors = rejected(data)

    assert errors == [("tool_servers[1].url", "host is not in tenant.egress_hosts (127.0.0.1:9)")]
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_egress_hosts_allow_what_they_name_and_are_kept_for_the_next_file():
    data = config()
    data["tenant"]["egress_hosts"] = ["127.0.0.1:9"]
    apply_config(data)
    assert Tenant.objects.get(slug=SLUG).egress_hosts == ["127.0.0.1:9"]
    before = snapshot()

    # A later file without the list is still held to the stored one.
    later = config()
    later["tool_servers"][1]["url"] = "http://127.0.0.1:8080/crm"
    later["tools"][1]["http_url"] = "http://127.0.0.1:8080/crm/create_ticket"

    assert rejected(later) == [("tool_servers[1].url", "host is not in tenant.egress_hosts (127.0.0.1:8080)")]
    assert snapshot() == before


def test_a_narrower_list_is_refused_while_a_stored_server_reaches_outside_it():
    apply_config(config())
    data = config()
    del data["tool_servers"][1]  # crm stays stored, not in this file
    data["tools"] = data["tools"][:1]
    data["grants"] = data["grants"][:1]
    data["agents"][0]["versions"] = data["agents"][0]["versions"][:1]
    data["agents"][0]["aliases"] = {"prod": 1}
    data["tenant"]["egress_hosts"] = ["crm.acme.example"]

    with pytest.raises(ConfigError) as caught:
        apply_config(data)

    assert caught.value.errors == [
        (
            "tenant.egress_hosts",
            "tool server 'crm' (stored, not in this file) reaches 127.0.0.1:9, which the list does not allow",
        )
    ]
    assert Tenant.objects.get(slug=SLUG).egress_hosts is None


def test_a_malformed_egress_host_is_an_error_at_its_path():
    data = config()
    data["tenant"]["egress_hosts"] = ["ok.example", "http://bad.example/path"]

    assert (
        "tenant.egress_hosts[1]",
        "bad host 'http://bad.example/path': give host, host:port or *.domain",
    ) in rejected(data)
