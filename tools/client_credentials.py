"""The platform's own OAuth token for an MCP server that takes one (client credentials grant).

A bank's MCP server may accept only tokens from its authorization server, issued to the platform
as a client (RFC 6749 section 4.4), rather than a static secret or each user's own token
(connections/). The server's `oauth` block (docs/configuration.md) names the token URL, the
client id, the client secret (a secret's name: stored encrypted, or read from the environment at
apply), the scopes and the audience; the platform authenticates with HTTP Basic (RFC 6749
section 2.3.1) or, where the server says `client_auth: post`, in the form.

| operation | what it does |
|---|---|
| `authorization(server)` | the `Authorization` header for a call: the cached token, or a new one when none is cached or the cached one is within `margin` of its expiry |
| `forget(server, header)` | drops that token (the MCP server answered 401 to it), so the next `authorization` fetches a new one |
| `fetch(settings)` | one token request, cached nowhere (apply's discovery, before the server is saved) |

Where tokens live: in this process's memory only, keyed by the server and a digest of its OAuth
settings (a changed secret or scope is a new key). Never in the database, the cache, a log, a
step, an event or an exception's text: the run records say which client and audience were
presented, never the token. Each worker process fetches its own; 128 threads wanting a token at
once make one request (one lock per key, held across the request: the others wait for its answer).

Error contract: `ToolFailed` ("denied before sending: …") when the token endpoint refuses the
client (400/401/403 with an OAuth error: a wrong secret, an unknown scope or audience), with the
endpoint's own reason; `ToolNotSent` (retried with backoff) when it cannot be reached, times out,
answers 5xx or 429, or answers something without a usable access token. In both cases nothing was
sent to the tool. No database connection is held across the token request.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

import httpx
from django.db import connection

from core.cookies import no_cookies
from tenants.models import Secret
from tools.models import ToolServer
from tools.types import ToolFailed, ToolNotSent

DEFAULT_LIFETIME = 300  # an answer without expires_in is trusted this long
TIMEOUT = 10.0


@dataclass(frozen=True)
class OAuthSettings:
    token_url: str
    client_id: str
    client_secret: str
    scopes: tuple[str, ...]
    audience: str
    client_auth: str = "basic"

    def key(self) -> str:
        raw = "\n".join(
            [
                self.token_url,
                self.client_id,
                self.client_secret,
                " ".join(self.scopes),
                self.audience,
                self.client_auth,
            ]
        )
        return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class Token:
    value: str
    use_until: float  # time.monotonic()


_tokens: dict[tuple[int, str], Token] = {}
_locks: dict[tuple[int, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def margin(lifetime: float) -> float:
    """How long before expiry a token stops being used: a tenth of its life, 10 s to 60 s (and never
    more than half of a short one)."""
    return min(max(lifetime / 10, 10.0), 60.0, lifetime / 2)


def settings_of(server: ToolServer) -> OAuthSettings | None:
    if not server.oauth_token_url:
        return None
    if server.oauth_client_secret_id is None:  # apply never stores one without; the admin might
        raise ToolFailed(
            f"denied before sending: server {server.name}'s OAuth settings name no client secret"
        )
    secret = Secret.objects.get(pk=server.oauth_client_secret_id).reveal()
    return OAuthSettings(
        token_url=server.oauth_token_url,
        client_id=server.oauth_client_id,
        client_secret=secret,
        scopes=tuple(server.oauth_scopes or ()),
        audience=server.oauth_audience,
        client_auth=server.oauth_client_auth or "basic",
    )


def authorization(server: ToolServer) -> dict[str, str]:
    """`{"Authorization": "Bearer …"}` for a call to `server`, or {} when it takes no OAuth token."""
    settings = settings_of(server)
    if settings is None:
        return {}
    key = (server.pk, settings.key())
    with _lock(key):
        cached = _tokens.get(key)
        if cached is None or cached.use_until <= time.monotonic():
            value, lifetime = _request(settings)
            cached = _tokens[key] = Token(value, time.monotonic() + lifetime - margin(lifetime))
    return {"Authorization": f"Bearer {cached.value}"}


def forget(server: ToolServer, headers: dict[str, str]) -> None:
    """Drop the token these headers carried, unless another thread already replaced it."""
    sent = headers.get("Authorization", "").removeprefix("Bearer ")
    for key in [key for key, token in list(_tokens.items()) if key[0] == server.pk and token.value == sent]:
        with _lock(key):
            if (token := _tokens.get(key)) is not None and token.value == sent:
                del _tokens[key]


def fetch(settings: OAuthSettings) -> str:
    """One token, cached nowhere."""
    return _request(settings)[0]


def _lock(key: tuple[int, str]) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _request(settings: OAuthSettings) -> tuple[str, float]:
    """(access token, lifetime in seconds) from the token endpoint."""
    form = {"grant_type": "client_credentials"}
    if settings.scopes:
        form["scope"] = " ".join(settings.scopes)
    if settings.audience:
        # Both spellings: `audience` (Auth0, Okta, Keycloak) and RFC 8707's `resource`.
        form["audience"] = settings.audience
        form["resource"] = settings.audience
    auth: httpx.Auth | httpx._client.UseClientDefault = httpx.USE_CLIENT_DEFAULT
    if settings.client_auth == "post":
        form |= {"client_id": settings.client_id, "client_secret": settings.client_secret}
    else:
        auth = httpx.BasicAuth(settings.client_id, settings.client_secret)
    where = f"the OAuth token endpoint {settings.token_url}"
    if not connection.in_atomic_block:
        connection.close()  # the engine's act phase holds none while a request is on the network
    try:
        with httpx.Client(timeout=TIMEOUT, follow_redirects=False, cookies=no_cookies()) as client:
            answer = client.post(
                settings.token_url, data=form, auth=auth, headers={"Accept": "application/json"}
            )
    except httpx.HTTPError as exc:
        raise ToolNotSent(f"{where} did not answer: {type(exc).__name__}") from None
    body = _json(answer)
    if answer.status_code in (400, 401, 403) and isinstance(body.get("error"), str):
        reason = body["error"][:100]
        if isinstance(body.get("error_description"), str):
            reason += f" ({body['error_description'][:300]})"
        raise ToolFailed(f"denied before sending: {where} refused client {settings.client_id!r}: {reason}")
    if answer.status_code != 200:
        retry_after = answer.headers.get("Retry-After")
        raise ToolNotSent(
            f"{where} answered HTTP {answer.status_code}",
            retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
        )
    token, kind = body.get("access_token"), str(body.get("token_type", "Bearer"))
    if not isinstance(token, str) or not token or kind.lower() != "bearer":
        raise ToolNotSent(f"{where} answered without a bearer access token")
    lifetime = body.get("expires_in", DEFAULT_LIFETIME)
    if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = DEFAULT_LIFETIME
    return token, float(lifetime)


def _json(answer: httpx.Response) -> dict:
    try:
        body = answer.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
