"""What sealing content costs, and the data subject search over sealed artifacts (vault/;
docs/history.md, "Sealed content").

    DATABASE_URL=postgres://root@127.0.0.1:5432/test .venv/bin/python bench/sealing.py \
        [--repeat 2000] [--artifacts 5000] [--artifact-bytes 10000]

DATABASE_URL only says where PostgreSQL is: the benchmark makes its own database (and its key
store beside it) and drops both. Prints:

1. per size, sealing and opening with the run's key cached (AES-256-GCM, the process's CPU time);
   a run's first sealing (its key made: two statements at the key store, a derivation, a wrap)
   and a first opening in a process (one key store read, an unwrap), wall time;
2. with `--artifacts N`: N CSV artifacts of `--artifact-bytes` stored (sealed, their words hashed
   with the tenant's key), 50 a run, one of them carrying the identifier; then the search for it
   (history.subjects.find) through the artifacts' keyed words and reading every artifact
   (`scan=True`), best of three each;
3. with `--keys N`: the shredding pass (history/shredding.py) over N keys of runs that do not
   exist, young (paged, none destroyed) and then old (all destroyed).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import dbs

TAG = f"bench_sealing_{os.getpid()}"
BASE_URL = os.environ.get("DATABASE_URL", "")
if not BASE_URL.startswith("postgres"):
    sys.exit("DATABASE_URL must point at PostgreSQL (only its server is used; a throwaway database is made)")
IDENTIFIER = "CUST-4471-XK"


BENCH_URL = dbs.with_database(BASE_URL, TAG)
os.environ["DATABASE_URL"] = BENCH_URL
os.environ["CELERY_BROKER_URL"] = "memory://"
os.environ.pop("CONTENT_KEYS_DATABASE_URL", None)  # the key store beside it: bench/dbs.py drops both
os.environ.setdefault("LOG_LEVEL", "ERROR")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")


def costs(sealing, repeat: int, sizes: list[int]) -> None:
    tenant = "bench"
    firsts, opens = [], []
    for _ in range(200):
        run_id = uuid.uuid4()
        started = time.perf_counter()
        sealed = sealing.seal(run_id, tenant, b"x" * 1000, "artifact:bench")
        firsts.append(time.perf_counter() - started)
        sealing.forget_cached()
        started = time.perf_counter()
        sealing.unseal(run_id, tenant, sealed, "artifact:bench")
        opens.append(time.perf_counter() - started)
    firsts.sort(), opens.sort()
    print(
        f"a run's first sealing (key made): p50 {firsts[100] * 1000:.2f} ms, p99 {firsts[198] * 1000:.2f} ms; "
        f"first opening in a process: p50 {opens[100] * 1000:.2f} ms, p99 {opens[198] * 1000:.2f} ms"
    )
    for size in sizes:
        body = os.urandom(size)
        times = max(20, repeat * 1000 // max(size, 1000))
        started = time.process_time()
        for _ in range(times):
            sealed = sealing.seal(run_id, tenant, body, "artifact:bench")
        seal_us = (time.process_time() - started) / times * 1e6
        started = time.process_time()
        for _ in range(times):
            sealing.unseal(run_id, tenant, sealed, "artifact:bench")
        open_us = (time.process_time() - started) / times * 1e6
        print(f"{size:>9} bytes, key cached: seal {seal_us:8.1f} us, open {open_us:8.1f} us (CPU, x{times})")
        # A column's value (a step's result, an approval's arguments: vault/fields.py): sealed with
        # the key the process holds, opened from the value alone.
        started = time.process_time()
        for _ in range(times):
            sealed = sealing.seal_value(run_id, body, "runs.step.result", tenant=tenant)
        seal_us = (time.process_time() - started) / times * 1e6
        started = time.process_time()
        for _ in range(times):
            sealing.open_value(sealed, "runs.step.result")
        open_us = (time.process_time() - started) / times * 1e6
        print(
            f"{size:>9} bytes, a column's value: seal {seal_us:8.1f} us, open {open_us:8.1f} us (CPU, x{times})"
        )


def search(count: int, size: int) -> None:
    from artifacts import services as artifacts
    from history import subjects
    from runs.services import start_run
    from tests import factories

    tenant = factories.make_tenant("bench", max_active_runs=100_000, max_starts_per_minute=1_000_000)
    user = factories.make_user(tenant, "asha")
    factories.make_agent(tenant, turns=[{"text": "done"}])
    words = [f"{w}{i}" for w in ("acct", "txn", "ref", "amount", "merchant") for i in range(2000)]
    rows = max(1, size // 40)
    started = time.perf_counter()
    run = None
    for i in range(count):
        if i % 50 == 0:
            run, _ = start_run(user=user, agent="agent", input={})
        lines = [",".join(random.choices(words, k=4)) for _ in range(rows)]
        if i == count // 2:
            lines[rows // 2] = f"{IDENTIFIER},DE89-3704,dispute"
        body = ("\n".join(lines) + "\n").encode()
        artifacts.store(run=run, name=f"export-{i}.csv", media_type="text/csv", content=body, source="upload")
    took = time.perf_counter() - started
    print(f"stored {count} artifacts of ~{size} bytes in {took:.1f} s ({took / count * 1000:.2f} ms each)")
    for label, scan in (("through the keyed words", False), ("reading every artifact", True)):
        best = None
        for _ in range(3):
            started = time.perf_counter()
            found = subjects.find(tenant.pk, IDENTIFIER, scan=scan)
            elapsed = time.perf_counter() - started
            best = elapsed if best is None else min(best, elapsed)
        assert sum(map(len, found.artifacts.values())) == 1, found.artifacts
        print(f"search {label}: {best:.3f} s (the whole find: runs through their index, artifacts)")


def pass_cost(count: int) -> None:
    """The shredding pass over a key store of `count` keys of runs that do not exist: young ones
    (within the grace: paged and checked, none destroyed), then the same made old (all destroyed)."""
    from history.shredding import shred_forgotten
    from vault import store

    store.get("warm")  # the store's database and table made
    store._run(
        "INSERT INTO content_keys (run_id, tenant, wrapped) "
        "SELECT gen_random_uuid()::text, 'bench', '\\x00'::bytea FROM generate_series(1, %s)",
        (count,),
        fetch=False,
    )
    for label in ("young keys, none destroyed", "old keys, all destroyed"):
        started = time.perf_counter()
        destroyed = shred_forgotten()
        print(
            f"shredding pass over {count} keys ({label}): {time.perf_counter() - started:.2f} s, {destroyed} destroyed"
        )
        store._run("UPDATE content_keys SET created_at = now() - interval '2 hours'", (), fetch=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--artifacts", type=int, default=0)
    parser.add_argument("--artifact-bytes", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=0, help="time the shredding pass over this many keys")
    args = parser.parse_args()
    dbs.create(BENCH_URL)
    try:
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        from vault import sealing, store

        print(
            f"sealing benchmark, database {TAG}, key store {store.location()}, load average {os.getloadavg()}"
        )
        costs(sealing, args.repeat, [int(s) for s in args.sizes.split(",")])
        if args.artifacts:
            search(args.artifacts, args.artifact_bytes)
        if args.keys:
            pass_cost(args.keys)
        print(f"load average after {os.getloadavg()}")
    finally:
        from django.db import connections

        connections.close_all()
        dbs.drop(BENCH_URL)  # and its key store beside it


if __name__ == "__main__":
    main()
