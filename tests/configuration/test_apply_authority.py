"""`manage.py apply` for delegated authority: a server's `delegation` and the tenant's
`identity_provider` (docs/authority.md), with field-level errors."""

from __future__ import annotations

import pytest

from authority.models import Delegation, IdentityProvider
from configuration.apply import apply_config
from tests.configuration.test_apply import SLUG, config, rejected
from tools.models import ToolServer

pytestmark = pytest.mark.django_db


def with_authority(**delegation) -> dict:
    data = config()
    data["secrets"] += [
        {"name": "idp-client-id", "value": "agent-platform"},
        {"name": "idp-client-secret", "value": "idp-secret-value-1234"},
    ]
    data["identity_provider"] = {
        "token_url": "https://login.bank.example/oauth2/token",
        "client_id": "idp-client-id",
        "client_secret": "idp-client-secret",
    }
    crm = data["tool_servers"][1]
    crm["auth_header"] = "X-Crm-Token"  # the IdP's token takes Authorization
    crm["delegation"] = delegation or {
        "auth": "token_exchange",
        "audience": "https://crm.bank.example",
        "scopes": ["tickets:write"],
    }
    return data


def test_it_stores_a_servers_delegation_and_the_identity_provider_and_is_idempotent():
    apply_config(with_authority())
    crm = ToolServer.objects.get(tenant__slug=SLUG, name="crm")
    stored = Delegation.objects.get(server=crm)
    assert (stored.mode, stored.audience, stored.scopes, stored.header) == (
        "token_exchange",
        "https://crm.bank.example",
        ["tickets:write"],
        "Agent-Assertion",
    )
    idp = IdentityProvider.objects.get(tenant__slug=SLUG)
    assert (idp.token_url, idp.client_id.name, idp.client_secret.reveal()) == (
        "https://login.bank.example/oauth2/token",
        "idp-client-id",
        "idp-secret-value-1234",
    )

    again = apply_config(with_authority())
    assert not again.changed

    changed = apply_config(with_authority(audience="https://crm2.bank.example"))
    assert (
        "updated tool_servers crm (delegation.mode, delegation.audience, delegation.scopes)"
        in changed.changes
    )
    assert Delegation.objects.get(server=crm).mode == "assertion"


def test_what_the_file_omits_is_removed():
    apply_config(with_authority())
    data = config()
    data["tool_servers"][1]["auth_header"] = "X-Crm-Token"
    report = apply_config(data)
    assert not Delegation.objects.exists() and not IdentityProvider.objects.exists()
    assert "updated tool_servers crm (delegation removed)" in report.changes


def test_it_reports_bad_delegation_fields_at_their_paths():
    data = with_authority(auth="sometimes", header="Authorization", mcp_meta=True, scopes=["a"])
    data["identity_provider"]["client_secret"] = "nope"
    errors = dict(rejected(data))
    assert "tool_servers[1].delegation.auth" in errors
    assert "other than Authorization" in errors["tool_servers[1].delegation.header"]
    assert errors["tool_servers[1].delegation.mcp_meta"] == "only for mcp servers"

    data = with_authority()
    data["tool_servers"][1]["auth_header"] = "Authorization"
    assert "already uses" in dict(rejected(data))["tool_servers[1].delegation.auth"]

    data = with_authority(audience="https://crm.bank.example", scopes=["x"])
    assert dict(rejected(data))["tool_servers[1].delegation.scopes"] == "only with auth: token_exchange"

    data = with_authority()
    data["identity_provider"]["client_secret"] = "nope"
    assert dict(rejected(data))["identity_provider.client_secret"] == "no secret named 'nope'"
    data = with_authority()
    del data["identity_provider"]["token_url"]
    assert dict(rejected(data))["identity_provider.token_url"] == "required"
