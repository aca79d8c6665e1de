"""Model instances from raw SQL rows, for reads made on every step where building the query with
the ORM would cost more than the read (about a millisecond of CPU; docs/performance.md).

They give back the same model instances the ORM would: every concrete column, the same
conversions (the backend's and the field's). Portable between PostgreSQL and SQLite (the demo):
parameters go through `adapt`, lists through `in_list`. The engine's own statements live in
runs/rows.py; these helpers serve any app below it (the tool gateway's checks).
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid

from django.db import connection, models

_UUID = models.UUIDField()


def adapt(value):
    """A parameter as the driver wants it: SQLite stores UUIDs as hex and datetimes as UTC text."""
    if isinstance(value, uuid.UUID):
        return _UUID.get_db_prep_value(value, connection)
    if isinstance(value, dt.datetime):
        return connection.ops.adapt_datetimefield_value(value)
    return value


def adapt_all(params):
    if isinstance(params, dict):
        return {name: adapt(value) for name, value in params.items()}
    return [adapt(value) for value in params]


def in_list(name: str, values, params: dict) -> str:
    """`IN (%(name_0)s, ...)` for `values`, added to the named `params` (false when empty)."""
    names = [f"{name}_{i}" for i in range(len(values))]
    params.update(zip(names, values))
    return "IN (" + (", ".join(f"%({n})s" for n in names) or "NULL") + ")"


@functools.cache
def _fields(model) -> tuple[list[str], list[str], list[tuple[int, object, list]], int]:
    """Columns, attribute names, converters per column (as the ORM's compiler finds them) and pk index."""
    fields = model._meta.concrete_fields
    converters = []
    for i, field in enumerate(fields):
        column = field.get_col(model._meta.db_table)
        found = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
        if found:
            converters.append((i, column, found))
    return [f.column for f in fields], [f.attname for f in fields], converters, fields.index(model._meta.pk)


def quote(name: str) -> str:
    """A table or column name as an SQL identifier."""
    return f'"{name}"'


def columns(model, alias: str) -> str:
    """The select list of every concrete column of `model` from table alias `alias`."""
    return ", ".join(f"{alias}.{quote(name)}" for name in _fields(model)[0])


def table(model) -> str:
    return quote(model._meta.db_table)


def build(model, values):
    """One instance from values in `columns(model)` order; None for an outer join that found nothing."""
    _, attnames, converters, pk = _fields(model)
    values = list(values)
    if values[pk] is None:
        return None
    for i, column, functions in converters:
        for convert in functions:
            values[i] = convert(values[i], column, connection)
    return model.from_db(connection.alias, attnames, values)


def split(row, *models) -> list:
    """Instances of `models` from one row that selected `columns(m, ...)` of each, in that order."""
    found, start = [], 0
    for model in models:
        width = len(_fields(model)[0])
        found.append(build(model, row[start : start + width]))
        start += width
    return found


def fetch(sql: str, params, *models) -> list[list]:
    with connection.cursor() as cursor:
        cursor.execute(sql, adapt_all(params))
        return [split(row, *models) for row in cursor.fetchall()]
