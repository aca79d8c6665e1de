from __future__ import annotations

from django.contrib.auth import authenticate
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_serializer, inline_serializer
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import DomainError
from core.schema import errors
from tenants import tokens
from tenants.auth import ApiTokenAuthentication, TokenAddressThrottle, TokenUsernameThrottle
from tenants.models import ApiToken

TokenOutput = inline_serializer(
    "Token",
    {
        "token": serializers.CharField(),
        "token_type": serializers.ChoiceField(choices=["Bearer"]),
        "expires_at": serializers.DateTimeField(),
    },
)


def _issued(issued: tokens.Issued, code: int = status.HTTP_200_OK) -> Response:
    return Response(
        {"token": issued.token, "token_type": "Bearer", "expires_at": issued.expires_at}, status=code
    )


def _caller_token(request) -> ApiToken:
    if not isinstance(request.auth, ApiToken):
        raise DomainError(
            "this needs an API token in the Authorization header", code="token_required", status=401
        )
    return request.auth


class TokenApi(APIView):
    """Sign in for an API token (POST), or revoke the token you call with (DELETE)."""

    authentication_classes = [ApiTokenAuthentication]
    throttle_classes = [TokenAddressThrottle, TokenUsernameThrottle]

    @extend_schema_serializer(component_name="SignIn")
    class InputSerializer(serializers.Serializer):
        username = serializers.CharField(max_length=150)
        password = serializers.CharField(max_length=4096, write_only=True, trim_whitespace=False)

    def get_permissions(self):
        return [AllowAny()] if self.request.method == "POST" else [IsAuthenticated()]

    def get_throttles(self):
        return super().get_throttles() if self.request.method == "POST" else []

    def perform_authentication(self, request):
        # Signing in must work even if the client still sends an old, expired token.
        if request.method != "POST":
            super().perform_authentication(request)

    @extend_schema(
        operation_id="create_token",
        summary="Sign in for a token",
        request=InputSerializer,
        responses={
            200: TokenOutput,
            **errors({429: "Too many sign-in attempts for this username or from this address"}),
        },
        auth=[],
    )
    def post(self, request):
        """Exchange a username and password for a new token (expires; see API_TOKEN_TTL_SECONDS).
        Send it as `Authorization: Bearer <token>` (or `Token <token>`)."""
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = authenticate(request, **data.validated_data)
        if user is None:
            raise DomainError("wrong username or password", code="invalid_credentials", status=401)
        return _issued(tokens.issue_token(user=user))

    @extend_schema(
        operation_id="revoke_token",
        summary="Revoke your token",
        responses={204: OpenApiResponse(description="Revoked")},
    )
    def delete(self, request):
        """Revoke the token this request is authenticated with; it stops working at once."""
        tokens.revoke_token(row=_caller_token(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class TokenRefreshApi(APIView):
    """Swap the token you call with for a new one with a fresh expiry; the old one is revoked."""

    authentication_classes = [ApiTokenAuthentication]

    @extend_schema(
        operation_id="refresh_token", summary="Refresh your token", request=None, responses=TokenOutput
    )
    def post(self, request):
        """Swap the token you call with for a new one with a fresh expiry; the old one is revoked at once.
        Refreshing ends API_TOKEN_MAX_AGE_SECONDS after the password sign-in."""
        try:
            return _issued(tokens.refresh_token(row=_caller_token(request)))
        except tokens.TokenRefused as exc:
            raise DomainError(str(exc), code="authentication_failed", status=401) from None
