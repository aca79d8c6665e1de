"""Tenant.on_killed_tool and Tenant.paused_time_counts: the tenant's choices for a killed tool
(pause the run, or answer the call as unavailable) and for a paused run's deadline (issue 24)."""

from django.db import migrations, models

from tenants.migrations._secret_triggers import create_on_sqlite, drop_on_sqlite


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0006_tenant_secrets_generation"),
    ]

    operations = [
        migrations.RunPython(drop_on_sqlite, create_on_sqlite),  # SQLite remakes the table
        migrations.AddField(
            model_name="tenant",
            name="on_killed_tool",
            field=models.CharField(
                choices=[("pause", "Pause"), ("unavailable", "Unavailable")], default="pause", max_length=12
            ),
        ),
        migrations.AddField(
            model_name="tenant",
            name="paused_time_counts",
            field=models.BooleanField(default=False),
        ),
        migrations.RunPython(create_on_sqlite, drop_on_sqlite),
    ]
