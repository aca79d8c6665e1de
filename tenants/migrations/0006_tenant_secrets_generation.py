"""Tenant.secrets_generation, moved by a trigger on every INSERT, UPDATE or DELETE of a secret.

The workers cache the tenant's decrypted secrets under this number (tenants/secrets.py): a trigger
rather than the writers' code, so that every write moves it (the admin, configuration apply, a
cascade from a deleted tenant, a shell), in the writer's transaction, so that a reader that sees
the new secret also sees the new number. PostgreSQL: one statement-level trigger per operation
(a statement writing many secrets moves each tenant once); SQLite (the demo): row-level triggers.
"""

from django.db import migrations, models

OPERATIONS = ("INSERT", "UPDATE", "DELETE")


def create_triggers(apps, schema_editor):
    tenant = apps.get_model("tenants", "Tenant")._meta.db_table
    secret = apps.get_model("tenants", "Secret")._meta.db_table
    if schema_editor.connection.vendor == "postgresql":
        # A transition table per operation: an UPDATE moving a secret to another tenant moves both.
        schema_editor.execute(
            f"""
            CREATE OR REPLACE FUNCTION tenants_secret_generation() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP IN ('INSERT', 'UPDATE') THEN
                    UPDATE "{tenant}" SET secrets_generation = secrets_generation + 1
                        WHERE id IN (SELECT tenant_id FROM new_rows);
                END IF;
                IF TG_OP IN ('UPDATE', 'DELETE') THEN
                    UPDATE "{tenant}" SET secrets_generation = secrets_generation + 1
                        WHERE id IN (SELECT tenant_id FROM old_rows);
                END IF;
                RETURN NULL;
            END
            $$;
            CREATE TRIGGER tenants_secret_generation_insert AFTER INSERT ON "{secret}"
                REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tenants_secret_generation();
            CREATE TRIGGER tenants_secret_generation_update AFTER UPDATE ON "{secret}"
                REFERENCING NEW TABLE AS new_rows OLD TABLE AS old_rows
                FOR EACH STATEMENT EXECUTE FUNCTION tenants_secret_generation();
            CREATE TRIGGER tenants_secret_generation_delete AFTER DELETE ON "{secret}"
                REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tenants_secret_generation();
            """
        )
        return
    for operation in OPERATIONS:
        rows = ["NEW"] if operation == "INSERT" else ["OLD"] if operation == "DELETE" else ["NEW", "OLD"]
        bumps = " ".join(
            f'UPDATE "{tenant}" SET secrets_generation = secrets_generation + 1 WHERE id = {row}.tenant_id;'
            for row in rows
        )
        schema_editor.execute(
            f'CREATE TRIGGER tenants_secret_generation_{operation.lower()} AFTER {operation} ON "{secret}" '
            f"FOR EACH ROW BEGIN {bumps} END"
        )


def drop_triggers(apps, schema_editor):
    secret = apps.get_model("tenants", "Secret")._meta.db_table
    postgres = schema_editor.connection.vendor == "postgresql"
    for operation in OPERATIONS:
        on = f' ON "{secret}"' if postgres else ""
        schema_editor.execute(f"DROP TRIGGER IF EXISTS tenants_secret_generation_{operation.lower()}{on}")
    if postgres:
        schema_editor.execute("DROP FUNCTION IF EXISTS tenants_secret_generation()")


class Migration(migrations.Migration):
    dependencies = [("tenants", "0005_tenant_currency")]

    operations = [
        migrations.AddField(
            model_name="tenant",
            name="secrets_generation",
            field=models.PositiveBigIntegerField(default=0, editable=False),
        ),
        migrations.RunPython(create_triggers, drop_triggers),
    ]
