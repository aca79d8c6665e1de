"""Storing artifacts: typed, bounded per artifact and per run, each stored once, never half.

`store` checks the media type and the tenant's limits, then writes the row in one transaction
that holds the run's artifact lock (an advisory lock: two files stored at once cannot both slip
under the run's cap). A refusal raises ArtifactRefused with the field that was wrong; nothing
is written then. The same file stored again by a retried step returns the row already there.

The bytes are sealed with the run's data key (vault/sealing.py) and read back through
`content_of`; erasure destroys that key, so a copy of the row in a backup no longer opens.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import re
import uuid

from cryptography.exceptions import InvalidTag
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Sum

from artifacts.models import Artifact, ArtifactLimits
from core.errors import DomainError
from core.words import WORD
from vault import sealing

UPLOAD_TYPES = {
    "text/csv": ".csv",
    "application/json": ".json",
    "text/plain": ".txt",
    "application/vnd.apache.parquet": ".parquet",
}
ALIASES = {"application/x-parquet": "application/vnd.apache.parquet", "application/csv": "text/csv"}
# What a sandbox may leave in /out besides the upload types: it is named by its extension.
EXTENSIONS = {ext: media for media, ext in UPLOAD_TYPES.items()} | {
    ".md": "text/markdown",
    ".tsv": "text/tab-separated-values",
}


# An artifact's words the search's index keeps at most (8 bytes each, and as much again in GIN):
# past it, none, and a search reads the artifact whole (history/subjects.py).
MAX_WORDS = 50_000


class ContentErased(DomainError):
    """The artifact's key was destroyed by an erasure: its bytes cannot be read any more."""

    def __init__(self, what: str):
        super().__init__(f"{what}: its content was erased", code="content_erased", status=410)


class ContentAltered(DomainError):
    """The sealed bytes do not open with their run's key: changed in the database, or another
    artifact's put in their place."""

    def __init__(self, what: str):
        super().__init__(
            f"{what}: its stored bytes fail their seal (altered)", code="content_altered", status=500
        )


class ArtifactRefused(DomainError):
    def __init__(self, message: str, *, field: str, status: int = 400):
        super().__init__(message, code="artifact_refused", status=status, fields={field: [message]})


@dataclasses.dataclass(frozen=True)
class Limits:
    max_artifact_bytes: int
    max_run_bytes: int
    max_run_artifacts: int


def limits_for(tenant) -> Limits:
    row = ArtifactLimits.objects.filter(tenant=tenant).first()
    if row:
        return Limits(row.max_artifact_bytes, row.max_run_bytes, row.max_run_artifacts)
    return Limits(
        settings.ARTIFACT_MAX_BYTES, settings.ARTIFACT_MAX_RUN_BYTES, settings.ARTIFACT_MAX_RUN_COUNT
    )


def media_type_of(content_type: str) -> str | None:
    """The upload type a Content-Type header names (parameters dropped), or None."""
    base = (content_type or "").split(";")[0].strip().lower()
    base = ALIASES.get(base, base)
    return base if base in UPLOAD_TYPES else None


def media_type_for_name(name: str) -> str:
    for ext, media in EXTENSIONS.items():
        if name.lower().endswith(ext):
            return media
    return "application/octet-stream"


def check_name(name: str) -> str | None:
    if not name or len(name) > 200:
        return "a name of 1 to 200 characters is required"
    if name.startswith(".") or any(c in name for c in "/\\\x00") or name in ("..", "."):
        return "must be a plain file name (no path, no leading dot)"
    return None


@dataclasses.dataclass(frozen=True)
class Given:
    """A file given with a run's start request: uploaded in it, or copied from an artifact the
    caller may read (`copied_from`)."""

    name: str
    media_type: str
    content: bytes
    copied_from: uuid.UUID | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


def check_given(tenant, files: list[Given]) -> None:
    """Refuse, before anything is written, files a start request cannot carry: a bad name or
    type, one over the tenant's limit per artifact, or all of them over its limits per run. The
    field of each error is the file's place in the request (`files[2].content`)."""
    limits = limits_for(tenant)
    if len(files) > limits.max_run_artifacts:
        raise ArtifactRefused(
            f"{len(files)} files; this tenant's limit per run is {limits.max_run_artifacts}",
            field="files",
            status=413,
        )
    names = set()
    for i, given in enumerate(files):
        problem = check_name(given.name)
        if problem:
            raise ArtifactRefused(f"name {problem}", field=f"files[{i}].name")
        if given.name in names:
            raise ArtifactRefused(f"{given.name} is given twice", field=f"files[{i}].name")
        names.add(given.name)
        if given.copied_from is None and given.media_type not in UPLOAD_TYPES:
            raise ArtifactRefused(
                f"type {given.media_type!r} is not one of {', '.join(sorted(UPLOAD_TYPES))}",
                field=f"files[{i}].media_type",
            )
        if len(given.content) > limits.max_artifact_bytes:
            raise ArtifactRefused(
                f"{given.name} is {len(given.content)} bytes; this tenant's limit per artifact is "
                f"{limits.max_artifact_bytes}",
                field=f"files[{i}].content",
                status=413,
            )
    total = sum(len(g.content) for g in files)
    if total > limits.max_run_bytes:
        raise ArtifactRefused(
            f"the files add up to {total} bytes; this tenant's limit per run is {limits.max_run_bytes}",
            field="files",
            status=413,
        )


def store_given(*, run, files: list[Given]) -> list[Artifact]:
    """Store the files of a start request with its run, inside the transaction that creates the
    run: a refusal (check_given first, store's own checks again) rolls back the run with them."""
    stored = []
    for i, given in enumerate(files):
        try:
            stored.append(
                store(
                    run=run,
                    name=given.name,
                    media_type=given.media_type,
                    content=given.content,
                    source=Artifact.Source.UPLOAD,
                    given_at_start=True,
                )
            )
        except ArtifactRefused as exc:
            field = next(iter(exc.fields), "file")
            raise ArtifactRefused(exc.message, field=f"files[{i}].{field}", status=exc.status) from None
    return stored


def start_descriptions(run) -> list[str]:
    """What the model's first message says of the files given with the run, in request order."""
    rows = Artifact.objects.filter(run=run, given_at_start=True).order_by("created_at", "pk")
    return [describe_text(describe(a)) for a in rows]


def store(
    *, run, name: str, media_type: str, content: bytes, source: str, step=None, given_at_start: bool = False
) -> Artifact:
    problem = check_name(name)
    if problem:
        raise ArtifactRefused(f"name {problem}", field="name")
    limits = limits_for(run.tenant)
    if len(content) > limits.max_artifact_bytes:
        raise ArtifactRefused(
            f"{name} is {len(content)} bytes; this tenant's limit per artifact is {limits.max_artifact_bytes}",
            field="file",
            status=413,
        )
    digest = hashlib.sha256(content).hexdigest()
    # Sealed before the transaction: the run's key may have to be made in the key store.
    artifact_id = uuid.uuid4()
    sealed = sealing.seal(run.pk, run.tenant_id, content, sealed_as(artifact_id))
    name_key = sealing.keyed_digest(run.tenant_id, name)
    found = words_of(content) | words_of(name.encode())
    # Too many to index (a large binary file): none kept, and every search reads it instead.
    hashes = sealing.word_hashes(run.tenant_id, found) if len(found) <= MAX_WORDS else None
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(hashtext('artifacts:' || %s))", [str(run.pk)])
        existing = (
            Artifact.objects.filter(run=run, step=step, name_key=name_key, sha256=digest)
            .defer("content")
            .first()
        )
        if existing:
            return existing
        totals = Artifact.objects.filter(run=run).aggregate(n=Count("pk"), size=Sum("size"))
        if totals["n"] + 1 > limits.max_run_artifacts:
            raise ArtifactRefused(
                f"this run already has {totals['n']} artifacts, the tenant's limit per run",
                field="file",
                status=413,
            )
        if (totals["size"] or 0) + len(content) > limits.max_run_bytes:
            raise ArtifactRefused(
                f"{name} would take this run past its {limits.max_run_bytes} bytes of artifacts",
                field="file",
                status=413,
            )
        try:
            with transaction.atomic():
                return Artifact.objects.create(
                    id=artifact_id,
                    tenant_id=run.tenant_id,
                    run=run,
                    step=step,
                    source=source,
                    name=name,
                    name_key=name_key,
                    media_type=media_type,
                    size=len(content),
                    sha256=digest,
                    content=sealed,
                    sealed=True,
                    words=hashes,
                    given_at_start=given_at_start,
                )
        except IntegrityError:
            return Artifact.objects.defer("content").get(run=run, step=step, name_key=name_key, sha256=digest)


def content_of(artifact: Artifact) -> bytes:
    """The artifact's bytes, opened with its run's key. ContentErased when that key was destroyed
    (the row came back from a backup taken before its run's content was erased)."""
    if "content" in artifact.get_deferred_fields():
        raw, sealed = Artifact.objects.values_list("content", "sealed").get(pk=artifact.pk)
    else:
        raw, sealed = artifact.content, artifact.sealed
    if not sealed:
        return bytes(raw)
    return open_sealed(artifact.pk, artifact.run_id, artifact.tenant_id, bytes(raw))


def words_of(content: bytes) -> set[str]:
    """The words of an artifact's text (binary files: the words among their bytes)."""
    return set(re.findall(WORD, content.decode("utf-8", errors="replace")))


def sealed_as(artifact_id) -> str:
    """The sealing's purpose, bound into the ciphertext: the bytes open as this artifact's only."""
    return f"artifact:{artifact_id}"


def open_sealed(artifact_id, run_id, tenant_id, raw: bytes) -> bytes:
    try:
        return sealing.unseal(run_id, tenant_id, raw, sealed_as(artifact_id))
    except sealing.KeyDestroyed:
        raise ContentErased(f"artifact {artifact_id}") from None
    except InvalidTag:
        raise ContentAltered(f"artifact {artifact_id}") from None


def is_text(media_type: str) -> bool:
    return media_type.startswith("text/") or media_type == "application/json"


def describe(artifact: Artifact, content: bytes | None = None) -> dict:
    """What the model sees of an artifact: its id, name, type, size and a glimpse, never all of it."""
    description = {
        "artifact_id": str(artifact.pk),
        "name": artifact.name,
        "media_type": artifact.media_type,
        "size": artifact.size,
        "sha256": artifact.sha256,
    }
    if is_text(artifact.media_type):
        content = content_of(artifact) if content is None else content
        text = content[: 64 * 1024].decode("utf-8", errors="replace")
        lines = text.splitlines()
        description["lines"] = content.count(b"\n") + (0 if content.endswith(b"\n") or not content else 1)
        description["first_lines"] = [line[:300] for line in lines[:5]]
        if artifact.media_type == "text/csv" and lines:
            description["columns"] = next(csv.reader(io.StringIO(lines[0])), [])
    return description


def describe_text(description: dict) -> str:
    parts = [
        f"artifact {description['artifact_id']}: {description['name']} ({description['media_type']}, {description['size']} bytes"
    ]
    if "lines" in description:
        parts[0] += f", {description['lines']} lines"
    parts[0] += ")"
    if description.get("columns"):
        parts.append("columns: " + ", ".join(description["columns"]))
    if description.get("first_lines"):
        parts.append("first lines:\n" + "\n".join(description["first_lines"]))
    parts.append(
        "pass its artifact_id to run_python to work on the whole file (mounted under /in)"
        + (", or read its text with read_result artifact=<artifact_id>" if "lines" in description else "")
    )
    return "\n".join(parts)


def of_run(run, ids: list[str]) -> list[Artifact]:
    """The run's artifacts with these ids, in order; an id of another run is refused."""
    wanted = []
    for i, raw in enumerate(ids):
        try:
            wanted.append(uuid.UUID(str(raw)))
        except ValueError:
            raise ArtifactRefused(f"{raw!r} is not an artifact id", field=f"artifacts[{i}]") from None
    found = {a.pk: a for a in Artifact.objects.filter(run=run, pk__in=wanted)}
    missing = [str(w) for w in wanted if w not in found]
    if missing:
        raise ArtifactRefused(f"no artifact {', '.join(missing)} in this run", field="artifacts")
    return [found[w] for w in wanted]
