"""Steps, events, reservations and ledger entries partitioned by month (history/partitions.py).

On PostgreSQL each table is rebuilt as a partitioned one and its rows copied, in this migration's
transaction: for a large installation, run it in a maintenance window (docs/history.md,
"Partitioning", says how long a copy takes). Rows made before ids were time-ordered land in each
table's default partition and stay there until retention deletes their runs.
"""

from django.db import migrations

from history import partitions


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for table, key in partitions.TABLES.items():
            partitions.partition_table(cursor, table, key)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for table, key in partitions.TABLES.items():
            partitions.unpartition_table(cursor, table, key)


class Migration(migrations.Migration):
    dependencies = [
        ("history", "0002_run_tombstones"),
        ("runs", "0025_time_ordered_run_ids"),
        ("budgets", "0009_time_ordered_reservations"),
        ("approvals", "0008_step_refs_without_db_keys"),
        ("artifacts", "0003_step_ref_without_db_key"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
