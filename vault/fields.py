"""Model fields whose values are sealed at rest with their run's data key (vault/sealing.py).

A column of such a field holds `bytea` (a BLOB on SQLite): the sealed value, or NULL when the
value is empty. Reading opens it (the sealed value names its run; the key comes from this
process's cache or the key store), so the ORM and `values()` give plain values as before. The
engine's row reads (`core.sql.build`) keep the value as stored (Unopened) and open it when the
attribute is first read: a step opens only the content it uses, not the run's input and
metadata at each of its two locks, and a row whose content fails its seal can still be read for
its state (an operator cancels such a run). Opened from its row, a value another run sealed is
refused as well; the ORM's loads, which open in from_db_value without the row, leave that to
`manage.py verify_history`. A value whose run's key was destroyed (its content erased) reads as empty;
one that does not open (altered in the database, or moved from another run or column) raises
SealedValueAltered, which `manage.py verify_history` names without raising.

Writing: `save()`, `create()`, `bulk_create()` and `core.sql.insert` seal through `pre_save`,
with the run the row belongs to. A write without an instance (`QuerySet.update`,
`core.sql.update`) must pass `seal(...)`'s result: a plain value other than an empty one is
refused with TypeError, so no writer can put content in the clear by mistake, and a lookup on
the content (`result__has_key`, `observation__contains`) is refused the same way, since the
database cannot read it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from django.db import models
from django.db.models.query_utils import DeferredAttribute

from core import chain
from core.errors import DomainError
from vault import sealing


class Sealed(bytes):
    """A column value sealed already: written as it is."""


class Unopened(Sealed):
    """A stored value read by `core.sql.build` and not opened yet: opened on the attribute's first
    read, and written back as it is if never read."""


_MISSING = object()


class _OpenedOnRead(DeferredAttribute):
    """A sealed field's attribute: a value read Unopened is opened on first access and kept
    opened. A data descriptor (it has __set__), so it is asked although the value sits in the
    instance's __dict__."""

    field: SealedField

    def __get__(self, instance, cls=None):
        if instance is None:
            return self
        value = instance.__dict__.get(self.field.attname, _MISSING)  # read on every access: no super() first
        if value is _MISSING:
            value = super().__get__(instance, cls)  # deferred: loaded from the database
        if type(value) is Unopened:
            # The row is at hand: a value another run sealed (copied over this one's) is refused
            # too. Only a direct attribute is followed, so opening never sends a query.
            path = self.field.run_attr
            run_id = None if "." in path else getattr(instance, path)
            value = instance.__dict__[self.field.attname] = self.field.open(value, run_id=run_id)
        return value

    def __set__(self, instance, value):
        instance.__dict__[self.field.attname] = value


class SealedValueAltered(DomainError):
    """A sealed column value does not open with its run's key: changed in the database, or copied
    from another run or column (500: the platform cannot show what was there)."""

    def __init__(self, purpose: str):
        super().__init__(
            f"{purpose}: its stored value fails its seal (altered)", code="content_altered", status=500
        )


class SealedField(models.Field):
    """A value sealed with the data key of the run its row belongs to: mixed into a JSON or text
    field, so forms, the admin and the API's serializers treat it as that field.

    `run`: the path to its run's id from a row ("run_id" for a step, "pk" for a run,
    "approval.run_id" for a vote); `tenant`: the path to the tenant's id ("run.tenant_id"),
    followed only when the run has no key yet.
    """

    descriptor_class = _OpenedOnRead

    def __init__(self, *args, run: str = "run_id", tenant: str = "run.tenant_id", **kwargs):
        self.run_attr, self.tenant_path = run, tenant
        kwargs.setdefault("null", True)
        super().__init__(*args, **kwargs)

    def deconstruct(self):
        name, path, args, kwargs = super().deconstruct()
        kwargs.pop("null", None)
        if self.run_attr != "run_id":
            kwargs["run"] = self.run_attr
        if self.tenant_path != "run.tenant_id":
            kwargs["tenant"] = self.tenant_path
        return name, path, args, kwargs

    def get_internal_type(self) -> str:
        return "BinaryField"  # the column's type: bytea, a BLOB on SQLite

    def get_lookup(self, lookup_name):
        if lookup_name != "isnull":  # the database cannot read the value: only whether there is one
            raise TypeError(f"{self.purpose} is sealed at rest: the database cannot search it")
        return super().get_lookup(lookup_name)

    def get_transform(self, name):
        raise TypeError(f"{self.purpose} is sealed at rest: the database cannot read into it")

    @property
    def purpose(self) -> str:
        """What the value is, bound into its seal: it opens in this column only."""
        return f"{self.model._meta.label_lower}.{self.name}"

    # What a subclass says about its values.
    def empty(self) -> Any:
        raise NotImplementedError

    def is_empty(self, value) -> bool:
        raise NotImplementedError

    def plaintext(self, value) -> bytes:
        raise NotImplementedError

    def from_plaintext(self, plain: bytes) -> Any:
        raise NotImplementedError

    def seal(self, run_id, value, *, tenant, plaintext: bytes | None = None) -> Sealed | None:
        """The value as this column stores it for run `run_id` (None when empty). `tenant`: the
        tenant's id, or a callable giving it. `plaintext`: the value's bytes, when the caller has
        made them already (the engine digests a step's content before it writes it)."""
        if self.is_empty(value):
            return None
        plain = plaintext if plaintext is not None else self.plaintext(value)
        return Sealed(sealing.seal_value(run_id, plain, self.purpose, tenant=tenant))

    def open(self, raw, *, run_id=None) -> Any:
        """A stored value, opened (empty once erased); SealedValueAltered when it does not open, or
        with `run_id`, when another run sealed it."""
        try:
            return self.open_strictly(raw, run_id=run_id)
        except sealing.KeyDestroyed:
            return self.empty()

    def open_strictly(self, raw, *, run_id=None) -> Any:
        """As `open`, but KeyDestroyed when the key is gone; with `run_id`, a value another run
        sealed is SealedValueAltered too (it would open with that run's key): the verifier's."""
        if raw is None:
            return self.empty()
        try:
            if run_id is not None and str(sealing.run_of(bytes(raw))) != str(run_id):
                raise SealedValueAltered(self.purpose)
            return self.from_plaintext(sealing.open_value(bytes(raw), self.purpose))
        except (InvalidTag, ValueError):
            raise SealedValueAltered(self.purpose) from None

    def from_db_value(self, value, expression, connection):
        return self.open(value)

    def read_unopened(self, value, expression, connection):
        """core.sql.build's converter for this column, instead of from_db_value."""
        return Unopened(value) if value is not None else self.empty()

    def pre_save(self, model_instance, add):
        stored = model_instance.__dict__.get(self.attname)
        if type(stored) is Unopened:  # never read since it was loaded: unchanged
            return stored
        value = getattr(model_instance, self.attname)
        if isinstance(value, Sealed) or self.is_empty(value):
            return value
        run_id = _follow(model_instance, self.run_attr)()
        return self.seal(run_id, value, tenant=_follow(model_instance, self.tenant_path))

    def get_prep_value(self, value):
        if isinstance(value, Sealed):
            return bytes(value)
        if self.is_empty(value):
            return None
        raise TypeError(
            f"{self.purpose} is sealed at rest: write vault.fields' seal(...) of the value, not the value"
            " (and the database cannot search it)"
        )

    def get_db_prep_value(self, value, connection, prepared=False):
        if not prepared:
            value = self.get_prep_value(value)
        return connection.Database.Binary(value) if value is not None else None

    def get_db_prep_save(self, value, connection):
        return self.get_db_prep_value(value, connection)


class SealedJSONField(SealedField, models.JSONField):
    """A JSON value, sealed as its canonical text (core.chain.canonical: the text its digest is of).
    `empty`: what an empty value reads as (None; `dict` for an approval's arguments, `{}` once
    erased), stored as NULL."""

    def __init__(self, *args, empty=None, **kwargs):
        self.empty_factory = empty
        super().__init__(*args, **kwargs)

    def deconstruct(self):
        name, path, args, kwargs = super().deconstruct()
        if self.empty_factory is not None:
            kwargs["empty"] = self.empty_factory
        return name, path, args, kwargs

    def empty(self):
        return self.empty_factory() if self.empty_factory is not None else None

    def is_empty(self, value) -> bool:
        return value is None or (self.empty_factory is not None and value == self.empty_factory())

    def plaintext(self, value) -> bytes:
        return chain.canonical(value)

    def from_plaintext(self, plain: bytes):
        return json.loads(plain)


class SealedTextField(SealedField, models.TextField):
    """A text, sealed as UTF-8; empty is ""."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("blank", True)
        super().__init__(*args, **kwargs)

    def empty(self):
        return ""

    def is_empty(self, value) -> bool:
        return value is None or value == ""

    def plaintext(self, value) -> bytes:
        return str(value).encode("utf-8")

    def from_plaintext(self, plain: bytes) -> str:
        return plain.decode("utf-8")


def _follow(obj, path: str) -> Callable[[], Any]:
    """A callable reading `path` ("run.tenant_id") from `obj`: asked only for a run's first key."""

    def read():
        value = obj
        for part in path.split("."):
            value = getattr(value, part)
        return value

    return read


def seal(model, name: str, run_id, value, *, tenant, plaintext: bytes | None = None) -> Sealed | None:
    """`value` as `model`'s sealed column `name` stores it for run `run_id`: what a write without
    an instance passes (QuerySet.update, core.sql.update)."""
    field = model._meta.get_field(name)
    if not isinstance(field, SealedField):
        raise TypeError(f"{model.__name__}.{name} is not sealed")
    return field.seal(run_id, value, tenant=tenant, plaintext=plaintext)


def sealed_names(model) -> tuple[str, ...]:
    return tuple(f.name for f in model._meta.concrete_fields if isinstance(f, SealedField))
