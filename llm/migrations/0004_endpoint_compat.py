from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("llm", "0003_endpoint_send_cache_key"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelendpoint",
            name="compat",
            field=models.JSONField(blank=True, default=dict),
        ),
    ]
