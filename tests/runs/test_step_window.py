"""The claim reads a window of the step log, not the log: as few rows at step 200 as at step 2.

runs/statements.step_window is prepared, so after a few calls PostgreSQL runs it with one generic
plan for every run; that plan must still start from the run's newest steps. These tests count the
rows its index scans fetched (this transaction's own counts, pg_stat_xact_user_tables).

The run's log sits among other runs' logs and the table's statistics are fresh, as autovacuum keeps
them in production: the planner's choice then follows the table, not whatever statistics the
test database last took (on a table it believes nearly empty, a sequential scan is the cheap plan,
and CI once counted 405 rows so).
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from runs import statements
from runs.models import Step, StepKind, StepStatus
from runs.services import start_run
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def _fetched() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) FROM pg_stat_xact_user_tables "
            "WHERE relname = 'runs_step'"
        )
        return cursor.fetchone()[0]


def _log(run, steps: int, *, open_seq: int | None = None) -> None:
    """`steps` finished steps: model calls at odd seqs, each proposing the tool call after it."""
    Step.objects.bulk_create(
        Step(
            run=run,
            seq=seq,
            kind=StepKind.MODEL if seq % 2 else StepKind.TOOL,
            status=StepStatus.AWAITING_APPROVAL if seq == open_seq else StepStatus.SUCCEEDED,
            tool_name="" if seq % 2 else "kb__search",
            parent_seq=None if seq % 2 else seq - 1,
            result={"text": "x" * 400} if seq % 2 else {"text": "found"},
        )
        for seq in range(1, steps + 1)
    )


@pytest.fixture
def long_run(tenant, asha):
    factories.make_agent(tenant, turns=[{"text": "done"}])

    def make(steps: int, **log):
        for _ in range(OTHER_RUNS):
            other, _ = start_run(user=asha, agent="agent", input={})
            _log(other, 200)
        run, _ = start_run(user=asha, agent="agent", input={})
        _log(run, steps, **log)
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {Step._meta.db_table}")
        return run

    return make


OTHER_RUNS = 20  # 4,000 steps besides the run's own: a few hundred pages


def _window_reads(run, *, after: int | None) -> tuple[list[int], int]:
    for _ in range(8):  # past the custom plans: what follows runs the generic plan
        statements.step_window(run, after=after)
    with transaction.atomic():
        before = _fetched()
        window = statements.step_window(run, after=after)
        return [step.seq for step in window], _fetched() - before


@pytest.mark.parametrize("steps", [20, 200])
def test_the_window_reads_a_handful_of_rows_at_any_length(long_run, steps):
    run = long_run(steps)
    seqs, fetched = _window_reads(run, after=steps - 2)
    assert seqs == [steps - 1, steps]  # the model call and the tool call it proposed
    assert fetched <= 12, f"{fetched} rows fetched at step {steps}"


def test_an_old_open_step_is_in_the_window(long_run):
    """A step still open far back in the log (an approval waited on) is read with the tail."""
    run = long_run(200, open_seq=40)
    seqs, fetched = _window_reads(run, after=None)
    assert seqs[0] == 40 and seqs[-2:] == [199, 200]
