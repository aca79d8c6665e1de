"""Fewer index writes per step: the step and event tables lose indexes that nothing needs.

`runs_step.run_id` and `runs_runevent.run_id` each had an index of their own beside the unique
(run_id, seq) index, whose leading column serves every lookup by run. The events' actor index
becomes partial: only a person's events have an actor, and deleting a user needs only those; the
engine's four or so events per step no longer write to it (docs/performance.md).

Built and dropped CONCURRENTLY on PostgreSQL (so a large events table is not locked against
writes), and therefore outside a transaction; SQLite (the demo) drops and builds them plainly.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

DROPPED = ["runs_step_run_id_2764751d", "runs_runevent_run_id_8bd13aa7", "runs_runevent_actor_id_104c5df7"]
ACTOR = "event_actor ON runs_runevent (actor_id) WHERE actor_id IS NOT NULL"
RESTORED = {
    "runs_step_run_id_2764751d": "runs_step (run_id)",
    "runs_runevent_run_id_8bd13aa7": "runs_runevent (run_id)",
    "runs_runevent_actor_id_104c5df7": "runs_runevent (actor_id)",
}


def _concurrently(schema_editor) -> str:
    return " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""


def forward(apps, schema_editor):
    how = _concurrently(schema_editor)
    schema_editor.execute(f"CREATE INDEX{how} IF NOT EXISTS {ACTOR}")
    for name in DROPPED:
        schema_editor.execute(f"DROP INDEX{how} IF EXISTS {name}")


def backward(apps, schema_editor):
    how = _concurrently(schema_editor)
    for name, where in RESTORED.items():
        schema_editor.execute(f"CREATE INDEX{how} IF NOT EXISTS {name} ON {where}")
    schema_editor.execute(f"DROP INDEX{how} IF EXISTS event_actor")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("runs", "0017_hot_run_updates"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="runevent",
                    name="actor",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                migrations.AlterField(
                    model_name="runevent",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="events",
                        to="runs.run",
                    ),
                ),
                migrations.AlterField(
                    model_name="step",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="steps",
                        to="runs.run",
                    ),
                ),
                migrations.AddIndex(
                    model_name="runevent",
                    index=models.Index(
                        condition=models.Q(("actor__isnull", False)), fields=["actor"], name="event_actor"
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        ),
    ]
