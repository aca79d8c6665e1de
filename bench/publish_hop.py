"""CPU of one publish of the next step: the engine's (runs.queueing) against a raw chain's.

    .venv/bin/python -m tests.services -- .venv/bin/python bench/publish_hop.py [--publishes 3000] [--rounds 5]

In this process, against the broker CELERY_BROKER_URL names (tests.services starts a throwaway
Redis): the engine's publish (`runs.queueing.resend` in a transaction: the message `enqueue`
sends after commit, without enqueue's UPDATE of the run) and a raw chain's `task.apply_async(args)`
(bench/noop_tasks.py) after the commit of the same empty transaction, interleaved, `--rounds` times; prints the best
round's CPU microseconds per publish for each (the best: the box is shared and noisy), and with
`--profile`, the engine's publish under cProfile (CPU time).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    opts = parser.parse_args()
    import django

    django.setup()
    from django.db import transaction
    from django.utils import timezone

    from bench.noop_tasks import noop_step
    from runs import queueing

    run_id, enqueued_at = str(uuid.uuid4()), timezone.now()

    def engine() -> None:
        with transaction.atomic():
            queueing.resend(run_id, enqueued_at=enqueued_at)

    def chain() -> None:
        with transaction.atomic():
            transaction.on_commit(lambda: noop_step.apply_async(("bench-hop", 1, 25)))

    best = {"engine": float("inf"), "chain": float("inf")}
    for _ in range(opts.rounds):
        for name, publish in (("engine", engine), ("chain", chain)):
            publish()  # the connection and the producer exist before the clock starts
            started = time.process_time()
            for _ in range(opts.publishes):
                publish()
            best[name] = min(best[name], (time.process_time() - started) / opts.publishes * 1e6)
    for name, us in best.items():
        print(f"{name:7} {us:6.0f} us CPU per publish (best of {opts.rounds} rounds of {opts.publishes})")
    if opts.profile:
        profile = cProfile.Profile(time.process_time)
        profile.enable()
        for _ in range(opts.publishes):
            engine()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
