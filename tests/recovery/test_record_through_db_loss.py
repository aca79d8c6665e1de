"""A known outcome is never lost because the database connection dropped while it was recorded.

The worker holds the provider's answer in memory; its backend is terminated for real
(`pg_terminate_backend`) in the middle of the record transaction. The record is retried from
fresh rows until it lands: the step ends with the provider's answer, the run goes on, and the
effect is counted once at the provider.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from budgets.models import Reservation
from runs.engine import advance
from runs.services import start_run
from tests.conftest import drive
from tests.recovery.conftest import EMAIL, events, http_bank_tool, single_call_agent
from tests.servers import database_url, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _admin():
    return psycopg.connect(database_url().replace("postgres://", "postgresql://", 1), autocommit=True)


class KillBackendAt:
    """An execute wrapper: once `armed()` says the call was answered, it terminates this
    connection's backend just before the n-th statement runs (that statement then fails)."""

    def __init__(self, n: int, armed):
        self.n, self.armed = n, armed
        self.seen = 0
        self.active = False
        self.killed_sql = ""

    def __call__(self, execute, sql, params, many, context):
        if not self.active:
            self.active = self.armed(sql, context)
        if self.active:
            self.seen += 1
            if self.seen == self.n:
                pid = context["connection"].connection.info.backend_pid
                with _admin() as admin:
                    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
                    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
                        time.sleep(0.01)
                self.killed_sql = sql
        return execute(sql, params, many, context)


def _email_agent(tenant, asha, bank) -> None:
    email = http_bank_tool(tenant, bank, "send_customer_email", effect_class="unsafe")
    single_call_agent(tenant, asha, email, EMAIL, final="emailed")


def _email_run(asha):
    run, _ = start_run(user=asha, agent="agent", input={})
    advance(run.pk)  # the model proposes the email
    return run


def _record_with_kill(run, bank, n: int) -> KillBackendAt:
    sent = len(bank.effects("send_customer_email"))
    killer = KillBackendAt(n, armed=lambda sql, context: len(bank.effects("send_customer_email")) > sent)
    with connection.execute_wrapper(killer):
        advance(run.pk)  # the tool step: call, then record
    return killer


def test_it_records_an_unsafe_tools_answer_whatever_statement_the_connection_dies_at(tenant, asha, bank):
    _email_agent(tenant, asha, bank)
    # How many statements the record makes, counted on an undisturbed run (the second: the first
    # may also fill this process's caches, the tenant's secrets say). The lock and the one closing
    # statement go through Django's cursor; the budget's settle is a prepared statement of its own.
    _record_with_kill(_email_run(asha), bank, n=10**6)
    counting = _record_with_kill(_email_run(asha), bank, n=10**6)
    statements = counting.seen
    assert statements >= 2

    for n in range(1, statements + 1):
        run = _email_run(asha)
        killer = _record_with_kill(run, bank, n)
        assert killer.killed_sql, f"statement {n} was never reached"
        run = drive(run.pk)
        assert run.status == "succeeded", f"killed at statement {n} ({killer.killed_sql[:80]}): {run.error}"
        step = run.steps.get(seq=2)
        assert (step.status, step.attempts, step.crashes) == ("succeeded", 1, 0), n
        assert step.result["structured"]["status"] == "sent", n
        assert not events(run.pk, "late_attempt"), n
        assert [r.status for r in Reservation.objects.filter(step=step)] == ["settled"], n
    # One email per run, none sent twice.
    assert len(bank.effects("send_customer_email")) == statements + 2


def test_it_records_a_model_reply_whatever_statement_the_connection_dies_at(tenant, asha, bank):
    """A model reply lost to a dead connection would be asked for, and paid, a second time."""
    _email_agent(tenant, asha, bank)

    def record_model_step(n: int):
        run, _ = start_run(user=asha, agent="agent", input={})
        state = {"marked": None}

        def after_the_call(sql, context) -> bool:
            # The step is inserted as dispatching, the connection closed for the call, and the
            # record opens a new one: count from the first statement on that new connection.
            current = context["connection"].connection
            if state["marked"] is None:
                if 'INSERT INTO "runs_step"' in sql:
                    state["marked"] = current
                return False
            return current is not state["marked"]

        killer = KillBackendAt(n, armed=after_the_call)
        with connection.execute_wrapper(killer):
            advance(run.pk)
        return run, killer

    record_model_step(10**6)  # warms this process's caches: the next count is every run's
    statements = record_model_step(10**6)[1].seen
    assert statements >= 2
    for n in range(1, statements + 1):
        run, killer = record_model_step(n)
        assert killer.killed_sql, f"statement {n} was never reached"
        step = run.steps.get(seq=1)
        assert (step.status, step.attempts) == ("succeeded", 1), f"killed at {n}: {killer.killed_sql[:80]}"
        run = type(run).objects.get(pk=run.pk)
        assert run.model_call_count == 1, n  # the reply was not asked for again
        assert [r.status for r in Reservation.objects.filter(step=step)] == ["settled"], n
        assert run.steps.filter(seq=2, status="proposed").exists(), n


def test_a_worker_records_the_answer_while_its_connections_are_being_killed(tenant, asha, bank, workers):
    """A real worker process; every backend it opens is terminated for 1.5 s around the answer."""
    _email_agent(tenant, asha, bank)
    bank.fault(tool="send_customer_email", delay_after_effect=2)  # answered 2 s after the effect
    worker = workers("w1", env={"PGAPPNAME": "record-under-fire", "LEASE_MARGIN_SECONDS": "10"})
    run, _ = start_run(user=asha, agent="agent", input={})

    wait_for(lambda: bank.effects("send_customer_email"), timeout=30, interval=0.02, what="the email sent")
    time.sleep(1.8)
    stop = threading.Event()
    killed = []

    def kill_loop():
        with _admin() as admin:
            while not stop.is_set():
                killed.extend(
                    admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name = 'record-under-fire'"
                    ).fetchall()
                )
                time.sleep(0.002)

    killer = threading.Thread(target=kill_loop)
    killer.start()
    time.sleep(1.5)
    stop.set()
    killer.join()

    run = wait_for(
        lambda: (r := type(run).objects.get(pk=run.pk)).is_terminal and r, timeout=60, what="run end"
    )
    assert killed, "no backend of the worker was terminated"
    assert "retrying" in worker.output(), "the record never met a dead connection"
    assert run.status == "succeeded", run.error
    step = run.steps.get(seq=2)
    assert (step.status, step.result["structured"]["status"]) == ("succeeded", "sent")
    assert len(bank.effects("send_customer_email")) == 1
