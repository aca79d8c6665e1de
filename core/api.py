"""Small shared pieces of the API layer."""

from __future__ import annotations

import contextlib
import json

from django.db import connection, transaction
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
        self._validate(request)
        return super().paginate_queryset(queryset, request, view)

    def _validate(self, request) -> None:
        params = self.Params(
            data={
                key: request.query_params[key] for key in ("limit", "offset") if key in request.query_params
            }
        )
        params.is_valid(raise_exception=True)
        self._bounded = params.validated_data

    def get_limit(self, request):
        return self._bounded.get("limit", self.default_limit)

    def get_offset(self, request):
        return self._bounded.get("offset", 0)


# Matches counted one by one at most; past this many, `count` is PostgreSQL's estimate.
COUNT_EXACT_MAX = 1_000


class BoundedCountPagination(Pagination):
    """For a list that reaches millions of rows (the runs): `count` is exact up to COUNT_EXACT_MAX
    matches and `count_exact` says so; past that, counting would read every match (seconds for a
    word in 5% of a million runs, docs/performance.md), so `count` is the planner's estimate,
    never below what the page shows exists, and `count_exact` is false ("about 45,000 runs").
    `next` comes from one row read past the page: it is right whatever `count` says. A queryset
    may carry `page_settings` (planner_settings) for reading its page."""

    def paginate_queryset(self, queryset, request, view=None):
        self._validate(request)
        self.request = request
        self.limit, self.offset = self.get_limit(request), self.get_offset(request)
        with planner_settings(getattr(queryset, "page_settings", None)):
            rows = list(queryset[self.offset : self.offset + self.limit + 1])
        self.has_more = len(rows) > self.limit
        page = rows[: self.limit]
        seen = self.offset + len(page) + self.has_more
        self.count, self.count_exact = bounded_count(queryset, at_least=seen)
        if self.count > self.limit and self.template is not None:
            self.display_page_controls = True
        return page

    def get_next_link(self):
        return super().get_next_link() if self.has_more else None

    def get_paginated_response(self, data):
        response = super().get_paginated_response(data)
        response.data["count_exact"] = self.count_exact
        return response


@contextlib.contextmanager
def planner_settings(settings: dict[str, str] | None):
    """PostgreSQL planner settings (`SET LOCAL`) for the statements inside, in a transaction of
    their own: how a queryset that knows better than the planner's estimate asks to be read
    (runs/front/search.py's walk of the newest runs for a common word)."""
    if not settings or connection.vendor != "postgresql":
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            before = {}
            for name, value in settings.items():
                cursor.execute("SELECT current_setting(%s), set_config(%s, %s, true)", [name, name, value])
                before[name] = cursor.fetchone()[0]
        yield
        # Inside a caller's transaction (a savepoint here) SET LOCAL would outlive this block.
        with connection.cursor() as cursor:
            for name, value in before.items():
                cursor.execute("SELECT set_config(%s, %s, true)", [name, value])


def bounded_count(queryset, *, at_least: int = 0) -> tuple[int, bool]:
    """(how many rows `queryset` holds, whether that is exact): counted up to COUNT_EXACT_MAX,
    estimated past it (EXPLAIN's rows for the query, which costs its planning only)."""
    rows = queryset.order_by().values("pk")
    if connection.vendor != "postgresql":  # the demo's few runs: count them
        return rows.count(), True
    counted = rows[: COUNT_EXACT_MAX + 1].count()
    if counted <= COUNT_EXACT_MAX:
        return counted, True
    sql, params = rows.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    if isinstance(plan, str):
        plan = json.loads(plan)
    return max(int(plan[0]["Plan"]["Plan Rows"]), counted, at_least), False


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


def paginate(view, request, queryset, serializer_class, *, bounded: bool = False):
    paginator = BoundedCountPagination() if bounded else Pagination()
    page = paginator.paginate_queryset(queryset, request, view=view)
    return paginator.get_paginated_response(serializer_class(page, many=True).data)


def paginated(serializer_class, name: str, *, bounded: bool = False):
    """The schema of what paginate() answers: count, next, previous and the page's results
    (`bounded`: BoundedCountPagination's, with count_exact)."""
    fields = {
        "count": serializers.IntegerField(
            help_text=f"matches; past {COUNT_EXACT_MAX:,} an estimate (count_exact false)"
            if bounded
            else "matches"
        ),
        "next": serializers.URLField(allow_null=True),
        "previous": serializers.URLField(allow_null=True),
        "results": serializer_class(many=True),
    }
    if bounded:
        fields["count_exact"] = serializers.BooleanField(
            help_text=f"true: count is exact; false: more than {COUNT_EXACT_MAX:,} matches, count is "
            "PostgreSQL's estimate"
        )
    return inline_serializer(name, fields)


def money(micros: int | None) -> str | None:
    return None if micros is None else f"{micros / 1_000_000:.6f}"


class BudgetSerializer(serializers.Serializer):
    limit_micros = serializers.IntegerField()
    reserved_micros = serializers.IntegerField()
    spent_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    overage_micros = serializers.IntegerField()
    remaining_micros = serializers.IntegerField()
