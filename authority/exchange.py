"""Token exchange with the tenant's identity provider (RFC 8693), and the encrypted token cache.

The platform's assertion for the call is the subject token; the platform authenticates as the
IdP's client (HTTP Basic, RFC 6749 section 2.3.1, credentials from the tenant's secrets); the
IdP answers with an access token for the user at the tool server's audience and scopes. One
round trip per (user, audience, scopes) per token lifetime: the token is cached, encrypted,
until `margin` before it expires, so no call starts with a token about to lapse.

Error contract: `AuthorityRefused` when the IdP answers with an OAuth error (400/401/403: the
user, the client or the audience is refused), with the IdP's own reason; `AuthorityUnavailable`
when it cannot be reached, times out, answers 5xx or 429, or answers something unusable.
Nothing here logs a token or puts one in an exception's text.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import httpx
import jwt
from django.conf import settings
from django.db import connection
from django.utils import timezone

from authority.errors import AuthorityRefused, AuthorityUnavailable
from authority.models import ExchangedToken, IdentityProvider
from tenants.crypto import REDACTED, decrypt, encrypt

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:token-exchange"
JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
DEFAULT_LIFETIME = 300  # an answer without expires_in is trusted this long


@dataclass(frozen=True)
class AccessToken:
    token: str
    subject: str
    use_until: dt.datetime
    cached: bool


def scope_key(scopes) -> str:
    return " ".join(sorted({str(s) for s in scopes or ()}))


def margin(lifetime: float) -> float:
    """How long before expiry a token stops being used: a tenth of its life, 10 s to 60 s."""
    return min(max(lifetime / 10, 10.0), 60.0)


def access_token(
    *, tenant_id: int, user_id: int, audience: str, scopes, subject_token: str, now: dt.datetime | None = None
) -> AccessToken:
    now = now or timezone.now()
    scope = scope_key(scopes)
    cached = (
        ExchangedToken.objects.filter(user_id=user_id, audience=audience, scope=scope, use_until__gt=now)
        .only("ciphertext", "subject", "use_until")
        .first()
    )
    if cached is not None:
        return AccessToken(
            decrypt(cached.ciphertext, settings.SECRET_ENCRYPTION_KEYS),
            cached.subject,
            cached.use_until,
            True,
        )
    idp = (
        IdentityProvider.objects.select_related("client_id", "client_secret")
        .filter(tenant_id=tenant_id)
        .first()
    )
    if idp is None:
        raise AuthorityRefused(
            "this tool server needs a token from the tenant's identity provider, and none is configured"
        )
    client_id, client_secret = idp.client_id.reveal(), idp.client_secret.reveal()
    release_connection()  # no database connection held across the IdP's round trip
    token, subject, lifetime = _exchange(
        idp, (client_id, client_secret), audience=audience, scope=scope, subject_token=subject_token
    )
    use_until = now + dt.timedelta(seconds=lifetime - margin(lifetime))
    ExchangedToken.objects.update_or_create(
        user_id=user_id,
        audience=audience,
        scope=scope,
        defaults={
            "tenant_id": tenant_id,
            "ciphertext": encrypt(token, settings.SECRET_ENCRYPTION_KEYS),
            "subject": subject,
            "issued_at": now,
            "use_until": use_until,
        },
    )
    return AccessToken(token, subject, use_until, False)


def forget(*, user_id: int, audience: str | None = None) -> int:
    """Drop a user's cached tokens (all, or one audience's): the next call exchanges again."""
    tokens = ExchangedToken.objects.filter(user_id=user_id)
    if audience is not None:
        tokens = tokens.filter(audience=audience)
    return tokens.delete()[0]


def release_connection() -> None:
    """Close this thread's database connection unless a transaction needs it: the engine's act
    phase holds none while a request is on the network (runs/engine/__init__.py)."""
    if not connection.in_atomic_block:
        connection.close()


def _exchange(
    idp: IdentityProvider, client: tuple[str, str], *, audience: str, scope: str, subject_token: str
) -> tuple[str, str, float]:
    form = {
        "grant_type": GRANT_TYPE,
        "subject_token": subject_token,
        "subject_token_type": JWT_TOKEN_TYPE,
        "requested_token_type": ACCESS_TOKEN_TYPE,
        "audience": audience,
    }
    if scope:
        form["scope"] = scope
    try:
        response = httpx.post(
            idp.token_url,
            data=form,
            auth=client,
            headers={"Accept": "application/json"},
            timeout=httpx.Timeout(idp.timeout_seconds, connect=min(5.0, idp.timeout_seconds)),
            follow_redirects=False,
        )
    except httpx.HTTPError as exc:
        raise AuthorityUnavailable(f"the identity provider did not answer: {type(exc).__name__}") from None
    if response.status_code >= 500 or response.status_code == 429:
        raise AuthorityUnavailable(
            f"the identity provider answered {response.status_code}", retry_after=_retry_after(response)
        )
    body = _json(response)
    if response.status_code in (400, 401, 403):
        error = str(body.get("error") or f"HTTP {response.status_code}")[:100]
        # An IdP that echoes the request must not put the assertion into the model's observation.
        reason = str(body.get("error_description") or "").replace(subject_token, REDACTED)[:500]
        raise AuthorityRefused(f"the identity provider refused: {error}" + (f": {reason}" if reason else ""))
    if response.status_code != 200:
        raise AuthorityUnavailable(f"the identity provider answered {response.status_code}")
    token = body.get("access_token")
    if not isinstance(token, str) or not token:
        raise AuthorityUnavailable("the identity provider's answer has no access_token")
    lifetime = body.get("expires_in", DEFAULT_LIFETIME)
    if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = DEFAULT_LIFETIME
    return token, _subject_of(token), float(lifetime)


def _subject_of(token: str) -> str:
    """The token's `sub` when it is a JWT, for the audit trail; the IdP vouches for it, not us.

    Read without verifying: the tool server verifies the token; the platform only records whom
    the IdP says it issued it for.
    """
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return ""
    sub = claims.get("sub")
    return str(sub)[:200] if sub is not None else ""


def _json(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None
