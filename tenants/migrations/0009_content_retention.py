"""Retention of runs' content per tenant and per agent (history/retention.py, docs/history.md)."""

from django.db import migrations, models

from tenants.migrations._secret_triggers import create_on_sqlite, drop_on_sqlite


class Migration(migrations.Migration):
    dependencies = [("tenants", "0008_quota_weight")]

    operations = [
        migrations.RunPython(drop_on_sqlite, create_on_sqlite),  # SQLite remakes the table
        migrations.AddField(
            model_name="tenant",
            name="content_retention_by_agent",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name="tenant",
            name="content_retention_seconds",
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(create_on_sqlite, drop_on_sqlite),
    ]
