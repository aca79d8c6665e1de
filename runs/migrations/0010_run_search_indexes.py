"""Indexes for finding runs (runs/search.py): the tenant's newest first, by creator, agent and status,
and a GIN index on every string and number of a run's input and metadata.

Built CONCURRENTLY (so the migration does not lock a large runs table against writes) and therefore
outside a transaction. The GIN expression must stay identical to runs.search.SearchValues. PostgreSQL
only: SQLite (the demo) has no jsonpath and scans its few runs.
"""

from django.db import migrations

VALUES_PATH = "strict $.** ? (@.type() == \"string\" || @.type() == \"number\")"
INDEXES = {
    "run_tenant_created": "(tenant_id, created_at DESC)",
    "run_tenant_creator_created": "(tenant_id, created_by_id, created_at DESC)",
    "run_tenant_agent_created": "(tenant_id, agent_id, created_at DESC)",
    "run_tenant_status_created": "(tenant_id, status, created_at DESC)",
    "run_search_values": (
        f"USING gin ((jsonb_path_query_array(input, '{VALUES_PATH}'::jsonpath)"
        f" || jsonb_path_query_array(metadata, '{VALUES_PATH}'::jsonpath)) jsonb_path_ops)"
    ),
}


def create_indexes(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, definition in INDEXES.items():
        schema_editor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON runs_run {definition}")


def drop_indexes(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("runs", "0009_engine_decisions")]

    operations = [migrations.RunPython(create_indexes, drop_indexes)]
