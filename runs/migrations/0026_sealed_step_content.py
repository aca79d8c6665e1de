"""A step's content sealed at rest with its run's data key (vault/fields.py): arguments, request,
result, observation, error and resolution become `bytea` (a BLOB on SQLite) holding the sealed
value, NULL when empty; every step stored before is sealed in place, a batch at a time
(vault/migrating.py). Reversible on PostgreSQL.
"""

from django.db import migrations

import vault.fields
from vault.migrating import Sealed, open_columns, seal_columns

STEPS = Sealed(
    table="runs_step",
    label="runs.step",
    json_columns={"arguments": None, "request": None, "result": None},
    text_columns={"observation": "", "error": "", "resolution": ""},
    run="t.run_id",
    tenant="r.tenant_id",
    join="JOIN runs_run r ON r.id = t.run_id",
)


def seal_existing(apps, schema_editor):
    seal_columns(schema_editor, STEPS)


def open_sealed(apps, schema_editor):
    open_columns(schema_editor, STEPS)


class Migration(migrations.Migration):
    dependencies = [("runs", "0025_time_ordered_run_ids")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(seal_existing, open_sealed)],
            state_operations=[
                migrations.AlterField(
                    model_name="step", name="arguments", field=vault.fields.SealedJSONField(blank=True)
                ),
                migrations.AlterField(
                    model_name="step", name="request", field=vault.fields.SealedJSONField(blank=True)
                ),
                migrations.AlterField(
                    model_name="step", name="result", field=vault.fields.SealedJSONField(blank=True)
                ),
                migrations.AlterField(
                    model_name="step", name="observation", field=vault.fields.SealedTextField()
                ),
                migrations.AlterField(model_name="step", name="error", field=vault.fields.SealedTextField()),
                migrations.AlterField(
                    model_name="step", name="resolution", field=vault.fields.SealedTextField()
                ),
            ],
        )
    ]
