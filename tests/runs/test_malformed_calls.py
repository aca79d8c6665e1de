"""Whatever the model sends, a step ends, the model is told, and a person can see why (issue 28).

The model's calls to the platform's own tools are checked like any tool's; an exception raised by
the engine's code (injected here at the database edge: a trigger that refuses one write, as a
constraint or a bug would) counts toward the step's crash budget and never loops.
"""

from __future__ import annotations

import pytest
from django.db import connection

from runs.engine import advance
from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)

BLOB = "".join(f"line {i:04d} of the ledger\n" for i in range(300))  # ~7,500 characters: shortened


def _agent(tenant, asha, builtins, *calls):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    turns = [{"tool_calls": [{"name": echo.name, "arguments": {"blob": BLOB}}]}]
    turns += [{"tool_calls": [call]} for call in calls]
    turns.append({"text": "done"})
    factories.make_agent(tenant, tools=[echo], turns=turns, context={"result_limit_chars": 1_000})


def test_malformed_read_result_calls_fail_with_a_reason_and_the_run_finishes(tenant, asha, builtins):
    _agent(
        tenant,
        asha,
        builtins,
        {"name": "read_result", "arguments": {"step": 0, "offset": 1287193640000}},
        {"name": "read_result", "arguments": {"step": 1}},
        {"name": "read_result", "arguments": {"step": 2, "offset": 10**12}},
        {"name": "read_result", "arguments": {"step": "two"}},
        {"name": "read_result", "arguments": {"step": 99}},
    )
    run, _ = start_run(user=asha, agent="agent", input={"case": 1})
    run = drive(run.pk)
    assert (run.status, run.final_output) == ("succeeded", "done")
    calls = list(Step.objects.filter(run=run, tool_name="read_result").order_by("seq"))
    assert [s.status for s in calls] == ["failed"] * 5
    observations = [s.observation for s in calls]
    assert "minimum of 1" in observations[0] or "less than the minimum" in observations[0]
    assert "is a model call, not a tool result" in observations[1]
    assert "past the end of step 2's result" in observations[2]
    assert "arguments invalid at step" in observations[3]
    assert "not an earlier step of this run" in observations[4]
    # The model was told each time: every failed call's observation is in the next request.
    assert all(o.startswith("ERROR: read_result: ") for o in observations)


def test_read_result_is_offered_only_once_there_is_something_to_page_through(tenant, asha, builtins):
    # Without compaction: a compacting policy offers it from the first call (tests/llm/test_compaction.py).
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": "read_result", "arguments": {"step": 1}}]}, {"text": "done"}],
        context={"compaction": "off"},
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, tool_name="read_result")
    assert step.status == "denied" and "was not offered" in step.observation
    assert "read_result" not in Step.objects.get(run=run, seq=1).request["tools"]


def _refuse_writes(table: str, when: str, run: Run) -> None:
    """A trigger that raises on one kind of write of this run's rows: the engine's code meets an
    error it did not expect (like a constraint or a bug), not a lost database."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE OR REPLACE FUNCTION refuse_for_test() RETURNS trigger AS $$
            BEGIN
              IF NEW.run_id = '{run.pk}'::uuid AND ({when}) THEN
                RAISE EXCEPTION 'injected failure for run %', NEW.run_id;
              END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql;
            DROP TRIGGER IF EXISTS refuse_for_test ON {table};
            CREATE TRIGGER refuse_for_test BEFORE INSERT OR UPDATE ON {table}
              FOR EACH ROW EXECUTE FUNCTION refuse_for_test();
            """
        )


@pytest.fixture
def refuse():
    yield _refuse_writes
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS refuse_for_test ON runs_step")
        cursor.execute("DROP FUNCTION IF EXISTS refuse_for_test() CASCADE")


def _advance_until_ended(run_id, tasks: int = 10) -> Run:
    for _ in range(tasks):
        advance(run_id)  # never raises: the engine records what raised and goes on or ends
        run = Run.objects.get(pk=run_id)
        if run.is_terminal:
            return run
    return Run.objects.get(pk=run_id)


@pytest.mark.parametrize(
    "phase,when",
    [
        ("claim", "TG_OP = 'INSERT' AND NEW.kind = 'model'"),  # committing the model call's intent
        ("record", "TG_OP = 'UPDATE' AND NEW.status = 'succeeded' AND NEW.kind = 'model'"),  # its outcome
        ("tool claim", "TG_OP = 'UPDATE' AND NEW.status = 'dispatching' AND NEW.kind = 'tool'"),
        ("tool record", "TG_OP = 'UPDATE' AND NEW.status = 'succeeded' AND NEW.kind = 'tool'"),
    ],
)
def test_a_phase_that_raises_on_every_attempt_fails_the_run_after_the_crash_budget(
    tenant, asha, builtins, refuse, settings, phase, when
):
    settings.MAX_STEP_CRASHES = 3
    settings.LEASE_MARGIN_SECONDS = 0
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"x": 1}}]}, {"text": "done"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    if phase.startswith("tool"):
        advance(run.pk)  # the model call goes through; its tool call meets the trigger
    refuse("runs_step", when, run)
    run = _advance_until_ended(run.pk)
    assert run.status == "failed", (phase, run.status, run.error)
    assert "injected failure for run" in run.error and "ProgrammingError" in run.error
    errors = RunEvent.objects.filter(run=run, kind="engine_error").order_by("seq")
    assert errors.count() == 3
    assert all("injected failure" in e.data["error"] for e in errors)
    assert [e.data["count"] for e in errors] == [1, 2, 3]
    resent = RunEvent.objects.filter(run=run, kind="recovery", skeleton__found="lost_message").count()
    assert resent == 0
    # Ended: the sweeper and any late message leave it alone.
    advance(run.pk)
    assert Run.objects.get(pk=run.pk).status == "failed"
