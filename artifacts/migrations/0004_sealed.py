"""Artifacts' bytes sealed with their run's data key (vault/): the flag, then every artifact stored
before it sealed in place, a batch at a time (the key store is reached here: it is made on first
use, beside the platform's database unless CONTENT_KEYS_DATABASE_URL names it)."""

from django.db import migrations, models



def sealed_as(artifact_id) -> str:
    return f"artifact:{artifact_id}"  # artifacts.services.sealed_as: bound into each ciphertext


def seal_existing(apps, schema_editor):
    Artifact = apps.get_model("artifacts", "Artifact")
    rows = Artifact.objects.filter(sealed=False).exclude(content=b"").order_by("pk")
    if not rows.exists():
        return
    from vault import sealing

    last = None
    while True:
        page = rows if last is None else rows.filter(pk__gt=last)
        batch = list(page.values_list("pk", "run_id", "tenant_id", "content")[:200])
        if not batch:
            return
        for pk, run_id, tenant_id, content in batch:
            sealed = sealing.seal(run_id, tenant_id, bytes(content), sealed_as(pk))
            Artifact.objects.filter(pk=pk, sealed=False).update(content=sealed, sealed=True)
        last = batch[-1][0]


def open_sealed(apps, schema_editor):
    """Back: the bytes in the clear again, those whose key was destroyed emptied (they were erased)."""
    Artifact = apps.get_model("artifacts", "Artifact")
    from vault import sealing

    for pk, run_id, tenant_id, content in Artifact.objects.filter(sealed=True).values_list(
        "pk", "run_id", "tenant_id", "content"
    ).iterator():
        try:
            plain = sealing.unseal(run_id, tenant_id, bytes(content), sealed_as(pk))
        except sealing.KeyDestroyed:
            plain = b""
        Artifact.objects.filter(pk=pk).update(content=plain, sealed=False)


class Migration(migrations.Migration):
    dependencies = [("artifacts", "0003_step_ref_without_db_key")]

    operations = [
        migrations.AddField(model_name="artifact", name="sealed", field=models.BooleanField(default=False)),
        migrations.RunPython(seal_existing, open_sealed, elidable=True),
    ]
