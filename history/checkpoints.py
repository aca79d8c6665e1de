"""Signed checkpoints over every run's chain head (docs/history.md, "Checkpoints").

    take_checkpoint()   read every run's head, write a leaf for each run whose head moved since its
                        last leaf, sign the Merkle root over all latest leaves with the platform's
                        key (authority/keys.py); one at a time (the previous checkpoint's row lock)
    merkle_root(leaves) RFC 6962's tree hash over leaf(run id, seq, head) in run id order
    inclusion_path()    a leaf's audit path (an export carries one per run: history/export.py)
    statement_digest()  what the next checkpoint names as `previous`

A run's head is read from its own row (what the engine writes in the statement that inserts
events), so a checkpoint takes each run at a committed state of its chain; it holds no run lock
and no step waits for it. Nothing here calls the network. A checkpoint's cost is one read of
the runs' heads and one of the latest leaves (O(runs)), plus a row per run that moved.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import uuid

from django.db import connection, transaction
from django.utils import timezone

from authority import keys
from authority.models import SigningKey
from history.models import Checkpoint, CheckpointLeaf
from runs.models import Run

VERSION = "ap-checkpoint-v1"


def leaf_hash(run_id, event_seq: int, head: bytes) -> bytes:
    data = uuid.UUID(str(run_id)).bytes + event_seq.to_bytes(4, "big") + bytes(head)
    return hashlib.sha256(b"\x00" + data).digest()


def merkle_root(hashes: list[bytes]) -> bytes:
    """RFC 6962's Merkle tree hash over leaf hashes in order (pairs bottom-up, an odd last node
    moves up unpaired, which gives the same tree as the RFC's split at the largest power of two)."""
    if not hashes:
        return hashlib.sha256(b"").digest()
    level = hashes
    while len(level) > 1:
        paired = [
            hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)
        ]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def _mth(hashes: list[bytes]) -> bytes:
    return merkle_root(hashes)


def inclusion_path(hashes: list[bytes], index: int) -> list[bytes]:
    """RFC 6962's audit path of leaf `index` in the tree over `hashes` (section 2.1.1)."""
    if len(hashes) <= 1:
        return []
    k = 1
    while k * 2 < len(hashes):
        k *= 2
    if index < k:
        return [*inclusion_path(hashes[:k], index), _mth(hashes[k:])]
    return [*inclusion_path(hashes[k:], index - k), _mth(hashes[:k])]


def root_from_path(index: int, size: int, leaf: bytes, path: list[bytes]) -> bytes | None:
    """The root an audit path gives (RFC 9162 section 2.1.3.2), None when it cannot be one."""
    if index >= size:
        return None
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return None
        if fn & 1 or fn == sn:
            r = hashlib.sha256(b"\x01" + p + r).digest()
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = hashlib.sha256(b"\x01" + r + p).digest()
        fn, sn = fn >> 1, sn >> 1
    return r if sn == 0 else None


def statement_digest(checkpoint: Checkpoint | None) -> str:
    return hashlib.sha256(checkpoint.statement.encode("utf-8")).hexdigest() if checkpoint else ""


def latest_leaves(*, upto: int | None = None) -> dict[uuid.UUID, tuple[int, bytes]]:
    """Every run's latest leaf (as of checkpoint number `upto`, else the latest): run id -> (seq, head)."""
    leaves = CheckpointLeaf.objects.all()
    if upto is not None:
        leaves = leaves.filter(checkpoint__number__lte=upto)
    if connection.vendor == "postgresql":
        rows = leaves.order_by("run_id", "-checkpoint__number").distinct("run_id")
    else:  # SQLite (the demo) has no DISTINCT ON: later leaves overwrite earlier ones
        rows = leaves.order_by("checkpoint__number")
    return {
        run_id: (seq, bytes(head)) for run_id, seq, head in rows.values_list("run_id", "event_seq", "head")
    }


def ordered(leaves: dict[uuid.UUID, tuple[int, bytes]]) -> list[uuid.UUID]:
    """The tree's order: run ids by their 16 bytes."""
    return sorted(leaves, key=lambda r: r.bytes)


def tree_root(leaves: dict[uuid.UUID, tuple[int, bytes]]) -> bytes:
    return merkle_root([leaf_hash(run_id, *leaves[run_id]) for run_id in ordered(leaves)])


def take_checkpoint(*, now: dt.datetime | None = None) -> Checkpoint | None:
    """Sign a checkpoint over the runs' heads; None when no run's head moved since the last one."""
    now = now or timezone.now()
    with transaction.atomic():
        if connection.vendor == "postgresql":
            # Checkpoints are numbered in turn: two beat ticks at once would both take number n.
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(hashtext('history.checkpoint'))")
        last = Checkpoint.objects.order_by("-number").first()
        leaves = latest_leaves()
        moved = []
        for run_id, seq, head in Run.objects.filter(event_seq__gt=0).values_list(
            "id", "event_seq", "chain_head"
        ):
            head = bytes(head)
            if leaves.get(run_id) != (seq, head):
                moved.append((run_id, seq, head))
                leaves[run_id] = (seq, head)
        if last is not None and not moved:
            return None
        number = (last.number + 1) if last else 1
        root = tree_root(leaves).hex()
        statement = json.dumps(
            {
                "version": VERSION,
                "number": number,
                "at": now.astimezone(dt.UTC).isoformat(),
                "size": len(leaves),
                "root": root,
                "previous": statement_digest(last),
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        kid, private = keys.signing_key()
        signature = base64.urlsafe_b64encode(private.sign(statement.encode("utf-8"))).rstrip(b"=").decode()
        checkpoint = Checkpoint.objects.create(
            number=number,
            at=now,
            size=len(leaves),
            root=root,
            previous=statement_digest(last),
            statement=statement,
            kid=kid,
            public_jwk=SigningKey.objects.values_list("public_jwk", flat=True).get(kid=kid),
            signature=signature,
        )
        CheckpointLeaf.objects.bulk_create(
            [CheckpointLeaf(checkpoint=checkpoint, run_id=r, event_seq=s, head=h) for r, s, h in moved],
            batch_size=5000,
        )
    return checkpoint
