"""NOTIFY only for runs someone streams: a step of a run nobody watches takes no notify lock.

PostgreSQL serialises every committing transaction that queued a NOTIFY on one cluster-wide lock,
held through the commit's WAL flush; migration 0008's trigger queued one for every INSERT of
events, so every step commit of every run took it (bench/notify_lock.py: 2,151 tps without a
trigger, 1,597 with it, 16 clients). The streams' process (runs/stream_feed.py) now keeps a row per
run it streams in `runs_streamedrun`, under a lease it renews, and the trigger notifies only for
runs with a live row: one index probe per INSERT statement, no NOTIFY when nobody streams (2,131
tps). A dead API process stops renewing; its rows lapse and the trigger ignores them.

The table has no model: only runs/stream_feed.py (async, psycopg) and this trigger read or write it.
PostgreSQL only, as 0008.
"""

from django.db import migrations

CHANNEL = "run_events"  # runs.stream_feed.CHANNEL
STREAMED = "runs_streamedrun"  # runs.stream_feed.STREAMED


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"""
        CREATE TABLE "{STREAMED}" (
            run_id uuid NOT NULL,
            process varchar(32) NOT NULL,
            lease_until timestamptz NOT NULL,
            PRIMARY KEY (run_id, process)
        );
        CREATE OR REPLACE FUNCTION runs_runevent_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', n.run_id::text || ':' || max(n.seq)) FROM new_rows n
                WHERE EXISTS (SELECT 1 FROM "{STREAMED}" s WHERE s.run_id = n.run_id AND s.lease_until > now())
                GROUP BY n.run_id;
            RETURN NULL;
        END
        $$;
        """
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"""
        CREATE OR REPLACE FUNCTION runs_runevent_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', run_id::text || ':' || max(seq)) FROM new_rows GROUP BY run_id;
            RETURN NULL;
        END
        $$;
        DROP TABLE IF EXISTS "{STREAMED}";
        """
    )


class Migration(migrations.Migration):
    dependencies = [("runs", "0010_run_search_indexes")]

    operations = [migrations.RunPython(create, drop)]
