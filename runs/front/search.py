"""Finding a run: the search behind `GET /v1/runs?q=` and the admin's search box.

`q` matches a run by its id or an id prefix (at least 4 hex digits: `a739`, `a7390f2e-53`), or by a
value anywhere in its input or metadata, exactly (`TXN-1002`, `12499`). Every filter has an index
(runs/migrations/0009_run_search_indexes.py), so a search stays fast at a million runs
(bench/run_search.py measures it):
- an id prefix is a range of the primary key (`a739…0000` to `a739…ffff`), read from its B-tree;
- values: a GIN index on the array of every string and number in input and metadata
  (`SearchValues`), queried with `@>`; the query repeats the index's expression to the letter,
  which is what lets PostgreSQL use it;
- the tenant's newest first: (tenant, created_at); creator, agent and status have their own.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Func, JSONField, Q
from django.db.models.sql.compiler import SQLCompiler

# Every string and number in the run's input and metadata, at any depth. The same text is in the
# index's definition (runs/migrations/0009_run_search_indexes.py).
VALUES_PATH = 'strict $.** ? (@.type() == "string" || @.type() == "number")'


class SearchValues(Func):
    """`jsonb_path_query_array(input, VALUES_PATH) || jsonb_path_query_array(metadata, VALUES_PATH)`,
    with the columns named through the ORM so a subquery's table alias is used."""

    template = (
        f"(jsonb_path_query_array(%(input)s, '{VALUES_PATH}'::jsonpath)"
        f" || jsonb_path_query_array(%(metadata)s, '{VALUES_PATH}'::jsonpath))"
    )
    output_field = JSONField()

    def __init__(self):
        super().__init__(F("input"), F("metadata"))

    def as_sql(
        self,
        compiler: SQLCompiler,
        connection: BaseDatabaseWrapper,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra_context: Any,
    ) -> tuple[str, tuple[str | int, ...]]:
        (input_sql, input_params), (metadata_sql, metadata_params) = (
            compiler.compile(expression) for expression in self.get_source_expressions()
        )
        return self.template % {"input": input_sql, "metadata": metadata_sql}, (
            *input_params,
            *metadata_params,
        )


ID_PREFIX = re.compile(r"^[0-9a-f]{4,32}$")
Q_MAX = 200


def id_range(q: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The ids that start with `q` (dashes optional), as a closed range; None if `q` is no id prefix."""
    digits = q.lower().replace("-", "")
    if not ID_PREFIX.match(digits):
        return None
    return uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))


PLAIN_NUMBER = re.compile(r"^-?\d{1,18}(\.\d{1,6})?$")


def _as_number(q: str):
    """`12499` and `12.5` are numbers too; `1e5`, `8e123456` (an id prefix) and `nan` are not."""
    if not PLAIN_NUMBER.match(q):
        return None
    number = Decimal(q)
    return int(number) if number == number.to_integral_value() else float(number)


def search(runs, q: str):
    """The runs of `runs` that `q` names: by id or id prefix, or by a value in input or metadata."""
    q = q.strip()
    if not q:
        return runs
    if connection.vendor == "postgresql":
        runs = runs.alias(search_values=SearchValues())
        match = Q(search_values__contains=[q])
        number = _as_number(q)
        if number is not None:
            match |= Q(search_values__contains=[number])
    else:  # SQLite (the demo): no jsonpath; the text of input and metadata, and few runs to scan
        match = Q(input__icontains=q) | Q(metadata__icontains=q)
    ids = id_range(q)
    if ids is not None:
        match |= Q(pk__gte=ids[0], pk__lte=ids[1])
    return runs.filter(match)


def created_between(runs, *, after: dt.datetime | None = None, before: dt.datetime | None = None):
    if after is not None:
        runs = runs.filter(created_at__gte=after)
    if before is not None:
        runs = runs.filter(created_at__lt=before)
    return runs
