"""The data subject search's index (history/subjects.py, docs/history.md "The search's index"):
a row per run, the 64-bit hashes of its texts' words under a GIN index, and the run's
`event_seq` when they were read, null while the run is not covered. A table of its own, not a
column of runs_run: the engine's frequent updates of a run stay HOT and never rewrite an array.

Two triggers on runs_run keep "not covered" exact without the step path writing anything:
- after an insert, the run's row, not covered (every way a run is made: the API, evaluations,
  replays, a benchmark's SQL);
- after an update of an ended run's `event_seq` or content columns (a late event, a removal),
  its row not covered again. A live run's updates, the step path's, fail the WHEN and do nothing.
So the runs not covered are read from a partial index, not found by comparing every run.
Existing runs get their rows here, not covered: the beat indexes them.
"""

import django.db.models.deletion
from django.db import migrations, models

import history.models

TERMINAL = "('succeeded', 'failed', 'cancelled', 'stopped')"
BATCH = 10_000

CREATE = f"""
CREATE INDEX IF NOT EXISTS history_subject_words_gin ON history_subject_words USING gin (words);
CREATE INDEX IF NOT EXISTS history_subject_words_uncovered ON history_subject_words (tenant_id, run_id)
    WHERE event_seq IS NULL;
CREATE OR REPLACE FUNCTION history_subject_words_new() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO history_subject_words (run_id, tenant_id, event_seq, words)
    VALUES (NEW.id, NEW.tenant_id, NULL, '{{}}') ON CONFLICT (run_id) DO NOTHING;
    RETURN NULL;
END
$$;
CREATE OR REPLACE FUNCTION history_subject_words_stale() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE history_subject_words SET event_seq = NULL WHERE run_id = NEW.id AND event_seq IS NOT NULL;
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS runs_run_subject_words_new ON runs_run;
CREATE TRIGGER runs_run_subject_words_new AFTER INSERT ON runs_run
    FOR EACH ROW EXECUTE FUNCTION history_subject_words_new();
DROP TRIGGER IF EXISTS runs_run_subject_words_stale ON runs_run;
CREATE TRIGGER runs_run_subject_words_stale
    AFTER UPDATE OF event_seq, input, metadata, final_output, error ON runs_run
    FOR EACH ROW WHEN (OLD.status IN {TERMINAL})
    EXECUTE FUNCTION history_subject_words_stale();
"""
FILL = f"""
INSERT INTO history_subject_words (run_id, tenant_id, event_seq, words)
SELECT r.id, r.tenant_id, NULL, '{{}}' FROM runs_run r
WHERE NOT EXISTS (SELECT 1 FROM history_subject_words w WHERE w.run_id = r.id) LIMIT {BATCH}
ON CONFLICT (run_id) DO NOTHING
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(CREATE)
    with schema_editor.connection.cursor() as cursor:
        while True:
            cursor.execute(FILL)
            if cursor.rowcount < BATCH:
                break


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP TRIGGER IF EXISTS runs_run_subject_words_new ON runs_run; "
        "DROP TRIGGER IF EXISTS runs_run_subject_words_stale ON runs_run; "
        "DROP FUNCTION IF EXISTS history_subject_words_new(); "
        "DROP FUNCTION IF EXISTS history_subject_words_stale()"
    )


class Migration(migrations.Migration):
    dependencies = [
        ("history", "0003_monthly_partitions"),
        ("runs", "0025_time_ordered_run_ids"),
        ("tenants", "0011_tenant_approval_reason_required"),
    ]

    operations = [
        migrations.CreateModel(
            name="SubjectWords",
            fields=[
                (
                    "run",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="+",
                        serialize=False,
                        to="runs.run",
                    ),
                ),
                ("event_seq", models.PositiveIntegerField(null=True)),
                ("words", history.models.WordHashes()),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="tenants.tenant",
                    ),
                ),
            ],
            options={
                "db_table": "history_subject_words",
            },
        ),
        migrations.RunPython(create, drop),
    ]
