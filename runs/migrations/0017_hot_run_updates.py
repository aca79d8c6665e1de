"""Let the engine's per-step updates of a run be HOT (heap-only) updates.

A claim and a record change the run's lease, counters and event sequence on every step. The
index on (status, lease_expires_at) made each of those updates write a new entry into every one
of the table's indexes, the GIN index over input and metadata among them (recomputed from the
row each time): most of PostgreSQL's CPU per step (docs/performance.md). Without it no indexed
column changes on a step, so PostgreSQL updates the row on its own page and no index is touched.
A fill factor of 70 keeps room on each page for those new row versions; it applies to pages
written from now on (existing pages fill as they are rewritten).
"""

from django.db import migrations


def fill_factor(value: str):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":  # SQLite (the demo) has no fill factor
            schema_editor.execute(f"ALTER TABLE runs_run {value}")

    return apply


class Migration(migrations.Migration):
    dependencies = [("runs", "0016_fallback")]

    operations = [
        migrations.RemoveIndex(model_name="run", name="runs_run_status_ab3a90_idx"),
        migrations.RunPython(fill_factor("SET (fillfactor = 70)"), fill_factor("RESET (fillfactor)")),
    ]
