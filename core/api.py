"""Small shared pieces of the API layer."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, inline_serializer
from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination

from core.errors import Forbidden

# Bounds shared by the API and the configuration (documented in the OpenAPI schema).
MONEY_MAX_MICROS = 10**15  # one billion currency units; far below bigint's 9.2e18
ID_MAX = 2**63 - 1  # bigint primary keys and sequence numbers
PAGE_MAX = 200
OFFSET_MAX = 10_000_000


def require_tenant(user) -> None:
    if user.tenant_id is None:
        raise Forbidden("this user belongs to no tenant", code="no_tenant")


class Pagination(LimitOffsetPagination):
    """limit and offset within bounds; a bad value is a 400 with its name, not a silent default."""

    default_limit = 50
    max_limit = PAGE_MAX

    class Params(serializers.Serializer):
        limit = serializers.IntegerField(min_value=1, max_value=PAGE_MAX, required=False)
        offset = serializers.IntegerField(min_value=0, max_value=OFFSET_MAX, required=False)

    def paginate_queryset(self, queryset, request, view=None):
        params = self.Params(
            data={
                key: request.query_params[key] for key in ("limit", "offset") if key in request.query_params
            }
        )
        params.is_valid(raise_exception=True)
        self._bounded = params.validated_data
        return super().paginate_queryset(queryset, request, view)

    def get_limit(self, request):
        return self._bounded.get("limit", self.default_limit)

    def get_offset(self, request):
        return self._bounded.get("offset", 0)


PAGE_PARAMETERS = [
    OpenApiParameter(
        "limit",
        {"type": "integer", "minimum": 1, "maximum": PAGE_MAX, "default": 50},
        description="page size",
    ),
    OpenApiParameter(
        "offset",
        {"type": "integer", "minimum": 0, "maximum": OFFSET_MAX, "default": 0},
        description="items to skip",
    ),
]


def paginate(view, request, queryset, serializer_class):
    paginator = Pagination()
    page = paginator.paginate_queryset(queryset, request, view=view)
    return paginator.get_paginated_response(serializer_class(page, many=True).data)


def paginated(serializer_class, name: str):
    """The schema of what paginate() answers: count, next, previous and the page's results."""
    return inline_serializer(
        name,
        {
            "count": serializers.IntegerField(),
            "next": serializers.URLField(allow_null=True),
            "previous": serializers.URLField(allow_null=True),
            "results": serializer_class(many=True),
        },
    )


def money(micros: int | None) -> str | None:
    return None if micros is None else f"{micros / 1_000_000:.6f}"


class BudgetSerializer(serializers.Serializer):
    limit_micros = serializers.IntegerField()
    reserved_micros = serializers.IntegerField()
    spent_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    overage_micros = serializers.IntegerField()
    remaining_micros = serializers.IntegerField()
