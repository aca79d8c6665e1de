"""Finding a run: the search behind `GET /v1/runs?q=` and the admin's search box.

`q` matches a run by its id or an id prefix (at least 4 hex digits: `a739`, `a7390f2e-53`), by a
value anywhere in its input or metadata, exactly (`TXN-1002`, `12499`), or by words: every word
of `q` among the words of the run's strings in input and metadata (the request's text, the
customer's name and email, a ticket's subject: `meera sharma`, `duplicate charge`), in web-search
syntax (`"exact phrase"`, `or`, `-word`), stemmed as English (`refunds` finds `refund`).

Input and metadata are sealed at rest (vault/fields.py): the database cannot read them. It
searches `search_words` instead, a tsvector of keyed lexemes of the run's words (with their
positions) and whole values, made when the run is created, and `q` is parsed in Python into a
tsquery of the same keyed lexemes (vault/keyed_search.py), one alternative per tenant searched
(the caller's; every tenant for an operator). One GIN index serves words and values
(runs/migrations/0021, 0029), so a search stays fast at a million runs (bench/run_search.py):
- an id prefix is a range of the primary key (`a739…0000` to `a739…ffff`), read from its B-tree;
- words and values: `search_words @@ tsquery`, from the GIN index;
- the tenant's newest first: (tenant, created_at); creator, agent and status have their own.

A query whose lexemes are in more than DENSE_MIN runs has its page read walking the newest runs
(WALK_NEWEST: PostgreSQL underestimates runs that carry several common words and would read and
sort them all). Measured in docs/performance.md.

Ranked (`ranked=True`: the API's list and the admin's, unless sorted by a column): when `q`
matches at most RANK_MAX runs (a name, a ticket's words), the best word matches first (ts_rank
over the stored tsvector), then newest first. More matches than that are listed newest first:
sorting them all by rank means reading every match, row by row (at a million runs, seconds for a
word in 5% of the runs; a word in most runs, such as `customer`, tells them apart no better than
their age).

SQLite (the demo): the same stored lexemes, matched in Python over the runs asked about (its few).
"""

from __future__ import annotations

import datetime as dt
import re
import uuid

from django.db import connection
from django.db.models import BooleanField, Case, F, FloatField, Func, Q, TextField, Value, When

from vault import keyed_search

RANK_MAX = 500
# More runs than this carry q's lexemes: their page is read walking the newest runs.
DENSE_MIN = 5_000
# The planner's settings for that walk (SET LOCAL while the page is read): no bitmap scan (the
# only way a GIN index is read), no sequential scan, no parallel workers (25 ms to start them).
WALK_NEWEST = {"enable_bitmapscan": "off", "enable_seqscan": "off", "max_parallel_workers_per_gather": "0"}


class _Words(Func):
    """An expression over the run's `search_words` and a tsquery's text (or an expression giving it)."""

    sql = ""

    def __init__(self, query):
        super().__init__(F("search_words"), query if hasattr(query, "resolve_expression") else Value(query))

    def as_sql(self, compiler, connection, function=None, template=None, arg_joiner=None, **extra_context):
        (words_sql, words_params), (q_sql, q_params) = (
            compiler.compile(expression) for expression in self.get_source_expressions()
        )
        return self.sql.format(words=words_sql, query=f"({q_sql})::tsquery"), (*words_params, *q_params)


class WordsMatch(_Words):
    """True when the run's lexemes satisfy the tsquery (`@@`, served by run_search_words)."""

    sql = "{words} @@ {query}"
    output_field = BooleanField()


class WordsRank(_Words):
    """How well the run's words match the tsquery (ts_rank over the stored tsvector)."""

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


def search(runs, q: str, *, tenants, ranked: bool = False):
    """The runs of `runs` that `q` names: by id or id prefix, by a value in input or metadata, or
    by words of their strings; `tenants`: the tenants whose runs `runs` may hold (their keys make
    the query); `ranked`: the best word matches first (module docstring)."""
    q = q.strip()
    if not q:
        return runs
    parsed = keyed_search.parse(q)
    if connection.vendor != "postgresql":
        return runs.filter(_by_id(q, Q(pk__in=_matching_in_python(runs, parsed))))
    query = keyed_search.tsquery(tenants, parsed)
    found = runs.filter(_by_id(q, Q(WordsMatch(query))))
    # How many runs carry q's lexemes, up to DENSE_MIN + 1 (one lookup in the words index).
    words = runs.filter(WordsMatch(query)).order_by().values("pk")[: DENSE_MIN + 1].count()
    if words > DENSE_MIN:
        # In many runs: the newest first, walking them. PostgreSQL misjudges how many runs carry
        # all of q's words (it multiplies their shares: 201 expected for "wrong amount debited",
        # 50,001 found), reads every match from the index and sorts them (390 ms), where the walk
        # fills the page in 1,700 runs (5 ms). Counting stays on the indexes.
        found.page_settings = WALK_NEWEST  # core.api.BoundedCountPagination reads the page with them
        return found
    if not ranked or words > RANK_MAX:
        # Many matches: newest first, which the (tenant, created_at) index serves without reading
        # every match; ranking them would sort them all, row by row (seconds for a word in most runs).
        return found
    return found.alias(search_rank=WordsRank(_ranking(tenants, parsed))).order_by(
        "-search_rank", "-created_at"
    )


def _ranking(tenants, parsed: keyed_search.Query):
    """What ts_rank is given: the query's words in the run's own tenant's lexemes. One tsquery
    ORing every tenant's would rank each match as an OR of its words (proximity ignored): an
    operator searching every tenant gets, for each run, its tenant's query."""
    queries = {tenant: keyed_search.tsquery([tenant], parsed, values=False) for tenant in tenants}
    if len(queries) == 1:
        return next(iter(queries.values()))
    return Case(
        *[When(tenant_id=tenant, then=Value(query)) for tenant, query in queries.items()],
        default=Value("''"),
        output_field=TextField(),
    )


def _by_id(q: str, match: Q) -> Q:
    """`match`, or the run's id starting with `q` when `q` is an id prefix."""
    ids = id_range(q)
    return match | Q(pk__gte=ids[0], pk__lte=ids[1]) if ids is not None else match


def _matching_in_python(runs, parsed: keyed_search.Query) -> list:
    """The demo's search: each run's stored lexemes against the query, in Python."""
    matchers: dict = {}
    found = []
    for pk, tenant_id, words in runs.order_by().values_list("pk", "tenant_id", "search_words"):
        if tenant_id not in matchers:
            matchers[tenant_id] = keyed_search.matcher(tenant_id, parsed)
        if matchers[tenant_id](words):
            found.append(pk)
    return found


def created_between(runs, *, after: dt.datetime | None = None, before: dt.datetime | None = None):
    if after is not None:
        runs = runs.filter(created_at__gte=after)
    if before is not None:
        runs = runs.filter(created_at__lt=before)
    return runs
