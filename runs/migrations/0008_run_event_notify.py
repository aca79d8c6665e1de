"""Every committed batch of run events wakes the live streams (runs/stream_feed.py) by NOTIFY.

One notification per run per INSERT statement (a transition table, not a row trigger): the engine
inserts a transaction's events in one statement, and the payload `<run_id>:<latest seq>` is all a
listener needs to know which streams to wake. PostgreSQL only; SQLite streams poll instead.
"""

from django.db import migrations

CHANNEL = "run_events"  # runs.stream_feed.CHANNEL


def create_trigger(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    table = apps.get_model("runs", "RunEvent")._meta.db_table
    schema_editor.execute(
        f"""
        CREATE OR REPLACE FUNCTION runs_runevent_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', run_id::text || ':' || max(seq)) FROM new_rows GROUP BY run_id;
            RETURN NULL;
        END
        $$;
        CREATE TRIGGER runs_runevent_notify AFTER INSERT ON "{table}"
            REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION runs_runevent_notify();
        """
    )


def drop_trigger(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    table = apps.get_model("runs", "RunEvent")._meta.db_table
    schema_editor.execute(
        f'DROP TRIGGER IF EXISTS runs_runevent_notify ON "{table}"; DROP FUNCTION IF EXISTS runs_runevent_notify();'
    )


class Migration(migrations.Migration):
    dependencies = [("runs", "0007_run_admission")]

    operations = [migrations.RunPython(create_trigger, drop_trigger)]
