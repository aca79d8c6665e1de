"""Two regions on one machine: this pytest process is Frankfurt (its database is the test
database on the session's throwaway cluster); Mumbai, the tenants' home, is a second throwaway
PostgreSQL cluster, its own Redis and its own API process (uvicorn, as scripts/serve.sh runs
it), reached only through a TCP proxy the test owns (tests/regions/link.py).

The home's database starts as a copy of the test database's freshly migrated schema (pg_dump
into the second cluster: the same schema `migrate` makes, in two seconds instead of a minute);
from then on the two databases share nothing. Each test uses its own tenant slug, so the
home's rows of one test never meet another's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.regions.link import Link
from tests.servers import ROOT, database_url
from tests.services import ThrowawayPostgres, ThrowawayRedis, free_port

HOME, AWAY = "mumbai", "frankfurt"
KEY = "test-key-mumbai-frankfurt-7f3a9c"


class Home:
    def __init__(self, pg: ThrowawayPostgres, redis: ThrowawayRedis):
        self.pg, self.redis = pg, redis
        self.port = free_port()
        self.env = {
            **os.environ,
            "DATABASE_URL": pg.url("home"),
            "CELERY_BROKER_URL": redis.url(),
            "CELERY_QUEUE": "runs-home",
            "REGION": HOME,
            "REGION_KEYS": f"{AWAY}={KEY}",
            "REGION_PEERS": "",
            "PYTHONUNBUFFERED": "1",
        }
        self.log = open(pg.folder / "api.log", "wb")  # the process owns it (SIM115 allowed in tests)
        self.api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "agentplatform.asgi:application", "--host", "127.0.0.1",
             "--port", str(self.port), "--no-access-log"],
            cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 180  # a loaded machine imports Django slowly
        while not self._healthy():
            if self.api.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"home API did not start: {(pg.folder / 'api.log').read_text()[-3000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def popen(self, command: str, args: dict) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.regions.home_side", command, json.dumps(args)],
            cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    @staticmethod
    def result(proc: subprocess.Popen, timeout: float = 300) -> dict:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"home_side failed: {err[-4000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def run(self, command: str, args: dict, timeout: float = 300) -> dict:
        return self.result(self.popen(command, args), timeout)

    def stop(self) -> None:
        self.api.terminate()
        try:
            self.api.wait(15)
        except subprocess.TimeoutExpired:
            self.api.kill()
        self.log.close()


def _copy_schema(target: ThrowawayPostgres) -> None:
    binaries = ThrowawayPostgres.binaries()
    dump = subprocess.run(
        [str(binaries / "pg_dump"), "--no-owner", "--no-privileges", "-d", database_url().replace("postgres://", "postgresql://", 1)],
        capture_output=True, check=True,
    )  # fmt: skip
    subprocess.run(
        [str(binaries / "psql"), "-q", "-v", "ON_ERROR_STOP=1", "-d", target.url("home").replace("postgres://", "postgresql://", 1)],
        input=dump.stdout, capture_output=True, check=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def home(django_db_setup, django_db_blocker):
    pg = ThrowawayPostgres.create()
    redis = ThrowawayRedis.create()
    server = None
    try:
        with open(pg.data / "postgresql.conf", "a") as conf:
            conf.write("wal_level = logical\n")
        pg.start()
        redis.start()
        pg.create_database("home")
        with django_db_blocker.unblock():
            _copy_schema(pg)
        server = Home(pg, redis)
        yield server
    finally:
        if server is not None:
            server.stop()
        redis.destroy()
        pg.destroy()


@pytest.fixture
def link(home, settings):
    """The link from Frankfurt (this process) to Mumbai, and this process configured as Frankfurt."""
    proxy = Link(home.port)
    settings.REGION_NAME = AWAY
    settings.REGION_PEERS = {HOME: proxy.url}
    settings.REGION_KEYS = {HOME: KEY}
    settings.REGION_TIMEOUT_SECONDS = 1.0
    yield proxy
    proxy.close()
