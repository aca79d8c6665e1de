"""Read-only views of delegated authority for operators: which key signs, how each server's calls
carry the user's authority, the tenant's IdP (by secret name), and which users hold a cached
token (subject and expiry, never the token). Changes go through `manage.py apply` and
`manage.py rotate_signing_key`."""

from __future__ import annotations

from django.contrib import admin

from authority.models import Delegation, ExchangedToken, IdentityProvider, SigningKey
from tenants.admin_site import ReadOnlyAdmin, site


@admin.register(SigningKey, site=site)
class SigningKeyAdmin(ReadOnlyAdmin):
    list_display = ("kid", "algorithm", "signs_from", "retired_at")
    fields = (
        "kid",
        "algorithm",
        "public_jwk",
        "created_at",
        "signs_from",
        "retired_at",
    )  # not the private half


@admin.register(Delegation, site=site)
class DelegationAdmin(ReadOnlyAdmin):
    list_display = ("server", "mode", "audience", "header", "mcp_meta", "mcp_authorization")


@admin.register(IdentityProvider, site=site)
class IdentityProviderAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "token_url", "client_id", "client_secret")  # secrets by name


@admin.register(ExchangedToken, site=site)
class ExchangedTokenAdmin(ReadOnlyAdmin):
    list_display = ("user", "subject", "audience", "scope", "issued_at", "use_until")
    fields = (
        "tenant",
        "user",
        "subject",
        "audience",
        "scope",
        "issued_at",
        "use_until",
    )  # not the ciphertext
