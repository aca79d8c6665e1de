"""An approval's content sealed at rest with its run's data key (vault/fields.py): the call's
arguments (as proposed and as corrected) and people's texts (the decision's, the correction's,
the withdrawal's, each vote's reason) become `bytea` holding the sealed value, NULL when empty;
every row stored before is sealed in place (vault/migrating.py). Reversible on PostgreSQL.
"""

from django.db import migrations

import vault.fields
from vault.migrating import Sealed, open_columns, seal_columns

APPROVALS = Sealed(
    table="approvals_approval",
    label="approvals.approval",
    json_columns={"arguments": "{}", "original_arguments": None},
    text_columns={"decision_reason": "", "correction_reason": "", "void_reason": ""},
    run="t.run_id",
    tenant="t.tenant_id",
)
VOTES = Sealed(
    table="approvals_approvalvote",
    label="approvals.approvalvote",
    json_columns={},
    text_columns={"reason": ""},
    run="a.run_id",
    tenant="a.tenant_id",
    join="JOIN approvals_approval a ON a.id = t.approval_id",
)


def seal_existing(apps, schema_editor):
    seal_columns(schema_editor, APPROVALS)
    seal_columns(schema_editor, VOTES)


def open_sealed(apps, schema_editor):
    open_columns(schema_editor, VOTES)
    open_columns(schema_editor, APPROVALS)


def _sealed_text(**kwargs):
    return vault.fields.SealedTextField(run="run_id", tenant="tenant_id", **kwargs)


class Migration(migrations.Migration):
    dependencies = [("approvals", "0008_step_refs_without_db_keys")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(seal_existing, open_sealed)],
            state_operations=[
                migrations.AlterField(
                    model_name="approval",
                    name="arguments",
                    field=vault.fields.SealedJSONField(empty=dict, run="run_id", tenant="tenant_id"),
                ),
                migrations.AlterField(
                    model_name="approval",
                    name="original_arguments",
                    field=vault.fields.SealedJSONField(blank=True, run="run_id", tenant="tenant_id"),
                ),
                migrations.AlterField(model_name="approval", name="decision_reason", field=_sealed_text()),
                migrations.AlterField(model_name="approval", name="correction_reason", field=_sealed_text()),
                migrations.AlterField(model_name="approval", name="void_reason", field=_sealed_text()),
                migrations.AlterField(
                    model_name="approvalvote",
                    name="reason",
                    field=vault.fields.SealedTextField(run="approval.run_id", tenant="approval.tenant_id"),
                ),
            ],
        )
    ]
