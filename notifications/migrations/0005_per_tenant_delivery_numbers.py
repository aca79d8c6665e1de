"""Per-tenant delivery numbers (issue 40): X-Delivery-Id was the table's id, one sequence across
tenants, so a receiver could infer other tenants' volume. Existing deliveries are numbered per
tenant in id order, and each tenant's counter starts after them."""

import django.db.models.deletion
from django.db import migrations, models


def number_existing(apps, schema_editor):
    Delivery = apps.get_model("notifications", "Delivery")
    DeliveryCounter = apps.get_model("notifications", "DeliveryCounter")
    last: dict[int, int] = {}
    for pk, tenant_id in Delivery.objects.order_by("id").values_list("id", "tenant_id").iterator():
        last[tenant_id] = last.get(tenant_id, 0) + 1
        Delivery.objects.filter(pk=pk).update(number=last[tenant_id])
    DeliveryCounter.objects.bulk_create(
        [DeliveryCounter(tenant_id=tenant_id, last=number) for tenant_id, number in last.items()]
    )


class Migration(migrations.Migration):
    dependencies = [
        ("notifications", "0004_approval_reminder_events"),
        ("tenants", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="DeliveryCounter",
            fields=[
                (
                    "tenant",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="+",
                        serialize=False,
                        to="tenants.tenant",
                    ),
                ),
                ("last", models.PositiveBigIntegerField(default=0)),
            ],
        ),
        migrations.AddField(
            model_name="delivery",
            name="number",
            field=models.PositiveBigIntegerField(null=True),
        ),
        migrations.RunPython(number_existing, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="delivery",
            name="number",
            field=models.PositiveBigIntegerField(),
        ),
        migrations.AddConstraint(
            model_name="delivery",
            constraint=models.UniqueConstraint(fields=("tenant", "number"), name="uniq_delivery_number"),
        ),
    ]
