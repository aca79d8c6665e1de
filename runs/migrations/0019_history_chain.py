"""The run history's hash chain (core/chain.py, docs/history.md): each event's content digest and
chain hash, the run's head; the SQL function that links a statement's events; and the chain over
the events written before this migration, in seq order, so every run verifies from its first event.
"""

from django.db import migrations, models

from core import chain

ZERO = bytes(32)

# Links a statement's events from the run's head (runs/statements.py): the same as core.chain.link
# over `bodies` in order, the i-th with seq first_seq + i - 1.
FUNCTION = """
CREATE OR REPLACE FUNCTION run_event_chain(prev bytea, first_seq integer, bodies bytea[])
RETURNS bytea[] LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    hashes bytea[] := '{}';
    head bytea := prev;
BEGIN
    FOR i IN 1 .. coalesce(array_length(bodies, 1), 0) LOOP
        head := sha256(head || int4send(first_seq + i - 1) || bodies[i]);
        hashes := hashes || head;
    END LOOP;
    RETURN hashes;
END
$$;
"""


def create_function(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTION)


def drop_function(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS run_event_chain(bytea, integer, bytea[])")


def chain_existing(apps, schema_editor):
    """Chain the events already written, run by run (one pass over the events table)."""
    Run = apps.get_model("runs", "Run")
    RunEvent = apps.get_model("runs", "RunEvent")
    for run_id in Run.objects.filter(event_seq__gt=0).values_list("pk", flat=True).iterator():
        head = ZERO
        for event in RunEvent.objects.filter(run_id=run_id).order_by("seq").iterator():
            event.content_digest = chain.content_digest(event.message, event.data)
            body = chain.event_body(
                run_id, event.at, event.kind, event.step_seq, event.actor_id, event.content_digest
            )
            head = event.chain_hash = chain.link(head, event.seq, body)
            event.save(update_fields=["content_digest", "chain_hash"])
        Run.objects.filter(pk=run_id).update(chain_head=head, chain_prev=ZERO)


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0018_fewer_index_writes"),
    ]

    operations = [
        migrations.AddField(model_name="run", name="chain_head", field=models.BinaryField(default=ZERO)),
        migrations.AddField(model_name="run", name="chain_prev", field=models.BinaryField(default=ZERO)),
        migrations.AddField(
            model_name="runevent", name="chain_hash", field=models.BinaryField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="runevent", name="content_digest", field=models.CharField(blank=True, max_length=64)
        ),
        migrations.RunPython(create_function, drop_function),
        migrations.RunPython(chain_existing, migrations.RunPython.noop),
    ]
