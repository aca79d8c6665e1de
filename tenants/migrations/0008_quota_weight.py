import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("tenants", "0007_pause_settings")]

    operations = [
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
    ]
