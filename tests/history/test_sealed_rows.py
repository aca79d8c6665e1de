"""Crypto-shredding of steps' and approvals' content (issue 37, part 4): a step's arguments,
request, result, observation, error and resolution, an approval's arguments and people's texts,
are sealed with their run's data key at rest; the API, the engine and the data subject search read
them opened; an erasure destroys the key, so a copy of the rows taken before no longer opens; a
plain write is refused."""

from __future__ import annotations

import pytest
from django.db import connection
from rest_framework.test import APIClient

from approvals.models import Approval, ApprovalVote
from history import subjects
from history.verify import verify
from runs.approval_effects import decide_approval
from runs.models import Run, RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.history.conftest import finished_run
from tests.history.test_erasure import _erase, _pg_dump
from vault import sealing, store
from vault.fields import SealedValueAltered

pytestmark = pytest.mark.django_db(transaction=True)

CUSTOMER = "CUST-4471-XK"
COLUMNS = ("arguments", "request", "result", "observation", "error", "resolution")


def _raw(run) -> list[tuple]:
    """The run's steps' content columns as PostgreSQL holds them."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT seq, {', '.join(COLUMNS)} FROM runs_step WHERE run_id = %s ORDER BY seq", [run.pk]
        )
        return cursor.fetchall()


def _steps_in(dump: str) -> str:
    """The data of the steps' table (each of its partitions) in a plain pg_dump."""
    sections = dump.split("\nCOPY ")
    return "".join(part.split("\n\\.\n", 1)[0] for part in sections if part.startswith("public.runs_step"))


def test_a_steps_content_is_sealed_at_rest_and_read_opened(asha, echo_agent):
    run = finished_run(asha, word=CUSTOMER)

    raw = _raw(run)
    stored = [bytes(value) for row in raw for value in row[1:] if value is not None]
    assert stored and all(value[:1] == sealing.VALUE_VERSION for value in stored)
    assert not [value for value in stored if CUSTOMER.encode() in value]
    assert "runs_step" in _pg_dump() and CUSTOMER not in _steps_in(_pg_dump())
    tool = Step.objects.get(run=run, kind="tool")
    assert tool.arguments == {"say": CUSTOMER} and CUSTOMER in tool.observation
    client = APIClient()
    client.force_authenticate(asha)
    steps = client.get(f"/v1/runs/{run.pk}/steps").json()
    assert any(s.get("arguments") == {"say": CUSTOMER} for s in steps), steps
    # The model step that proposed the call carries it too, in its result.
    assert subjects.find(run.tenant_id, CUSTOMER, scan=True).steps == {run.pk: [tool.seq - 1, tool.seq]}
    assert verify([run.pk]).ok
    # The run's answer too.
    assert _raw_output(run)[:1] == sealing.VALUE_VERSION and b"all done" not in _raw_output(run)
    assert Run.objects.get(pk=run.pk).final_output == "all done"


def _raw_output(run) -> bytes:
    with connection.cursor() as cursor:
        cursor.execute("SELECT final_output FROM runs_run WHERE id = %s", [run.pk])
        return bytes(cursor.fetchone()[0])


def test_an_erasure_destroys_the_key_so_steps_copied_before_no_longer_open(asha, compliance, echo_agent):
    run = finished_run(asha, word=CUSTOMER)
    backup, answer = _raw(run), _raw_output(run)  # a backup's copy of the rows

    assert _erase(compliance).status_code == 201

    assert store.get(run.pk) is None
    assert all(value is None for row in _raw(run) for value in row[1:])  # overwritten too
    with connection.cursor() as cursor:  # the backup restored
        for seq, *values in backup:
            cursor.execute(
                f"UPDATE runs_step SET {', '.join(f'{c} = %s' for c in COLUMNS)} WHERE run_id = %s AND seq = %s",
                [*values, run.pk, seq],
            )
        cursor.execute("UPDATE runs_run SET final_output = %s WHERE id = %s", [answer, run.pk])
    sealing.forget_cached()  # another process: nothing kept in memory
    assert Run.objects.get(pk=run.pk).final_output == ""
    tool = Step.objects.get(run=run, kind="tool")
    assert tool.arguments is None and tool.observation == "" and tool.result is None  # erased, not served
    assert subjects.find(run.tenant_id, CUSTOMER, scan=True).run_ids() == set()
    assert verify([run.pk]).ok  # the chain holds digests only: it still verifies


def test_a_plain_write_of_a_steps_content_is_refused(asha, echo_agent):
    run = finished_run(asha)
    with pytest.raises(TypeError, match="runs.step.result is sealed at rest"):
        Step.objects.filter(run=run).update(result={"forged": True})
    with pytest.raises(TypeError, match="runs.step.observation is sealed at rest"):
        Step.objects.filter(run=run, observation__contains="hello").count()
    Step.objects.filter(run=run).update(error="")  # emptying needs no key
    # A value altered in the database is refused on reading, not served.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_step SET result = overlay(result placing '\\x00'::bytea from 40 for 1) "
            "WHERE run_id = %s AND kind = 'tool'",
            [run.pk],
        )
    with pytest.raises(SealedValueAltered):
        list(Step.objects.filter(run=run))


def test_an_approvals_arguments_and_reasons_are_sealed_and_an_erasure_shreds_them(
    asha, ravi, compliance, echo_agent
):
    type(echo_agent).objects.filter(pk=echo_agent.pk).update(approval_policy="always")
    factories.grant(echo_agent, approve=[ravi])
    run, _ = start_run(user=asha, agent="agent", input={"word": CUSTOMER})
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL
    approval = Approval.objects.get(run=run)
    decide_approval(approval_id=approval.pk, user=ravi, approve=True, reason=f"called {CUSTOMER} back")
    assert drive(run.pk).status == RunStatus.SUCCEEDED

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT arguments, decision_reason FROM approvals_approval WHERE id = %s", [approval.pk]
        )
        arguments, reason = (bytes(v) for v in cursor.fetchone())
        cursor.execute("SELECT reason FROM approvals_approvalvote WHERE approval_id = %s", [approval.pk])
        (vote,) = (bytes(v) for (v,) in cursor.fetchall())
    assert all(
        v[:1] == sealing.VALUE_VERSION and CUSTOMER.encode() not in v for v in (arguments, reason, vote)
    )
    approval.refresh_from_db()
    assert approval.arguments == {"say": CUSTOMER} and approval.decision_reason == f"called {CUSTOMER} back"
    client = APIClient()
    client.force_authenticate(ravi)
    shown = client.get(f"/v1/approvals/{approval.pk}").json()
    assert shown["arguments"] == {"say": CUSTOMER}, shown
    assert subjects.find(run.tenant_id, CUSTOMER, scan=True).approvals == {run.pk: [approval.pk]}
    subjects.index_due(batch=10)  # the index reads the sealed texts' words too
    assert run.pk in subjects.candidates(run.tenant_id, CUSTOMER)

    assert _erase(compliance).status_code == 201
    with connection.cursor() as cursor:  # a backup of the rows from before, restored
        cursor.execute(
            "UPDATE approvals_approval SET arguments = %s, decision_reason = %s WHERE id = %s",
            [arguments, reason, approval.pk],
        )
        cursor.execute(
            "UPDATE approvals_approvalvote SET reason = %s WHERE approval_id = %s", [vote, approval.pk]
        )
    sealing.forget_cached()
    approval.refresh_from_db()
    assert approval.arguments == {} and approval.decision_reason == ""  # erased, not served
    assert [v.reason for v in ApprovalVote.objects.filter(approval=approval)] == [""]
    assert subjects.find(run.tenant_id, CUSTOMER, scan=True).run_ids() == set()
