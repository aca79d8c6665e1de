"""A run's events' messages and data, and the run's error, sealed at rest with the run's data key
(vault/fields.py), as its steps' content is since 0026. An event's data keys about the platform's
own state (statuses, tools, digests, what a removal removed: runs.models.EVENT_SKELETON, copied
here as it stood) are first copied in the clear into the new `skeleton` column, which the database
filters on and which stays once the content is removed or its key destroyed. Every row stored
before is then sealed in place (vault/migrating.py). Reversible on PostgreSQL. PostgreSQL rewrites
the events table (and the runs table) to change the columns' types: on a large one, plan the time
(docs/history.md).
"""

import json

from django.db import migrations, models

import vault.fields
from vault.migrating import Sealed, open_columns, seal_columns

SKELETON = sorted(
    {
        "from", "to", "step_kind", "tool", "content", "agent", "version", "alias",
        "expected_cost_micros", "admission", "cost_micros", "effect_class", "outcome", "policies", "policy_set",
        "policy_version", "decision", "scope", "approval", "certificate", "hold", "jti", "subject",
        "audience", "token_subject", "found", "action", "state", "limit", "alone", "bulk_action", "at", "first_step", "last_step", "region_reason",
        "note", "why", "run", "steps", "events", "approvals", "artifacts",
    }
)  # fmt: skip
EVENTS = Sealed(
    table="runs_runevent",
    label="runs.runevent",
    json_columns={"data": "{}"},
    text_columns={"message": ""},
    run="t.run_id",
    tenant="r.tenant_id",
    join="JOIN runs_run r ON r.id = t.run_id",
)
RUNS = Sealed(
    table="runs_run",
    label="runs.run",
    json_columns={},
    text_columns={"error": ""},
    run="t.id",
    tenant="t.tenant_id",
)


def copy_skeleton(apps, schema_editor):
    conn = schema_editor.connection
    with conn.cursor() as cursor:
        if conn.vendor == "postgresql":
            cursor.execute(
                """
                UPDATE runs_runevent SET skeleton = (
                    SELECT coalesce(jsonb_object_agg(key, value), '{}'::jsonb)
                    FROM jsonb_each(data) WHERE key = ANY(%s)
                ) WHERE jsonb_typeof(data) = 'object'
                """,
                [SKELETON],
            )
            return
        cursor.execute("SELECT id, data FROM runs_runevent")
        rows = cursor.fetchall()
        for pk, data in rows:
            value = json.loads(data) if isinstance(data, str) else data
            if isinstance(value, dict):
                kept = {key: item for key, item in value.items() if key in SKELETON}
                cursor.execute("UPDATE runs_runevent SET skeleton = %s WHERE id = %s", [json.dumps(kept), pk])


def seal_existing(apps, schema_editor):
    seal_columns(schema_editor, EVENTS)
    seal_columns(schema_editor, RUNS)


def open_sealed(apps, schema_editor):
    open_columns(schema_editor, RUNS)
    open_columns(schema_editor, EVENTS)


class Migration(migrations.Migration):
    dependencies = [("runs", "0027_sealed_final_output")]

    operations = [
        migrations.AddField(
            model_name="runevent",
            name="skeleton",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(copy_skeleton, migrations.RunPython.noop),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(seal_existing, open_sealed)],
            state_operations=[
                migrations.AlterField(
                    model_name="runevent",
                    name="message",
                    field=vault.fields.SealedTextField(),
                ),
                migrations.AlterField(
                    model_name="runevent",
                    name="data",
                    field=vault.fields.SealedJSONField(blank=True, empty=dict),
                ),
                migrations.AlterField(
                    model_name="run",
                    name="error",
                    field=vault.fields.SealedTextField(run="pk", tenant="tenant_id"),
                ),
            ],
        ),
    ]
