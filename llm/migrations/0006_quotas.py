from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("llm", "0005_fallback"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelendpoint",
            name="requests_per_minute",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="modelendpoint",
            name="tokens_per_minute",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name="modelendpoint",
            constraint=models.CheckConstraint(
                condition=models.Q(requests_per_minute__isnull=True) | models.Q(requests_per_minute__gt=0),
                name="endpoint_rpm_positive",
            ),
        ),
        migrations.AddConstraint(
            model_name="modelendpoint",
            constraint=models.CheckConstraint(
                condition=models.Q(tokens_per_minute__isnull=True) | models.Q(tokens_per_minute__gt=0),
                name="endpoint_tpm_positive",
            ),
        ),
    ]
