"""Verify the run history (manage.py verify_history; docs/history.md, "Verifying").

    verify_checkpoints(jwks)   every checkpoint's signature, their own chain (each names the
                               previous one's digest), and the latest one's Merkle root recomputed
                               from the leaves
    verify_run(run_id, ...)    one run's events: content against digests, each link, gaps, the
                               head on the run row, every checkpoint leaf of the run; its steps'
                               and its own content against the digests its events bound; its
                               artifacts' bytes sealed, opening, and matching their sha256
    verify(run_ids, jwks)      both, over every run (or those given)

Each finding names the run and the event (or step). What the verifier can tell apart, and what
it cannot (docs/history.md, "What an administrator can and cannot do"): an edit of content is
named by the content check; an edit of an event's skeleton by its link; a deleted event by the
gap, or by the run's counter and head when it was the last; two events swapped, or events
renumbered around an insertion or a deletion, by where their hash says they were written; a
rewrite of the whole chain after an edit by the signed checkpoint that took the old head.
Reads only; holds no lock.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import uuid
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from django.db import connection

from artifacts import services as artifact_services
from artifacts.models import Artifact
from authority.models import SigningKey
from core import chain, sql
from history import checkpoints
from history.models import Checkpoint, CheckpointLeaf, RunTombstone
from runs.models import Run, RunEvent, Step, skeleton_of
from vault import sealing
from vault.fields import SealedField, SealedValueAltered

# Where a misplaced event's hash is looked for: this many places either side of where it stands.
WINDOW = 3
REMOVED_KIND = "content_removed"  # history/content.py: erased or purged
# How far a tombstone's times may stray past the checkpoints' signed times: a checkpoint takes its
# time before it reads the heads, and a run's times are taken before its transaction commits.
SLACK = dt.timedelta(hours=1)


@dataclass(frozen=True)
class Finding:
    run_id: str | None
    seq: int | None  # the event's seq (None: the run, or a checkpoint)
    problem: str

    def __str__(self) -> str:
        where = f"run {self.run_id}" if self.run_id else "checkpoints"
        if self.seq is not None:
            where += f" event {self.seq}"
        return f"{where}: {self.problem}"


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    runs: int = 0
    events: int = 0
    checkpoint: int | None = None  # the latest checkpoint verified
    purged: dict[int, int] = field(default_factory=dict)  # skeleton period (s) -> runs purged under it

    @property
    def ok(self) -> bool:
        return not self.findings


def _b64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def public_key(jwk: dict) -> Ed25519PublicKey:
    if jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise ValueError(f"key {jwk.get('kid')}: not an Ed25519 key")
    return Ed25519PublicKey.from_public_bytes(_b64(jwk["x"]))


def signature_ok(statement: str, signature: str, jwk: dict) -> bool:
    try:
        public_key(jwk).verify(_b64(signature), statement.encode("utf-8"))
    except (InvalidSignature, ValueError):
        return False
    return True


def verify_checkpoints(jwks: dict | None = None) -> tuple[list[Finding], Checkpoint | None]:
    """Signatures against the pinned keys (`jwks`: a JWKS the auditor kept) or the platform's own
    table of keys; the checkpoints' chain; the latest root against the leaves."""

    findings: list[Finding] = []
    pinned = {k["kid"]: k for k in (jwks or {}).get("keys", [])}
    known = dict(SigningKey.objects.values_list("kid", "public_jwk"))
    previous: Checkpoint | None = None
    latest = None
    for cp in Checkpoint.objects.order_by("number"):
        where = f"checkpoint {cp.number}"
        trusted = pinned.get(cp.kid) if jwks is not None else known.get(cp.kid, cp.public_jwk)
        if trusted is None:
            findings.append(Finding(None, None, f"{where}: key {cp.kid} is not among the pinned keys"))
        elif trusted.get("x") != cp.public_jwk.get("x"):
            findings.append(
                Finding(None, None, f"{where}: its key {cp.kid} is not the key published under that id")
            )
        elif not signature_ok(cp.statement, cp.signature, trusted):
            findings.append(Finding(None, None, f"{where}: the signature does not verify"))
        if (previous is None and cp.number != 1) or (
            previous is not None and cp.number != previous.number + 1
        ):
            findings.append(Finding(None, None, f"{where}: checkpoints before it are missing"))
        if (
            cp.previous != checkpoints.statement_digest(previous)
            or f'"previous":"{cp.previous}"' not in cp.statement
        ):
            findings.append(Finding(None, None, f"{where}: does not name the checkpoint before it"))
        if f'"root":"{cp.root}"' not in cp.statement:
            findings.append(Finding(None, None, f"{where}: its root is not the one signed"))
        previous = latest = cp
    if latest is not None:
        root = checkpoints.tree_root(checkpoints.latest_leaves(upto=latest.number)).hex()
        if root != latest.root:
            findings.append(
                Finding(None, None, f"checkpoint {latest.number}: its leaves no longer give the signed root")
            )
    return findings, latest


def verify_run(run_id, *, leaves: list[tuple[int, int, bytes]] | None = None) -> tuple[list[Finding], int]:
    """One run's findings and the number of its events. `leaves`: (checkpoint number, seq, head)."""
    rid = str(run_id)
    run = Run.objects.filter(pk=run_id).values("event_seq", "chain_head").first()
    leaves = leaves if leaves is not None else _leaves_of(run_id)
    if run is None:
        if leaves:
            return [Finding(rid, None, f"the run is gone, but checkpoint {leaves[-1][0]} holds its head")], 0
        return [Finding(rid, None, "no such run")], 0
    events = _stored(RunEvent, EVENT_COLUMNS, rid)
    findings: list[Finding] = []
    erased_events, erased_steps, erased_run = _erased(events)
    bodies = [
        chain.event_body(rid, at, kind, step, actor, digest)
        for _, at, kind, step, actor, _, _, _, digest, _ in events
    ]
    stored = [bytes(h) if h is not None else None for *_, h in events]
    by_seq = {e[0]: i for i, e in enumerate(events)}
    last_seq, prev = 0, chain.GENESIS
    # Where each event's hash says it was written (its seq when in place): an event after two
    # swapped ones links from the one written before it, wherever that one stands now.
    written_as: dict[int, bytes] = {0: chain.GENESIS}
    for i, (seq, _at, _kind, _step, _actor, message, data, skeleton, digest, _) in enumerate(events):
        if seq not in erased_events:
            problem = _event_content(rid, message, data, skeleton, digest)
            if problem is not None:
                findings.append(Finding(rid, seq, problem))
        gap = seq > last_seq + 1
        if gap:
            missing = f"{last_seq + 1}" if seq == last_seq + 2 else f"{last_seq + 1}..{seq - 1}"
            findings.append(
                Finding(
                    rid,
                    last_seq + 1,
                    f"deleted: the run's events jump from {last_seq} to {seq} (missing {missing})",
                )
            )
        own = stored[i]
        if own is None:
            findings.append(Finding(rid, seq, "inserted: it carries no chain hash"))
        elif chain.link(written_as.get(seq - 1, prev), seq, bodies[i]) == own:
            written_as[seq] = own
        elif not gap:
            problem, written = _diagnose(i, events, bodies, stored)
            findings.append(Finding(rid, seq, problem))
            if written is not None:
                written_as[written] = own
        last_seq, prev = seq, own if own is not None else prev
    if run["event_seq"] > last_seq:
        findings.append(
            Finding(
                rid, last_seq + 1, f"deleted: the run counted {run['event_seq']} events, {last_seq} remain"
            )
        )
    elif run["event_seq"] < last_seq:
        findings.append(
            Finding(
                rid,
                run["event_seq"] + 1,
                f"inserted: the run counted {run['event_seq']} events, {last_seq} are there",
            )
        )
    elif events and bytes(run["chain_head"]) != prev:
        findings.append(
            Finding(
                rid, last_seq, "the run's head is not its last event's hash: events were deleted or rewritten"
            )
        )
    for number, seq, head in leaves:
        at = by_seq.get(seq)
        if at is None or stored[at] != head:
            findings.append(
                Finding(
                    rid,
                    seq,
                    f"differs from signed checkpoint {number}: the history up to this event was rewritten",
                )
            )
    findings += _content_bindings(rid, dict(run), events, erased_steps, erased_run)
    findings += _artifacts(rid, erased_run)
    return findings, len(events)


def _diagnose(i: int, events, bodies, stored) -> tuple[str, int | None]:
    """Why event i does not link from the one before it, and where its own hash says it was
    written (None: nowhere the verifier looked)."""
    seq = events[i][0]
    candidates = [(0, chain.GENESIS)] + [
        (events[j][0], stored[j]) for j in range(len(events)) if stored[j] is not None
    ]
    for written in range(max(1, seq - WINDOW), seq + WINDOW + 1):
        for before, head in candidates:
            if abs(before - (written - 1)) <= WINDOW and chain.link(head, written, bodies[i]) == stored[i]:
                if written != seq:
                    return (
                        f"out of place: its hash says it was written as event {written} "
                        "(events reordered, or renumbered around a deleted or inserted one)",
                        written,
                    )
                return (
                    f"does not follow the event before it: it was written after event {before}'s hash "
                    "(an event between was deleted or inserted)",
                    written,
                )
    nxt = i + 1
    if (
        nxt < len(events)
        and stored[nxt] is not None
        and chain.link(stored[i], events[nxt][0], bodies[nxt]) == stored[nxt]
    ):
        return "edited: its skeleton fields or content digest no longer give its chain hash", events[i][0]
    return "inserted or rewritten: it chains from no event of the run", None


EVENT_COLUMNS = (
    "seq",
    "at",
    "kind",
    "step_seq",
    "actor",
    "message",
    "data",
    "skeleton",
    "content_digest",
    "chain_hash",
)


def _stored(
    model, names: tuple[str, ...], rid: str, *, by: str = "run", order: str | None = "seq"
) -> list[tuple]:
    """The run's rows of `model` (`by`: the field naming the run), `names` in that order, as
    stored: sealed columns raw (not opened: the verifier says which do not open), the others as
    the ORM gives them."""
    fields = [model._meta.get_field(name) for name in names]
    ordered = f" ORDER BY {sql.column(model, order)}" if order else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(sql.column(model, name) for name in names)} FROM {sql.table(model)} "
            f"WHERE {sql.column(model, by)} = %s{ordered}",
            [sql.adapt(uuid.UUID(rid))],
        )
        rows = cursor.fetchall()
    return [
        tuple(value if isinstance(f, SealedField) else sql.convert(f, value) for f, value in zip(fields, row))
        for row in rows
    ]


def _event_content(rid: str, message, data, skeleton, digest: str) -> str | None:
    """What is wrong with an event's content (None: nothing): it does not open, does not match the
    digest its chain hash took, or its skeleton is not what its data says. Sealed by a key since
    destroyed (the run's content removed), it must be all skeleton, as a removal's own record is:
    an event whose content went is one a removal names, and skipped."""
    try:
        text = _opened(RunEvent, "message", message, rid)
        values = _opened(RunEvent, "data", data, rid)
    except SealedValueAltered:
        return "content edited: its message or data fail their seal (altered, or copied from elsewhere)"
    except sealing.KeyDestroyed:
        if message is None and chain.content_digest("", skeleton) == digest:
            return None
        return "its message and data are sealed by a key this run does not hold, and no removal names it"
    if chain.content_digest(text, values) != digest:
        return "content edited: its message or data no longer match the digest in the chain"
    if skeleton != skeleton_of(values):
        return "skeleton edited: its kept keys differ from its data's (statuses, tools, digests)"
    return None


def _erased(events) -> tuple[set[int], set[int], bool]:
    """What the run's removal events (history/content.py) say was removed: event seqs, step seqs,
    the run's own content (from their skeletons: kept when the content goes)."""
    events_out: set[int] = set()
    steps_out: set[int] = set()
    run_out = False
    for _seq, _at, kind, _step, _actor, _message, _data, data, _digest, _ in events:
        if kind == REMOVED_KIND and isinstance(data, dict):
            events_out.update(data.get("events", []))
            steps_out.update(data.get("steps", []))
            run_out = run_out or bool(data.get("run"))
    return events_out, steps_out, run_out


def _content_bindings(rid: str, run: dict, events, erased_steps: set[int], erased_run: bool) -> list[Finding]:
    """The run's and its steps' content against the latest digest an event bound for each column."""
    bound: dict[tuple[int | None, str], tuple[int, str]] = {}
    for seq, _at, _kind, step_seq, _actor, _message, _data, skeleton, _digest, _ in events:
        content = skeleton.get("content") if isinstance(skeleton, dict) else None
        if isinstance(content, dict):
            for name, value in content.items():
                bound[(step_seq, name)] = (seq, value)
    findings: list[Finding] = []
    if not erased_run:
        run = run | _run_sealed(rid, bound, findings)
        for name in chain.RUN_CONTENT:
            if name not in run:
                continue  # does not open: named above
            if (None, name) in bound and chain.digest(run[name]) != bound[(None, name)][1]:
                seq = bound[(None, name)][0]
                findings.append(
                    Finding(
                        rid,
                        seq,
                        f"the run's {name} was edited: it no longer matches the digest event {seq} bound",
                    )
                )
    for seq, stored in _step_content(rid):
        if seq in erased_steps:
            continue
        for name in chain.STEP_CONTENT:
            binding = bound.get((seq, name))
            where = binding[0] if binding is not None else None
            try:
                value = _opened(Step, name, stored[name], rid)
            except SealedValueAltered:
                findings.append(
                    Finding(
                        rid, where, f"step {seq}'s {name} fails its seal: altered, or copied from elsewhere"
                    )
                )
                continue
            except sealing.KeyDestroyed:
                findings.append(
                    Finding(rid, where, f"step {seq}'s {name} is sealed by a key this run does not hold")
                )
                continue
            if binding is not None and chain.digest(value) != binding[1]:
                findings.append(
                    Finding(
                        rid,
                        binding[0],
                        f"step {seq}'s {name} was edited: it no longer matches the digest this event bound",
                    )
                )
    return findings


def _run_sealed(rid: str, bound: dict, findings: list) -> dict:
    """The run's own sealed content opened from its raw bytes ({} for a column that does not
    open, with the finding added)."""
    names = tuple(f.name for f in Run._meta.concrete_fields if isinstance(f, SealedField))
    (row,) = _stored(Run, names, rid, by="id", order=None)
    opened = {}
    for name, raw in zip(names, row):
        where = bound.get((None, name), (None,))[0]
        try:
            opened[name] = _opened(Run, name, raw, rid)
        except SealedValueAltered:
            findings.append(
                Finding(rid, where, f"the run's {name} fails its seal: altered, or copied from elsewhere")
            )
        except sealing.KeyDestroyed:
            findings.append(
                Finding(rid, where, f"the run's {name} is sealed by a key this run does not hold")
            )
    return opened


def _step_content(rid: str) -> list[tuple[int, dict]]:
    """Each step's content columns as stored (sealed bytes, not opened: the verifier says which do not open)."""
    rows = _stored(Step, ("seq", *chain.STEP_CONTENT), rid)
    return [(row[0], dict(zip(chain.STEP_CONTENT, row[1:]))) for row in rows]


def _opened(model, name: str, raw, rid: str):
    """A sealed column's stored value opened strictly (vault.fields.SealedField.open_strictly)."""
    return model._meta.get_field(name).open_strictly(raw, run_id=rid)


def _artifacts(rid: str, erased_run: bool) -> list[Finding]:
    """Each artifact's bytes: sealed (vault/), opening with the run's key, and matching its sha256.
    Bytes in the clear were written around the platform (every artifact is sealed since migration
    artifacts/0004); emptied ones only by a content removal. Bytes whose key is gone are no finding
    in a run whose content was removed (a copy from before the erasure, unreadable as it meant them
    to be), and one anywhere else."""
    findings = []
    rows = Artifact.objects.filter(run_id=rid).values_list("pk", "tenant_id", "sealed", "content", "sha256")
    for pk, tenant_id, sealed, content, sha256 in rows.order_by("created_at", "pk"):
        raw = bytes(content)
        if not sealed:
            if raw or not erased_run:
                what = "in the clear" if raw else "emptied without a content removal"
                findings.append(
                    Finding(rid, None, f"artifact {pk}: its bytes are {what}: written around the platform")
                )
            continue
        try:
            plain = artifact_services.open_sealed(pk, rid, tenant_id, raw)
        except artifact_services.ContentErased:
            if not erased_run:
                findings.append(
                    Finding(
                        rid,
                        None,
                        f"artifact {pk}: its bytes were sealed by a key this run does not hold: another run's, "
                        "or restored from before an erasure this history does not record",
                    )
                )
            continue
        except artifact_services.ContentAltered:
            findings.append(
                Finding(rid, None, f"artifact {pk}: its bytes fail their seal: edited, or another's")
            )
            continue
        if hashlib.sha256(plain).hexdigest() != sha256:
            findings.append(Finding(rid, None, f"artifact {pk}: its bytes no longer match its sha256"))
    return findings


def _leaves_of(run_id) -> list[tuple[int, int, bytes]]:
    return [
        (number, seq, bytes(head))
        for number, seq, head in CheckpointLeaf.objects.filter(run_id=run_id)
        .order_by("checkpoint__number")
        .values_list("checkpoint__number", "event_seq", "head")
    ]


def verify(run_ids: list | None = None, *, jwks: dict | None = None) -> Report:
    report = Report()
    found, latest = verify_checkpoints(jwks)
    report.findings += found
    report.checkpoint = latest.number if latest else None
    if run_ids is None:
        # Every run, and every run a checkpoint holds that is no longer there.
        ids = set(Run.objects.values_list("pk", flat=True)) | set(
            CheckpointLeaf.objects.values_list("run_id", flat=True).distinct()
        )
        run_ids = sorted(ids, key=str)
    signed_at = _signed_times()
    for run_id in run_ids:
        run_id = uuid.UUID(str(run_id))
        stone = RunTombstone.objects.select_related("checkpoint").filter(run_id=run_id).first()
        if stone is not None and not Run.objects.filter(pk=run_id).exists():
            report.findings += verify_tombstone(stone, _leaves_of(run_id), signed_at)
            report.purged[stone.period_seconds] = report.purged.get(stone.period_seconds, 0) + 1
            continue
        found_in_run, events = verify_run(run_id)
        report.findings += found_in_run
        report.runs += 1
        report.events += events
    return report


def _signed_times() -> dict[int, dt.datetime]:
    """Each checkpoint's time as its signed statement gives it (the `at` column is not signed)."""
    return {
        number: dt.datetime.fromisoformat(json.loads(statement)["at"])
        for number, statement in Checkpoint.objects.values_list("number", "statement")
    }


def verify_tombstone(
    stone: RunTombstone, leaves: list[tuple[int, int, bytes]], signed_at: dict[int, dt.datetime]
) -> list[Finding]:
    """A run deleted by skeleton retention: its tombstone must carry the head the checkpoints
    last signed for it, and its times must fit theirs. The run's first leaf bounds its creation
    (the checkpoint before did not hold it), its last its end (that checkpoint held its final
    head): a young run deleted under a tombstone claiming it was old is named."""
    rid = str(stone.run_id)
    if not leaves:
        return [
            Finding(rid, None, "deleted: a tombstone says retention purged it, but no checkpoint holds it")
        ]
    number, seq, head = leaves[-1]
    if (seq, head) != (stone.event_seq, bytes(stone.chain_head)) or (
        stone.checkpoint is None or stone.checkpoint.number != number
    ):
        return [
            Finding(
                rid,
                seq,
                f"deleted: its tombstone's head is not the one checkpoint {number} signed for it",
            )
        ]
    findings = []
    before = signed_at.get(leaves[0][0] - 1)
    if before is not None and stone.created_at < before - SLACK:
        findings.append(
            Finding(
                rid,
                None,
                f"deleted: its tombstone says it was created {stone.created_at:%Y-%m-%d %H:%M}, "
                f"but checkpoint {leaves[0][0] - 1} ({before:%Y-%m-%d %H:%M}) did not hold it",
            )
        )
    last = signed_at.get(number)
    finished = stone.finished_at
    if finished is None or (last is not None and finished > last + SLACK) or finished < stone.created_at:
        findings.append(
            Finding(
                rid,
                None,
                f"deleted: its tombstone's end does not fit checkpoint {number}, which took its last head",
            )
        )
    elif (
        finished + dt.timedelta(seconds=stone.period_seconds)
        > min(stone.purged_at, dt.datetime.now(dt.UTC)) + SLACK
    ):
        findings.append(
            Finding(
                rid,
                None,
                f"deleted before its period: it ended {finished:%Y-%m-%d}, the tombstone claims a "
                f"{stone.period_seconds // 86400}-day period, purged {stone.purged_at:%Y-%m-%d}",
            )
        )
    return findings
