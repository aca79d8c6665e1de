"""DRF authentication by API token: `Authorization: Bearer <token>` or `Authorization: Token <token>`."""

from __future__ import annotations

import hashlib

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle, UserRateThrottle

from tenants import tokens

KEYWORDS = (b"bearer", b"token")


class ApiTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() not in KEYWORDS:
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed(
                "Invalid Authorization header: give the scheme and one token."
            )
        try:
            token = parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        try:
            return tokens.authenticate_token(token)
        except tokens.TokenRefused as exc:
            raise exceptions.AuthenticationFailed(str(exc)) from None

    def authenticate_header(self, request) -> str:
        # Makes DRF answer 401 (not 403) to a request without credentials.
        return 'Bearer realm="api"'


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.auth.ApiTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "a token from POST /v1/auth/token; `Token <token>` is accepted too",
        }


# --- rate limits (on the shared cache, so every API process counts together) ---------------------


class _SettingsRate:
    """Read the rate when used: DRF copies DEFAULT_THROTTLE_RATES into the class at import."""

    scope: str  # the throttle's

    def get_rate(self):
        return api_settings.DEFAULT_THROTTLE_RATES[self.scope]


class TokenUsernameThrottle(_SettingsRate, SimpleRateThrottle):
    """Sign-in attempts per username, wherever they come from (password guessing on one account)."""

    scope = "token_username"

    def get_cache_key(self, request, view):
        username = request.data.get("username") if isinstance(request.data, dict) else None
        if not isinstance(username, str) or not username:
            return None
        ident = hashlib.sha256(username.casefold().encode("utf-8", "replace")).hexdigest()
        return self.cache_format % {"scope": self.scope, "ident": ident}


class TokenAddressThrottle(_SettingsRate, SimpleRateThrottle):
    """Sign-in attempts per client address (one client trying many usernames)."""

    scope = "token_address"

    def get_cache_key(self, request, view):
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class RunStartThrottle(_SettingsRate, UserRateThrottle):
    """Run starts per user; reads are not limited."""

    scope = "run_start"

    def allow_request(self, request, view):
        return request.method != "POST" or super().allow_request(request, view)
