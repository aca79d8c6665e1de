import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("llm", "0004_endpoint_compat"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelendpoint",
            name="breaker_failures",
            field=models.PositiveIntegerField(default=5),
        ),
        migrations.AddField(
            model_name="modelendpoint",
            name="breaker_window_seconds",
            field=models.PositiveIntegerField(default=60),
        ),
        migrations.AddField(
            model_name="modelendpoint",
            name="breaker_open_seconds",
            field=models.PositiveIntegerField(default=30),
        ),
        migrations.CreateModel(
            name="EndpointCircuit",
            fields=[
                (
                    "endpoint",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="circuit",
                        serialize=False,
                        to="llm.modelendpoint",
                    ),
                ),
                (
                    "state",
                    models.CharField(
                        choices=[("closed", "Closed"), ("open", "Open"), ("half_open", "Half Open")],
                        default="closed",
                        max_length=10,
                    ),
                ),
                ("failures", models.PositiveIntegerField(default=0)),
                ("window_started_at", models.DateTimeField(blank=True, null=True)),
                ("opened_at", models.DateTimeField(blank=True, null=True)),
                ("until", models.DateTimeField(blank=True, null=True)),
                ("last_error", models.TextField(blank=True)),
                ("changed_at", models.DateTimeField(blank=True, null=True)),
            ],
        ),
    ]
