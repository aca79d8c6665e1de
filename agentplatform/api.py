"""Small shared pieces of the API layer."""
from __future__ import annotations

from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination

from agentplatform.errors import Forbidden


def require_tenant(user) -> None:
    if user.tenant_id is None:
        raise Forbidden("this user belongs to no tenant", code="no_tenant")


def paginate(view, request, queryset, serializer_class):
    paginator = LimitOffsetPagination()
    page = paginator.paginate_queryset(queryset, request, view=view)
    return paginator.get_paginated_response(serializer_class(page, many=True).data)


def money(micros: int | None) -> str | None:
    return None if micros is None else f"{micros / 1_000_000:.6f}"


class BudgetSerializer(serializers.Serializer):
    limit_micros = serializers.IntegerField()
    reserved_micros = serializers.IntegerField()
    spent_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    overage_micros = serializers.IntegerField()
    remaining_micros = serializers.IntegerField()
