"""Where a data subject's identifier appears: every run, step, event, approval and artifact of a
tenant carrying it as an exact value (a customer id, an email, an account number).

"Exact": the identifier as a whole token, not as part of a longer one (`C-77` matches
`"C-77"` and `customer C-77 called`, not `C-775`): a regular expression with the identifier
between non-word characters, over the text of each content column (JSON as PostgreSQL prints
it); over steps' and artifacts' content, sealed at rest (vault/), the same in Python once opened
(a step's JSON as the platform serialises it).

Through an index, so a request does not read every row of the tenant (docs/history.md, "The
search's index"): `history_subject_words` holds a row per run with the keyed 64-bit hashes
(vault.sealing.word_hashes: HMAC with the tenant's word key, so a copy of the index confirms no
guessed word) of the words of every text the search reads, opened in Python (maximal runs of
ASCII letters, digits and `_`, two or more long)
and the run's `event_seq` when they were read, or null while the run is not covered (live, never
indexed, changed since: triggers on runs_run keep that, migration 0004). The words of an
identifier found in a text as a whole token are words of that text, so the runs whose row holds
all of the identifier's words, together with the runs not covered, are a superset of the runs
carrying it; the regular expression then runs over those runs only. The beat fills the index
(`index_due`), off the step path; content removal empties a run's row, so no hash of an erased
word is kept. An identifier with no such word (all its letters non-ASCII) reads the whole
tenant, as artifacts always are (they are few a run, and written without an event).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from django.db import connection, transaction

from approvals.models import Approval, ApprovalVote
from artifacts import services as artifact_services
from artifacts.models import Artifact
from core import partitions, sql
from core.errors import DomainError
from core.words import WORD
from runs.models import TERMINAL, Run, RunEvent, Step
from vault import sealing
from vault.fields import SealedField, SealedValueAltered

RUNS, EVENTS = sql.table(Run), sql.table(RunEvent)
APPROVALS, ARTIFACTS = sql.table(Approval), sql.table(Artifact)
WORDS = "history_subject_words"  # history/migrations/0004_subject_words.py

# The texts the search reads of each table (and the index's words are made of): one list, so the
# two cannot part.
EVENT_TEXTS = ("e.skeleton::text",)  # its data's keys about the platform's state, in the clear
# Sealed at rest (vault/fields.py): read and searched here, in Python (SEALED_SOURCES).
RUN_SEALED_TEXTS = ("input", "metadata", "final_output", "error")
STEP_TEXTS = ("arguments", "request", "result", "observation", "error", "resolution")
EVENT_SEALED_TEXTS = ("message", "data")
APPROVAL_TEXTS = ("arguments", "original_arguments", "decision_reason", "correction_reason")
VOTE_TEXTS = ("reason",)  # its dual-control votes' reasons: an approval's too


@dataclass
class Found:
    """The items carrying an identifier, by run."""

    runs: set = field(default_factory=set)  # run ids whose own content carries it
    steps: dict = field(default_factory=dict)  # run id -> [step seq]
    events: dict = field(default_factory=dict)  # run id -> [event seq]
    approvals: dict = field(default_factory=dict)  # run id -> [approval id]
    artifacts: dict = field(default_factory=dict)  # run id -> [artifact id]

    def run_ids(self) -> set:
        ids = set(self.runs)
        for items in (self.steps, self.events, self.approvals, self.artifacts):
            ids |= set(items)
        return ids

    def counts(self) -> dict[str, int]:
        return {
            "runs": len(self.runs),
            "steps": sum(map(len, self.steps.values())),
            "events": sum(map(len, self.events.values())),
            "approvals": sum(map(len, self.approvals.values())),
            "artifacts": sum(map(len, self.artifacts.values())),
        }


def pattern(identifier: str) -> str:
    """A PostgreSQL regular expression matching the identifier as a whole token."""
    escaped = "".join(c if c.isalnum() else "\\" + c for c in identifier)
    return f"(^|[^[:alnum:]_]){escaped}($|[^[:alnum:]_])"


def words(identifier: str) -> list[str]:
    """The identifier's words the index holds (an identifier with none cannot use it)."""
    return sorted(set(re.findall(WORD, identifier)))


def _rows(text: str, params: list | dict) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(text, params)
        return cursor.fetchall()


def _matching(texts: tuple[str, ...]) -> str:
    return " OR ".join(f"coalesce({t}, '') ~ %s" for t in texts)


def find(tenant_id, identifier: str, *, within: list | None = None, scan: bool = False) -> Found:
    """Every item of the tenant (of the runs `within`, when given) carrying `identifier`.
    `scan`: read every run of the tenant, not only those the index names (the benchmark's
    comparison, and a check of the index)."""
    identifier = identifier.strip()
    if len(identifier) < 3:
        message = "an identifier must be at least 3 characters"
        raise DomainError(message, code="identifier_too_short", fields={"identifier": [message]})
    if connection.vendor != "postgresql":
        raise DomainError("finding a data subject needs PostgreSQL", code="not_supported")
    p = pattern(identifier)
    found = Found()
    artifacts_within = within
    if not scan and words(identifier):
        scope = {str(r) for r in candidates(tenant_id, identifier) | uncovered(tenant_id, within=within)}
        within = [r for r in within if str(r) in scope] if within is not None else sorted(scope)

    if within is None:
        _read(found, tenant_id, p, identifier, None)
    else:
        # By month: a list of one month's runs prunes steps and events to that month's partition,
        # where a list spanning months is planned over every partition (a scan of each).
        months: dict = {}
        for run_id in within:
            months.setdefault(partitions.month_of(run_id), []).append(str(run_id))
        for ids in months.values():
            _read(found, tenant_id, p, identifier, ids)
    # Artifacts are written without an event (artifacts/services.py), so the run index cannot tell
    # when a run's changed: they have words of their own (their bytes' and name's), keyed, written
    # with them.
    ids = [str(r) for r in artifacts_within] if artifacts_within is not None else None
    _read_sealed(found, tenant_id, identifier, ids, scan=scan)
    return found


def _read_sealed(found: Found, tenant_id, identifier: str, ids: list | None, *, scan: bool) -> None:
    """Sealed artifacts carrying the identifier as a whole token: those whose words hold all of its
    words, or have too many to keep (every one, with `scan` or an identifier without one), each opened with its run's key (a
    key destroyed: nothing left to find) and read, a hundred at a time."""
    needed = words(identifier)
    hashed = sealing.word_hashes(tenant_id, needed) if needed and not scan else None
    named = _rows(
        f"SELECT a.id FROM {ARTIFACTS} a WHERE a.tenant_id = %s AND a.sealed{_only(ids, 'a.run_id')}"
        + (" AND (a.words IS NULL OR a.words @> %s::bigint[])" if hashed else ""),
        [tenant_id, *([ids] if ids is not None else []), *([hashed] if hashed else [])],
    )
    todo = [pk for (pk,) in named]
    found_token = token(identifier)
    for start in range(0, len(todo), 100):
        rows = _rows(
            f"SELECT a.id, a.run_id, a.content, a.name FROM {ARTIFACTS} a WHERE a.id = ANY(%s::uuid[])",
            [[str(pk) for pk in todo[start : start + 100]]],
        )
        for pk, run_id, content, name in rows:
            texts = []
            try:
                texts.append(_ARTIFACT_NAME.open(name))
            except SealedValueAltered:
                pass  # unreadable since altered: verify_history names it
            try:
                plain = artifact_services.open_sealed(pk, run_id, tenant_id, bytes(content))
                texts.append(plain.decode("utf-8", errors="replace"))
            except (artifact_services.ContentErased, artifact_services.ContentAltered):
                pass  # nothing anyone can read: erased, or unreadable since altered
            if any(found_token.search(text) for text in texts):
                found.artifacts.setdefault(run_id, []).append(pk)


_ARTIFACT_NAME = Artifact._meta.get_field("name")
assert isinstance(_ARTIFACT_NAME, SealedField)


def _only(ids: list | None, column: str) -> str:
    return f" AND {column} = ANY(%s::uuid[])" if ids is not None else ""


def _read(found: Found, tenant_id, p: str, identifier: str, ids: list | None) -> None:
    """The runs, steps, events and approvals of the tenant (of the runs `ids`) matching `p`."""
    extra = [ids] if ids is not None else []
    found_token = token(identifier)
    for source in SEALED_SOURCES:
        for run_id, item, texts in _sealed_texts(source, tenant_id, ids):
            if any(found_token.search(text) for text in texts):
                kept = getattr(found, source.found_as)
                if isinstance(kept, set):  # the run itself
                    kept.add(run_id)
                    continue
                items = kept.setdefault(run_id, [])
                if item not in items:  # an approval found by its own texts and a vote's
                    items.append(item)
    for run_id, seq in _rows(
        f"SELECT e.run_id, e.seq FROM {EVENTS} e JOIN {RUNS} r ON r.id = e.run_id "
        f"WHERE r.tenant_id = %s{_only(ids, 'e.run_id')} AND ({_matching(EVENT_TEXTS)})",
        [tenant_id, *extra, *[p] * len(EVENT_TEXTS)],
    ):
        seqs = found.events.setdefault(run_id, [])
        if seq not in seqs:  # found by its sealed texts too
            seqs.append(seq)


def token(identifier: str) -> re.Pattern:
    """The identifier as a whole token, in Python (`pattern` is PostgreSQL's)."""
    return re.compile(rf"(?:^|[^\w]){re.escape(identifier)}(?:$|[^\w])")


@dataclass(frozen=True)
class SealedSource:
    """A table whose texts are sealed at rest (vault/fields.py), read in Python: its rows' run
    (`run`), what the search reports (`item`), and the order it pages in (`key`), over alias `t`."""

    model: Any  # a model class
    texts: tuple[str, ...]
    found_as: str  # the Found attribute its items go to
    run: str = "t.run_id"
    item: str = "t.id"
    key: str = "t.id"
    join: str = ""


SEALED_SOURCES = (
    SealedSource(Run, RUN_SEALED_TEXTS, "runs", run="t.id"),
    SealedSource(Step, STEP_TEXTS, "steps", item="t.seq", key="t.seq"),
    SealedSource(RunEvent, EVENT_SEALED_TEXTS, "events", item="t.seq", key="t.seq"),
    SealedSource(Approval, APPROVAL_TEXTS, "approvals"),
    # A vote's reason is its approval's: the approval is what the search reports.
    SealedSource(
        ApprovalVote,
        VOTE_TEXTS,
        "approvals",
        run="a.run_id",
        item="t.approval_id",
        join=f"JOIN {APPROVALS} a ON a.id = t.approval_id",
    ),
)


def _sealed_texts(source: SealedSource, tenant_id, ids: list | None):
    """(run id, item, [its texts]) of the tenant's rows of `source` (of the runs `ids`), a page of
    500 at a time, each text opened with its run's key (one erased or altered is left out:
    nothing anyone can read; verify_history names an altered step)."""
    fields = [source.model._meta.get_field(name) for name in source.texts]
    columns = ", ".join(f't."{f.column}"' for f in fields)
    purposes = [f.purpose for f in fields]
    extra = [ids] if ids is not None else []
    table = sql.table(source.model)
    last: list = []
    while True:
        after = f" AND ({source.run}, {source.key}) > (%s::uuid, %s)" if last else ""
        rows = _rows(
            f"SELECT {source.run}, {source.key}, {source.item}, {columns} FROM {table} t {source.join} "
            f"JOIN {RUNS} r ON r.id = {source.run} WHERE r.tenant_id = %s{_only(ids, source.run)}{after} "
            f"ORDER BY {source.run}, {source.key} LIMIT 500",
            [tenant_id, *extra, *last],
        )
        if not rows:
            return
        for run_id, _key, item, *stored in rows:
            texts = []
            for raw, purpose in zip(stored, purposes):
                if raw is None:
                    continue
                try:
                    texts.append(sealing.open_value(bytes(raw), purpose).decode("utf-8"))
                except (sealing.KeyDestroyed, InvalidTag, ValueError):
                    continue
            yield run_id, item, texts
        last = [str(rows[-1][0]), rows[-1][1]]


def run_words(run_id, tenant_id) -> list[str]:
    """The words of every text of a run the search reads: those in the clear read in SQL, the
    sealed ones (its own, its steps', events', approvals', votes') opened here."""
    found: set[str] = set()
    for (text,) in _rows(PLAIN_TEXTS, {"run": run_id}):
        if text:
            found.update(re.findall(WORD, text))
    for source in SEALED_SOURCES:
        for _run, _item, texts in _sealed_texts(source, tenant_id, [str(run_id)]):
            for text in texts:
                found.update(re.findall(WORD, text))
    return sorted(found)


def word_hashes(run_id, tenant_id) -> list[int]:
    """What a run's index row holds: its words' keyed hashes, sorted and distinct (so that a row
    read back compares equal)."""
    return sealing.word_hashes(tenant_id, run_words(run_id, tenant_id))


def candidates(tenant_id, identifier: str) -> set:
    """The indexed runs of the tenant whose words include all of the identifier's."""
    return {
        run_id
        for (run_id,) in _rows(
            f"SELECT run_id FROM {WORDS} WHERE tenant_id = %s AND words @> %s::bigint[]",
            [tenant_id, sealing.word_hashes(tenant_id, words(identifier))],
        )
    }


def uncovered(tenant_id, *, within: list | None = None) -> set:
    """The tenant's runs (of `within`, when given) the index does not cover: live, not yet
    indexed, changed since or emptied (a partial index holds them: migration 0004's triggers)."""
    ids = [str(r) for r in within] if within is not None else None
    return {
        run_id
        for (run_id,) in _rows(
            f"SELECT run_id FROM {WORDS} WHERE tenant_id = %s AND event_seq IS NULL{_only(ids, 'run_id')}",
            [tenant_id, *([ids] if ids is not None else [])],
        )
    }


def _texts(alias: str, table: str, texts: tuple[str, ...], key: str) -> str:
    return f"SELECT t FROM {table} {alias}, unnest(ARRAY[{', '.join(texts)}]) t WHERE {alias}.{key} = %(run)s"


# A run's texts in the clear (its events' skeletons), one a row.
PLAIN_TEXTS = _texts("e", EVENTS, EVENT_TEXTS, "run_id")
INDEX_RUN = f"""
INSERT INTO {WORDS} (run_id, tenant_id, event_seq, words) VALUES (%(run)s, %(tenant)s, %(seq)s, %(words)s::bigint[])
ON CONFLICT (run_id) DO UPDATE SET event_seq = EXCLUDED.event_seq, words = EXCLUDED.words
"""


def index_due(*, batch: int) -> int:
    """Index up to `batch` ended runs the index does not cover (the beat's pass); how many. Each
    run in its own short transaction, its row share-locked so that its content and `event_seq`
    are read together; a run locked by a writer (an erasure, a late event) waits for the next pass."""
    if connection.vendor != "postgresql":
        return 0
    due = _rows(
        f"SELECT w.run_id FROM {WORDS} w JOIN {RUNS} r ON r.id = w.run_id "
        "WHERE w.event_seq IS NULL AND r.status = ANY(%s) ORDER BY w.run_id LIMIT %s",
        [sorted(TERMINAL), batch],
    )
    done = 0
    for (run_id,) in due:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"SELECT tenant_id, event_seq FROM {RUNS} WHERE id = %s AND status = ANY(%s) FOR SHARE SKIP LOCKED",
                [run_id, sorted(TERMINAL)],
            )
            row = cursor.fetchone()
            if row is None:
                continue
            index_run(cursor, run_id, row[0], row[1])
            done += 1
    return done


def index_run(cursor, run_id, tenant_id, seq) -> None:
    """Write the run's index row: its words as of event `seq` (the caller holds the run's row)."""
    cursor.execute(
        INDEX_RUN, {"run": run_id, "tenant": tenant_id, "seq": seq, "words": word_hashes(run_id, tenant_id)}
    )


def forget(run_id) -> None:
    """Empty a run's words (its content is being removed): no hash of an erased word is kept, and
    the run is read whole until the beat indexes what is left."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {WORDS} (run_id, tenant_id, event_seq, words) "
                f"SELECT id, tenant_id, NULL, '{{}}' FROM {RUNS} WHERE id = %s "
                "ON CONFLICT (run_id) DO UPDATE SET event_seq = NULL, words = '{}'",
                [run_id],
            )


def mismatched(run_ids: list | None = None) -> list[tuple]:
    """(run id, what is wrong) for each run (of `run_ids`, or all) a search could miss because of
    its index row: none at all, one claiming to cover a run that moved on, or one holding other
    words than its content's: someone with database access hid the run from searches
    (`manage.py verify_history --subject-index`). Reads every covered run: as slow as indexing."""
    if connection.vendor != "postgresql":
        return []
    only = " AND r.id = ANY(%s::uuid[])" if run_ids is not None else ""
    ids = [[str(r) for r in run_ids]] if run_ids is not None else []
    found: list[tuple] = [
        (run_id, "it has no row in the data subject search's index, so a search does not read it")
        for (run_id,) in _rows(
            f"SELECT r.id FROM {RUNS} r WHERE NOT EXISTS (SELECT 1 FROM {WORDS} w WHERE w.run_id = r.id){only} "
            "ORDER BY r.id",
            ids,
        )
    ]
    covered = _rows(
        f"SELECT r.id FROM {WORDS} w JOIN {RUNS} r ON r.id = w.run_id WHERE w.event_seq IS NOT NULL{only} "
        "ORDER BY r.id",
        ids,
    )
    for (run_id,) in covered:
        with transaction.atomic(), connection.cursor() as cursor:
            # Share-locked as the index pass does: no writer moves the run between the two reads.
            cursor.execute(
                f"SELECT event_seq, status, tenant_id FROM {RUNS} WHERE id = %s FOR SHARE", [run_id]
            )
            seq, status, tenant_id = cursor.fetchone()
            cursor.execute(f"SELECT w.event_seq, w.words FROM {WORDS} w WHERE w.run_id = %s", [run_id])
            row = cursor.fetchone()
            if row is None or row[0] is None:
                continue  # emptied meanwhile: not covered, read whole
            other_words = sorted(set(row[1])) != word_hashes(run_id, tenant_id)
        if status not in TERMINAL or row[0] != seq:
            found.append(
                (
                    run_id,
                    f"its index row claims to cover it at event {row[0]}, but it is {status} at event {seq}",
                )
            )
        elif other_words:
            found.append((run_id, "its index row holds other words than its content's"))
    return found


def runs_carrying(tenant_id, identifier: str, *, within: list | None = None) -> set:
    return find(tenant_id, identifier, within=within).run_ids()
