import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0015_waiting_authorization"),
        ("llm", "0005_fallback"),
    ]

    operations = [
        migrations.AddField(
            model_name="step",
            name="model_endpoint",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="llm.modelendpoint",
            ),
        ),
        migrations.AddField(
            model_name="step",
            name="error_class",
            field=models.CharField(blank=True, max_length=20),
        ),
    ]
