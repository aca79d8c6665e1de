"""What sealing content costs (vault/; docs/history.md, "Sealed content").

    DATABASE_URL=postgres://root@127.0.0.1:5432/test .venv/bin/python bench/sealing.py [--repeat 2000]

Per artifact size: sealing and opening with the run's key cached (AES-256-GCM, the process's CPU
time), and the first sealing of a run in a process (a key made: two statements at the key store,
the tenant's key derived and the data key wrapped) and a first opening (one key store read and
an unwrap). The key store is the one DATABASE_URL implies (its database name + `_keys`), made if
missing (and dropped again); the keys this writes are destroyed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--sizes", default="1000,100000,1000000")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")
    import django

    django.setup()
    from vault import sealing, store

    print(f"load average {os.getloadavg()}; key store {store.location()}")
    existed = _exists(store)
    tenant = "bench"
    made = []
    firsts, opens = [], []
    for _ in range(200):  # first sealing and first opening of a run, wall time
        run_id = uuid.uuid4()
        made.append(run_id)
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
    run_id = made[0]
    for size in (int(s) for s in args.sizes.split(",")):
        body = os.urandom(size)
        repeat = max(20, args.repeat * 1000 // max(size, 1000))
        started = time.process_time()
        for _ in range(repeat):
            sealed = sealing.seal(run_id, tenant, body, "artifact:bench")
        seal_us = (time.process_time() - started) / repeat * 1e6
        started = time.process_time()
        for _ in range(repeat):
            sealing.unseal(run_id, tenant, sealed, "artifact:bench")
        open_us = (time.process_time() - started) / repeat * 1e6
        print(f"{size:>9} bytes, key cached: seal {seal_us:8.1f} us, open {open_us:8.1f} us (CPU, x{repeat})")
    print(f"destroyed {sealing.shred(made)} keys")
    if not existed:
        store.drop_database()


def _exists(store) -> bool:
    import psycopg

    admin, name = store._server(store.location())
    with psycopg.connect(admin, autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is not None


if __name__ == "__main__":
    main()
