"""Words for the data subject search's indexes (history/subjects.py): what a word is, and the
column that holds a row's word hashes."""

from __future__ import annotations

from django.db import models

WORD = "[A-Za-z0-9_]{2,}"  # PostgreSQL's and Python's regular expressions read it alike


class WordHashes(models.Field):
    """64-bit word hashes: `bigint[]` under a GIN index on PostgreSQL. Written and read in SQL only
    (history/subjects.py); the search needs PostgreSQL, so elsewhere the column is an unused text."""

    def db_type(self, connection):
        return "bigint[]" if connection.vendor == "postgresql" else "text"

    def get_db_prep_value(self, value, connection, prepared=False):
        if value is None or connection.vendor == "postgresql":
            return value
        return " ".join(map(str, value))  # kept, not searched (the demo's SQLite)
