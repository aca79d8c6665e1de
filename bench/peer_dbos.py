"""The agent loop as a DBOS durable workflow on PostgreSQL: one scenario of bench/peers.py.

    python -m bench.peer_dbos --db postgresql://root@127.0.0.1:5432/<own db> \
        --model-url http://127.0.0.1:<port>/v1 --tool-url http://127.0.0.1:<port> --runs 100 --steps 25

A run is one `@DBOS.workflow()` whose steps are `@DBOS.step()` functions: the model call and
the tool call over HTTP (bench/peer_agent.py). DBOS (dbos-transact 3.x) records the workflow's
inputs when it starts, each step's output as the step finishes (before the workflow goes on)
and the result at the end, in its system database (here the scenario's own database), so a
crashed run resumes after its last recorded step. Workflows are started with
`DBOS.start_workflow` and run on DBOS's executor threads, one per run; the system database pool
has `--pool` connections, as the engine's workers have DB_POOL_MAX.

DBOS keeps background threads (notification listener, queue and scheduler pollers) connected to
its database, so the starting commit count cannot be read with nothing connected: it is read
after launch and a pause of pgstats.SETTLE_SECONDS, and whatever those threads commit during the
window counts, as it would in production. Prints one JSON line like bench/peer_langgraph.py.
"""

from __future__ import annotations

import argparse
import json
import time

import psutil

from bench import peer_agent, pgstats, sqlcount


def main() -> None:
    parser = argparse.ArgumentParser(description="DBOS durable workflow scenario of bench/peers.py")
    parser.add_argument("--db", required=True, help="postgresql:// URL of a database of its own")
    parser.add_argument("--model-url", required=True)
    parser.add_argument("--tool-url", required=True)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--pool", type=int, default=20, help="system database pool size")
    args = parser.parse_args()

    sqlcount.install()
    from dbos import DBOS

    client = peer_agent.make_client()
    DBOS(
        config={
            "name": "bench-peers",
            "system_database_url": args.db,
            "sys_db_pool_size": args.pool,
            "application_version": "bench",
            "log_level": "WARNING",
        }
    )

    @DBOS.step()
    def model_step(messages: list) -> dict:
        return peer_agent.model_turn(client, args.model_url, messages)

    @DBOS.step()
    def tool_step(call: dict, key: str) -> dict:
        return peer_agent.tool_turn(client, args.tool_url, call, key)

    @DBOS.workflow()
    def agent_run(run: int) -> int:
        messages = peer_agent.first_messages(run)
        while not peer_agent.is_done(messages):
            call = peer_agent.pending_call(messages)
            if call is not None:
                messages.append(tool_step(call, f"dbos-{DBOS.workflow_id}-{len(messages)}"))
            else:
                messages.append(model_step(messages))
        peer_agent.check_run(messages, args.steps)
        return len(messages)

    DBOS.launch()  # its migrations and recovery: not part of the figures
    time.sleep(pgstats.SETTLE_SECONDS)
    before = pgstats.counters(args.db)

    process = psutil.Process()
    cpu_before = sum(process.cpu_times()[:2])
    sql_before = sqlcount.snapshot()
    start = time.time()
    handles = [DBOS.start_workflow(agent_run, run) for run in range(args.runs)]
    for handle in handles:
        handle.get_result()
    end = time.time()
    cpu = sum(process.cpu_times()[:2]) - cpu_before
    sql_after = sqlcount.snapshot()
    DBOS.destroy()
    client.close()
    after = pgstats.wait_idle(args.db)
    print(
        json.dumps(
            {
                "steps": args.runs * args.steps,
                "seconds": end - start,
                "cpu": cpu,
                "statements": sql_after["statements"] - sql_before["statements"],
                "checks": sql_after["checks"] - sql_before["checks"],
                "commits": after["commits"] - before["commits"],
                "rollbacks": after["rollbacks"] - before["rollbacks"],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
