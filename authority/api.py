"""The platform's public keys, for providers verifying its assertions (docs/authority.md)."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from authority import keys


@require_GET
def jwks(request: HttpRequest) -> JsonResponse:
    """The JSON Web Key Set (RFC 7517) of every key an assertion in circulation may name.

    Cached by verifiers for JWKS_CACHE_SECONDS at most (five minutes by default): a new key is
    published SIGNING_KEY_LEAD_SECONDS, at least twice that, before it signs (authority/keys.py).
    """
    response = JsonResponse(keys.jwks())
    response["Cache-Control"] = f"public, max-age={settings.JWKS_CACHE_SECONDS}"
    return response
