"""Run search at a million runs: the queries of `GET /v1/runs` (runs/front/search.py) on a generated table.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test .venv/bin/python bench/run_search.py

DATABASE_URL only says where PostgreSQL is: the benchmark creates its own database
`bench_search_<pid>`, migrates it (so the indexes are the migration's own), fills it and drops it
at the end; no other database is touched.

The table: BENCH_RUNS (1,000,000) runs, 90% in the searched tenant and 10% in another, spread over
a year, 50 creators and 5 agents, statuses in realistic proportions (85% succeeded, 5% failed, ...),
each with an input like {"transaction_id": "TXN-<n>", "customer_email": ..., "amount": ...,
"customer_name": "Meera Sharma", "request": "Customer reports duplicate charge at shop12 for order
<n>"} and metadata {"ticket": "DSP-<n>"}, written as the platform writes them: sealed with each run's
own key (kept in the bench database's key store) and indexed by keyed lexemes (runs/front/search.py),
in Python; the other columns by INSERT … SELECT over unnest, 10,000 runs a statement; then ANALYZEd.

Each query is what the API runs for one page: the page of 50 newest (LIMIT 51: one more says
whether there is a next page) and its count (`count` in the answer: COUNT(*) of at most 1,001
matches, and past 1,000 the planner's estimate, core/api.py's bounded_count), timed apart and together, both through the same selector and search as the view, as a
supervisor who reads every run of the tenant. Each runs BENCH_REPEATS (200) times with a fresh
random value; the figures are p50, p95 and p99 in milliseconds.

Options (environment): BENCH_RUNS (1000000), BENCH_REPEATS (200), BENCH_REUSE (a database left by
an earlier run), BENCH_KEEP=1 (leave this run's database for BENCH_REUSE); BENCH_EXPLAIN=1 prints each
query's plan (EXPLAIN ANALYZE of the page) first.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import dbs

RUNS = int(os.environ.get("BENCH_RUNS", 1_000_000))
REPEATS = int(os.environ.get("BENCH_REPEATS", 200))
USERS, AGENTS, CHUNK = 50, 5, 10_000
# BENCH_REUSE=<database>: time the queries on a database an earlier run filled and left (one stopped
# before its end: SIGTERM skips the drop); nothing is written, nothing dropped.
REUSE = os.environ.get("BENCH_REUSE", "")
KEEP = bool(os.environ.get("BENCH_KEEP"))  # leave the filled database for BENCH_REUSE
TAG = REUSE or f"bench_search_{os.getpid()}"

BASE_URL = os.environ.get("DATABASE_URL", "")
if not BASE_URL.startswith("postgres"):
    sys.exit("DATABASE_URL must point at PostgreSQL (only its server is used; a throwaway database is made)")


BENCH_URL = dbs.with_database(BASE_URL, TAG)
os.environ["DATABASE_URL"] = BENCH_URL
os.environ.pop("CONTENT_KEYS_DATABASE_URL", None)  # the key store beside it: bench/dbs.py drops both
os.environ["CELERY_BROKER_URL"] = "memory://"
os.environ.pop("DB_POOL_MAX", None)
os.environ.setdefault("LOG_LEVEL", "ERROR")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

# Each run's column values as SQL over i (its number in generate_series); the other non-null
# columns get their model default.
STATUS_SQL = (
    "CASE WHEN mod(i, 100) < 85 THEN 'succeeded' WHEN mod(i, 100) < 90 THEN 'failed' WHEN mod(i, 100) < 93"
    " THEN 'cancelled' WHEN mod(i, 100) < 95 THEN 'stopped' WHEN mod(i, 100) < 97 THEN 'waiting_approval'"
    " WHEN mod(i, 100) < 98"
    " THEN 'needs_attention' ELSE 'running' END"
)


# The words of a run's request and its customer's name: 40 first names and 50 surnames (a surname
# in ~18,000 of the tenant's runs, a full name in ~450), 20 problems (~45,000 runs each: each has
# a word of its own, the first), 1,000 shops (~900 runs each), and "customer" in every run.
FIRST_NAMES = [
    "Meera",
    "Ravi",
    "Asha",
    "Arjun",
    "Priya",
    "Rahul",
    "Anita",
    "Vikram",
    "Sunita",
    "Karan",
    "Neha",
    "Amit",
    "Pooja",
    "Sanjay",
    "Kavita",
    "Rohan",
    "Divya",
    "Manoj",
    "Lakshmi",
    "Suresh",
    "Deepa",
    "Anil",
    "Geeta",
    "Vijay",
    "Rekha",
    "Ajay",
    "Shalini",
    "Nikhil",
    "Swati",
    "Rajesh",
    "Nisha",
    "Harish",
    "Uma",
    "Gopal",
    "Radha",
    "Mohan",
    "Seema",
    "Prakash",
    "Jaya",
    "Dinesh",
]
SURNAMES = [
    "Sharma",
    "Verma",
    "Gupta",
    "Mehta",
    "Iyer",
    "Nair",
    "Reddy",
    "Rao",
    "Patel",
    "Shah",
    "Joshi",
    "Kulkarni",
    "Desai",
    "Menon",
    "Pillai",
    "Bose",
    "Sen",
    "Das",
    "Ghosh",
    "Banerjee",
    "Chatterjee",
    "Mukherjee",
    "Singh",
    "Kaur",
    "Gill",
    "Sandhu",
    "Malhotra",
    "Kapoor",
    "Khanna",
    "Chopra",
    "Agarwal",
    "Jain",
    "Bansal",
    "Mittal",
    "Goel",
    "Saxena",
    "Srivastava",
    "Tiwari",
    "Pandey",
    "Mishra",
    "Dubey",
    "Yadav",
    "Chauhan",
    "Rathore",
    "Thakur",
    "Naidu",
    "Hegde",
    "Shetty",
    "Kamath",
    "Bhat",
]
PROBLEMS = [
    "duplicate charge",
    "unrecognised transaction",
    "refund never arrived",
    "chargeback request",
    "overdraft fee dispute",
    "stolen card",
    "failed transfer",
    "wrong amount debited",
    "subscription cancellation",
    "loan statement error",
    "blocked account",
    "missing cashback",
    "fraudulent login",
    "delayed settlement",
    "currency conversion complaint",
    "standing instruction failure",
    "cheque bounce",
    "interest miscalculation",
    "kyc verification stuck",
    "emi deferment",
]
SHOPS = 1000


def contents(i: int) -> tuple[dict, dict]:
    """Run i's input and metadata."""
    first, surname = FIRST_NAMES[i % len(FIRST_NAMES)], SURNAMES[(i // 7) % len(SURNAMES)]
    problem = PROBLEMS[(i // 3) % len(PROBLEMS)]
    return {
        "transaction_id": f"TXN-{i}",
        "customer_email": f"c{i % 50000}@example.com",
        "amount": (i * 37) % 100000,
        "customer_name": f"{first} {surname}",
        "request": f"Customer reports {problem} at shop{(i * 13) % SHOPS} for order {i}",
    }, {"ticket": f"DSP-{i}"}


def fill(tenants, users, agents) -> float:
    """Every run as the platform writes it: input and metadata sealed with the run's own key (kept
    in the key store, made in bulk: vault.sealing.make_keys), its search words keyed with its
    tenant's word key (vault/keyed_search.py), made in Python; the other columns in SQL over i."""
    import uuid

    from django.db import connection

    from core import chain
    from runs.models import Run
    from vault import keyed_search, sealing

    columns = {
        "id": "v.id",
        # 90% in the searched tenant, 10% in the other.
        "tenant_id": f"CASE WHEN mod(i, 10) = 0 THEN {tenants[1].pk} ELSE {tenants[0].pk} END",
        "created_by_id": "CASE WHEN mod(i, 10) = 0 THEN %(other_user)s ELSE (%(users)s::bigint[])[1 + mod(i / 10, %(n_users)s)] END",
        "agent_id": "CASE WHEN mod(i, 10) = 0 THEN %(other_agent)s ELSE (%(agents)s::bigint[])[1 + mod(i / 7, %(n_agents)s)] END",
        "version_id": "CASE WHEN mod(i, 10) = 0 THEN %(other_version)s ELSE (%(versions)s::bigint[])[1 + mod(i / 7, %(n_agents)s)] END",
        "input": "v.input",
        "metadata": "v.metadata",
        "search_words": "v.search_words::tsvector",
        "status": STATUS_SQL,
        # Newest is i = 1; one run every 30 s or so over a year.
        "created_at": "now() - make_interval(secs => i * 31.5)",
    }
    params = {
        "users": [u.pk for u in users[:-1]],
        "n_users": len(users) - 1,
        "other_user": users[-1].pk,
        "agents": [a.pk for a, _ in agents[:-1]],
        "versions": [v.pk for _, v in agents[:-1]],
        "n_agents": len(agents) - 1,
        "other_agent": agents[-1][0].pk,
        "other_version": agents[-1][1].pk,
    }
    names, values = [], []
    for field in Run._meta.concrete_fields:
        if field.column in columns:
            names.append(field.column)
            values.append(columns[field.column])
        elif not field.null:
            names.append(field.column)
            key = f"default_{field.column}"
            params[key] = field.get_db_prep_save(field.get_default(), connection)
            values.append(f"%({key})s")
    sql = (
        f"INSERT INTO runs_run ({', '.join(names)}) SELECT {', '.join(values)} FROM unnest(%(i)s::bigint[], "
        "%(ids)s::uuid[], %(inputs)s::bytea[], %(metadatas)s::bytea[], %(words)s::text[]) "
        "AS v(i, id, input, metadata, search_words)"
    )
    input_purpose = Run._meta.get_field("input").purpose
    metadata_purpose = Run._meta.get_field("metadata").purpose
    started = time.monotonic()
    with connection.cursor() as cursor:
        for start in range(1, RUNS + 1, CHUNK):
            numbers = list(range(start, min(start + CHUNK, RUNS + 1)))
            ids = [uuid.uuid4() for _ in numbers]
            other = [str(run_id) for i, run_id in zip(numbers, ids) if i % 10 == 0]
            searched = [str(run_id) for i, run_id in zip(numbers, ids) if i % 10 != 0]
            keys = sealing.make_keys(tenants[1].pk, other) | sealing.make_keys(tenants[0].pk, searched)
            inputs, metadatas, words = [], [], []
            for i, run_id in zip(numbers, ids):
                body, metadata = contents(i)
                key = keys[str(run_id)]
                inputs.append(sealing.seal_with(key, run_id, chain.canonical(body), input_purpose))
                metadatas.append(sealing.seal_with(key, run_id, chain.canonical(metadata), metadata_purpose))
                words.append(keyed_search.document(tenants[1 if i % 10 == 0 else 0].pk, body, metadata))
            cursor.execute(
                sql,
                {
                    **params,
                    "i": numbers,
                    "ids": ids,
                    "inputs": inputs,
                    "metadatas": metadatas,
                    "words": words,
                },
            )
        cursor.execute("ANALYZE runs_run")
    return time.monotonic() - started


def setup():
    from guardian.shortcuts import assign_perm

    from agents.services import create_version
    from llm.models import ModelEndpoint
    from tenants.models import Tenant, User

    tenants = [Tenant.objects.create(slug=slug, name=slug) for slug in ("searched", "other")]
    users = [User.objects.create_user(username=f"user{n}", tenant=tenants[0]) for n in range(USERS)]
    users.append(User.objects.create_user(username="other-user", tenant=tenants[1]))
    agents = []
    for tenant, names in ((tenants[0], [f"agent-{n}" for n in range(AGENTS)]), (tenants[1], ["other-agent"])):
        ModelEndpoint.objects.create(tenant=tenant, name="scripted", kind="scripted")
        for name in names:
            version, _ = create_version(
                tenant=tenant, agent=name, spec={"model": "scripted", "instructions": "bench"}
            )
            agents.append((version.agent, version))
    supervisor = User.objects.create_user(username="supervisor", tenant=tenants[0], is_staff=True)
    assign_perm("tenants.view_runs", supervisor, tenants[0])
    return tenants, users, agents, supervisor


def page_and_count(supervisor, **filters) -> tuple[float, float]:
    """What the API view runs for one page: (ms for the page, ms for the page and its count)."""
    from core.api import bounded_count, planner_settings
    from runs import selectors
    from runs.front import search

    q = filters.pop("q", "")
    after = filters.pop("created_after", None)
    started = time.perf_counter()
    runs = search.search(
        search.created_between(selectors.runs_for(supervisor, **filters), after=after),
        q,
        tenants=[supervisor.tenant_id],
        ranked=True,
    )
    with planner_settings(getattr(runs, "page_settings", None)):  # as BoundedCountPagination
        rows = list(runs[:51])  # one row past the page, for `next`
    page = time.perf_counter()
    bounded_count(runs, at_least=len(rows))
    return (page - started) * 1000, (time.perf_counter() - started) * 1000


def main() -> None:
    if not REUSE:
        dbs.create(BENCH_URL)
    try:
        import django
        from django.core.management import call_command
        from django.utils import timezone

        django.setup()
        if REUSE:
            from tenants.models import User

            supervisor, seconds = User.objects.get(username="supervisor"), 0.0
        else:
            call_command("migrate", verbosity=0)
            tenants, users, agents, supervisor = setup()
            seconds = fill(tenants, users, agents)
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_size_pretty(pg_relation_size('run_search_words'))")
            words_size = cursor.fetchone()[0]
            cursor.execute("SELECT pg_size_pretty(pg_relation_size('runs_run'))")
            table_size = cursor.fetchone()[0]
            cursor.execute("SELECT id FROM runs_run TABLESAMPLE SYSTEM (1) LIMIT 2000")
            sample_ids = [str(row[0]) for row in cursor.fetchall()]
        print(
            f"run search benchmark on {os.cpu_count()} CPUs, database {TAG}: {RUNS:,} runs written in "
            f"{seconds:.0f} s (table {table_size}, words and values index {words_size}); "
            f"{REPEATS} repeats per query, "
            f"load average before: {os.getloadavg()[0]:.1f}\n"
        )
        rng = random.Random(7)
        day_ago = timezone.now() - timezone.timedelta(days=1)
        cases = {
            "newest page, no filter": lambda: {},
            "q=TXN-<n> (input value, 1 hit)": lambda: {"q": f"TXN-{rng.randrange(1, RUNS) | 1}"},
            "q=DSP-<n> (metadata value)": lambda: {"q": f"DSP-{rng.randrange(1, RUNS) | 1}"},
            "q=<customer email> (~18 hits)": lambda: {"q": f"c{rng.randrange(1, 50000)}@example.com"},
            "q=<surname> (~18,000 hits)": lambda: {"q": rng.choice(SURNAMES)},
            "q=<first name> <surname> (~450)": lambda: {
                "q": f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"
            },
            "q=shop<n> (request word, ~900)": lambda: {"q": f"shop{rng.randrange(SHOPS)}"},
            "q=<problem> (2 words, ~45,000)": lambda: {"q": rng.choice(PROBLEMS)},
            "q=<surname> <problem word>": lambda: {
                "q": f"{rng.choice(SURNAMES)} {rng.choice(PROBLEMS).split()[0]}"
            },
            "q=customer (every run)": lambda: {"q": "customer"},
            "q=<8-hex id prefix>": lambda: {"q": rng.choice(sample_ids)[:8]},
            "q=<full id>": lambda: {"q": rng.choice(sample_ids)},
            "created_by=<user>": lambda: {"created_by": f"user{rng.randrange(USERS)}"},
            "created_by=<user with no runs>": lambda: {"created_by": "supervisor"},
            "agent=<agent>&status=failed": lambda: {
                "agent": f"agent-{rng.randrange(AGENTS - 1)}",
                "status": "failed",
            },
            "status=needs_attention": lambda: {"status": "needs_attention"},
            "created_after=<24 h ago>": lambda: {"created_after": day_ago},
            "q=TXN-<n>&status=succeeded": lambda: {
                "q": f"TXN-{rng.randrange(1, RUNS) | 1}",
                "status": "succeeded",
            },
        }
        if os.environ.get("BENCH_EXPLAIN"):
            from runs import selectors
            from runs.front import search

            for label, make in cases.items():
                filters = make()
                q, after = filters.pop("q", ""), filters.pop("created_after", None)
                runs = search.search(
                    search.created_between(selectors.runs_for(supervisor, **filters), after=after),
                    q,
                    tenants=[supervisor.tenant_id],
                    ranked=True,
                )
                print(label, runs[:50].explain(analyze=True), sep="\n", end="\n\n")
        print(f"{'':<36} {'page of 50':^26} {'page + count':^26}")
        print(f"{'query':<36}" + f" {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}" * 2)
        for label, make in cases.items():
            for _ in range(5):  # warm the caches the way a running server has them
                page_and_count(supervisor, **make())
            timed = [page_and_count(supervisor, **make()) for _ in range(REPEATS)]
            cells = []
            for times in (sorted(t[0] for t in timed), sorted(t[1] for t in timed)):
                p = statistics.quantiles(times, n=100) if len(times) > 1 else [times[0]] * 99
                cells.append(f" {statistics.median(times):>8.2f} {p[94]:>8.2f} {p[98]:>8.2f}")
            print(f"{label:<36}{''.join(cells)}")
    finally:
        from django.db import connections

        connections.close_all()
        if KEEP:
            print(
                f"database kept: BENCH_REUSE={TAG} times it again; drop it and its key store with DROP DATABASE {TAG}, {TAG}_keys"
            )
        elif not REUSE:
            dbs.drop(BENCH_URL)


if __name__ == "__main__":
    main()
