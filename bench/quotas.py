"""What the shared endpoint quota adds to a model call (llm/quotas.py): time and round trips.

    .venv/bin/python -m tests.services -- .venv/bin/python bench/quotas.py [--calls 5000] [--tenants 1,20]

In this process, against the Redis that QUOTA_REDIS_URL (or CELERY_BROKER_URL) names: `quotas.admit`
as the claim calls it, for a call that goes (a quota with room) and one told to wait (a quota
that is full), with 1 and with 20 tenants sharing the account (the script reads the weights of
every tenant waiting). Prints, per case, the wall-clock microseconds per call (median, p99, mean),
the client's round trips to Redis per call (counted at the connection: every command sent), and
Redis's own CPU per call (INFO cpu before and after); a PING's round trip is the floor.
Target (issue 26): under 1 ms and one round trip per model call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")


class RoundTrips:
    """Counts the commands this process sends to Redis (a pipeline would count once)."""

    def __init__(self) -> None:
        import redis.connection

        self.count = 0
        original = redis.connection.AbstractConnection.send_packed_command

        def counted(conn, command, check_health=True):
            self.count += 1
            return original(conn, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


def redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def measure(call, calls: int, trips: RoundTrips, client) -> dict:
    call()  # the script is loaded and the connection open before the clock starts
    samples = []
    trips.count = 0
    cpu = redis_cpu(client)
    before = trips.count
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e6)
    sent = trips.count - before
    cpu = (redis_cpu(client) - cpu) / calls * 1e6
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "p99_us": samples[int(len(samples) * 0.99) - 1],
        "mean_us": statistics.fmean(samples),
        "round_trips": (sent - 1) / calls,  # less the INFO after the loop
        "redis_cpu_us": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--tenants", default="1,20", help="tenants sharing the account, comma-separated")
    opts = parser.parse_args()
    import django

    django.setup()
    from django.conf import settings

    from llm import quotas
    from llm.models import ModelEndpoint

    if not settings.QUOTA_REDIS_URL:
        sys.exit("no Redis: run under `python -m tests.services --` or set QUOTA_REDIS_URL")
    trips = RoundTrips()
    limiter = quotas._get_limiter()
    assert limiter is not None
    client = limiter.client

    rows = [("PING (the floor)", measure(client.ping, opts.calls, trips, client))]
    for tenants in (int(n) for n in opts.tenants.split(",")):
        for case, rpm in (("goes", 2_000_000_000), ("waits", 1)):
            endpoint = ModelEndpoint(
                name="bench",
                kind="openai",
                base_url=f"http://bench/{uuid.uuid4().hex}",
                model="m",
                requests_per_minute=rpm,
                tokens_per_minute=2_000_000_000,
            )
            # The other tenants have calls waiting, so each call reads their weights and tags.
            for other in range(1, tenants):
                quotas.admit(endpoint, tenant=f"t{other}", weight=other, tokens=1000, caller=f"r{other}")
            counter = iter(range(10**9))

            def call(endpoint=endpoint, counter=counter) -> None:
                quotas.admit(endpoint, tenant="t0", weight=1, tokens=1000, caller=f"run-{next(counter) % 50}")

            rows.append((f"admit, {case}, {tenants} tenant(s)", measure(call, opts.calls, trips, client)))

    print(
        f"{'case':34} {'median µs':>10} {'p99 µs':>9} {'mean µs':>9} {'round trips':>12} {'Redis CPU µs':>13}"
    )
    for name, row in rows:
        print(
            f"{name:34} {row['median_us']:10.0f} {row['p99_us']:9.0f} {row['mean_us']:9.0f} "
            f"{row['round_trips']:12.2f} {row['redis_cpu_us']:13.1f}"
        )


if __name__ == "__main__":
    main()
