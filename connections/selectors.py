"""Reads of connections, always through the acting user or tenant."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import QuerySet

from connections.models import Connection, ConnectionStatus
from tools.models import ToolServer


@dataclass(frozen=True)
class ConnectionState:
    """What the check at dispatch needs to know of a user and a server."""

    protected: bool  # the server asks for each user's own token
    active: bool = False
    revoked_at: dt.datetime | None = None  # of the user's latest connection, if it was revoked


def state_for(user_id: int, server: ToolServer) -> ConnectionState:
    """The user's connection to the server, as of now (read fresh: the claim asks at every dispatch).

    Whether the server is protected is read through `server.protection`, which Django keeps on
    the instance (a missing row too): the transport that sends the call from the same instance
    (tools/transports._mcp_config_as_user) does not ask again."""
    if getattr(server, "protection", None) is None:  # no row raises AttributeError
        return ConnectionState(protected=False)
    latest = (
        Connection.objects.filter(user_id=user_id, server_id=server.pk)
        .exclude(status__in=[ConnectionStatus.PENDING, ConnectionStatus.ABANDONED])
        .order_by("-created_at")
        .values_list("status", "revoked_at")
        .first()
    )
    if latest is None:
        return ConnectionState(protected=True)
    status, revoked_at = latest
    if status == ConnectionStatus.ACTIVE:
        return ConnectionState(protected=True, active=True)
    return ConnectionState(protected=True, revoked_at=revoked_at)


def connections_for(user) -> QuerySet[Connection]:
    """The connections a user may see and revoke: their own; the tenant's with manage_connections
    (the operator role); every tenant's for the platform's operators."""
    qs = Connection.objects.select_related("server", "user").exclude(status=ConnectionStatus.PENDING)
    if user.is_superuser and user.tenant_id is None:
        return qs
    if user.has_perm("connections.manage_connections"):
        return qs.filter(tenant_id=user.tenant_id)
    return qs.filter(user=user)


def get_connection(user, connection_id) -> Connection | None:
    try:
        return connections_for(user).get(pk=connection_id)
    except (Connection.DoesNotExist, ValueError):
        return None
