"""A restore of a dump verifies (issue 37, proof): the chain, its SQL function and the signed
checkpoints travel in pg_dump; verify_history, run against the restored database in a process of
its own, finds nothing, and still names an edit made there."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from django.conf import settings
from django.db import connection

from history.checkpoints import take_checkpoint
from tests.history.conftest import finished_run
from vault import store

pytestmark = pytest.mark.django_db(transaction=True)


def _pg(*args: str, db: str, stdin: bytes | None = None) -> bytes:
    conf = connection.settings_dict
    base = ["-h", conf["HOST"] or "127.0.0.1", "-p", str(conf["PORT"]), "-U", conf["USER"]]
    env = {"PATH": "/usr/bin:/bin", "PGPASSWORD": conf.get("PASSWORD") or ""}
    return subprocess.run(
        [*args[:1], *base, *args[1:], db], input=stdin, capture_output=True, check=True, env=env
    ).stdout


def _verify(db: str) -> subprocess.CompletedProcess:
    conf = connection.settings_dict
    url = f"postgres://{conf['USER']}@{conf['HOST'] or '127.0.0.1'}:{conf['PORT']}/{db}"
    # Restored beside the original, with the original's key store (docs/history.md, "Backups"):
    # the restored content opens with the keys that sealed it.
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "CONTENT_KEYS_DATABASE_URL": store.location(),
    }
    return subprocess.run(
        [sys.executable, "manage.py", "verify_history"],
        capture_output=True,
        text=True,
        env=env,
        cwd=settings.BASE_DIR,
    )


def test_a_restored_dump_verifies_and_an_edit_there_is_named(asha, echo_agent):
    runs = [finished_run(asha, word=w) for w in ("one", "two", "three")]
    take_checkpoint()
    finished_run(asha, word="four")
    dump = _pg("pg_dump", "-Fc", db=connection.settings_dict["NAME"])
    restored = f"restored_{uuid.uuid4().hex[:8]}"
    _pg("createdb", db=restored)
    try:
        _pg("pg_restore", "--no-owner", "-d", db=restored, stdin=dump)

        ok = _verify(restored)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "OK: 4 runs," in ok.stdout and "checkpoint 1" in ok.stdout

        _pg(
            "psql",
            "-c",
            f"UPDATE runs_runevent SET message = 'x' WHERE run_id = '{runs[1].pk}' AND seq = 2",
            db=restored,
        )
        found = _verify(restored)
        assert found.returncode == 1
        assert f"FAIL run {runs[1].pk} event 2: content edited" in found.stdout, found.stdout
    finally:
        _pg("dropdb", db=restored)
