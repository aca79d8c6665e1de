"""RunEvent.seq: events numbered per run (the API's event id), with the counter on Run.

Existing events are numbered in the order they were written (their global id).
"""
from django.db import migrations, models


def number_existing_events(apps, schema_editor):
    run_event = apps.get_model("runs", "RunEvent")._meta.db_table
    run = apps.get_model("runs", "Run")._meta.db_table
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f'UPDATE "{run_event}" SET seq = numbered.n FROM (SELECT id, ROW_NUMBER() OVER '
                       f'(PARTITION BY run_id ORDER BY id) AS n FROM "{run_event}") AS numbered '
                       f'WHERE "{run_event}".id = numbered.id')
        cursor.execute(f'UPDATE "{run}" SET event_seq = (SELECT COUNT(*) FROM "{run_event}" e '
                       f'WHERE e.run_id = "{run}".id)')


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0004_settle_window"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="event_seq",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="runevent",
            name="seq",
            field=models.PositiveIntegerField(null=True),
        ),
        migrations.RunPython(number_existing_events, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="runevent",
            name="seq",
            field=models.PositiveIntegerField(),
        ),
        migrations.RemoveIndex(
            model_name="runevent",
            name="runs_runeve_run_id_69c61a_idx",
        ),
        migrations.AddConstraint(
            model_name="runevent",
            constraint=models.UniqueConstraint(fields=("run", "seq"), name="uniq_run_event_seq"),
        ),
    ]
