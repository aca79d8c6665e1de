"""The benchmarks' throwaway databases, made on the server DATABASE_URL names and dropped afterwards.

A database the platform has sealed content in has a second one beside it: the content-key store
(vault/store.py: `<name>_keys` on the same server, unless CONTENT_KEYS_DATABASE_URL names
another). Dropping a benchmark's database drops that one too; before this module, the benchmarks
that ran the engine left one `_keys` database behind per run.
"""

from __future__ import annotations

from urllib.parse import urlparse, urlunparse

import psycopg
from psycopg import sql

from bench import pgstats


def with_database(url: str, name: str) -> str:
    """`url` with its database replaced by `name`."""
    return urlunparse(urlparse(url)._replace(path=f"/{name}"))


def admin(url: str, statement: sql.Composable | str) -> None:
    """A statement (CREATE or DROP DATABASE) on a connection to `url`'s server's maintenance database."""
    with psycopg.connect(pgstats.admin_url(url), autocommit=True) as conn:
        conn.execute(statement)


def create(url: str) -> None:
    """The database `url` names, new: what an earlier run left under that name is dropped first."""
    drop(url)
    admin(url, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(pgstats.database_name(url))))


def drop(url: str) -> None:
    """Drop the database `url` names and its content-key store, ending their sessions."""
    name = pgstats.database_name(url)
    for database in (name, f"{name}_keys"):
        admin(url, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
