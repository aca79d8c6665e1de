import django.core.validators
from django.db import migrations, models

from tenants.migrations._secret_triggers import create_on_sqlite, drop_on_sqlite


class Migration(migrations.Migration):
    dependencies = [("tenants", "0007_pause_settings")]

    operations = [
        migrations.RunPython(drop_on_sqlite, create_on_sqlite),  # SQLite remakes the table
        migrations.AddField(
            model_name="tenant",
            name="quota_weight",
            field=models.PositiveIntegerField(
                default=1,
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(1000),
                ],
            ),
        ),
        migrations.RunPython(create_on_sqlite, drop_on_sqlite),
    ]
