"""The agent loop as a LangGraph graph checkpointed by PostgresSaver: one scenario of bench/peers.py.

    python -m bench.peer_langgraph --db postgresql://root@127.0.0.1:5432/<own db> \
        --model-url http://127.0.0.1:<port>/v1 --tool-url http://127.0.0.1:<port> --runs 100 --steps 25

The graph is START -> model -> (tool -> model)* -> END; a node is one model call or one tool
call over HTTP (bench/peer_agent.py), so a run is 25 supersteps. PostgresSaver (from
langgraph-checkpoint-postgres, on a psycopg_pool.ConnectionPool as its documentation shows)
writes a checkpoint at every superstep; with `--durability sync` (the default here, the
guarantee closest to the engine's) the checkpoint is committed before the next node starts.
Runs are `invoke` calls on their own threads (one per run, at most `--threads`), each with its
own thread_id, the way a threaded worker would serve them.

Prints one JSON line: steps, seconds (first start to last finish), cpu (this process's user +
system CPU over the same window), statements and checks sent (bench/sqlcount.py), commits and
rollbacks of its database (bench/pgstats.py, read with nothing connected, before and after).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypedDict

import psutil

from bench import peer_agent, pgstats, sqlcount


class AgentState(TypedDict):
    messages: Annotated[list[dict[str, Any]], operator.add]


def build_graph(client, model_url: str, tool_url: str):
    from langgraph.graph import END, START, StateGraph

    def model(state: AgentState, config) -> dict:
        return {"messages": [peer_agent.model_turn(client, model_url, state["messages"])]}

    def tool(state: AgentState, config) -> dict:
        call = peer_agent.pending_call(state["messages"])
        key = f"langgraph-{config['configurable']['thread_id']}-{len(state['messages'])}"
        return {"messages": [peer_agent.tool_turn(client, tool_url, call, key)]}

    def route(state: AgentState) -> str:
        return "tool" if peer_agent.pending_call(state["messages"]) else END

    graph = StateGraph(AgentState)
    graph.add_node("model", model)
    graph.add_node("tool", tool)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["tool", END])
    graph.add_edge("tool", "model")
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description="LangGraph + PostgresSaver scenario of bench/peers.py")
    parser.add_argument("--db", required=True, help="postgresql:// URL of a database of its own")
    parser.add_argument("--model-url", required=True)
    parser.add_argument("--tool-url", required=True)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--threads", type=int, default=128)
    parser.add_argument("--pool", type=int, default=20, help="PostgreSQL connection pool size")
    parser.add_argument("--durability", choices=["sync", "async", "exit"], default="sync")
    args = parser.parse_args()

    sqlcount.install()
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import ConnectionPool

    with PostgresSaver.from_conn_string(args.db) as saver:
        saver.setup()  # its migrations: not part of the figures
    before = pgstats.wait_idle(args.db)

    client = peer_agent.make_client()
    pool = ConnectionPool(
        args.db,
        min_size=1,
        max_size=args.pool,
        open=True,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    app = build_graph(client, args.model_url, args.tool_url).compile(checkpointer=PostgresSaver(pool))

    def one_run(run: int) -> float:
        # A thread id of this process only: the database outlives a round, and an old thread would
        # go on with its finished conversation.
        config = {
            "configurable": {"thread_id": f"run-{os.getpid()}-{run}"},
            "recursion_limit": args.steps + 10,
        }
        state = app.invoke({"messages": peer_agent.first_messages(run)}, config, durability=args.durability)
        peer_agent.check_run(state["messages"], args.steps)
        return time.time()

    process = psutil.Process()
    cpu_before = sum(process.cpu_times()[:2])
    sql_before = sqlcount.snapshot()
    start = time.time()
    with ThreadPoolExecutor(max_workers=min(args.threads, args.runs), thread_name_prefix="run") as executor:
        ends = list(executor.map(one_run, range(args.runs)))
    cpu = sum(process.cpu_times()[:2]) - cpu_before
    sql_after = sqlcount.snapshot()
    pool.close()
    client.close()
    after = pgstats.wait_idle(args.db)
    print(
        json.dumps(
            {
                "steps": args.runs * args.steps,
                "seconds": max(ends) - start,
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
