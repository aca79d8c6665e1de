"""A run's answer (`final_output`) sealed at rest with its data key (vault/fields.py), as its
steps' content is since 0026: `bytea` holding the sealed value, NULL when empty; every run stored
before sealed in place (vault/migrating.py; the data subject index's trigger that names the
column is made again after). Reversible on PostgreSQL. PostgreSQL rewrites the runs table to
change the column's type: on a large table, plan the time (docs/history.md).
"""

from django.db import migrations

import vault.fields
from vault.migrating import Sealed, open_columns, seal_columns

RUNS = Sealed(
    table="runs_run",
    label="runs.run",
    json_columns={},
    text_columns={"final_output": ""},
    run="t.id",
    tenant="t.tenant_id",
)


def seal_existing(apps, schema_editor):
    seal_columns(schema_editor, RUNS)


def open_sealed(apps, schema_editor):
    open_columns(schema_editor, RUNS)


class Migration(migrations.Migration):
    dependencies = [("runs", "0026_sealed_step_content")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(seal_existing, open_sealed)],
            state_operations=[
                migrations.AlterField(
                    model_name="run",
                    name="final_output",
                    field=vault.fields.SealedTextField(run="pk", tenant="tenant_id"),
                ),
            ],
        )
    ]
