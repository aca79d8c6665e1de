"""The admin's Connections page: each user sees and revokes their own; manage_connections sees the
tenant's; no token is ever shown."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from connections.models import Connection, ConnectionStatus
from tests import factories
from tools.models import ToolServer

pytestmark = pytest.mark.django_db

ACCESS = "canary-access-token-1f2e"


def _connection(tenant, user, server) -> Connection:
    return Connection.objects.create(
        tenant=tenant,
        user=user,
        server=server,
        status=ConnectionStatus.ACTIVE,
        state=f"state-{user.username}",
        access_ciphertext=Connection.seal(ACCESS),
        refresh_ciphertext=Connection.seal("canary-refresh-token-9a8b"),
        scopes="statements:read",
        connected_at=timezone.now(),
    )


@pytest.fixture
def server(tenant):
    return ToolServer.objects.create(
        tenant=tenant,
        name="cards",
        kind=ToolServer.Kind.MCP,
        transport="streamable_http",
        url="http://127.0.0.1:9/mcp",
    )


def test_a_user_sees_and_revokes_only_their_own_connections(tenant, server):
    asha = factories.make_user(tenant, "asha", staff=True, view_runs=False)
    ravi = factories.make_user(tenant, "ravi", staff=True, view_runs=False)
    mine, theirs = _connection(tenant, asha, server), _connection(tenant, ravi, server)
    web = APIClient()
    web.force_login(asha)
    listing = web.get(reverse("admin:connections_connection_changelist")).content.decode()
    assert f"/connection/{mine.pk}/change/" in listing and f"/connection/{theirs.pk}/change/" not in listing
    assert ACCESS not in listing and "statements:read" in listing
    assert web.get(reverse("admin:connections_connection_change", args=[theirs.pk])).status_code == 404

    web.post(
        reverse("admin:connections_connection_changelist"),
        {"action": "revoke", "_selected_action": [mine.pk, theirs.pk]},
    )

    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert (
        mine.status == ConnectionStatus.REVOKED and mine.revoked_by == asha and mine.access_ciphertext == ""
    )
    assert theirs.status == ConnectionStatus.ACTIVE


def test_an_operator_sees_and_revokes_the_tenants_connections(tenant, server):
    asha = factories.make_user(tenant, "asha")
    olga = factories.make_user(tenant, "olga", staff=True, view_runs=False)
    olga.user_permissions.add(Permission.objects.get(codename="manage_connections"))
    connection = _connection(tenant, asha, server)
    api = APIClient()
    api.force_authenticate(olga)
    assert [c["user"] for c in api.get("/v1/connections").json()] == ["asha"]

    answer = api.delete(f"/v1/connections/{connection.pk}")

    assert answer.status_code == 200 and answer.json()["revoked_reason"] == "revoked by olga"
    assert api.delete(f"/v1/connections/{connection.pk}").status_code == 409  # already revoked


def test_another_tenants_connection_answers_404(tenant, server):
    other = factories.make_tenant("other")
    mallory = factories.make_user(other, "mallory")
    mallory.user_permissions.add(Permission.objects.get(codename="manage_connections"))
    connection = _connection(tenant, factories.make_user(tenant, "asha"), server)
    api = APIClient()
    api.force_authenticate(mallory)
    assert api.get("/v1/connections").json() == []
    assert api.delete(f"/v1/connections/{connection.pk}").status_code == 404
