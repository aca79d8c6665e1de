"""The data subject search's index (history/subjects.py, docs/history.md "The search's index"):
one row per ended run, the 64-bit hashes of its texts' words under a GIN index, and the run's
`event_seq` when they were read. A table of its own, not a column of runs_run: the engine's
frequent updates of a run stay HOT and never rewrite a large array. Empty when made: the beat
fills it, and until a run is in it the search reads that run whole.
"""

import django.db.models.deletion
import history.models
from django.db import migrations, models




def gin(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS history_subject_words_gin ON history_subject_words USING gin (words)"
        )


def no_gin(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS history_subject_words_gin")


class Migration(migrations.Migration):

    dependencies = [
        ('history', '0003_monthly_partitions'),
        ('runs', '0025_time_ordered_run_ids'),
        ('tenants', '0011_tenant_approval_reason_required'),
    ]

    operations = [
        migrations.CreateModel(
            name='SubjectWords',
            fields=[
                ('run', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='+', serialize=False, to='runs.run')),
                ('event_seq', models.PositiveIntegerField()),
                ('words', history.models.WordHashes()),
                ('tenant', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
            ],
            options={
                'db_table': 'history_subject_words',
            },
        ),
        migrations.RunPython(gin, no_gin),
    ]
