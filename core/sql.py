"""Model instances from raw SQL rows, and the few generic writes, for the statements made on every
step (the engine's, in runs/statements.py, and the tool gateway's checks and offer).

Building a query with the ORM costs about a millisecond of CPU on the benchmark machine, and
a `select_related` read several (docs/performance.md). The engine's per-step reads are written
once in SQL here and give back the same model instances the ORM would: every concrete column,
the same conversions (the backend's and the field's), related rows attached as if select_related.

The SQL is portable between PostgreSQL and SQLite (the demo): parameters go through `adapt`,
lists through `in_list`, row locks through `for_update`.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connection, connections, models
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models import signals
from django.db.models.base import ModelState

_UUID = models.UUIDField()


def _db():
    """The default connection itself. `django.db.connection` is a proxy that looks the connection
    up in thread-local storage on every attribute, and the fields' conversions read several of
    them per value: a step converted about 80 values through it (bench/profile_step.py)."""
    return connections[DEFAULT_DB_ALIAS]


def adapt(value, db=None):
    """A parameter as the driver wants it: SQLite stores UUIDs as hex and datetimes as UTC text."""
    if isinstance(value, uuid.UUID):
        return _UUID.get_db_prep_value(value, db or _db())
    if isinstance(value, dt.datetime):
        return (db or _db()).ops.adapt_datetimefield_value(value)
    return value


def adapt_all(params):
    db = _db()
    if isinstance(params, dict):
        return {name: adapt(value, db) for name, value in params.items()}
    return [adapt(value, db) for value in params]


def execute(cursor, sql: str, params) -> None:
    cursor.execute(sql, adapt_all(params))


def in_list(name: str, values, params: dict) -> str:
    """`IN (%(name_0)s, ...)` for `values`, added to the named `params` (false when empty)."""
    names = [f"{name}_{i}" for i in range(len(values))]
    params.update(zip(names, values))
    return "IN (" + (", ".join(f"%({n})s" for n in names) or "NULL") + ")"


def for_update(alias: str) -> str:
    """Lock the rows of table alias `alias`; SQLite has no row locks (its writers queue anyway)."""
    return f"FOR UPDATE OF {alias}" if connection.features.has_select_for_update_of else ""


@functools.cache
def _fields(model) -> tuple[list[str], list[str], list[tuple[int, object, list]], int]:
    """Columns, attribute names, converters per column (as the ORM's compiler finds them) and pk
    index. A field marked `read_in_rows = False` is left out of the rows read here (the run's
    search words: only the search reads them); its attribute loads on access, as a deferred one.
    A field with `read_unopened` (a sealed one: vault/fields.py) has it as its converter instead
    of its from_db_value: the value is opened when its attribute is first read."""
    fields = [f for f in model._meta.concrete_fields if getattr(f, "read_in_rows", True)]
    converters = []
    for i, field in enumerate(fields):
        column = field.get_col(model._meta.db_table)
        own = getattr(field, "read_unopened", None)
        found = connection.ops.get_db_converters(column) + (
            [own] if own is not None else column.get_db_converters(connection)
        )
        if found:
            converters.append((i, column, found))
    return [f.column for f in fields], [f.attname for f in fields], converters, fields.index(model._meta.pk)


def convert(field, value, db=None):
    """A column's value read in raw SQL, as the ORM gives it (the conversions `build` applies)."""
    column = field.get_col(field.model._meta.db_table)
    db = db or _db()
    for function in db.ops.get_db_converters(column) + column.get_db_converters(db):
        value = function(value, column, db)
    return value


def quote(name: str) -> str:
    """A table or column name as an SQL identifier."""
    return f'"{name}"'


def column(model, field: str) -> str:
    """The quoted column of `model`'s field `field`."""
    return quote(model._meta.get_field(field).column)


def columns(model, alias: str) -> str:
    """The select list of every concrete column of `model` from table alias `alias`."""
    return ", ".join(f"{alias}.{quote(name)}" for name in _fields(model)[0])


def table(model) -> str:
    return quote(model._meta.db_table)


def build(model, values, db=None):
    """One instance from values in `columns(model)` order; None for an outer join that found nothing."""
    _, attnames, converters, pk = _fields(model)
    values = list(values)
    if values[pk] is None:
        return None
    db = db or _db()
    for i, column, functions in converters:
        for convert in functions:
            values[i] = convert(values[i], column, db)
    if _plain(model):
        # What Model.from_db ends with, without Model.__init__'s per-field setattr: every concrete
        # field is a plain attribute of the instance (the engine builds ~30 rows a step).
        obj = model.__new__(model)
        obj.__dict__.update(zip(attnames, values))
        obj._state = ModelState()
        obj._state.adding = False
        obj._state.db = db.alias
        return obj
    return model.from_db(db.alias, attnames, values)


def new(model, **values):
    """A new (unsaved) instance, as `model(**values)` makes it but without Model.__init__'s
    descriptor work per field (the engine makes several events and steps a step). `values` by
    field name or attname; a related instance is kept as the relation's cached object."""
    if not _plain(model):
        return model(**values)
    obj = model.__new__(model)
    state = obj._state = ModelState()
    attrs = obj.__dict__
    for field in model._meta.concrete_fields:
        if field.name in values:
            value = values[field.name]
            if field.is_relation:
                state.fields_cache[field.name] = value
                value = value.pk if value is not None else None
        elif field.attname in values:
            value = values[field.attname]
        else:
            value = field.get_default()
        attrs[field.attname] = value
    return obj


@functools.cache
def _plain(model) -> bool:
    """True when building an instance needs nothing but its field values: no init signals are
    listened to and from_db is Django's own."""
    return (
        not signals.pre_init.has_listeners(model)
        and not signals.post_init.has_listeners(model)
        and getattr(model.from_db, "__func__", None) is models.Model.__dict__["from_db"].__func__
    )


def split(row, *models) -> list:
    """Instances of `models` from one row that selected `columns(m, ...)` of each, in that order."""
    found, start, db = [], 0, _db()
    for model in models:
        width = len(_fields(model)[0])
        found.append(build(model, row[start : start + width], db))
        start += width
    return found


class _PreparedCursor(psycopg.Cursor):
    """psycopg's server-side-binding cursor, every statement prepared (Django's wrapper passes no
    `prepare` of its own)."""

    def execute(self, query, params=None, *, prepare=None, binary=None):
        return super().execute(query, params, prepare=True if prepare is None else prepare, binary=binary)


class _PreparedDebugCursor(CursorDebugWrapper):
    """DEBUG's query log for a prepared cursor. psycopg binds a prepared statement's parameters on
    the server and keeps no text of it once run, so Django's `last_executed_query` reads None (the
    log then held `None` for every engine statement, and bench/engine.py's count broke on it): the
    statement is logged as sent, its parameters beside it in the debug logger's record."""

    def execute(self, sql, params=None):
        with self.debug_sql(sql, params):
            return CursorWrapper.execute(self, sql, params)


def prepared_cursor():
    """A cursor whose statements PostgreSQL parses and plans once per connection.

    Django binds parameters on the client, so every call of a statement is parsed and planned
    again: for the engine's longest reads (the run's claim row, the step window, the tools) that
    was more of PostgreSQL's time than running them (bench/profile_step.py --plans). These go
    through psycopg's server-side-binding cursor, prepared (as the budget ledger's statements
    are: budgets/services._execute), wrapped as Django wraps its own cursors (errors mapped,
    execute wrappers and DEBUG's query log applied); a pooler in front of PostgreSQL must
    support prepared statements. SQLite: Django's cursor.
    """
    db = _db()
    if db.vendor != "postgresql":
        return db.cursor()
    db.ensure_connection()
    db.validate_thread_sharing()
    raw: Any = _PreparedCursor(db.connection)  # django-stubs types the argument as Django's own wrapper
    return _PreparedDebugCursor(raw, db) if db.queries_logged else db.make_cursor(raw)


def fetch(sql: str, params, *models) -> list[list]:
    with prepared_cursor() as cursor:
        cursor.execute(sql, adapt_all(params))
        return [split(row, *models) for row in cursor.fetchall()]


def fetch_with_rest(sql: str, params, *models) -> list[tuple[list, tuple]]:
    """As fetch, with each row's columns after the models' own: (instances, the rest)."""
    width = sum(len(_fields(model)[0]) for model in models)
    with prepared_cursor() as cursor:
        cursor.execute(sql, adapt_all(params))
        return [(split(row, *models), tuple(row[width:])) for row in cursor.fetchall()]


def insert(objs: list) -> None:
    """INSERT the (new) instances of one model in one statement and set their primary keys.

    Values go through the fields as with save(): JSON is adapted, auto_now_add is filled where
    the instance has no value yet (an event keeps the time it was recorded, not the flush time).
    Prepared, as the engine's reads are: a model step's INSERT binds some thirty parameters,
    which a client-side cursor quotes into the text and PostgreSQL then parses and plans anew.
    """
    if not objs:
        return
    meta = type(objs[0])._meta
    text, params = insert_sql(objs)
    db = _db()
    with prepared_cursor() as cursor:
        cursor.execute(f"{text} RETURNING {quote(meta.pk.column)}", params)
        for obj, (pk,) in zip(objs, cursor.fetchall()):
            setattr(obj, meta.pk.attname, pk)
            obj._state.adding = False
            obj._state.db = db.alias


def insert_sql(objs: list) -> tuple[str, list]:
    """The INSERT of `insert` (without its RETURNING), and its parameters, for a caller that sends
    it inside another statement."""
    model: Any = type(objs[0])
    text, fields = _insert_shape(model, getattr(objs[0], model._meta.pk.attname) is None, len(objs))
    params, db = [], _db()
    for obj in objs:
        params += [f.get_db_prep_save(_value(f, obj), db) for f in fields]
    return text, params


@functools.cache
def _insert_shape(model, pk_generated: bool, rows: int) -> tuple[str, list]:
    """The text of an INSERT of `rows` rows and the fields it writes, once per shape."""
    fields = [f for f in model._meta.concrete_fields if not (f.primary_key and pk_generated)]
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    columns = ", ".join(quote(f.column) for f in fields)
    return f"INSERT INTO {table(model)} ({columns}) VALUES {', '.join([row] * rows)}", fields


def _value(field, obj):
    kept = getattr(field, "auto_now_add", False) and getattr(obj, field.attname) is not None
    return getattr(obj, field.attname) if kept else field.pre_save(obj, True)


def take(model, pk, field: str, count: int) -> int:
    """Add `count` to a counter column of one row and return its new value.

    The UPDATE locks the row until the transaction ends, so concurrent takers get disjoint
    ranges (`new - count + 1` .. `new`) without reading first.
    """
    with connection.cursor() as cursor:
        execute(
            cursor,
            f"UPDATE {table(model)} SET {column(model, field)} = {column(model, field)} + %s "
            f"WHERE {quote(model._meta.pk.column)} = %s RETURNING {column(model, field)}",
            [count, pk],
        )
        return cursor.fetchone()[0]


def update(model, pk, *, where: dict | None = None, **values) -> int:
    """UPDATE one row by primary key (and `where` equalities, for conditional updates): rows changed."""
    text, params = update_sql(model, pk, where=where, **values)
    with connection.cursor() as cursor:
        cursor.execute(text, params)
        return cursor.rowcount


def update_sql(
    model, pk, *, where: dict | None = None, into: str | None = None, **values
) -> tuple[str, list]:
    """The UPDATE of `update`, and its parameters, for a caller that sends it inside another
    statement. `into`: the quoted table to update, where not the model's (a partition of it)."""
    where = where or {}
    text, fields, key, guards = _update_shape(model, tuple(values), tuple(where), into)
    db = _db()
    params = [
        field.get_db_prep_save(value.pk if hasattr(value, "_meta") else value, db)
        for field, value in zip(fields, values.values())
    ]
    params.append(key.get_db_prep_value(pk, db))
    params += [field.get_db_prep_value(value, db) for field, value in zip(guards, where.values())]
    return text, params


@functools.cache
def _update_shape(
    model, names: tuple[str, ...], where: tuple[str, ...], into: str | None = None
) -> tuple[str, list, Any, list]:
    """The text of an UPDATE of fields `names` guarded by equalities on `where`, once per shape,
    with the fields whose conversions its parameters go through."""
    meta = model._meta
    fields = [meta.get_field(name) for name in names]
    guards = [meta.get_field(name) for name in where]
    sets = ", ".join(f"{quote(f.column)} = %s" for f in fields)
    conditions = " AND ".join([f"{quote(meta.pk.column)} = %s"] + [f"{quote(f.column)} = %s" for f in guards])
    return f"UPDATE {into or table(model)} SET {sets} WHERE {conditions}", fields, meta.pk, guards
