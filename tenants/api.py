from __future__ import annotations

from django.contrib.auth import authenticate
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.authtoken.models import Token
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agentplatform.errors import DomainError


class TokenCreateApi(APIView):
    """Exchange a username and password for an API token (the same token on every call)."""

    permission_classes = [AllowAny]
    authentication_classes: list = []

    class InputSerializer(serializers.Serializer):
        username = serializers.CharField()
        password = serializers.CharField(write_only=True)

    @extend_schema(request=InputSerializer, responses=inline_serializer("Token", {"token": serializers.CharField()}))
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = authenticate(request, **data.validated_data)
        if user is None:
            raise DomainError("wrong username or password", code="invalid_credentials", status=401)
        token, _ = Token.objects.get_or_create(user=user)
        return Response({"token": token.key})
