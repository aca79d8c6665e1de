"""Per-user OAuth connections to MCP servers (DESIGN.md 7.1; docs/authority-oauth.md).

`ProtectedServer`: a tool server that answered 401 with protected resource metadata (RFC 9728), so
its calls carry each user's own token; the platform's client registration with its authorization
server (dynamic client registration, RFC 7591) is kept here, once per server.
`Connection`: one user's authorization of one server: pending while the user signs in, then
active with the refresh and access tokens encrypted like secrets, until revoked (by the user, an
operator, or the authorization server refusing a refresh).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from tenants.crypto import decrypt, encrypt


class ProtectedServer(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    server = models.OneToOneField("tools.ToolServer", on_delete=models.CASCADE, related_name="protection")
    resource_metadata_url = models.CharField(max_length=500, blank=True)  # from WWW-Authenticate
    # What discovery found (public documents: protected resource and authorization server metadata).
    resource = models.CharField(max_length=500, blank=True)
    issuer = models.CharField(max_length=500, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    # The registration the authorization server gave the platform; its secret encrypted.
    client_info = models.JSONField(default=dict, blank=True)
    client_secret_ciphertext = models.TextField(blank=True)
    scopes = models.CharField(max_length=500, blank=True)  # asked for; empty: what the server challenges
    discovered_at = models.DateTimeField(auto_now_add=True)
    registered_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.server} (OAuth)"


class ConnectionStatus(models.TextChoices):
    PENDING = "pending"  # the user was sent to sign in; the callback has not come back
    ACTIVE = "active"
    REVOKED = "revoked"  # by the user, an operator, a refused refresh, or a newer connection
    ABANDONED = "abandoned"  # a sign-in that never came back, or failed


CONNECTION_TRANSITIONS: dict[str, set[str]] = {
    ConnectionStatus.PENDING: {ConnectionStatus.ACTIVE, ConnectionStatus.ABANDONED},
    ConnectionStatus.ACTIVE: {ConnectionStatus.REVOKED},
    ConnectionStatus.REVOKED: set(),
    ConnectionStatus.ABANDONED: set(),
}


class Connection(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="connections")
    server = models.ForeignKey("tools.ToolServer", on_delete=models.CASCADE, related_name="connections")
    status = models.CharField(
        max_length=16, choices=ConnectionStatus.choices, default=ConnectionStatus.PENDING
    )
    # The authorization request in flight: `state` finds it again at the callback (single use);
    # the PKCE verifier is encrypted, it proves the code is ours.
    state = models.CharField(max_length=100, unique=True)
    verifier_ciphertext = models.TextField(blank=True)
    pending_until = models.DateTimeField(null=True, blank=True)
    # The tokens, encrypted at rest with SECRET_ENCRYPTION_KEYS exactly as tenants.Secret is.
    access_ciphertext = models.TextField(blank=True)
    refresh_ciphertext = models.TextField(blank=True)
    access_expires_at = models.DateTimeField(null=True, blank=True)
    scopes = models.CharField(max_length=500, blank=True)  # what the authorization server granted
    created_at = models.DateTimeField(auto_now_add=True)
    connected_at = models.DateTimeField(null=True, blank=True)  # "since"
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    revoked_reason = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user", "server"],
                condition=models.Q(status="active"),
                name="uniq_active_connection",
            )
        ]
        indexes = [models.Index(fields=["user", "server", "status"])]
        ordering = ["-created_at"]
        permissions = [("manage_connections", "See and revoke every connection of the tenant")]

    def __str__(self) -> str:
        return f"{self.user} → {self.server} ({self.status})"

    @staticmethod
    def seal(value: str) -> str:
        return encrypt(value, settings.SECRET_ENCRYPTION_KEYS) if value else ""

    @staticmethod
    def unseal(ciphertext: str) -> str:
        return decrypt(ciphertext, settings.SECRET_ENCRYPTION_KEYS) if ciphertext else ""
