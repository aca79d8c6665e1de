"""A step away from home against a step at home (issue 36's goal: at most 5% more worker and
PostgreSQL CPU while the slice has room; no call between regions on the step path).

The same runs (model call, tool call, model call, on the scripted model and the builtin echo
tool) are driven in this process by runs.engine.advance, as a Celery worker drives them, in
alternating rounds: at home (REGION unset: the deployment of one region) and away from home
(REGION=frankfurt, the tenant's home mumbai, a fresh home heartbeat, the day's limit standing
for the slices granted). Per engine task it measures this process's CPU (the worker's),
PostgreSQL's backends' CPU (bench/pgcpu.py) and the statements sent (bench/sqlcount.py).

    python -m tests.services -- sh -c '.venv/bin/python manage.py migrate -v0 && \
        .venv/bin/python -m bench.regions_step --runs 40 --rounds 3'

Prints one line per round and side, then the medians side by side. CPU figures on a loaded
machine are noisy: note the load average (printed) next to them; the statements are exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection, transaction
    from django.utils import timezone

    from bench import sqlcount
    from bench.pgcpu import BackendCpu
    from budgets import services as budgets
    from regions.models import Heartbeat, TenantRegions
    from runs.engine import advance
    from runs.models import Run
    from runs.services import start_run
    from tests import factories

    sqlcount.install()
    tenant = factories.make_tenant("bench-regions", max_active_runs=10_000, max_starts_per_minute=100_000)
    tenant.daily_budget_micros = 10**12
    tenant.save()
    user = factories.make_user(tenant, "bench-asha")
    echo = factories.make_builtin_tools(tenant)["echo"]
    factories.grant(echo, use=[user])
    factories.make_agent(
        tenant,
        tools=[echo],
        runners=[user],
        expected_cost_micros=10_000,
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"n": 1}}]}, {"text": "done"}],
    )
    config = TenantRegions.objects.create(
        tenant=tenant, home="mumbai", allowed=["mumbai", "frankfurt"], revocation_reach_seconds=3600
    )
    with transaction.atomic():  # the day opened; away from home its limit stands for the slices
        budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    url = settings.DATABASES["default"]
    pg_url = f"postgresql://{url['USER']}@{url['HOST']}:{url['PORT']}/{url['NAME']}"

    def side(away: bool) -> dict:
        settings.REGION_NAME = "frankfurt" if away else ""
        TenantRegions.objects.filter(pk=config.pk).update(home="mumbai" if away else "frankfurt")
        Heartbeat.objects.update_or_create(region="mumbai", defaults={"beat_at": timezone.now()})
        runs = [start_run(user=user, agent="agent", input={"i": i})[0].pk for i in range(args.runs)]
        cpu = BackendCpu(pg_url)
        cpu.start()
        before, started = sqlcount.snapshot()["statements"], time.process_time()
        tasks = 0
        for run_id in runs:
            for _ in range(10):
                advance(run_id)
                tasks += 1
                if Run.objects.filter(pk=run_id, status="succeeded").exists():
                    break
        worker = time.process_time() - started
        statements = sqlcount.snapshot()["statements"] - before
        pg = cpu.stop()
        assert Run.objects.filter(pk__in=runs, status="succeeded").count() == len(runs)
        # The success probe after each task is the bench's, not the step's: one statement each.
        return {
            "worker_ms": worker * 1000 / tasks,
            # None: the backends' /proc entries could not be read (bench/pgcpu.py)
            "pg_ms": pg * 1000 / tasks if pg else float("nan"),
            "statements": (statements - tasks) / tasks,
        }

    side(False)  # warm: caches, the day's accounts
    results: dict[str, list[dict]] = {"home": [], "away": []}
    for n in range(args.rounds):
        for name in ("home", "away") if n % 2 == 0 else ("away", "home"):
            figures = side(name == "away")
            results[name].append(figures)
            print(
                f"round {n + 1} {name}: worker {figures['worker_ms']:.2f} ms/task, "
                f"PostgreSQL {figures['pg_ms']:.2f} ms/task, {figures['statements']:.2f} statements/task"
            )
        connection.close()
    print(f"load average {os.getloadavg()}")
    for key in ("worker_ms", "pg_ms", "statements"):
        home = statistics.median(r[key] for r in results["home"])
        away = statistics.median(r[key] for r in results["away"])
        print(f"{key}: home {home:.2f}, away {away:.2f}, away/home {away / home:.3f}")


if __name__ == "__main__":
    main()
