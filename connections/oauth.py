"""The MCP authorization flow, run by the official `mcp` SDK's OAuth client (mcp.client.auth).

The SDK's `OAuthClientProvider` drives the flow as an httpx2 auth: a request answered 401 makes
it discover the protected resource metadata (RFC 9728: the `resource_metadata` of the
WWW-Authenticate challenge, then the well-known URLs), the authorization server's metadata (RFC
8414, its issuer checked), register a client (RFC 7591, or a client ID metadata document where
the server supports one), and build the authorization request with PKCE (S256) and the RFC 8707
resource indicator; it exchanges the code, and refreshes tokens, the same way.

The one thing a platform cannot do as the SDK's desktop clients do is wait, inside one request,
for a person to sign in: the browser goes to the authorization server and comes back, minutes
later, to the platform's callback, maybe served by another process. So `_PlatformAuth` ends the
SDK's flow at the browser step (`AuthorizationStarted` carries the URL, the state and the PKCE
verifier to keep), and `finish` resumes it from what was kept: the SDK builds the token request
and checks the answer. Nothing here touches the database: the callers (connections/services.py)
read and write the rows before and after, outside any transaction during the network calls.

Errors: `OAuthFailed` (the authorization server or the MCP server refused, or answered something
that is not OAuth), `RefreshRefused` (a refresh the authorization server refused: the connection
is over), `Unreachable` (nobody answered: nothing was learnt).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlencode

import anyio
import httpx2
from mcp.client.auth import OAuthClientProvider, PKCEParameters
from mcp.client.auth.exceptions import OAuthFlowError, OAuthRegistrationError, OAuthTokenError
from mcp.client.auth.utils import validate_authorization_response_iss
from mcp.shared.auth import (
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthMetadata,
    OAuthToken,
    ProtectedResourceMetadata,
)

PROTOCOL_VERSION = "2025-11-25"
TIMEOUT = 15.0
# A token this close to its expiry is refreshed before a call rather than sent.
EXPIRY_MARGIN_SECONDS = 30


class OAuthFailed(Exception):
    pass


class RefreshRefused(OAuthFailed):
    pass


class Unreachable(Exception):
    pass


@dataclass(frozen=True)
class Discovery:
    """What the SDK learnt about a server and its authorization server, to keep (public)."""

    resource: str
    issuer: str
    resource_metadata: dict
    server_metadata: dict
    client_info: dict  # the registration, client_secret included: the caller encrypts it


@dataclass(frozen=True)
class Started:
    authorization_url: str
    state: str
    verifier: str
    discovery: Discovery


@dataclass(frozen=True)
class Tokens:
    access_token: str
    refresh_token: str
    expires_at: float | None  # epoch seconds
    scope: str


class AuthorizationStarted(Exception):
    """Raised from inside the SDK's flow at the browser step: nothing waits for the person."""

    def __init__(self, url: str, state: str, verifier: str):
        super().__init__("authorization started")
        self.url, self.state, self.verifier = url, state, verifier


class _QuietAboutTheBrowserStep(logging.Filter):
    """The SDK logs every exception that leaves its flow; ending it at the browser step is no error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], AuthorizationStarted))


logging.getLogger("mcp.client.auth.oauth2").addFilter(_QuietAboutTheBrowserStep())


class _Memory:
    """The SDK's TokenStorage, in memory: the rows are read before and written after the flow."""

    def __init__(
        self, tokens: OAuthToken | None = None, client_info: OAuthClientInformationFull | None = None
    ):
        self.tokens, self.client_info = tokens, client_info

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client_info = client_info


class _PlatformAuth(OAuthClientProvider):
    async def _perform_authorization_code_grant(self) -> tuple[str, str]:
        """The SDK's authorization request, built as the SDK builds it (PKCE S256, state, RFC 8707
        resource, scope); the person's sign-in then happens outside this process's wait."""
        ctx = self.context
        if not ctx.client_info or not ctx.client_metadata.redirect_uris:
            raise OAuthFlowError("no client registration or redirect URI for the authorization request")
        if ctx.oauth_metadata is None or ctx.oauth_metadata.authorization_endpoint is None:
            raise OAuthFlowError("the authorization server publishes no authorization endpoint")
        pkce = PKCEParameters.generate()
        state = secrets.token_urlsafe(32)
        params = {
            "response_type": "code",
            "client_id": ctx.client_info.client_id,
            "redirect_uri": str(ctx.client_metadata.redirect_uris[0]),
            "state": state,
            "code_challenge": pkce.code_challenge,
            "code_challenge_method": "S256",
        }
        if ctx.should_include_resource_param(ctx.protocol_version):
            params["resource"] = ctx.get_resource_url()
        if ctx.client_metadata.scope:
            params["scope"] = ctx.client_metadata.scope
        raise AuthorizationStarted(
            f"{ctx.oauth_metadata.authorization_endpoint}?{urlencode(params)}", state, pkce.code_verifier
        )


def _provider(
    server_url: str, redirect_uri: str, *, scopes: str = "", client_info: dict | None = None
) -> tuple[_PlatformAuth, _Memory]:
    memory = _Memory(
        client_info=OAuthClientInformationFull.model_validate(client_info) if client_info else None
    )
    metadata = OAuthClientMetadata.model_validate(
        {
            "redirect_uris": [redirect_uri],
            "client_name": "Agent platform",
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "application_type": "web",
            "scope": scopes or None,
        }
    )
    return _PlatformAuth(server_url, metadata, memory), memory


def _restore(auth: _PlatformAuth, discovery: Discovery) -> None:
    ctx = auth.context
    ctx.protected_resource_metadata = ProtectedResourceMetadata.model_validate(discovery.resource_metadata)
    ctx.oauth_metadata = OAuthMetadata.model_validate(discovery.server_metadata)
    ctx.auth_server_url = discovery.issuer
    ctx.protocol_version = PROTOCOL_VERSION


def _run(coro_fn, *args):
    try:
        return anyio.run(coro_fn, *args)
    except (OAuthFlowError, OAuthRegistrationError, OAuthTokenError) as exc:
        raise OAuthFailed(str(exc)) from None
    except httpx2.TransportError as exc:
        raise Unreachable(f"{type(exc).__name__}: {exc}") from None


# --- start: from the server's 401 to the authorization URL -----------------------------------


def start(
    server_url: str, redirect_uri: str, *, scopes: str = "", client_info: dict | None = None
) -> Started:
    """Ask the MCP server (an `initialize` it must refuse with 401), discover, register if no
    registration is kept, and build the authorization URL the user's browser is sent to."""
    return _run(_start, server_url, redirect_uri, scopes, client_info)


async def _start(server_url: str, redirect_uri: str, scopes: str, client_info: dict | None) -> Started:
    auth, memory = _provider(server_url, redirect_uri, scopes=scopes, client_info=client_info)
    probe = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "agent-platform-connect", "version": "1"},
        },
    }
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": PROTOCOL_VERSION}
    async with httpx2.AsyncClient(auth=auth, timeout=TIMEOUT, follow_redirects=False) as http:
        try:
            response = await http.post(server_url, json=probe, headers=headers)
        except AuthorizationStarted as started:
            ctx = auth.context
            assert ctx.oauth_metadata is not None and memory.client_info is not None
            prm = ctx.protected_resource_metadata
            return Started(
                authorization_url=started.url,
                state=started.state,
                verifier=started.verifier,
                discovery=Discovery(
                    resource=ctx.get_resource_url(),
                    issuer=str(ctx.oauth_metadata.issuer),
                    resource_metadata=prm.model_dump(mode="json", exclude_none=True) if prm else {},
                    server_metadata=ctx.oauth_metadata.model_dump(mode="json", exclude_none=True),
                    client_info=memory.client_info.model_dump(mode="json", exclude_none=True),
                ),
            )
    raise OAuthFailed(f"the server answered {response.status_code} without asking for authorization")


# --- finish: the code from the callback, exchanged by the SDK ---------------------------------


def finish(
    server_url: str, redirect_uri: str, discovery: Discovery, *, code: str, verifier: str, iss: str | None
) -> Tokens:
    return _run(_finish, server_url, redirect_uri, discovery, code, verifier, iss)


async def _finish(
    server_url: str, redirect_uri: str, discovery: Discovery, code: str, verifier: str, iss: str | None
) -> Tokens:
    auth, memory = _provider(server_url, redirect_uri, client_info=discovery.client_info)
    _restore(auth, discovery)
    auth.context.client_info = memory.client_info
    validate_authorization_response_iss(iss, auth.context.oauth_metadata)  # RFC 9207
    request = await auth._exchange_token_authorization_code(code, verifier)
    async with httpx2.AsyncClient(timeout=TIMEOUT, follow_redirects=False) as http:
        response = await http.send(request)
        await auth._handle_token_response(response)
    return _tokens(memory.tokens)


# --- refresh: a fresh access token before a call ----------------------------------------------


def fresh(
    server_url: str, redirect_uri: str, discovery: Discovery, tokens: Tokens, *, now: float | None = None
) -> Tokens | None:
    """The tokens to call with: None when the access token is still good, else refreshed by the
    SDK. RefreshRefused when the authorization server says no (or there is no refresh token)."""
    now = time.time() if now is None else now
    if tokens.expires_at is None or tokens.expires_at - EXPIRY_MARGIN_SECONDS > now:
        return None
    if not tokens.refresh_token:
        raise RefreshRefused("the access token expired and the authorization server gave no refresh token")
    return _run(_refresh, server_url, redirect_uri, discovery, tokens)


async def _refresh(server_url: str, redirect_uri: str, discovery: Discovery, tokens: Tokens) -> Tokens:
    auth, memory = _provider(server_url, redirect_uri, client_info=discovery.client_info)
    _restore(auth, discovery)
    ctx = auth.context
    ctx.client_info = memory.client_info
    ctx.current_tokens = OAuthToken(
        access_token=tokens.access_token, refresh_token=tokens.refresh_token, scope=tokens.scope or None
    )
    request = await auth._refresh_token()
    async with httpx2.AsyncClient(timeout=TIMEOUT, follow_redirects=False) as http:
        response = await http.send(request)
        if not await auth._handle_refresh_response(response):
            raise RefreshRefused(f"the authorization server refused the refresh ({response.status_code})")
    return _tokens(memory.tokens)


def _tokens(token: OAuthToken | None) -> Tokens:
    if token is None:
        raise OAuthFailed("the authorization server answered no token")
    return Tokens(
        access_token=token.access_token,
        refresh_token=token.refresh_token or "",
        expires_at=time.time() + token.expires_in if token.expires_in else None,
        scope=token.scope or "",
    )
