"""Connections in the API: list, start (the authorization URL), revoke, and the OAuth callback."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from connections import selectors, services
from connections.models import Connection
from core.api import require_tenant
from core.errors import NotFound
from core.schema import errors
from runs.authorization_effects import resume_connected
from tools.models import ToolServer


class ConnectionOutput(serializers.ModelSerializer):
    server = serializers.CharField(source="server.name")
    user = serializers.CharField(source="user.username")
    since = serializers.DateTimeField(source="connected_at", allow_null=True)

    class Meta:
        model = Connection
        fields = [
            "id",
            "server",
            "user",
            "status",
            "scopes",
            "since",
            "last_used_at",
            "revoked_at",
            "revoked_reason",
        ]


class StartRequest(serializers.Serializer):
    server = serializers.SlugField(max_length=50, help_text="the tool server's name")


class StartOutput(serializers.Serializer):
    id = serializers.IntegerField()
    server = serializers.CharField()
    authorization_url = serializers.CharField(help_text="send the user's browser here to sign in")
    expires_at = serializers.DateTimeField(help_text="the sign-in must come back before this")


class ConnectedOutput(serializers.Serializer):
    connected = serializers.BooleanField()
    server = serializers.CharField()
    scopes = serializers.CharField()
    runs_resumed = serializers.IntegerField()


class ConnectionListApi(APIView):
    @extend_schema(
        operation_id="list_connections", summary="List connections", responses=ConnectionOutput(many=True)
    )
    def get(self, request):
        """Your connections to OAuth-protected MCP servers (the tenant's, with manage_connections)."""
        require_tenant(request.user)
        return Response(ConnectionOutput(selectors.connections_for(request.user)[:200], many=True).data)

    @extend_schema(
        operation_id="start_connection",
        summary="Connect to a tool server",
        request=StartRequest,
        responses={
            201: StartOutput,
            **errors({502: "The server or its authorization server refused or did not answer"}),
        },
    )
    def post(self, request):
        """Start connecting your account to an MCP server that asks for each user's own OAuth token:
        the answer's authorization_url is where your browser signs in; it comes back to the callback."""
        require_tenant(request.user)
        data = StartRequest(data=request.data)
        data.is_valid(raise_exception=True)
        server = ToolServer.objects.filter(
            tenant_id=request.user.tenant_id, name=data.validated_data["server"]
        ).first()
        if server is None:
            raise NotFound("tool server")
        connection, url = services.start_connection(user=request.user, server=server)
        return Response(
            {
                "id": connection.pk,
                "server": server.name,
                "authorization_url": url,
                "expires_at": connection.pending_until,
            },
            status=status.HTTP_201_CREATED,
        )


class ConnectionDetailApi(APIView):
    @extend_schema(
        operation_id="revoke_connection", summary="Revoke a connection", responses=ConnectionOutput
    )
    def delete(self, request, connection_id):
        """Revoke a connection: the next call a run makes with it is denied."""
        require_tenant(request.user)
        connection = selectors.get_connection(request.user, connection_id)
        if connection is None:
            raise NotFound("connection")
        services.revoke_connection(
            connection=connection, actor=request.user, reason=f"revoked by {request.user.username}"
        )
        return Response(ConnectionOutput(connection).data)


class ConnectionCallbackApi(APIView):
    # The browser comes back from the authorization server with no platform credentials: the
    # single-use `state` (256 random bits, bound to the user who started) is what identifies it.
    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="connection_callback",
        summary="OAuth callback",
        parameters=[
            OpenApiParameter("state", str, required=True),
            OpenApiParameter("code", str, required=False),
            OpenApiParameter("iss", str, required=False),
            OpenApiParameter("error", str, required=False),
        ],
        responses=ConnectedOutput,
    )
    def get(self, request):
        """Where the authorization server sends the browser back: the code is exchanged, the tokens
        kept encrypted, and the user's runs waiting for this connection resume."""
        params = request.query_params
        connection = services.finish_connection(
            state=params.get("state", "")[:200],
            code=params.get("code", "")[:2000],
            iss=params.get("iss"),
            error=params.get("error", "")[:200],
        )
        resumed = resume_connected(user_id=connection.user_id, server_id=connection.server_id)
        return Response(
            {
                "connected": True,
                "server": connection.server.name,
                "scopes": connection.scopes,
                "runs_resumed": resumed,
            }
        )
