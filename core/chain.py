"""The run history's hash chain (DESIGN.md section 12, docs/history.md): one definition, used by
the statement that writes events (runs/statements.py), by the verifier (history/verify.py) and,
copied, by the offline snippet in docs/history.md.

    content_digest(message, data)   SHA-256 of an event's content, hex (kept when the content is erased)
    event_body(...)                 SHA-256 of an event's skeleton fields and its content digest
    link(prev, seq, body)           the event's chain hash: SHA-256(prev || seq as 4 bytes || body)
    content_of(fields, names)       digests of the content columns being written, for the write's event
    content_texts / digests_of      the same in two halves, for a writer that writes the texts too

A run's first event links from GENESIS. The hash covers the skeleton and the content's digest,
never the content itself, so erasing content (history/erasure.py) leaves every link verifiable.
PostgreSQL computes the links in the statement that inserts the events (the function
run_event_chain, runs migration 0019), from the previous head kept on the run row; Python computes
the bodies, the one cheap computation the step path adds.
"""

from __future__ import annotations

import datetime as dt
import hashlib

from django.core.serializers.json import DjangoJSONEncoder

GENESIS = bytes(32)
VERSION = "ap-event-v1"
# A step's columns that hold content (what a person, a model or a tool said); the rest of the row
# is skeleton. An event that writes one of them carries its digest (runs.transitions.transition_step).
STEP_CONTENT = ("arguments", "request", "result", "observation", "error")
RUN_CONTENT = ("input", "metadata", "final_output")


# One encoder for every call: json.dumps(cls=...) builds a new one each time (a third of the cost).
_ENCODER = DjangoJSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical(value) -> bytes:
    """JSON with sorted keys and no spaces, as stored values read back give it again (JSON types
    only after the round trip: the encoder writes dates and decimals as the strings stored)."""
    return _ENCODER.encode(value).encode("utf-8")


def digest(value) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def content_digest(message: str, data) -> str:
    return digest({"message": message, "data": data})


def format_at(at: dt.datetime) -> str:
    """An event's time as hashed: UTC, microseconds always written (isoformat drops zeros)."""
    return at.astimezone(dt.UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def event_body(run_id, at: dt.datetime, kind: str, step_seq, actor_id, content: str) -> bytes:
    skeleton = [VERSION, str(run_id), format_at(at), kind, step_seq, actor_id, content]
    return hashlib.sha256(canonical(skeleton)).digest()


def link(prev: bytes, seq: int, body: bytes) -> bytes:
    return hashlib.sha256(bytes(prev) + seq.to_bytes(4, "big") + body).digest()


def content_of(fields: dict, names: tuple[str, ...] = STEP_CONTENT) -> dict:
    """{column: digest} of the content columns `names` among a write's `fields` ({} when none)."""
    return digests_of(content_texts(fields, names))


def content_texts(fields: dict, names: tuple[str, ...] = STEP_CONTENT) -> dict[str, bytes]:
    """{column: canonical text} of the content columns `names` among a write's `fields`: a writer
    that digests them can seal the same text (vault/fields.py) rather than serialise twice."""
    return {name: canonical(fields[name]) for name in names if name in fields}


def digests_of(texts: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(text).hexdigest() for name, text in texts.items()}
