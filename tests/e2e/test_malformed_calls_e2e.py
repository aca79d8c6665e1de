"""Issue 28 with a real worker: a model's malformed calls to the platform's own tools end within
seconds as failed steps the model is told about, and a claim that raises on every attempt fails
its run after MAX_STEP_CRASHES with the exception's text, and is not sent again."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from django.db import connection
from django.utils import timezone

from runs.models import Run, RunEvent, Step
from runs.recovery import sweeper
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import FAST_LEASES
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

BLOB = "".join(f"line {i:04d} of the ledger\n" for i in range(300))


def test_malformed_read_result_calls_end_within_seconds_and_the_run_answers(tenant, asha, builtins, workers):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        context={"result_limit_chars": 1_000},
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"blob": BLOB}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"step": 0, "offset": 1287193640000}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"step": 1}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"step": 2, "offset": 10**12}}]},
            {"text": "done"},
        ],
    )
    workers("w1")
    began = time.monotonic()
    run, _ = start_run(user=asha, agent="agent", input={"case": 1})
    run = wait_for(lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=60, what="run end")
    took = time.monotonic() - began
    assert (run.status, run.final_output) == ("succeeded", "done"), run.error
    assert took < 30
    calls = list(Step.objects.filter(run=run, tool_name="read_result").order_by("seq"))
    assert [c.status for c in calls] == ["failed", "failed", "failed"]
    assert all(c.observation.startswith("ERROR: read_result: ") for c in calls)
    # Each failed call's observation reached the model in the next request's history.
    last_request = Step.objects.filter(run=run, kind="model").order_by("-seq").first().request
    assert last_request["messages"] >= 8
    assert not RunEvent.objects.filter(run=run, kind__in=["engine_error"]).exists()
    assert not RunEvent.objects.filter(run=run, kind="recovery").exists()  # nothing to recover


def test_a_claim_that_raises_every_time_fails_the_run_and_is_not_sent_again(tenant, asha, builtins, workers):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(tenant, tools=[echo], turns=[{"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    with connection.cursor() as cursor:  # every attempt to commit the model call's intent raises
        cursor.execute(
            f"""
            CREATE OR REPLACE FUNCTION refuse_e2e() RETURNS trigger AS $$
            BEGIN
              IF NEW.run_id = '{run.pk}'::uuid THEN RAISE EXCEPTION 'injected claim failure'; END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER refuse_e2e BEFORE INSERT ON runs_step FOR EACH ROW EXECUTE FUNCTION refuse_e2e();
            """
        )
    try:
        workers("w1", env={**FAST_LEASES, "MAX_STEP_CRASHES": "3"})
        run = wait_for(
            lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=60, what="run end"
        )
        assert run.status == "failed"
        assert "injected claim failure" in run.error
        errors = RunEvent.objects.filter(run=run, kind="engine_error")
        assert errors.count() == 3 and all("injected claim failure" in e.message for e in errors)
        # Ended: the sweeper finds nothing to send again, now or an hour from now.
        sweeper.sweep()
        sweeper.sweep(now=timezone.now() + dt.timedelta(hours=1))
        recoveries = [e.data.get("action") for e in RunEvent.objects.filter(run=run, kind="recovery")]
        assert recoveries == ["fail_run"]  # the failure itself; no re-send
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER IF EXISTS refuse_e2e ON runs_step; DROP FUNCTION IF EXISTS refuse_e2e()"
            )
