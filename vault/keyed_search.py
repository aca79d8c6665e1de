"""Full-text search over sealed content: keyed lexemes (the run search's, runs/front/search.py).

A run's input and metadata are sealed at rest (vault/fields.py): PostgreSQL cannot read them to
search. What it searches instead is a tsvector made here, in Python, when the run is written, whose
lexemes are keyed hashes (HMAC-SHA256 with the tenant's word key, 64 bits in hex:
vault.sealing.search_lexemes) of
- each word of each string, lower-cased and stemmed as English (Snowball's English stemmer, the one
  PostgreSQL's `english` configuration uses, with its stop words left out), at its position, so
  that a phrase (`<->`, `<N>`) and ts_rank work as they did on the words themselves;
- each string and each number whole: a value (`TXN-1002`, `12499`, `12.5`), found exactly.
A search's text is parsed here too, in web-search syntax as websearch_to_tsquery reads it
(`"a phrase"`, `or`, `-word`), into a tsquery of the same hashes. A dump or a backup holds only
hashes: without the tenant's word key (in the key store) they confirm no guess.

Positions follow jsonb_to_tsvector: one apart within a string, two across strings (a phrase does
not span two values), at most MAX_POSITION; at most MAX_POSITIONS kept per lexeme (tsvector's
limits). SQLite (the demo) stores the same text and `matches` evaluates a query in Python.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

import snowballstemmer
from django.db import models

from vault import sealing

WORD = re.compile(r"[^\W_]+")  # letters and digits: `_`, `-`, `@` and `.` part words
# PostgreSQL's english.stop (Snowball's English stop words): dropped from documents and queries.
_ENGLISH_STOP = """i me my myself we our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves what which who whom this
    that these those am is are was were be been being have has had having do does did doing a an
    the and but if or because as until while of at by for with about against between into through
    during before after above below to from up down in out on off over under again further then
    once here there when where why how all any both each few more most other some such no nor not
    only own same so than too very s t can will just don should now"""
STOP_WORDS = frozenset(_ENGLISH_STOP.split())
MAX_POSITION = 16383
MAX_POSITIONS = 256
NUMBER = re.compile(r"^-?\d{1,18}(\.\d{1,6})?$")  # `1e5`, `nan` and an id prefix like `8e12` are not
# A chunk of a search text: `-` (not), then a quoted phrase (to its closing quote or the end) or a word.
CHUNK = re.compile(r'(-?)(?:"([^"]*)"?|(\S+))')

_local = threading.local()


@functools.lru_cache(maxsize=65_536)  # a tenant's words repeat: names, products, the same complaints
def _stem(word: str) -> str:
    stemmer = getattr(_local, "stemmer", None)
    if stemmer is None:  # a Snowball stemmer keeps its word while it works: one a thread
        stemmer = _local.stemmer = snowballstemmer.stemmer("english")
    return stemmer.stemWord(word)


def _number(value) -> str:
    """A number's one text: 12, 12.0 and 12.00 are `12`; 12.50 is `12.5`."""
    exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if exact == exact.to_integral_value():
        return str(int(exact))
    return format(exact.normalize(), "f")


def _scalars(value):
    """Every string and number in a JSON value, at any depth (not the objects' keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int | float):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _scalars(item)
    elif isinstance(value, list):
        for item in value:
            yield from _scalars(item)


def _words(text: str, start: int = 0) -> tuple[list[tuple[str, int]], int]:
    """The stems of a text's words with their positions (after `start`), stop words left out but
    counted, as PostgreSQL counts them; and how many words it has."""
    words = WORD.findall(text.lower())
    found = [(_stem(w), at) for at, w in enumerate(words, start=start + 1) if w not in STOP_WORDS]
    return found, len(words)


def _tokens(*values) -> tuple[dict[str, list[int]], set[str]]:
    """A document's plain tokens: each word's positions (`w|stem`), and its whole values (`s|text`,
    `n|number`)."""
    positions: dict[str, list[int]] = {}
    whole: set[str] = set()
    position = 0
    for value in values:
        for item in _scalars(value):
            if not isinstance(item, str):
                whole.add(f"n|{_number(item)}")
                continue
            whole.add(f"s|{item}")
            found, count = _words(item, position)
            for stem, at in found:
                positions.setdefault(f"w|{stem}", []).append(min(at, MAX_POSITION))
            position += count + 1
    return positions, whole


def document(tenant, *values) -> str:
    """The values' tsvector text, with the tenant's keyed lexemes: what `search_words` holds."""
    positions, whole = _tokens(*values)
    names = list(positions) + sorted(whole)
    hashed = dict(zip(names, sealing.search_lexemes(tenant, names), strict=True))
    entries = [
        f"'{hashed[token]}':{','.join(str(p) for p in sorted(set(at))[:MAX_POSITIONS])}"
        for token, at in positions.items()
    ]
    entries += [f"'{hashed[token]}'" for token in sorted(whole)]
    return " ".join(entries)


def parse_document(text: str | None) -> dict[str, set[int]]:
    """A stored `document` back as {lexeme: positions} (SQLite's search evaluates it in Python)."""
    found: dict[str, set[int]] = {}
    for entry in (text or "").split():
        lexeme, _, at = entry.partition(":")
        found[lexeme.strip("'")] = {int(p) for p in at.split(",")} if at else set()
    return found


# A term: whether it is negated, and its phrase: each stem with its distance from the one before it
# (0 for the first). A query: OR of groups, each the AND of its terms; and the whole values.
Term = tuple[bool, tuple[tuple[str, int], ...]]


@dataclass(frozen=True)
class Query:
    groups: tuple[tuple[Term, ...], ...]
    values: tuple[str, ...]

    def lexemes(self) -> list[str]:
        """Its plain tokens, in the order `tsquery` hashes them."""
        words = [f"w|{stem}" for group in self.groups for _, phrase in group for stem, _ in phrase]
        return words + list(self.values)


def parse(q: str) -> Query:
    """A search text in web-search syntax (websearch_to_tsquery's): words and `"phrases"` all
    present, `or` between alternatives (AND binds tighter), `-` before a word or phrase for not; a
    word with punctuation inside (`meera@bank.example`, `TXN-1002`) is the phrase of its parts.
    The whole text is also a value (and a number, if it reads as one)."""
    groups: list[tuple[Term, ...]] = []
    group: list[Term] = []
    dangling = False  # a `-` standing alone negates the next word or phrase
    for negated, quoted, word in CHUNK.findall(q):
        text = quoted if quoted or not word else word
        if not negated and not quoted and word.lower() == "or":
            if group:
                groups.append(tuple(group))
            group, dangling = [], False
            continue
        found, _ = _words(text)
        if not found:
            dangling = dangling or text.startswith("-")
            continue
        phrase = tuple((stem, at - found[i - 1][1] if i else 0) for i, (stem, at) in enumerate(found))
        group.append((bool(negated) or dangling, phrase))
        dangling = False
    if group:
        groups.append(tuple(group))
    values = [f"s|{q}"]
    if NUMBER.match(q):
        values.append(f"n|{_number(Decimal(q))}")
    return Query(tuple(groups), tuple(values))


def tsquery(tenants, query: Query, *, values: bool = True) -> str:
    """The query's tsquery text over each tenant's keyed lexemes, one alternative a tenant (a
    tenant's lexemes are nobody else's: the key differs). `values=False`: its words only, what
    ts_rank is given (an alternative `| value` would make it rank every match as an OR)."""
    alternatives = []
    for tenant in tenants:
        hashed = _hashed(tenant, query)
        if hashed is None:  # no word key: the tenant has no stored words to match
            continue
        words = [
            " & ".join(_term(negated, phrase, hashed) for negated, phrase in group) for group in query.groups
        ]
        alternatives += [f"({w})" for w in words] + [f"'{hashed[v]}'" for v in query.values if values]
    return " | ".join(alternatives) if alternatives else "''"


def _hashed(tenant, query: Query) -> dict[str, str] | None:
    """The query's tokens in the tenant's lexemes; None when the tenant has no word key (a search
    does not make one)."""
    names = query.lexemes()
    lexemes = sealing.query_lexemes(tenant, names)
    return None if lexemes is None else dict(zip(names, lexemes, strict=True))


def _term(negated: bool, phrase, hashed: dict) -> str:
    text = ""
    for stem, distance in phrase:
        lexeme = f"'{hashed[f'w|{stem}']}'"
        text = lexeme if not text else f"{text} <{distance}> {lexeme}"
    return f"!({text})" if negated else f"({text})"


def matcher(tenant, query: Query) -> Callable[[str | None], bool]:
    """Whether a stored `document` of the tenant matches the query, as `@@` decides (the demo's
    search, in Python)."""
    hashed = _hashed(tenant, query)
    if hashed is None:
        return lambda stored: False  # no word key: nothing of the tenant's holds words
    values = [hashed[v] for v in query.values]
    groups = [
        [
            (negated, [(hashed[f"w|{stem}"], distance) for stem, distance in phrase])
            for negated, phrase in group
        ]
        for group in query.groups
    ]

    def match(stored: str | None) -> bool:
        found = parse_document(stored)
        if any(v in found for v in values):
            return True
        return any(all(_holds(phrase, found) != negated for negated, phrase in g) for g in groups)

    return match


def _holds(phrase: list[tuple[str, int]], found: dict[str, set[int]]) -> bool:
    """Whether the phrase's lexemes stand at their distances somewhere in the document."""
    (first, _), *rest = phrase
    for start in found.get(first, ()):
        at = start
        for lexeme, distance in rest:
            at += distance
            if at not in found.get(lexeme, ()):
                break
        else:
            return True
    return False


class KeyedWordsField(models.TextField):
    """A `document`: a tsvector in PostgreSQL (searched with `@@` through its GIN index), its text
    in SQLite. Not shown or edited anywhere, and left out of the engine's row reads (core/sql.py):
    a claim has no use for it."""

    read_in_rows = False

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("null", True)
        kwargs.setdefault("editable", False)
        super().__init__(*args, **kwargs)

    def db_type(self, connection) -> str:
        return "tsvector" if connection.vendor == "postgresql" else "text"
