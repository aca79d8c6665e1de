"""Retention of runs' skeleton per tenant and per agent (history/retention.py, docs/history.md)."""

from django.db import migrations, models

from tenants.migrations._secret_triggers import create_on_sqlite, drop_on_sqlite


class Migration(migrations.Migration):
    dependencies = [("tenants", "0009_content_retention")]

    operations = [
        migrations.RunPython(drop_on_sqlite, create_on_sqlite),  # SQLite remakes the table
        migrations.AddField(
            model_name="tenant",
            name="skeleton_retention_by_agent",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name="tenant",
            name="skeleton_retention_seconds",
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(create_on_sqlite, drop_on_sqlite),
    ]
