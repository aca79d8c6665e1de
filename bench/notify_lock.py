"""What waking the run streams costs a step transaction: pgbench tps of an engine-like transaction.

    python bench/notify_lock.py [--clients 16] [--seconds 10]

Starts a throwaway PostgreSQL cluster of its own (tests/services.py) with fsync and synchronous
commit ON (the notify lock is held through the commit's WAL flush, so a cluster without flushes
hides it), creates a run table, an events table and the streamed-runs table of
runs/migrations/0011_streamed_runs.py, and runs one pgbench script (lock the run, move its event
counter and insert two events in one statement, update a step, commit: what each of the engine's
two commits per step does) against each way of waking the streams:

- `none`: no trigger at all (the floor; also the database side of waking through Redis after commit)
- `notify-always`: migration 0008's trigger, a NOTIFY for every INSERT statement
- `notify-streamed`: migration 0009's trigger, a NOTIFY only for a run in the streamed-runs table,
  here with nobody streaming (the usual case: a stream is opened for a run someone watches)
- `notify-streamed-all`: the same trigger with every run streamed (the worst case: it is
  notify-always plus one index probe)

and prints tps for each. The Redis alternative (PUBLISH after commit) costs the worker one round
trip per commit; `--redis` times that against a throwaway Redis too.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.services import ThrowawayPostgres, ThrowawayRedis

RUNS = 1000

SCHEMA = f"""
CREATE TABLE run (id bigint PRIMARY KEY, event_seq integer NOT NULL DEFAULT 0, steps integer NOT NULL DEFAULT 0);
CREATE TABLE step (id bigint PRIMARY KEY, run_id bigint NOT NULL, status text NOT NULL, record jsonb);
CREATE TABLE event (id bigserial PRIMARY KEY, run_id bigint NOT NULL, seq integer NOT NULL, kind text NOT NULL,
                    data jsonb NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE INDEX ON event (run_id, seq);
CREATE TABLE runs_streamedrun (run_id bigint NOT NULL, process varchar(32) NOT NULL,
                               lease_until timestamptz NOT NULL, PRIMARY KEY (run_id, process));
INSERT INTO run (id) SELECT g FROM generate_series(1, {RUNS}) g;
INSERT INTO step (id, run_id, status) SELECT g, g, 'running' FROM generate_series(1, {RUNS}) g;
"""

TRIGGERS = {
    "none": "",
    "notify-always": """
        CREATE FUNCTION wake() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('run_events', run_id::text || ':' || max(seq)) FROM new_rows GROUP BY run_id;
            RETURN NULL;
        END $$;
    """,
    "notify-streamed": """
        CREATE FUNCTION wake() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('run_events', n.run_id::text || ':' || max(n.seq)) FROM new_rows n
                WHERE EXISTS (SELECT 1 FROM runs_streamedrun s WHERE s.run_id = n.run_id AND s.lease_until > now())
                GROUP BY n.run_id;
            RETURN NULL;
        END $$;
    """,
}
TRIGGERS["notify-streamed-all"] = TRIGGERS["notify-streamed"]

ON = """CREATE TRIGGER wake AFTER INSERT ON event REFERENCING NEW TABLE AS new_rows
        FOR EACH STATEMENT EXECUTE FUNCTION wake();"""

SCRIPT = f"""\\set r random(1, {RUNS})
BEGIN;
WITH moved AS (UPDATE run SET event_seq = event_seq + 2, steps = steps + 1 WHERE id = :r RETURNING id, event_seq)
INSERT INTO event (run_id, seq, kind, data)
SELECT id, event_seq - 1, 'step_started', '{{"seq": 1}}'::jsonb FROM moved
UNION ALL SELECT id, event_seq, 'step_recorded', '{{"seq": 1}}'::jsonb FROM moved;
UPDATE step SET status = 'done', record = '{{"text": "a reply"}}' WHERE id = :r;
COMMIT;
"""


def psql(server: ThrowawayPostgres, sql: str) -> None:
    subprocess.run(
        ["psql", "-q", "-v", "ON_ERROR_STOP=1", server.url("bench"), "-c", sql],
        check=True,
        capture_output=True,
    )


def pgbench(server: ThrowawayPostgres, script: Path, clients: int, seconds: int) -> float:
    out = subprocess.run(
        [
            "pgbench",
            "-n",
            "-c",
            str(clients),
            "-j",
            "2",
            "-T",
            str(seconds),
            "-f",
            str(script),
            server.url("bench"),
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"pgbench failed: {out.stderr}")
    return float(re.search(r"tps = ([\d.]+)", out.stdout).group(1))


def redis_publish_cost(count: int = 5000) -> float:
    """Microseconds of the publishing process's CPU per PUBLISH (a worker's cost per commit)."""
    import redis

    server = ThrowawayRedis.create()
    server.start()
    try:
        client = redis.Redis.from_url(server.url())
        client.ping()
        before = time.process_time()
        for i in range(count):
            client.publish("run_events", f"{i}:1")
        return (time.process_time() - before) / count * 1e6
    finally:
        server.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--redis", action="store_true", help="also time a PUBLISH after commit")
    args = parser.parse_args()
    server = ThrowawayPostgres.create()
    with open(server.data / "postgresql.conf", "a") as conf:
        conf.write("fsync = on\nsynchronous_commit = on\nfull_page_writes = on\n")
    server.start()
    results = {}
    try:
        server.create_database("bench")
        with tempfile.TemporaryDirectory() as folder:
            script = Path(folder) / "step.sql"
            script.write_text(SCRIPT)
            os.chmod(folder, 0o755)
            psql(server, SCHEMA)
            for name, trigger in TRIGGERS.items():
                psql(server, "DROP TRIGGER IF EXISTS wake ON event; DROP FUNCTION IF EXISTS wake();")
                psql(server, "TRUNCATE event, runs_streamedrun; CHECKPOINT;")
                if trigger:
                    psql(server, trigger + ON)
                if name == "notify-streamed-all":
                    psql(
                        server,
                        f"INSERT INTO runs_streamedrun SELECT g, 'bench', now() + interval '1 hour' "
                        f"FROM generate_series(1, {RUNS}) g;",
                    )
                results[name] = pgbench(server, script, args.clients, args.seconds)
                print(
                    f"{name:22} {results[name]:9.0f} tps ({args.clients} clients, {args.seconds} s)",
                    flush=True,
                )
    finally:
        server.destroy()
    if args.redis:
        print(f"redis PUBLISH after commit: {redis_publish_cost():.0f} us of the worker's CPU per commit")


if __name__ == "__main__":
    main()
