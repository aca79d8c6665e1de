"""The data subject search's index keyed: its rows hold the words' HMACs with the tenant's word key
(vault.sealing.word_hashes), where they held PostgreSQL's plain `hashtextextended`, which anyone
holding a copy of the table could test a guessed word against. Every row is emptied and marked not
covered, so the beat indexes the runs again (history.subjects.index_due) and a search reads the
runs not yet indexed whole meanwhile: slower, never missing one.
"""

from django.db import migrations


def uncover(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("UPDATE history_subject_words SET event_seq = NULL, words = '{}'")


class Migration(migrations.Migration):
    dependencies = [("history", "0004_subject_words"), ("runs", "0028_sealed_events_and_error")]

    operations = [migrations.RunPython(uncover, uncover)]
