"""The keyed hashes of each artifact's words, for the data subject search over sealed bytes
(history/subjects.py): the column under GIN, then those of every sealed artifact, opened with its
run's key a batch at a time (one whose key was destroyed keeps none: it was erased)."""

import re

from cryptography.exceptions import InvalidTag
from django.db import migrations

import core.words

# As artifacts.services has them.
MAX_WORDS = 50_000


def sealed_as(artifact_id) -> str:
    return f"artifact:{artifact_id}"


def words_of(content: bytes) -> set[str]:
    return set(re.findall(core.words.WORD, content.decode("utf-8", errors="replace")))


def index_words(apps, schema_editor):
    Artifact = apps.get_model("artifacts", "Artifact")
    rows = Artifact.objects.filter(sealed=True).order_by("pk")
    if not rows.exists():
        return
    from vault import sealing

    last = None
    while True:
        page = rows if last is None else rows.filter(pk__gt=last)
        batch = list(page.values_list("pk", "run_id", "tenant_id", "content")[:200])
        if not batch:
            return
        for pk, run_id, tenant_id, content in batch:
            try:
                found: set | None = words_of(sealing.unseal(run_id, tenant_id, bytes(content), sealed_as(pk)))
            except sealing.KeyDestroyed:
                found = set()
            except InvalidTag:
                found = None  # does not open (altered): no words, so every search reads it
            hashes = sealing.word_hashes(tenant_id, found) if found is not None and len(found) <= MAX_WORDS else None
            Artifact.objects.filter(pk=pk).update(words=hashes)
        last = batch[-1][0]


def gin_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("CREATE INDEX artifacts_artifact_words ON artifacts_artifact USING gin (words)")


def drop_gin_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS artifacts_artifact_words")


class Migration(migrations.Migration):
    dependencies = [("artifacts", "0004_sealed")]

    operations = [
        migrations.AddField(
            model_name="artifact", name="words", field=core.words.WordHashes(null=True, default=list)
        ),
        migrations.RunPython(gin_index, drop_gin_index),
        migrations.RunPython(index_words, migrations.RunPython.noop, elidable=True),
    ]
