"""A tenant may require a reason to approve, as one is always required to deny (approvals/services.py)."""

from django.db import migrations, models

from tenants.migrations._secret_triggers import create_on_sqlite, drop_on_sqlite


class Migration(migrations.Migration):
    dependencies = [("tenants", "0010_skeleton_retention")]

    operations = [
        migrations.RunPython(drop_on_sqlite, create_on_sqlite),  # SQLite remakes the table
        migrations.AddField(
            model_name="tenant",
            name="approval_reason_required",
            field=models.BooleanField(default=False),
        ),
        migrations.RunPython(create_on_sqlite, drop_on_sqlite),
    ]
