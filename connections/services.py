"""Connecting a user to an OAuth-protected MCP server, using the connection, revoking it.

    start_connection     the MCP server's 401 -> discovery, registration -> the authorization URL
    finish_connection    the callback's code -> tokens (encrypted) -> an active connection
    revoke_connection    by the user or an operator; a refused refresh revokes too
    token_for_call       the act phase of a tool step: the user's access token, refreshed if due

Every network call here (connections/oauth.py, the SDK) runs outside any transaction; the rows
are read before and written after, each write one conditional UPDATE on the status.
No token, verifier or client secret is ever logged or returned in an error message.
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from connections import oauth
from connections.models import CONNECTION_TRANSITIONS, Connection, ConnectionStatus, ProtectedServer
from core.errors import Conflict, DomainError
from tenants.crypto import decrypt, encrypt
from tools.models import ToolServer

PENDING_SECONDS = 600  # how long a sign-in may take before its state is refused


class ConnectionUnusable(Exception):
    """The user's connection cannot be used for a call (none, revoked, or refused on refresh)."""


def callback_url() -> str:
    return f"{settings.PUBLIC_BASE_URL}/v1/connections/callback"


def connect_link(server: ToolServer) -> str:
    """Where a user's browser goes to connect (the admin, signed in): on the timeline and webhooks."""
    return f"{settings.PUBLIC_BASE_URL}/admin/connections/connection/connect/{server.pk}/"


def note_protected(server: ToolServer, challenge: str = "") -> ProtectedServer:
    """The server answered 401: from now on its calls need each user's connection."""
    protected, _ = ProtectedServer.objects.get_or_create(
        server=server,
        defaults={"tenant_id": server.tenant_id, "resource_metadata_url": _resource_metadata(challenge)},
    )
    return protected


def _resource_metadata(challenge: str) -> str:
    for part in challenge.replace(",", " ").split():
        if part.startswith("resource_metadata="):
            return part.split("=", 1)[1].strip('"')[:500]
    return ""


# --- start and finish ------------------------------------------------------------------------


def start_connection(*, user, server: ToolServer) -> tuple[Connection, str]:
    """A pending connection and the authorization URL to send the user's browser to."""
    if server.tenant_id != user.tenant_id:
        raise DomainError("tool server not found", code="not_found", status=404)
    if server.kind != ToolServer.Kind.MCP or server.transport not in (
        "",
        ToolServer.Transport.STREAMABLE_HTTP,
    ):
        raise DomainError(
            f"{server.name} is not an MCP server over HTTP: it has no OAuth connections",
            code="invalid",
            fields={"server": ["not an MCP server over streamable HTTP"]},
        )
    protected = note_protected(server)
    try:
        started = oauth.start(
            server.url, callback_url(), scopes=protected.scopes, client_info=_client_info(protected) or None
        )
    except oauth.Unreachable as exc:
        raise DomainError(
            f"{server.name} or its authorization server did not answer: {exc}", code="unreachable", status=502
        ) from None
    except oauth.OAuthFailed as exc:
        raise DomainError(
            f"{server.name} cannot be connected: {exc}", code="oauth_failed", status=502
        ) from None
    _keep_discovery(protected, started.discovery)
    connection = Connection.objects.create(
        tenant_id=user.tenant_id,
        user=user,
        server=server,
        state=started.state,
        verifier_ciphertext=Connection.seal(started.verifier),
        pending_until=timezone.now() + dt.timedelta(seconds=PENDING_SECONDS),
    )
    return connection, started.authorization_url


def finish_connection(*, state: str, code: str = "", iss: str | None = None, error: str = "") -> Connection:
    """The authorization server sent the browser back: exchange the code, keep the tokens."""
    now = timezone.now()
    connection = (
        Connection.objects.select_related("server", "user")
        .filter(state=state, status=ConnectionStatus.PENDING)
        .first()
        if state
        else None
    )
    if connection is None:
        raise DomainError(
            "unknown or used authorization state",
            code="invalid_state",
            fields={"state": ["unknown or already used"]},
        )
    if connection.pending_until is not None and connection.pending_until < now:
        _move(connection, ConnectionStatus.ABANDONED, revoked_reason="the sign-in took too long")
        raise DomainError(
            "this sign-in expired: start again", code="invalid_state", fields={"state": ["expired"]}
        )
    if error or not code:
        _move(
            connection,
            ConnectionStatus.ABANDONED,
            revoked_reason=f"authorization refused: {error or 'no code'}"[:500],
        )
        raise DomainError(
            f"the authorization server refused: {error or 'no code'}", code="authorization_refused"
        )
    protected = ProtectedServer.objects.get(server=connection.server)
    try:
        tokens = oauth.finish(
            connection.server.url,
            callback_url(),
            _discovery(protected),
            code=code,
            verifier=Connection.unseal(connection.verifier_ciphertext),
            iss=iss,
        )
    except (oauth.OAuthFailed, oauth.Unreachable) as exc:
        _move(connection, ConnectionStatus.ABANDONED, revoked_reason=f"code exchange failed: {exc}"[:500])
        raise DomainError(f"the code exchange failed: {exc}", code="oauth_failed", status=502) from None
    with transaction.atomic():
        # One active connection per user and server: a new one replaces the old.
        for old in Connection.objects.select_for_update().filter(
            user_id=connection.user_id, server_id=connection.server_id, status=ConnectionStatus.ACTIVE
        ):
            _move(
                old, ConnectionStatus.REVOKED, revoked_at=now, revoked_reason="replaced by a new connection"
            )
        _move(
            connection,
            ConnectionStatus.ACTIVE,
            verifier_ciphertext="",
            connected_at=now,
            scopes=tokens.scope[:500],
            **_sealed(tokens),
        )
    return connection


def revoke_connection(*, connection: Connection, actor=None, reason: str = "") -> Connection:
    """End a connection: its next call is denied, with the reason on the run's timeline."""
    who = actor.username if actor is not None else "the platform"
    _move(
        connection,
        ConnectionStatus.REVOKED,
        revoked_at=timezone.now(),
        revoked_by=actor,
        revoked_reason=(reason or f"revoked by {who}")[:500],
        access_ciphertext="",
        refresh_ciphertext="",
    )
    return connection


# --- a call ----------------------------------------------------------------------------------


def token_for_call(*, user_id: int, server: ToolServer) -> tuple[int, str, str]:
    """(connection id, access token, audience) for the user's call to the server; the token
    refreshed first when due.

    Raises ConnectionUnusable: no active connection, or the authorization server refused the
    refresh (the connection is revoked then, so every later call is denied too)."""
    connection = Connection.objects.filter(
        user_id=user_id, server=server, status=ConnectionStatus.ACTIVE
    ).first()
    if connection is None:
        raise ConnectionUnusable(f"the user has no active connection to {server.name}")
    tokens = oauth.Tokens(
        access_token=Connection.unseal(connection.access_ciphertext),
        refresh_token=Connection.unseal(connection.refresh_ciphertext),
        expires_at=connection.access_expires_at.timestamp() if connection.access_expires_at else None,
        scope=connection.scopes,
    )
    protected = server.protection  # as the claim read it on this instance (connections.selectors.state_for)
    try:
        refreshed = oauth.fresh(server.url, callback_url(), _discovery(protected), tokens)
    except oauth.RefreshRefused as exc:
        revoke_connection(
            connection=connection, reason=f"the authorization server refused the refresh: {exc}"
        )
        raise ConnectionUnusable(
            f"{server.name}'s authorization server refused to refresh the user's token"
        ) from None
    except (oauth.OAuthFailed, oauth.Unreachable) as exc:
        raise ConnectionUnusable(f"could not refresh the user's token for {server.name}: {exc}") from None
    now = timezone.now()
    if refreshed is not None:
        tokens = refreshed
        Connection.objects.filter(pk=connection.pk, status=ConnectionStatus.ACTIVE).update(
            last_used_at=now, **_sealed(refreshed)
        )
    else:
        Connection.objects.filter(pk=connection.pk, status=ConnectionStatus.ACTIVE).update(last_used_at=now)
    return connection.pk, tokens.access_token, protected.resource


def refused_by_server(connection_id: int, *, server: ToolServer) -> None:
    """The MCP server answered 401 to the user's own token: the connection is over."""
    connection = Connection.objects.filter(pk=connection_id, status=ConnectionStatus.ACTIVE).first()
    if connection is not None:
        revoke_connection(connection=connection, reason=f"{server.name} refused the user's token (401)")


# --- rows ------------------------------------------------------------------------------------


def _move(connection: Connection, to: str, **fields) -> None:
    """One conditional UPDATE on the status; an illegal or lost move raises."""
    old = connection.status
    if to not in CONNECTION_TRANSITIONS[old]:
        raise Conflict(f"connection is {old}: it cannot become {to}", code="illegal_transition")
    try:
        moved = Connection.objects.filter(pk=connection.pk, status=old).update(status=to, **fields)
    except IntegrityError:
        raise Conflict("the user already has an active connection to this server") from None
    if not moved:
        raise Conflict(f"connection is no longer {old}", code="illegal_transition")
    connection.status = to
    for name, value in fields.items():
        setattr(connection, name, value)


def _sealed(tokens: oauth.Tokens) -> dict:
    return {
        "access_ciphertext": Connection.seal(tokens.access_token),
        "refresh_ciphertext": Connection.seal(tokens.refresh_token),
        "access_expires_at": dt.datetime.fromtimestamp(tokens.expires_at, tz=dt.UTC)
        if tokens.expires_at
        else None,
    }


def _client_info(protected: ProtectedServer) -> dict:
    if not protected.client_info:
        return {}
    info = dict(protected.client_info)
    if protected.client_secret_ciphertext:
        info["client_secret"] = decrypt(protected.client_secret_ciphertext, settings.SECRET_ENCRYPTION_KEYS)
    return info


def _discovery(protected: ProtectedServer) -> oauth.Discovery:
    return oauth.Discovery(
        resource=protected.resource,
        issuer=protected.issuer,
        resource_metadata=protected.metadata.get("resource", {}),
        server_metadata=protected.metadata.get("authorization_server", {}),
        client_info=_client_info(protected),
    )


def _keep_discovery(protected: ProtectedServer, discovery: oauth.Discovery) -> None:
    info = dict(discovery.client_info)
    secret = info.pop("client_secret", None) or ""
    fields: dict[str, object] = {
        "resource": discovery.resource[:500],
        "issuer": discovery.issuer[:500],
        "metadata": {
            "resource": discovery.resource_metadata,
            "authorization_server": discovery.server_metadata,
        },
        "client_info": info,
        "client_secret_ciphertext": encrypt(secret, settings.SECRET_ENCRYPTION_KEYS) if secret else "",
    }
    if info != protected.client_info:
        fields["registered_at"] = timezone.now()
    ProtectedServer.objects.filter(pk=protected.pk).update(**fields)
    for name, value in fields.items():
        setattr(protected, name, value)
