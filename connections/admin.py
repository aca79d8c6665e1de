"""Connections in the admin: each user's connections (server, scopes, since, last used), revoked by
the user or an operator; and the link a run's timeline gives to connect (signed in to the admin)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path

from connections import selectors, services
from connections.models import Connection, ConnectionStatus
from core.errors import DomainError
from tenants.admin_site import ReadOnlyAdmin, site
from tools.models import ToolServer


@admin.register(Connection, site=site)
class ConnectionAdmin(ReadOnlyAdmin):
    list_display = ["user", "server", "status", "scopes", "connected_at", "last_used_at", "revoked_at"]
    list_filter = ["status"]
    # Only what a person needs to judge a connection: never its tokens, verifier or state.
    FIELDS = (
        "user",
        "server",
        "status",
        "scopes",
        "connected_at",
        "last_used_at",
        "access_expires_at",
        "revoked_at",
        "revoked_by",
        "revoked_reason",
    )
    fields = FIELDS
    readonly_fields = FIELDS
    actions = ["revoke"]

    def get_queryset(self, request):
        return super().get_queryset(request) & selectors.connections_for(request.user)

    def has_view_permission(self, request, obj=None):
        # Everyone with a tenant sees their own connections; manage_connections sees the tenant's.
        return bool(request.user.is_active and request.user.is_staff)

    def has_module_permission(self, request):
        return self.has_view_permission(request)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    @admin.action(description="Revoke the selected connections (their next calls are denied)")
    def revoke(self, request, queryset):
        for connection in queryset.filter(status=ConnectionStatus.ACTIVE):
            services.revoke_connection(
                connection=connection,
                actor=request.user,
                reason=f"revoked by {request.user.username} in the admin",
            )
            messages.success(request, f"{connection.user} → {connection.server}: revoked")

    def get_urls(self):
        return [
            path(
                "connect/<int:server_id>/",
                self.admin_site.admin_view(self.connect_view),
                name="connections_connect",
            ),
            *super().get_urls(),
        ]

    def connect_view(self, request, server_id):
        """Start connecting the signed-in user to the server and send the browser to sign in there."""
        server = get_object_or_404(ToolServer, pk=server_id, tenant_id=request.user.tenant_id)
        try:
            _, url = services.start_connection(user=request.user, server=server)
        except DomainError as exc:
            messages.error(request, f"{server}: {exc.message}")
            return HttpResponseRedirect("../../")
        return HttpResponseRedirect(url)
