"""The floor: the least a step can do on this stack and keep the engine's guarantees.

Loaded into bench/peers.py's Celery workers with `-I` (scenario "floor"). The same agent loop as
the chain (bench/peer_agent.py, the conversation carried in the message), the same worker and
delivery settings as the engine (threads, acks_late, prefetch 1, one task per step, the next task
published on commit), through Django's connection to the engine's database, and in each step the
two transactions the guarantees need and nothing else:

    claim   lock the run row; refuse a run whose lease another worker holds; insert the step as
            `dispatching` with its idempotency key; reserve the call's worst case on the run's
            account and on a tenant-day sub-account, refused past either limit; record the
            reservation; take the lease with a new token and count the step; commit
    act     no transaction, no connection held: the model or the tool over HTTP, the tool with
            the step's idempotency key
    record  lock the run row; write only if the lease token still matches; the step's outcome;
            settle the reservation and move reserved to spent on both accounts; one event; give
            the lease back (or end the run); publish the next step on commit

Not here (the engine does them, and they are what the engine costs above this floor): the
permission, policy and approval checks, the agent's spec and the model request built from the
step log, loop detection, redaction of secrets, the user's signed authority on each tool call,
the circuit breaker and quotas, metrics, the event stream's payloads.
"""

from __future__ import annotations

import json
import time
import uuid

from celery import shared_task
from django.db import connection, transaction

from bench import peer_agent
from bench.peer_tasks import shared_client, shared_redis

SHARDS = 64  # as many tenant-day sub-accounts as the engine has by default (BUDGET_DAY_SHARDS)
ESTIMATE = 10_000  # micros reserved per call
PRICE = 4_000  # micros settled per call

TABLES = """
CREATE TABLE IF NOT EXISTS bench_floor_run (
    id bigint PRIMARY KEY, status text NOT NULL, step_count int NOT NULL DEFAULT 0,
    lease_token uuid, lease_expires_at timestamptz, event_seq int NOT NULL DEFAULT 0,
    input jsonb NOT NULL DEFAULT '{}', finished_at timestamptz);
CREATE TABLE IF NOT EXISTS bench_floor_step (
    id bigserial PRIMARY KEY, run_id bigint NOT NULL REFERENCES bench_floor_run(id),
    seq int NOT NULL, kind text NOT NULL, status text NOT NULL, idempotency_key text NOT NULL,
    result jsonb, cost_micros bigint, dispatched_at timestamptz, finished_at timestamptz,
    UNIQUE (run_id, seq));
CREATE TABLE IF NOT EXISTS bench_floor_account (
    id bigserial PRIMARY KEY, run_id bigint, shard int, limit_micros bigint NOT NULL,
    reserved_micros bigint NOT NULL DEFAULT 0, spent_micros bigint NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS bench_floor_reservation (
    id bigserial PRIMARY KEY, step_id bigint NOT NULL REFERENCES bench_floor_step(id),
    run_account bigint NOT NULL, day_account bigint NOT NULL, amount_micros bigint NOT NULL,
    actual_micros bigint, status text NOT NULL);
CREATE TABLE IF NOT EXISTS bench_floor_event (
    id bigserial PRIMARY KEY, run_id bigint NOT NULL REFERENCES bench_floor_run(id), seq int NOT NULL,
    kind text NOT NULL, data jsonb NOT NULL, at timestamptz NOT NULL DEFAULT now(), UNIQUE (run_id, seq));
"""


def create_runs(cursor, runs: int) -> None:
    """The tables (once) and `runs` queued runs, each with its run account; the day's sub-accounts."""
    cursor.execute(TABLES)
    cursor.execute(
        "TRUNCATE bench_floor_event, bench_floor_reservation, bench_floor_step, bench_floor_account, "
        "bench_floor_run"
    )
    cursor.execute(
        "INSERT INTO bench_floor_run (id, status, input) SELECT n, 'queued', '{\"question\": \"q\"}' "
        "FROM generate_series(0, %s - 1) n",
        [runs],
    )
    cursor.execute(
        "INSERT INTO bench_floor_account (run_id, limit_micros) SELECT id, 10000000000 FROM bench_floor_run"
    )
    cursor.execute(
        "INSERT INTO bench_floor_account (shard, limit_micros) SELECT s, 10000000000000 "
        "FROM generate_series(0, %s - 1) s",
        [SHARDS],
    )


def _claim(run: int, kind: str, key: str):
    """The first transaction: (step id, reservation id, lease token), or None when the run is
    leased by another worker or over budget."""
    token = uuid.uuid4()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT step_count, lease_token IS NOT NULL AND lease_expires_at > now() FROM bench_floor_run "
            "WHERE id = %s FOR UPDATE",
            [run],
        )
        step_count, leased = cursor.fetchone()
        if leased:
            return None
        cursor.execute(
            "INSERT INTO bench_floor_step (run_id, seq, kind, status, idempotency_key, dispatched_at) "
            "VALUES (%s, %s, %s, 'dispatching', %s, now()) RETURNING id",
            [run, step_count + 1, kind, key],
        )
        (step_id,) = cursor.fetchone()
        # Both accounts in one statement, in id order; refused unless both can carry it.
        cursor.execute(
            "UPDATE bench_floor_account SET reserved_micros = reserved_micros + %s "
            "WHERE (run_id = %s OR shard = %s) AND limit_micros - reserved_micros - spent_micros >= %s "
            "RETURNING id, run_id IS NOT NULL",
            [ESTIMATE, run, run % SHARDS, ESTIMATE],
        )
        accounts = {is_run: account for account, is_run in cursor.fetchall()}
        if len(accounts) != 2:
            raise RuntimeError(f"floor run {run}: budget refused the call")
        cursor.execute(
            "INSERT INTO bench_floor_reservation (step_id, run_account, day_account, amount_micros, status) "
            "VALUES (%s, %s, %s, %s, 'open') RETURNING id",
            [step_id, accounts[True], accounts[False], ESTIMATE],
        )
        (reservation_id,) = cursor.fetchone()
        cursor.execute(
            "UPDATE bench_floor_run SET status = 'running', lease_token = %s, "
            "lease_expires_at = now() + interval '60 seconds', step_count = step_count + 1 WHERE id = %s",
            [token, run],
        )
    return step_id, reservation_id, token


def _record(
    run: int, step_id: int, reservation_id: int, token: uuid.UUID, answer: dict, done: bool, on_commit
):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT lease_token FROM bench_floor_run WHERE id = %s FOR UPDATE", [run])
        if cursor.fetchone()[0] != token:
            return  # fenced out: another worker owns the run now
        cursor.execute(
            "UPDATE bench_floor_step SET status = 'succeeded', result = %s, cost_micros = %s, "
            "finished_at = now() WHERE id = %s",
            [json.dumps(answer), PRICE, step_id],
        )
        cursor.execute(
            "WITH closed AS (UPDATE bench_floor_reservation SET status = 'settled', actual_micros = %s "
            "WHERE id = %s AND status = 'open' RETURNING run_account, day_account, amount_micros) "
            "UPDATE bench_floor_account a SET reserved_micros = reserved_micros - c.amount_micros, "
            "spent_micros = spent_micros + %s FROM closed c WHERE a.id IN (c.run_account, c.day_account)",
            [PRICE, reservation_id, PRICE],
        )
        cursor.execute(
            "WITH r AS (UPDATE bench_floor_run SET event_seq = event_seq + 1, lease_token = NULL, "
            "lease_expires_at = NULL, status = %s, finished_at = CASE WHEN %s THEN now() END "
            "WHERE id = %s RETURNING event_seq) "
            "INSERT INTO bench_floor_event (run_id, seq, kind, data) SELECT %s, event_seq, 'step', %s FROM r",
            [
                "succeeded" if done else "running",
                done,
                run,
                run,
                json.dumps({"step_id": step_id, "to": "succeeded", "cost_micros": PRICE}),
            ],
        )
        transaction.on_commit(on_commit)


def step(
    client, run: int, model_url: str, tool_url: str, messages: list, steps: int, key: str, then
) -> bool | None:
    """One step of the floor: claim, the call with no connection held, record, and `then(done)`
    on commit. The answer is appended to `messages`; None when another worker holds the run.
    Raises peer_agent.StepFailed. (bench/profile_step.py --floor drives it in-process too.)"""
    call = peer_agent.pending_call(messages)
    claimed = _claim(run, "tool" if call is not None else "model", key)
    if claimed is None:
        return None
    connection.close()  # no connection held during the call (back to the pool)
    if call is not None:
        answer = peer_agent.tool_turn(client, tool_url, call, key)
    else:
        answer = peer_agent.model_turn(client, model_url, messages)
    messages.append(answer)
    done = peer_agent.is_done(messages)
    if done:
        peer_agent.check_run(messages, steps)
    _record(run, *claimed, answer, done, lambda: then(done))
    return done


@shared_task(name="bench.peer_floor_step", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def floor_step(done_key: str, run: int, model_url: str, tool_url: str, messages: list, steps: int) -> None:
    def next_step(done: bool) -> None:
        if done:
            shared_redis().rpush(done_key, f"{run} {time.time()}")
        else:
            floor_step.apply_async((done_key, run, model_url, tool_url, messages, steps))

    key = f"floor-{done_key}-{run}-{len(messages)}"
    try:
        step(shared_client(), run, model_url, tool_url, messages, steps, key, next_step)
    except peer_agent.StepFailed as exc:
        shared_redis().rpush(done_key, f"{run} ERROR {exc}")
