"""The words of a run for search (runs/front/search.py): `runs_run.search_words`, the English tsvector
of every string in the run's input and metadata, kept by a trigger, with a GIN index; `q` finds a
run by a word of its request or a customer's name.

Why a column kept by a trigger, not an expression index or a generated column: ranking needs each
match's tsvector, and rebuilding it from the JSON costs ~70 µs a row (an expression index holds
no value to read back); a stored generated column would rewrite the whole table under an
exclusive lock when added. The trigger fires on INSERT and on an UPDATE that names input or
metadata (a redaction: the erased words leave the index with them), so the engine's frequent
updates of a run never rebuild it, and stay HOT. The column is not a model field: only the
search reads it. PostgreSQL only (SQLite, the demo, searches the JSON's text).

Filled in batches of BATCH rows (each its own statement, outside a transaction), then indexed
CONCURRENTLY: no long lock on a large runs table.
"""

from django.db import migrations

WORDS = (
    "jsonb_to_tsvector('english'::regconfig, {row}.input, '[\"string\"]')"
    " || jsonb_to_tsvector('english'::regconfig, {row}.metadata, '[\"string\"]')"
)
BATCH = 10_000

FUNCTION = f"""
CREATE OR REPLACE FUNCTION runs_run_search_words() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.search_words := {WORDS.format(row="NEW")};
    RETURN NEW;
END
$$
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("ALTER TABLE runs_run ADD COLUMN IF NOT EXISTS search_words tsvector")
    schema_editor.execute(FUNCTION)
    schema_editor.execute("DROP TRIGGER IF EXISTS runs_run_search_words ON runs_run")
    schema_editor.execute(
        "CREATE TRIGGER runs_run_search_words BEFORE INSERT OR UPDATE OF input, metadata ON runs_run "
        "FOR EACH ROW EXECUTE FUNCTION runs_run_search_words()"
    )
    fill = (
        f"UPDATE runs_run r SET search_words = {WORDS.format(row='r')} WHERE r.id IN "
        f"(SELECT id FROM runs_run WHERE search_words IS NULL LIMIT {BATCH})"
    )
    with schema_editor.connection.cursor() as cursor:
        while True:
            cursor.execute(fill)
            if cursor.rowcount < BATCH:
                break
    schema_editor.execute(
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS run_search_words ON runs_run USING gin (search_words)"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS run_search_words")
    schema_editor.execute("DROP TRIGGER IF EXISTS runs_run_search_words ON runs_run")
    schema_editor.execute("DROP FUNCTION IF EXISTS runs_run_search_words()")
    schema_editor.execute("ALTER TABLE runs_run DROP COLUMN IF EXISTS search_words")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("runs", "0020_bulk_cancel_and_kill_switch_names")]

    operations = [migrations.RunPython(create, drop)]
