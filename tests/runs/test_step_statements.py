"""What a model step asks the database about people's decisions: nothing, until a person has
decided an approval of the run (ClaimReads.people_decided, read with the run's lock); then who
decided each observed call, which its compact record names (runs/engine/conversation.decisions)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from approvals.models import Approval
from runs.approval_effects import decide_approval
from runs.engine import advance
from runs.models import RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def _approval_reads(run_id) -> int:
    """Advance the run once: the statements it sent asking who decided approvals (the claim's
    lock reads whether any was decided inside the run's own statement)."""
    with CaptureQueriesContext(connection) as queries:
        advance(run_id)
    return sum(
        1
        for q in queries.captured_queries
        if q["sql"].lstrip().startswith('SELECT "approvals_approval"')
        and 'decided_by_id" IS NOT NULL' in q["sql"]
    )


def _to_the_end(run):
    """Advance the run task by task until it ends: the run, and each task's approval reads."""
    reads = []
    for _ in range(8):
        reads.append(_approval_reads(run.pk))
        run.refresh_from_db()
        if run.is_terminal:
            break
    return run, reads


def test_it_asks_nothing_about_approvals_of_a_run_no_person_decided(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"n": i}}]} for i in range(3)]
        + [{"text": "done"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run, reads = _to_the_end(run)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert Step.objects.filter(run=run, tool_name=echo.name, status="succeeded").count() == 3
    assert reads == [0] * len(reads)


def test_once_a_person_decided_the_model_step_reads_who(tenant, asha, ravi, builtins, bank):
    noop = builtins["noop"]
    refund = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    factories.grant(refund, use=[asha], approve=[ravi])
    factories.grant(noop, use=[asha])
    arguments = {"transaction_id": "TXN-1001", "amount": 12499, "currency": "INR"}
    factories.make_agent(
        tenant,
        tools=[noop, refund],
        turns=[
            {"tool_calls": [{"name": refund.name, "arguments": arguments}]},
            {"tool_calls": [{"name": noop.name, "arguments": {"i": 1}}]},
            {"text": "done"},
        ],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, run.error
    decide_approval(approval_id=Approval.objects.get(run=run).pk, user=ravi, approve=True, reason="ok")

    run, reads = _to_the_end(run)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert len(bank.effects("issue_refund")) == 1
    # The model steps after the approved refund read who decided the calls new to them.
    assert sum(reads) >= 1
