"""API tokens: issue, authenticate, refresh, revoke. Only a token's sha256 is ever stored.

A token is 32 random bytes (256 bits), so an unsalted sha256 is a safe way to store it: nothing
shorter than the token itself can be guessed, and a stolen table gives nobody a usable token.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.crypto import constant_time_compare, salted_hmac

from tenants.models import ApiToken, User

PREFIX = "ap_"  # lets secret scanners recognise a leaked token


@dataclass(frozen=True)
class Issued:
    token: str  # shown to the caller once, never stored
    expires_at: dt.datetime


class TokenRefused(Exception):
    """The presented token does not authenticate (or cannot be refreshed); the message is safe to show.

    Not a DomainError: this module is imported while DRF loads its settings, before core.errors.
    """


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def credentials_fingerprint(password_hash: str) -> str:
    """Keyed so that the stored value says nothing about the password hash it came from."""
    return salted_hmac(
        "agentplatform.tenants.ApiToken.credentials", password_hash, algorithm="sha256"
    ).hexdigest()


def issue_token(*, user: User, signed_in_at: dt.datetime | None = None) -> Issued:
    """A new token for `user` (who just proved their password, or refreshed a live token)."""
    now = timezone.now()
    signed_in_at = signed_in_at or now
    expires_at = min(
        now + dt.timedelta(seconds=settings.API_TOKEN_TTL_SECONDS),
        signed_in_at + dt.timedelta(seconds=settings.API_TOKEN_MAX_AGE_SECONDS),
    )
    token = PREFIX + secrets.token_urlsafe(32)
    # Expired tokens of this user are dead weight; clearing them here keeps the table small.
    ApiToken.objects.filter(user=user, expires_at__lte=now).delete()
    ApiToken.objects.create(
        user=user,
        digest=token_digest(token),
        credentials=credentials_fingerprint(user.password),
        created_at=now,
        expires_at=expires_at,
        signed_in_at=signed_in_at,
    )
    return Issued(token, expires_at)


def authenticate_token(token: str) -> tuple[User, ApiToken]:
    """The user and token row for a presented token, or TokenRefused."""
    row = ApiToken.objects.select_related("user").filter(digest=token_digest(token)).first()
    if row is None:
        raise TokenRefused("Invalid token.")
    if row.expires_at <= timezone.now():
        row.delete()
        raise TokenRefused("Token expired; sign in again or refresh before expiry.")
    user = row.user
    if not user.is_active or not constant_time_compare(
        row.credentials, credentials_fingerprint(user.password)
    ):
        # Deactivated, or the password changed since this token was issued: every token goes.
        revoke_all(user=user)
        raise TokenRefused("Token revoked.")
    return user, row


def refresh_token(*, row: ApiToken) -> Issued:
    """Swap a live token for a new one; the old one stops working now. Refused past the maximum age."""
    now = timezone.now()
    if row.signed_in_at + dt.timedelta(seconds=settings.API_TOKEN_MAX_AGE_SECONDS) <= now:
        raise TokenRefused("This sign-in is too old to refresh; sign in with your password again.")
    with transaction.atomic():
        # Conditional delete: of two concurrent refreshes of one token, only one gets a new token.
        deleted, _ = ApiToken.objects.filter(pk=row.pk).delete()
        if not deleted:
            raise TokenRefused("Token revoked.")
        return issue_token(user=row.user, signed_in_at=row.signed_in_at)


def revoke_token(*, row: ApiToken) -> None:
    ApiToken.objects.filter(pk=row.pk).delete()


def revoke_all(*, user: User) -> int:
    """End every token of `user` (password change, deactivation)."""
    deleted, _ = ApiToken.objects.filter(user=user).delete()
    return deleted
