"""Artifacts' bytes sealed with their run's data key (vault/), and the keyed hashes of their words
for the data subject search: the columns, then every artifact stored before sealed in place, a
batch at a time (the key store is reached here: it is made on first use, beside the platform's
database unless CONTENT_KEYS_DATABASE_URL names it)."""

import re

from django.db import migrations, models

import core.words

# As artifacts.services has them: bound into each ciphertext, and what a word is.
WORD = core.words.WORD
MAX_WORDS = 50_000


def sealed_as(artifact_id) -> str:
    return f"artifact:{artifact_id}"


def words_of(content: bytes) -> set[str]:
    return set(re.findall(WORD, content.decode("utf-8", errors="replace")))


def seal_existing(apps, schema_editor):
    Artifact = apps.get_model("artifacts", "Artifact")
    rows = Artifact.objects.filter(sealed=False).exclude(content=b"").order_by("pk")
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
            plain = bytes(content)
            Artifact.objects.filter(pk=pk, sealed=False).update(
                content=sealing.seal(run_id, tenant_id, plain, sealed_as(pk)),
                sealed=True,
                words=sealing.word_hashes(tenant_id, found) if len(found := words_of(plain)) <= MAX_WORDS else None,
            )
        last = batch[-1][0]


def open_sealed(apps, schema_editor):
    """Back: the bytes in the clear again, those whose key was destroyed emptied (they were erased)."""
    Artifact = apps.get_model("artifacts", "Artifact")
    from vault import sealing

    rows = Artifact.objects.filter(sealed=True).values_list("pk", "run_id", "tenant_id", "content")
    for pk, run_id, tenant_id, content in rows.iterator():
        try:
            plain = sealing.unseal(run_id, tenant_id, bytes(content), sealed_as(pk))
        except sealing.KeyDestroyed:
            plain = b""
        Artifact.objects.filter(pk=pk).update(content=plain, sealed=False)


def gin_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("CREATE INDEX artifacts_artifact_words ON artifacts_artifact USING gin (words)")


def drop_gin_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS artifacts_artifact_words")


class Migration(migrations.Migration):
    dependencies = [("artifacts", "0003_step_ref_without_db_key")]

    operations = [
        migrations.AddField(model_name="artifact", name="sealed", field=models.BooleanField(default=False)),
        migrations.AddField(model_name="artifact", name="words", field=core.words.WordHashes(null=True, default=list)),
        migrations.RunPython(gin_index, drop_gin_index),
        migrations.RunPython(seal_existing, open_sealed, elidable=True),
    ]
