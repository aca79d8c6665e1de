"""Delegated authority (DESIGN.md 7.1): the platform's signing keys, each tool server's delegation
settings, the tenant's identity provider and the tokens it issued, all encrypted at rest."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class SigningKey(models.Model):
    """An Ed25519 key the platform signs assertions with; the private half only as ciphertext.

    A rotation adds a key that is published at once and signs from `signs_from`, so verifiers that
    cache the key set can learn it first; the key it replaces stops signing then (`retired_at`)
    and stays published until every assertion it signed has expired.
    """

    kid = models.CharField(max_length=64, unique=True)
    algorithm = models.CharField(max_length=16, default="EdDSA")
    private_ciphertext = models.TextField()  # PEM (PKCS#8), Fernet under SECRET_ENCRYPTION_KEYS
    public_jwk = models.JSONField()
    created_at = models.DateTimeField()
    signs_from = models.DateTimeField()
    retired_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-signs_from", "-id"]

    def __str__(self) -> str:
        return self.kid


class Delegation(models.Model):
    """How a tool server's calls carry the user's authority (configuration, like its URL)."""

    class Mode(models.TextChoices):
        ASSERTION = "assertion"  # the platform's signed assertion only
        TOKEN_EXCHANGE = "token_exchange"  # plus the tenant IdP's access token for the user

    server = models.OneToOneField("tools.ToolServer", on_delete=models.CASCADE, related_name="delegation")
    mode = models.CharField(max_length=20, choices=Mode.choices, default=Mode.ASSERTION)
    # The `aud` of the assertion (and the audience asked of the IdP); blank: the server URL's origin.
    audience = models.CharField(max_length=500, blank=True)
    scopes = models.JSONField(default=list, blank=True)  # token_exchange: scopes asked for
    # Where the assertion goes: an HTTP header (HTTP tools and MCP over HTTP; blank: not as a
    # header), the MCP request's `_meta`, and/or `Authorization: Bearer` (MCP, assertion mode).
    header = models.CharField(max_length=100, default="Agent-Assertion", blank=True)
    mcp_meta = models.BooleanField(default=True)
    mcp_authorization = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"{self.server} ({self.mode})"


class IdentityProvider(models.Model):
    """The tenant's identity provider: its token endpoint and the platform's client credentials."""

    tenant = models.OneToOneField(
        "tenants.Tenant", on_delete=models.CASCADE, related_name="identity_provider"
    )
    token_url = models.CharField(max_length=500)
    client_id = models.ForeignKey("tenants.Secret", on_delete=models.PROTECT, related_name="+")
    client_secret = models.ForeignKey("tenants.Secret", on_delete=models.PROTECT, related_name="+")
    timeout_seconds = models.FloatField(default=10.0)

    def __str__(self) -> str:
        return f"{self.tenant} identity provider"


class ExchangedToken(models.Model):
    """An access token the IdP issued for a user, cached per (user, audience, scopes) until shortly
    before it expires; only its ciphertext is stored, and only its subject is ever shown."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    audience = models.CharField(max_length=500)
    scope = models.CharField(max_length=500, blank=True)  # the scopes asked for, sorted, space-separated
    ciphertext = models.TextField()
    subject = models.CharField(max_length=200, blank=True)  # who the IdP says the token is for
    issued_at = models.DateTimeField()
    use_until = models.DateTimeField()  # expiry less a margin: an in-flight call must not outlive it

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "audience", "scope"], name="uniq_exchanged_token")
        ]

    def __str__(self) -> str:
        return f"token for {self.subject or self.user_id} at {self.audience}"
