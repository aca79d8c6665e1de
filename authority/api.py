"""The platform's public keys, for providers verifying its assertions (docs/authority.md)."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from authority import keys


@require_GET
def jwks(request: HttpRequest) -> JsonResponse:
    """The JSON Web Key Set (RFC 7517) of every key an assertion in circulation may name.

    Cached by verifiers for five minutes at most: a new key is published SIGNING_KEY_LEAD_SECONDS
    (ten minutes by default) before it signs, and verifiers fetch again on an unknown `kid`.
    """
    response = JsonResponse(keys.jwks())
    response["Cache-Control"] = "public, max-age=300"
    return response
