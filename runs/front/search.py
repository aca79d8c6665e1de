"""Finding a run: the search behind `GET /v1/runs?q=` and the admin's search box.

`q` matches a run by its id or an id prefix (at least 4 hex digits: `a739`, `a7390f2e-53`), by a
value anywhere in its input or metadata, exactly (`TXN-1002`, `12499`), or by words: every word
of `q` among the words of the run's strings in input and metadata (the request's text, the
customer's name and email, a ticket's subject: `meera sharma`, `duplicate charge`), in web-search
syntax (`"exact phrase"`, `or`, `-word`), stemmed as English (`refunds` finds `refund`). Every
filter has an index (runs/migrations/0010_run_search_indexes.py, 0021_run_search_words.py), so a
search stays fast at a million runs (bench/run_search.py measures it):
- an id prefix is a range of the primary key (`a739…0000` to `a739…ffff`), read from its B-tree;
- values: a GIN index on the array of every string and number in input and metadata
  (`SearchValues`), queried with `@>`; the query repeats the index's expression to the letter,
  which is what lets PostgreSQL use it;
- words: `search_words`, the tsvector of every string in input and metadata, kept by a trigger,
  with a GIN index, queried with `@@ websearch_to_tsquery('english', q)`;
- the tenant's newest first: (tenant, created_at); creator, agent and status have their own.

The values are looked up first and their runs' ids stand in the match (rebuilding each run's
array in the match cost 3 µs a run); a query whose words are in more than DENSE_MIN runs has its
page read walking the newest runs (WALK_NEWEST: PostgreSQL underestimates runs that carry several
common words and would read and sort them all). Measured in docs/performance.md.

Ranked (`ranked=True`: the API's list and the admin's, unless sorted by a column): when `q`
matches at most RANK_MAX runs (a name, a ticket's words), the best word matches first (ts_rank
over the stored tsvector), then newest first. More matches than that are listed newest first:
sorting them all by rank means reading every match, row by row (at a million runs, seconds for a
word in 5% of the runs; a word in most runs, such as `customer`, tells them apart no better than
their age). One cheap question decides: is there a match past the first RANK_MAX?

SQLite (the demo): no jsonpath, no tsvector; every word of `q` must appear in the text of input
or metadata (case-insensitive), newest first, over its few runs.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BooleanField, F, FloatField, Func, JSONField, Q, Value
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


# The run's words: `runs_run.search_words`, the English tsvector of every string in input and
# metadata, kept by a trigger (runs/migrations/0021_run_search_words.py; not a model field).
RANK_MAX = 500
# More runs than this carry q's words: their page is read walking the newest runs.
DENSE_MIN = 5_000
# The planner's settings for that walk (SET LOCAL while the page is read): no bitmap scan (the
# only way a GIN index is read), no sequential scan, no parallel workers (25 ms to start them).
WALK_NEWEST = {"enable_bitmapscan": "off", "enable_seqscan": "off", "max_parallel_workers_per_gather": "0"}
# At most this many runs hold q as a value for their ids to stand in the match.
VALUES_MAX = 500


class _Words(Func):
    """An expression over the run's `search_words` column and the search text; the column is named
    with the table alias the ORM gives `input` (a subquery's own)."""

    sql = ""

    def __init__(self, q: str):
        super().__init__(F("input"), Value(q))

    def as_sql(self, compiler, connection, function=None, template=None, arg_joiner=None, **extra_context):
        (input_sql, input_params), (q_sql, q_params) = (
            compiler.compile(expression) for expression in self.get_source_expressions()
        )
        table = input_sql.rsplit(".", 1)[0]
        words = f'{table}."search_words"'
        query = f"websearch_to_tsquery('english'::regconfig, {q_sql})"
        return self.sql.format(words=words, query=query), (*input_params, *q_params)


class WordsMatch(_Words):
    """True when every word of q is among the run's words (`@@`, served by run_search_words)."""

    sql = "{words} @@ {query}"
    output_field = BooleanField()


class WordsRank(_Words):
    """How well the run's words match q (ts_rank over the stored tsvector)."""

    sql = "ts_rank({words}, {query})"
    output_field = FloatField()


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


def search(runs, q: str, *, ranked: bool = False):
    """The runs of `runs` that `q` names: by id or id prefix, by a value in input or metadata, or
    by words of their strings; `ranked`: the best word matches first (module docstring)."""
    q = q.strip()
    if not q:
        return runs
    if connection.vendor != "postgresql":
        return runs.filter(_sqlite_match(q))
    by_values = Q(search_values__contains=[q])
    number = _as_number(q)
    if number is not None:
        by_values |= Q(search_values__contains=[number])
    # The runs that hold q as a value, found first (one lookup in the values index): few, as
    # values are exact. In the match their ids cost nothing per run, where the values
    # expression rebuilt each run's array (3 µs a run: 166 ms to walk 50,000 runs for a shop).
    valued = list(holding_values(runs, by_values).values_list("pk", flat=True)[: VALUES_MAX + 1])
    if len(valued) > VALUES_MAX:  # a value in very many runs (an amount): the expression itself
        values_match = by_values
        runs = runs.alias(search_values=SearchValues())
    else:
        values_match = Q(pk__in=valued)
    ids = id_range(q)
    if ids is not None:
        values_match |= Q(pk__gte=ids[0], pk__lte=ids[1])
    found = runs.filter(Q(WordsMatch(q)) | values_match)
    # How many runs carry q's words, up to DENSE_MIN + 1 (one lookup in the words index).
    words = runs.filter(WordsMatch(q)).order_by().values("pk")[: DENSE_MIN + 1].count()
    if words > DENSE_MIN:
        # Words in many runs: the newest first, walking them. PostgreSQL misjudges how many runs
        # carry all of q's words (it multiplies their shares: 201 expected for "wrong amount
        # debited", 50,001 found), reads every match from the index and sorts them (390 ms),
        # where the walk fills the page in 1,700 runs (5 ms). Counting stays on the indexes.
        found.page_settings = WALK_NEWEST  # core.api.BoundedCountPagination reads the page with them
        return found
    if not ranked or (words + len(valued) > RANK_MAX and _more_than(found, RANK_MAX)):
        # Many matches: newest first, which the (tenant, created_at) index serves without reading
        # every match; ranking them would sort them all, row by row (seconds for a word in most runs).
        return found
    return found.alias(search_rank=WordsRank(q)).order_by("-search_rank", "-created_at")


def holding_values(runs, by_values: Q):
    """The runs of `runs` that hold a value of `by_values` (`search_values__contains=[...]`), from
    the values index (its expression repeated to the letter), unordered."""
    return runs.alias(search_values=SearchValues()).filter(by_values).order_by()


def _more_than(runs, n: int) -> bool:
    """Whether more than n runs are in `runs`. Unordered: which match is the (n+1)th does not
    matter, and ordered, every match was sorted (188 ms for a word in 5% of a million runs)."""
    return runs.order_by().values("pk")[n : n + 1].exists()


def _sqlite_match(q: str) -> Q:
    """The demo's search: the whole of q, or every word of it, in the text of input or metadata."""

    def anywhere(text: str) -> Q:
        return Q(input__icontains=text) | Q(metadata__icontains=text)

    words = [word.strip('"') for word in q.split() if word.strip('"')]
    every_word = Q()
    for word in words:
        every_word &= anywhere(word)
    match = anywhere(q) | every_word
    ids = id_range(q)
    if ids is not None:
        match |= Q(pk__gte=ids[0], pk__lte=ids[1])
    return match


def created_between(runs, *, after: dt.datetime | None = None, before: dt.datetime | None = None):
    if after is not None:
        runs = runs.filter(created_at__gte=after)
    if before is not None:
        runs = runs.filter(created_at__lt=before)
    return runs
