"""Profile the engine's step in-process: CPU per step, statements per step, and where the time goes.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test CELERY_BROKER_URL=redis://127.0.0.1:6379/15 \
        .venv/bin/python bench/profile_step.py [--runs 10] [--steps 25] [--top 40] [--sql]

The same agent loop as bench/peers.py (the fake OpenAI server, the declared HTTP tool on
bench/tool_server.py), but driven by calling `runs.engine.advance` in this process, one run after
another, its messages held back: no Celery, no threads. Prints CPU ms per step (this process
only; the fake servers run apart), statements per step (bench/sqlcount.py), and a cProfile of
advance() sorted by cumulative time. `--sql` lists the statements by their first words.

`--floor ROUNDS`: no profile; the engine's steps and the floor's (bench/peer_floor.py: the two
transactions the guarantees need and nothing else) alternate round by round in this process,
and their worker and PostgreSQL CPU per step are printed side by side, with the ratio. The
machine's drift then falls on both alike: the way to see what a change to the engine moves.
`--stream ROUNDS`: no profile; the engine's steps with the model endpoint streamed (the default)
and not, alternating round by round, and what streaming costs the worker per model step.
`--partitions ROUNDS`: no profile; the engine's steps with the history tables plain and
partitioned by month (`--months` past months beside this one), rebuilt between rounds in the same
database: what partitioning costs the step path.
`--walk`: the modules one step visits: a model step and a tool step of a warm run traced call by
call (sys.setprofile), each module change counted as a stop, with the rooms it climbs back up
(a call from a room into a room above it on scripts/imports.py's ladder), and the rooms (apps,
with the run's records apart) the modules belong to.
`--schema-sql FILE`: run FILE's SQL on the benchmark's database after its migrations, to measure a
schema change (with `--floor 2 --statements`: statement by statement) before writing its migration.
`--stagger`: cost at length, early and late steps of long runs measured in the same minutes.
With `--statements`, each side's PostgreSQL CPU is also split by statement (bench/pgstatements.py:
the backend's own CPU time around each statement and COMMIT, to the microsecond), which moves
by a few percent from run to run where the whole figure moves by 20%.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import dbs, peers, pgcpu, sqlcount
from bench import engine as engine_bench


def _caller() -> str:
    """The innermost frame of the product's own code (not the SQL helpers) that sent a statement."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if (
            name.startswith(str(ROOT))
            and "/.venv/" not in name
            and not name.endswith(("sql.py", "sqlcount.py"))
        ):
            return f"{Path(name).relative_to(ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sql", action="store_true")
    parser.add_argument(
        "--callers", action="store_true", help="with --sql: each statement by the product line that sent it"
    )
    parser.add_argument(
        "--plans",
        action="store_true",
        help="PostgreSQL's planning and execution time of each statement of a step, by EXPLAIN ANALYZE "
        "of one of its calls (in a transaction rolled back)",
    )
    parser.add_argument("--sort", default="cumulative", help="pstats order: cumulative, tottime, ...")
    parser.add_argument("--no-profile", action="store_true", help="CPU per step without the profiler's cost")
    parser.add_argument(
        "--floor",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="no profile: the engine's steps and the floor's (bench/peer_floor.py) in this process, "
        "alternating for ROUNDS rounds of --runs runs, and their CPU side by side",
    )
    parser.add_argument(
        "--stagger",
        action="store_true",
        help="cost at length: --runs runs of --steps steps, started at even spacing and advanced in turn, "
        "worker and PostgreSQL CPU per advance by its place in its run (steps 1-25 against the last 26)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="with --floor: each side's worker CPU split into its claim, its call and its record",
    )
    parser.add_argument(
        "--statements",
        action="store_true",
        help="with --floor: PostgreSQL's CPU per statement of each side (bench/pgstatements.py); "
        "the reads add about 10 us of this process's CPU per statement to both sides",
    )
    parser.add_argument("--walk", action="store_true", help="the modules a model step and a tool step visit")
    parser.add_argument(
        "--schema-sql",
        metavar="FILE",
        help="SQL run on the benchmark's database after its migrations: what a schema change (a foreign "
        "key or an index dropped, a fillfactor) would take off the step, before writing its migration",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="no profile: the engine's steps with the history tables plain and partitioned by month "
        "(history/partitions.py), rebuilt between rounds in this database, alternating for ROUNDS rounds",
    )
    parser.add_argument(
        "--months",
        type=int,
        default=24,
        help="with --partitions: how many past months' partitions the tables have beside this month's",
    )
    parser.add_argument(
        "--stream",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="no profile: the engine's steps with the model endpoint streamed and not, alternating for "
        "ROUNDS rounds, worker CPU per step and per model step side by side",
    )
    opts = parser.parse_args()
    import subprocess

    url = peers.DB_URLS["engine"]
    dbs.create(url)
    servers = []
    try:
        subprocess.run(
            [peers.PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, check=True, env=dict(os.environ)
        )
        if opts.schema_sql:
            import psycopg

            with psycopg.connect(url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
                conn.execute(Path(opts.schema_sql).read_text())
        import django

        # Pooled, unchecked connections and DEBUG off, as a worker has them (scripts/serve.sh). With
        # DEBUG on Django logs every statement, which --sql and --plans read (and pay for).
        os.environ.update(DB_POOL_MAX="4", DB_POOL_CHECK="0", DEBUG=str(opts.sql or opts.plans).lower())
        django.setup()
        from django.db import connection

        from runs.engine import advance
        from runs.models import TERMINAL, Run

        proc, port = peers.start_server(
            [
                "tests.fakes.model_servers",
                "--kind",
                "openai",
                "--latency-ms",
                "0",
                "--tool-turns",
                str((opts.steps - 1) // 2),
            ],
            "fake model server",
        )
        servers.append(proc)
        proc, tport = peers.start_server(["bench.tool_server"], "tool server")
        servers.append(proc)
        user, agents = peers.setup_engine_data(
            {peers.LONG if opts.stagger else 0: f"http://127.0.0.1:{port}/v1"}, f"http://127.0.0.1:{tport}"
        )
        if opts.stagger:
            _staggered(opts, user, agents[peers.LONG])
            return
        if opts.floor:
            _side_by_side(
                opts, user, agents[0], f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{tport}", url
            )
            return
        if opts.walk:
            _walk(advance, user, agents[0])
            return
        if opts.partitions:
            _partitioned_or_not(opts, user, agents[0], url)
            return
        if opts.stream:
            _streamed_or_not(opts, user, agents[0], url)
            return
        ids, _held, _ = engine_bench.create_runs(user, agents[0], opts.runs)
        texts: collections.Counter = collections.Counter()
        samples: dict[str, str] = {}  # --plans: one call of each statement, its parameters bound
        if opts.sql or opts.plans:
            original = connection.ops.__class__.last_executed_query

            def remember(ops, cursor, sql, params):
                text = " ".join(str(sql).split())[:90]
                texts[f"{text}  <- {_caller()}" if opts.callers else text] += 1
                if opts.plans and text.startswith(("SELECT", "WITH", "UPDATE", "INSERT")):
                    try:
                        import psycopg  # a cursor of its own: mogrify would reset this one's result

                        samples[text] = psycopg.ClientCursor(cursor.connection).mogrify(sql, params)
                    except Exception:  # a statement mogrify cannot render is left out
                        pass
                return original(ops, cursor, sql, params)

            connection.ops.__class__.last_executed_query = remember
        sqlcount.install()
        backends = pgcpu.BackendCpu(url).start()
        wal_before = _wal(connection)
        profile = cProfile.Profile(time.process_time)  # CPU, not wall time: waits cost nothing
        before = sqlcount.snapshot()
        cpu = time.process_time()
        steps = 0
        with engine_bench.HeldMessages():
            for run_id in ids:
                for _ in range(opts.steps * 2):
                    if not opts.no_profile:
                        profile.enable()
                    advance(run_id)
                    if not opts.no_profile:
                        profile.disable()
                    steps += 1
                    if Run.objects.filter(pk=run_id).values_list("status", flat=True)[0] in TERMINAL:
                        break
        cpu = time.process_time() - cpu
        pg_cpu = backends.stop()
        wal = [after - before for after, before in zip(_wal(connection), wal_before, strict=True)]
        after = sqlcount.snapshot()
        # The loop's own status read is one statement per advance: left out.
        statements = after["statements"] - before["statements"] - steps
        print(
            f"{steps} advances, {cpu * 1000 / steps:.2f} ms CPU per advance ({'without' if opts.no_profile else 'with'} the profiler), "
            f"{statements / steps:.2f} statements, {(after['checks'] - before['checks']) / steps:.2f} checks, "
            + (
                f"{pg_cpu * 1000 / steps:.2f} ms PostgreSQL CPU"
                if pg_cpu is not None
                else "PostgreSQL CPU unreadable"
            )
        )
        print(
            f"WAL per advance (the whole server's: other work on it adds to it): {wal[0] / steps:.1f} records, "
            f"{wal[1] / steps:.2f} full-page images, {wal[2] / steps:.0f} bytes"
        )
        _print_prepared(connection)
        if not opts.no_profile:
            stats = pstats.Stats(profile)
            stats.sort_stats(opts.sort).print_stats(opts.top)
            by_package: collections.Counter = collections.Counter()
            for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
                parts = Path(filename).parts
                where = (
                    parts[parts.index("site-packages") + 1]
                    if "site-packages" in parts
                    else ("/".join(parts[-2:]) if str(ROOT) in filename else "python")
                )
                by_package[where] += tottime
            total = sum(by_package.values())
            print("own CPU by package or engine file (share of the profiled time):")
            for where, seconds in by_package.most_common(25):
                print(f"{seconds * 100 / total:6.1f}% {where}")
        if opts.sql:
            for text, n in texts.most_common(60):
                print(f"{n / steps:6.2f} {text}")
        if opts.plans:
            _print_plans(samples, texts, steps)
    finally:
        for proc in servers:
            proc.terminate()
        from django.apps import apps

        if apps.ready:
            from django.db import connections

            connections.close_all()
        dbs.drop(url)


def _walk(advance, user, agent) -> None:
    """Trace whole steps of one warm run: which product modules each visits, in order."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import imports as ladder  # scripts/ is not a package: the ladder is read from its folder

    from runs.models import Step

    floor = {name: i for i, name in enumerate(ladder.LADDER)}
    skip = ("/.venv/", "/bench/", "/tests/", "/scripts/")

    def module(filename: str) -> str | None:
        if not filename.startswith(str(ROOT)) or any(part in filename for part in skip):
            return None
        rel = Path(filename).relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
        return ".".join(parts)

    def innermost(frame) -> str | None:
        while frame is not None:
            name = module(frame.f_code.co_filename)
            if name:
                return name
            frame = frame.f_back
        return None

    (run_id,), _held, _ = engine_bench.create_runs(user, agent, 1)
    with engine_bench.HeldMessages():
        for _ in range(2):  # warm: the per-process caches (conversation, secrets, specs) filled
            advance(run_id)
        for _ in range(4):
            stops: list[tuple[str, str, str]] = []  # (kind, from, to)
            current = [None]

            def profile(frame, event, arg, stops=stops, current=current):
                if event not in ("call", "return"):
                    return
                here = module(frame.f_code.co_filename)
                if here is None:
                    return
                after = here if event == "call" else innermost(frame.f_back)
                if after != current[0]:
                    if current[0] is not None and after is not None:
                        stops.append((event, current[0], after))
                    current[0] = after

            sys.setprofile(profile)
            try:
                advance(run_id)
            finally:
                sys.setprofile(None)
            # The step this advance called: the one it finished last (a model step proposes tool
            # steps after itself, so the newest step is not it).
            step = (
                Step.objects.filter(run_id=run_id).exclude(finished_at=None).order_by("-finished_at").first()
            )
            kind = f"{step.kind} step" if step is not None else "no step finished"
            visited = sorted({to for _, _, to in stops} | {frm for _, frm, _ in stops})
            climbs = [
                (frm, to)
                for event, frm, to in stops
                if event == "call" and floor[ladder.room(to)] > floor[ladder.room(frm)]
            ]
            calls = sum(1 for event, _, _ in stops if event == "call")
            print(
                f"advance ({kind}): {len(visited)} modules, {len(stops)} stops "
                f"({calls} calls, {len(stops) - calls} returns), {len(climbs)} climbs back up the ladder"
            )
            print("   modules: " + ", ".join(visited))
            rooms = collections.Counter(ladder.room(name) for name in visited)
            print(
                f"   rooms: {len(rooms)} ("
                + ", ".join(f"{room} {n}" for room, n in sorted(rooms.items()))
                + ")"
            )
            visits = collections.Counter(to for _, _, to in stops[:50])
            print(
                "   visits in the first 50 stops: " + ", ".join(f"{m} {n}" for m, n in visits.most_common(8))
            )
            for frm, to in sorted(set(climbs)):
                print(f"   climb: {frm} -> {to}")


def _staggered(opts, user, agent) -> None:
    """--stagger: does a step late in a long run cost more than an early one?

    Measured one after the other, the first and the last steps of a run fall minutes apart, and
    this machine's speed drifts by more than the difference sought (bench/peers.py's engine-long
    gave 1.33x and 1.03x in two runs ten minutes apart, LangGraph 1.68x and 1.23x beside it). Here
    a new run starts every 2 x steps/runs turns and each turn advances every run once, so that once
    the first run has ended and until the last one starts, runs at every place of their length
    are advanced in the same minutes; only the advances of that window are counted.
    """
    from bench import pgstatements
    from runs.engine import advance
    from runs.models import TERMINAL

    # Runs enough to span two run lengths: half of them are under way at any turn of the window.
    spacing = max(2 * opts.steps // opts.runs, 1)
    window = (opts.steps + 2, spacing * (opts.runs - 1))  # turns: every place has a run in it
    if window[0] >= window[1]:
        raise SystemExit(
            f"--stagger: {opts.runs} runs of {opts.steps} steps leave no turn with every place in use"
        )
    worker: collections.Counter = collections.Counter()
    postgres: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    by_statement: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    costs = pgstatements.Costs().install()
    try:
        ids, _held, _ = engine_bench.create_runs(user, agent, opts.runs)
        with engine_bench.HeldMessages():
            active: list[list] = []  # [run id, advances made]
            turn = started = 0
            while started < len(ids) or active:
                if started < len(ids) and turn % spacing == 0:
                    active.append([ids[started], 0])
                    started += 1
                for entry in list(active):
                    pg_before, cpu = collections.Counter(costs.ns), time.process_time()
                    report = advance(entry[0])
                    if window[0] <= turn < window[1]:
                        worker[entry[1]] += time.process_time() - cpu
                        used = costs.ns - pg_before
                        postgres[entry[1]] += used.total()
                        by_statement[entry[1]].update(used)
                        count[entry[1]] += 1
                    entry[1] += 1
                    if report.get("run_status") in TERMINAL or "step" not in report:
                        active.remove(entry)
                turn += 1
    finally:
        costs.uninstall()
    last = max(count)

    def per_advance(places: range) -> tuple[float, float, int]:
        n = sum(count[p] for p in places)
        return (
            sum(worker[p] for p in places) * 1000 / n,
            sum(postgres[p] for p in places) / 1e6 / n,
            n,
        )

    print(
        f"{opts.runs} runs x {opts.steps} steps, a new run every {spacing} turns; counted turns "
        f"{window[0]}-{window[1]}, load {os.getloadavg()[0]:.2f}"
    )
    early = per_advance(range(0, 25))
    for name, places in (
        ("steps 1-25", range(0, 25)),
        ("steps 76-100", range(75, 100)),
        (f"the last 26 ({last - 24}-{last + 1})", range(last - 25, last + 1)),
    ):
        cpu, pg, n = per_advance(places)
        print(
            f"  {name:22} worker {cpu:6.2f} ms  PostgreSQL {pg:5.2f} ms per advance  "
            f"({cpu / early[0]:.2f}x, {pg / early[1]:.2f}x of steps 1-25; {n} advances)"
        )

    def statements(places: range) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for place in places:
            total.update(by_statement[place])
        n = sum(count[p] for p in places)
        return collections.Counter({what: ns / n / 1e3 for what, ns in total.items()})

    first, final = statements(range(0, 25)), statements(range(last - 25, last + 1))
    grown = sorted(final, key=lambda what: final[what] - first.get(what, 0.0), reverse=True)[:6]
    print("  the statements that grew most, us per advance: steps 1-25, the last 26")
    for what in grown:
        print(f"    {first.get(what, 0.0):7.1f} {final[what]:7.1f}  {what}")


def _engine_steps(user, agent, opts) -> int:
    """`--runs` new runs advanced in this process until each ends: how many steps they took."""
    from runs.engine import advance
    from runs.models import TERMINAL

    ids, _held, _ = engine_bench.create_runs(user, agent, opts.runs)
    steps = 0
    with engine_bench.HeldMessages():
        for run_id in ids:
            for _ in range(opts.steps * 2):
                report = advance(run_id)
                steps += 1
                if report.get("run_status") in TERMINAL or "step" not in report:
                    break
    return steps


def _measured(label: str, drive, url: str, total: list, costs=None) -> None:
    """One side's round: this process's and PostgreSQL's CPU over `drive()`'s steps, added to
    `total` (worker seconds, PostgreSQL seconds, steps) and printed; `costs`: by statement too."""
    backends = pgcpu.BackendCpu(url).start()
    if costs is not None:
        costs.install()
    cpu = time.process_time()
    steps = drive()
    cpu = time.process_time() - cpu
    if costs is not None:
        costs.uninstall()
    pg_cpu = backends.stop() or 0.0
    total[0], total[1], total[2] = total[0] + cpu, total[1] + pg_cpu, total[2] + steps
    print(
        f"{label} {steps:5} steps  worker {cpu * 1000 / steps:6.2f} ms/step  PostgreSQL {pg_cpu * 1000 / steps:5.2f} ms/step"
    )


def _side_by_side(opts, user, agent, model_url: str, tool_url: str, url: str) -> None:
    """--floor: the engine's step and the floor's, the same agent loop over the same servers and
    database, driven from this process one after the other, round by round.

    Machine speed here drifts by up to 2x within an hour (docs/performance.md), more than most
    changes move a step; measured minutes apart, two figures compare the machine. Interleaved,
    the drift falls on both alike, and the ratio engine/floor is what a change moves. Unlike
    bench/peers.py there is no Celery and no concurrency: only the step itself is measured.
    """
    from django.db import connection

    from bench import peer_agent, peer_floor, pgstatements

    def engine() -> int:
        return _engine_steps(user, agent, opts)

    def floor() -> int:
        with connection.cursor() as cursor:
            peer_floor.create_runs(cursor, opts.runs)
        steps = 0
        for run in range(opts.runs):
            messages = peer_agent.first_messages(run)
            while not peer_agent.is_done(messages):
                key = f"profile-{run}-{len(messages)}"
                if (
                    peer_floor.step(
                        client, run, model_url, tool_url, messages, opts.steps, key, lambda done: None
                    )
                    is None
                ):
                    raise RuntimeError(f"floor run {run}: not claimed")
                steps += 1
        return steps

    client = peer_agent.make_client()
    engine(), floor()  # not counted: the first round pays for imports, caches and prepared statements
    totals: dict[str, list[float]] = {"engine": [0.0, 0.0, 0], "floor": [0.0, 0.0, 0]}
    costs = {"engine": pgstatements.Costs(), "floor": pgstatements.Costs()}
    phases = _Phases() if opts.phases else None
    print(
        f"{opts.runs} runs x {opts.steps} steps per round, engine then floor, load {os.getloadavg()[0]:.2f}"
    )
    for round_no in range(1, opts.floor + 1):
        for name, drive in (("engine", engine), ("floor", floor)):
            if phases is not None:
                phases.side = name
            _measured(
                f"round {round_no} {name:6}",
                drive,
                url,
                totals[name],
                costs[name] if opts.statements else None,
            )
    (ecpu, epg, esteps), (fcpu, fpg, fsteps) = totals["engine"], totals["floor"]
    print(
        f"all rounds: engine {ecpu * 1000 / esteps:.2f} / {epg * 1000 / esteps:.2f} ms, "
        f"floor {fcpu * 1000 / fsteps:.2f} / {fpg * 1000 / fsteps:.2f} ms (worker / PostgreSQL per step); "
        f"engine/floor: worker {ecpu / esteps / (fcpu / fsteps):.2f}x, PostgreSQL {epg / esteps / (fpg / fsteps):.2f}x"
    )
    if phases is not None:
        phases.report({"engine": esteps, "floor": fsteps}, {"engine": ecpu, "floor": fcpu})
    if opts.statements:
        for name, steps in (("engine", esteps), ("floor", fsteps)):
            costs[name].report(int(steps), title=f"{name}: ")


def _partitioned_or_not(opts, user, agent, url: str) -> None:
    """--partitions: the engine's step with steps, events, reservations and ledger entries in plain
    tables and in tables partitioned by month (with --months past months beside this one and the
    default partition), the tables rebuilt in this database between rounds, so both sides step
    over the same rows and the machine's drift falls on both alike."""
    import datetime as dt

    from django.db import connection, transaction

    from history import partitions

    def engine() -> int:
        return _engine_steps(user, agent, opts)

    now = dt.datetime.now(dt.UTC)
    first = dt.datetime(now.year - (opts.months // 12), now.month, 1, tzinfo=dt.UTC)
    while (now.year - first.year) * 12 + now.month - first.month > opts.months:
        first = dt.datetime(first.year + first.month // 12, first.month % 12 + 1, 1, tzinfo=dt.UTC)

    def layout(partitioned: bool) -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            for table, key in partitions.TABLES.items():
                if partitioned:
                    partitions.partition_table(cursor, table, key, months_of=first)
                    partitions.ensure_months_of(cursor, table, first, ahead=opts.months + 2)
                else:
                    partitions.unpartition_table(cursor, table, key)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")

    from bench import pgstatements

    engine()  # not counted: the first round pays for imports, caches and prepared statements
    totals: dict[str, list[float]] = {"plain": [0.0, 0.0, 0], "partitioned": [0.0, 0.0, 0]}
    costs = {"plain": pgstatements.Costs(), "partitioned": pgstatements.Costs()}
    print(
        f"{opts.runs} runs x {opts.steps} steps per round, plain then partitioned ({opts.months} past months), "
        f"load {os.getloadavg()[0]:.2f}"
    )
    for round_no in range(1, opts.partitions + 1):
        for name in ("plain", "partitioned"):
            layout(name == "partitioned")
            engine()  # not counted: the rebuilt tables' catalog entries are read into every backend anew
            _measured(
                f"round {round_no} {name:11}",
                engine,
                url,
                totals[name],
                costs[name] if opts.statements else None,
            )
    (pcpu, ppg, psteps), (qcpu, qpg, qsteps) = totals["plain"], totals["partitioned"]
    print(
        f"all rounds: plain {pcpu * 1000 / psteps:.2f} / {ppg * 1000 / psteps:.2f} ms, "
        f"partitioned {qcpu * 1000 / qsteps:.2f} / {qpg * 1000 / qsteps:.2f} ms (worker / PostgreSQL per step); "
        f"partitioned/plain: worker {qcpu / qsteps / (pcpu / psteps):.3f}x, PostgreSQL {qpg / qsteps / (ppg / psteps):.3f}x, "
        f"both {(qcpu + qpg) / qsteps / ((pcpu + ppg) / psteps):.3f}x"
    )
    if opts.statements:
        for name, steps in (("plain", psteps), ("partitioned", qsteps)):
            costs[name].report(int(steps), title=f"{name}: ")


def _streamed_or_not(opts, user, agent, url: str) -> None:
    """--stream: the same runs with the model endpoint's answers read as a stream (the default)
    and as one JSON body, round by round in this process; the difference per model step is what
    streaming costs the worker (the fake server answers a tool call or "done" in a few events)."""
    from llm.models import ModelEndpoint
    from runs.engine import advance
    from runs.models import TERMINAL, Step

    def engine(stream: bool) -> tuple[int, int]:
        ModelEndpoint.objects.filter(kind="openai").update(
            stream=stream
        )  # the bench database: its one endpoint
        ids, _held, _ = engine_bench.create_runs(user, agent, opts.runs)
        steps = 0
        with engine_bench.HeldMessages():
            for run_id in ids:
                for _ in range(opts.steps * 2):
                    report = advance(run_id)
                    steps += 1
                    if report.get("run_status") in TERMINAL or "step" not in report:
                        break
        return steps, Step.objects.filter(run_id__in=ids, kind="model").count()

    engine(True), engine(False)  # not counted: imports, caches, prepared statements
    totals = {True: [0.0, 0.0, 0, 0], False: [0.0, 0.0, 0, 0]}
    print(f"{opts.runs} runs x {opts.steps} steps per round, load {os.getloadavg()[0]:.2f}")
    for round_no in range(1, opts.stream + 1):
        for stream in (True, False):
            backends = pgcpu.BackendCpu(url).start()
            cpu = time.process_time()
            steps, model_steps = engine(stream)
            cpu = time.process_time() - cpu
            pg_cpu = backends.stop() or 0.0
            total = totals[stream]
            total[0], total[1], total[2], total[3] = (
                total[0] + cpu,
                total[1] + pg_cpu,
                total[2] + steps,
                total[3] + model_steps,
            )
            print(
                f"round {round_no} {'streamed' if stream else 'JSON':8} {steps:5} steps ({model_steps} model)  "
                f"worker {cpu * 1000 / steps:6.2f} ms/step  PostgreSQL {pg_cpu * 1000 / steps:5.2f} ms/step  "
                f"load {os.getloadavg()[0]:.2f}"
            )
    (scpu, spg, ssteps, smodel), (jcpu, jpg, jsteps, _jmodel) = totals[True], totals[False]
    print(
        f"all rounds: streamed {scpu * 1000 / ssteps:.2f} / JSON {jcpu * 1000 / jsteps:.2f} worker ms per step; "
        f"streaming costs {(scpu - jcpu * ssteps / jsteps) * 1000 / smodel:+.2f} ms per model step "
        f"(PostgreSQL {spg * 1000 / ssteps:.2f} / {jpg * 1000 / jsteps:.2f} ms per step)"
    )


class _Phases:
    """--phases: the worker CPU of each side's claim and record (the rest of a step is its call:
    the model or tool request over HTTP, and for the engine what it does around the call).

    Wraps the two transactions of each side where the step calls them: the engine's claim
    (runs.engine.claim) and the record every outcome goes through (dispatch.through_database_outage,
    as model_step and tool_step import it); the floor's _claim and _record."""

    def __init__(self):
        import runs.engine as engine
        from bench import peer_floor
        from runs.engine import model_step, tool_step

        self.side = "engine"
        self.cpu: collections.Counter = collections.Counter()
        engine.claim = self._timed("claim", engine.claim)
        record = self._timed("record", model_step.through_database_outage)
        model_step.through_database_outage = tool_step.through_database_outage = record
        peer_floor._claim = self._timed("claim", peer_floor._claim)
        peer_floor._record = self._timed("record", peer_floor._record)

    def _timed(self, phase: str, function):
        def timed(*args, **kwargs):
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.cpu[self.side, phase] += time.process_time() - started

        return timed

    def report(self, steps: dict, total: dict) -> None:
        print("worker CPU per step by phase, ms: claim, call (the rest), record")
        for side in ("engine", "floor"):
            claim, record = self.cpu[side, "claim"], self.cpu[side, "record"]
            call = total[side] - claim - record
            per = 1000 / steps[side]
            print(f"  {side:6} {claim * per:6.2f} {call * per:6.2f} {record * per:6.2f}")


def _wal(connection) -> tuple[int, int, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal")
        return tuple(int(v) for v in cursor.fetchone())


def _print_prepared(connection) -> None:
    """How PostgreSQL planned the engine's prepared statements on this connection: a statement
    planned anew on every call (custom plans) pays planning each time, as an unprepared one does."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans, left(regexp_replace(statement, '\\s+', ' ', 'g'), 90) "
            "FROM pg_prepared_statements ORDER BY custom_plans DESC"
        )
        rows = cursor.fetchall()
        cursor.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
            "WHERE n_tup_ins + n_tup_upd > 0 ORDER BY n_tup_ins + n_tup_upd DESC LIMIT 10"
        )
        tables = cursor.fetchall()
    print("rows inserted and updated, and of the updates those in place (HOT: no index touched), by table:")
    for name, inserted, updated, hot in tables:
        print(f"  {name:<28} {inserted:7d} inserted {updated:7d} updated {hot:7d} HOT")
    if rows:
        print("prepared statements of one connection: generic plans, custom plans, statement")
        for generic, custom, text in rows:
            print(f"{generic:7d} {custom:7d}  {text}")


def _print_plans(samples: dict[str, str], counts, steps: int) -> None:
    """Planning and execution time per statement, weighted by how often a step sends it: where
    PostgreSQL's CPU per step goes (parse and plan are paid on every call of a statement that is
    not prepared)."""
    from django.db import connection, transaction

    rows = []
    for text, statement in samples.items():
        n = sum(c for key, c in counts.items() if key.split("  <- ")[0] == text) / steps
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("EXPLAIN (ANALYZE, SUMMARY, FORMAT JSON) " + statement.replace("%", "%%"))
                plan = cursor.fetchone()[0][0]
                transaction.set_rollback(True)
        except Exception as exc:  # e.g. a guarded write that finds its row moved on
            print(f"  (not explained: {text[:60]}: {str(exc)[:80]})")
            continue
        rows.append((n, plan["Planning Time"], plan["Execution Time"], text))
    rows.sort(key=lambda r: -r[0] * (r[1] + r[2]))
    print("per step: calls, planning ms, execution ms (each per call), statement")
    for n, planning, execution, text in rows:
        print(f"{n:6.2f}  {planning:7.3f}  {execution:7.3f}  {text}")
    print(
        f"planning {sum(n * p for n, p, _, _ in rows):.3f} ms and execution "
        f"{sum(n * e for n, _, e, _ in rows):.3f} ms per step (EXPLAIN's own timing overhead included)"
    )


if __name__ == "__main__":
    main()
