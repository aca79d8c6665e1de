"""An artifact's name sealed at rest with its run's data key (vault/fields.py), as its bytes are
since 0004: a file's name can carry a customer's (`statement_C-4471.pdf`). First each name's keyed
digest (vault.sealing.keyed_digest) is written to `name_key`, which the unique constraint compares
in place of the name, and the name's words join the artifact's keyed word hashes (the data subject
search finds an identifier in a name through them); then every name is sealed in place
(vault/migrating.py). A name already erased stays empty, its key the artifact's id. Reversible on
PostgreSQL.
"""

import re

from django.db import migrations, models

import core.words
import vault.fields
from vault.migrating import Sealed, open_columns, seal_columns

NAMES = Sealed(
    table="artifacts_artifact",
    label="artifacts.artifact",
    json_columns={},
    text_columns={"name": ""},
    run="t.run_id",
    tenant="t.tenant_id",
)


def key_names(apps, schema_editor):
    Artifact = apps.get_model("artifacts", "Artifact")
    rows = Artifact.objects.order_by("pk")
    if not rows.exists():
        return
    from vault import sealing

    last = None
    while True:
        page = rows if last is None else rows.filter(pk__gt=last)
        batch = list(page.values_list("pk", "tenant_id", "name", "sealed", "words")[:200])
        if not batch:
            return
        for pk, tenant_id, name, sealed, words in batch:
            if not sealed or name in ("", "[erased]"):  # erased: nothing to key, nothing to find
                Artifact.objects.filter(pk=pk).update(name="", name_key=str(pk))
                continue
            found = set(re.findall(core.words.WORD, name))
            if words is not None and found:
                words = sorted(set(words) | set(sealing.word_hashes(tenant_id, found)))
            Artifact.objects.filter(pk=pk).update(name_key=sealing.keyed_digest(tenant_id, name), words=words)
        last = batch[-1][0]


def seal_existing(apps, schema_editor):
    seal_columns(schema_editor, NAMES)


def open_sealed(apps, schema_editor):
    open_columns(schema_editor, NAMES)


class Migration(migrations.Migration):
    dependencies = [("artifacts", "0005_words"), ("runs", "0028_sealed_events_and_error")]

    operations = [
        migrations.AddField(
            model_name="artifact",
            name="name_key",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
        migrations.RunPython(key_names, migrations.RunPython.noop),
        migrations.RemoveConstraint(model_name="artifact", name="uniq_artifact_per_step"),
        migrations.AddConstraint(
            model_name="artifact",
            constraint=models.UniqueConstraint(
                fields=("run", "step", "name_key", "sha256"), name="uniq_artifact_name_per_step"
            ),
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(seal_existing, open_sealed)],
            state_operations=[
                migrations.AlterField(
                    model_name="artifact",
                    name="name",
                    field=vault.fields.SealedTextField(run="run_id", tenant="tenant_id"),
                ),
            ],
        ),
    ]
