"""A run's input and metadata sealed at rest with the run's data key (vault/fields.py), as the rest
of its content is since 0026-0028; the run search's words keyed.

PostgreSQL searched input and metadata itself: a GIN index over every value (0010) and
`search_words`, an English tsvector kept by a trigger (0021), both copies of the content in the
clear. Now `search_words` is a model field holding keyed lexemes (vault/keyed_search.py), made in
Python when a run is created. Here, on PostgreSQL: the trigger and the values index go; every run's
`search_words` is made anew from its input and metadata, a page at a time; then both columns are
sealed in place (vault/migrating.py). The GIN index over `search_words` (0021) stays and now holds
hashes. On SQLite (the demo) the column is added and filled the same way.

Reversible on PostgreSQL: the columns opened back, the plain words, trigger and index made again.
The runs table is rewritten to change the columns' types: on a large one, plan the time
(docs/history.md).
"""

import json

from django.db import migrations

import vault.fields
import vault.keyed_search
from vault.keyed_search import document
from vault.migrating import Sealed, fill_column, open_columns, seal_columns

RUNS = Sealed(
    table="runs_run",
    label="runs.run",
    json_columns={"input": "{}", "metadata": "{}"},
    text_columns={},
    run="t.id",
    tenant="t.tenant_id",
)
# As 0010 and 0021 made them (for the way back).
VALUES_PATH = 'strict $.** ? (@.type() == "string" || @.type() == "number")'
VALUES_INDEX = (
    "CREATE INDEX IF NOT EXISTS run_search_values ON runs_run USING gin "
    f"((jsonb_path_query_array(input, '{VALUES_PATH}'::jsonpath)"
    f" || jsonb_path_query_array(metadata, '{VALUES_PATH}'::jsonpath)) jsonb_path_ops)"
)
WORDS = (
    "jsonb_to_tsvector('english'::regconfig, {row}.input, '[\"string\"]')"
    " || jsonb_to_tsvector('english'::regconfig, {row}.metadata, '[\"string\"]')"
)
FUNCTION = f"""
CREATE OR REPLACE FUNCTION runs_run_search_words() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.search_words := {WORDS.format(row="NEW")};
    RETURN NEW;
END
$$
"""
TRIGGER = (
    "CREATE TRIGGER runs_run_search_words BEFORE INSERT OR UPDATE OF input, metadata ON runs_run "
    "FOR EACH ROW EXECUTE FUNCTION runs_run_search_words()"
)


def drop_plain_search(apps, schema_editor):
    conn = schema_editor.connection
    with conn.cursor() as cursor:
        if conn.vendor != "postgresql":
            cursor.execute("ALTER TABLE runs_run ADD COLUMN search_words text NULL")
            return
        cursor.execute("DROP TRIGGER IF EXISTS runs_run_search_words ON runs_run")
        cursor.execute("DROP FUNCTION IF EXISTS runs_run_search_words()")
        cursor.execute("DROP INDEX IF EXISTS run_search_values")


def make_plain_search(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(VALUES_INDEX)
        cursor.execute(FUNCTION)
        cursor.execute(TRIGGER)


def keyed_words(apps, schema_editor):
    fill_column(
        schema_editor,
        RUNS,
        "search_words",
        lambda tenant_id, values: document(tenant_id, *(_json(v) for v in values)),
        types="tsvector",
    )


def plain_words(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"UPDATE runs_run r SET search_words = {WORDS.format(row='r')}")


def _json(value):
    if value is None:
        return {}
    if isinstance(value, memoryview | bytes):
        value = bytes(value).decode("utf-8")
    return json.loads(value) if isinstance(value, str) else value


def seal_existing(apps, schema_editor):
    seal_columns(schema_editor, RUNS)


def open_sealed(apps, schema_editor):
    open_columns(schema_editor, RUNS)


class Migration(migrations.Migration):
    dependencies = [("runs", "0028_sealed_events_and_error")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(drop_plain_search, make_plain_search)],
            state_operations=[
                migrations.AddField(
                    model_name="run",
                    name="search_words",
                    field=vault.keyed_search.KeyedWordsField(),
                ),
            ],
        ),
        migrations.RunPython(keyed_words, plain_words),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(seal_existing, open_sealed)],
            state_operations=[
                migrations.AlterField(
                    model_name="run",
                    name="input",
                    field=vault.fields.SealedJSONField(run="pk", tenant="tenant_id", empty=dict),
                ),
                migrations.AlterField(
                    model_name="run",
                    name="metadata",
                    field=vault.fields.SealedJSONField(
                        blank=True, default=dict, run="pk", tenant="tenant_id", empty=dict
                    ),
                ),
            ],
        ),
    ]
