"""SQLite (the demo) around a migration that alters the tenants table.

SQLite alters a table by making a new one, dropping the old and renaming the new: the secrets'
row triggers of 0006 name the tenants table, and the rename fails on them ("error in trigger
tenants_secret_generation_insert: no such table"). A migration that adds a tenant column drops
them first and makes them again after. PostgreSQL alters in place: nothing to do there.
"""

from __future__ import annotations

import importlib

_generation = importlib.import_module("tenants.migrations.0006_tenant_secrets_generation")


def drop_on_sqlite(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        _generation.drop_triggers(apps, schema_editor)


def create_on_sqlite(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        _generation.create_triggers(apps, schema_editor)
