"""Crypto-shredding of runs', steps', events' and approvals' content (issue 37, part 4): a step's
arguments, request, result, observation, error and resolution, a run's error and answer, an
event's message and data (its skeleton kept apart in the clear), an approval's arguments and
people's texts,
are sealed with their run's data key at rest; the API, the engine and the data subject search read
them opened; an erasure destroys the key, so a copy of the rows taken before no longer opens; a
plain write is refused."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from rest_framework.test import APIClient

from approvals.models import Approval, ApprovalVote
from artifacts import services as artifact_services
from artifacts.models import Artifact
from history import subjects
from history.verify import verify
from runs.approval_effects import decide_approval
from runs.models import Run, RunEvent, RunStatus, Step
from runs.services import cancel_run, start_run
from runs.transitions import end_run, lock_run, record_event
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


def _raw_events(run) -> list[tuple]:
    """The run's events' (seq, message, data, skeleton) as PostgreSQL holds them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq, message, data, skeleton FROM runs_runevent WHERE run_id = %s ORDER BY seq", [run.pk]
        )
        return [(seq, m, d, json.loads(skeleton)) for seq, m, d, skeleton in cursor.fetchall()]


def _events_in(dump: str) -> str:
    sections = dump.split("\nCOPY ")
    return "".join(
        part.split("\n\\.\n", 1)[0] for part in sections if part.startswith("public.runs_runevent")
    )


def test_a_runs_events_and_error_are_sealed_at_rest_with_their_skeleton_kept_in_the_clear(asha, echo_agent):
    run = finished_run(asha, word=CUSTOMER)
    record_event(run.pk, "note", f"customer {CUSTOMER} called back", customer=CUSTOMER, to="noted")
    failed, _ = start_run(user=asha, agent="agent", input={"word": "other"})
    end_run(Run.objects.get(pk=failed.pk), RunStatus.FAILED, error=f"the bank refused {CUSTOMER}")

    raw = _raw_events(run)
    sealed = [bytes(v) for _seq, message, data, _skeleton in raw for v in (message, data) if v is not None]
    assert len(sealed) >= len(raw) and all(v[:1] == sealing.VALUE_VERSION for v in sealed)
    assert not [v for v in sealed if CUSTOMER.encode() in v]
    dump = _pg_dump()
    assert "runs_runevent" in dump and CUSTOMER not in _events_in(dump)
    with connection.cursor() as cursor:
        cursor.execute("SELECT error FROM runs_run WHERE id = %s", [failed.pk])
        error = bytes(cursor.fetchone()[0])
    assert error[:1] == sealing.VALUE_VERSION and CUSTOMER.encode() not in error
    assert Run.objects.get(pk=failed.pk).error == f"the bank refused {CUSTOMER}"
    # The skeleton: the keys about the platform's own state, in the clear; what was said, not.
    note = RunEvent.objects.get(run=run, kind="note")
    assert note.skeleton == {"to": "noted"} and note.data == {"customer": CUSTOMER, "to": "noted"}
    statuses = [skeleton["to"] for _seq, _m, _d, skeleton in raw if "from" in skeleton]
    assert statuses[-1] == RunStatus.SUCCEEDED
    # Read opened: the API's timeline, the stream's rows, the search.
    client = APIClient()
    client.force_authenticate(asha)
    timeline = client.get(f"/v1/runs/{run.pk}/events").json()
    shown = next(e for e in timeline if e["kind"] == "note")
    assert shown["message"] == f"customer {CUSTOMER} called back" and shown["data"]["customer"] == CUSTOMER
    found = subjects.find(run.tenant_id, CUSTOMER, scan=True)
    assert note.seq in found.events[run.pk] and failed.pk in found.runs
    assert subjects.index_due(batch=100) >= 2
    assert subjects.find(run.tenant_id, CUSTOMER).events == found.events  # through the keyed index
    with pytest.raises(TypeError, match="runs.runevent.message is sealed at rest"):
        RunEvent.objects.filter(run=run, message__contains=CUSTOMER).count()
    assert verify([run.pk, failed.pk]).ok


def test_after_an_erasure_events_keep_their_skeleton_and_copies_taken_before_no_longer_open(
    asha, compliance, echo_agent
):
    run = finished_run(asha, word=CUSTOMER)
    record_event(run.pk, "note", f"customer {CUSTOMER} called back", customer=CUSTOMER)
    backup = _raw_events(run)

    assert _erase(compliance).status_code == 201

    after = _raw_events(run)
    removal = RunEvent.objects.get(run=run, kind="content_removed")
    # Every event's message and data gone; the removal's own record is all skeleton.
    assert all(m is None and d is None for seq, m, d, _s in after if seq != removal.seq)
    assert removal.skeleton["why"] == "erasure" and removal.skeleton["note"].startswith("content erased")
    # The note carried the identifier: its skeleton too is the certificate's marker.
    note = RunEvent.objects.get(run=run, kind="note")
    assert note.skeleton == {"erased": removal.skeleton["certificate"]}
    kept = {seq: skeleton for seq, _m, _d, skeleton in after}
    assert [kept[seq] for seq, *_ in backup if seq != note.seq] == [
        skeleton for seq, _m, _d, skeleton in backup if seq != note.seq
    ]
    with connection.cursor() as cursor:  # the backup restored
        for seq, message, data, _skeleton in backup:
            cursor.execute(
                "UPDATE runs_runevent SET message = %s, data = %s WHERE run_id = %s AND seq = %s",
                [message, data, run.pk, seq],
            )
    sealing.forget_cached()
    events = list(RunEvent.objects.filter(run=run).order_by("seq"))
    assert all(e.message == "" and e.data == {} for e in events)  # nothing opens
    client = APIClient()
    client.force_authenticate(asha)
    shown = client.get(f"/v1/runs/{run.pk}/events").json()
    assert CUSTOMER not in str(shown)
    assert [e["data"] for e in shown if e["kind"] == "status"][-1]["to"] == RunStatus.SUCCEEDED
    assert subjects.find(run.tenant_id, CUSTOMER, scan=True).run_ids() == set()
    assert verify([run.pk]).ok


def test_an_artifacts_name_is_sealed_found_by_the_search_and_erased(asha, compliance, echo_agent):
    run = finished_run(asha)
    name = f"statement-{CUSTOMER}.txt"
    artifact = artifact_services.store(
        run=run, name=name, media_type="text/plain", content=b"balance 12.40", source=Artifact.Source.TOOL
    )
    # The same file stored again (a retried step) finds its row through the name's keyed digest.
    again = artifact_services.store(
        run=run, name=name, media_type="text/plain", content=b"balance 12.40", source=Artifact.Source.TOOL
    )
    other = artifact_services.store(
        run=run,
        name="other.txt",
        media_type="text/plain",
        content=b"balance 12.40",
        source=Artifact.Source.TOOL,
    )
    assert again.pk == artifact.pk and other.pk != artifact.pk

    with connection.cursor() as cursor:
        cursor.execute("SELECT name, name_key FROM artifacts_artifact WHERE id = %s", [artifact.pk])
        raw, key = cursor.fetchone()
    assert bytes(raw)[:1] == sealing.VALUE_VERSION and CUSTOMER.encode() not in bytes(raw)
    assert CUSTOMER not in key and len(key) == 64
    assert CUSTOMER not in "".join(
        part.split("\n\\.\n", 1)[0]
        for part in _pg_dump().split("\nCOPY ")
        if part.startswith("public.artifacts")
    )
    assert Artifact.objects.get(pk=artifact.pk).name == name
    client = APIClient()
    client.force_authenticate(asha)
    assert name in [a["name"] for a in client.get(f"/v1/runs/{run.pk}/artifacts").json()]
    # Only its name carries the identifier: found through its keyed words, and by reading.
    assert subjects.find(run.tenant_id, CUSTOMER).artifacts == {run.pk: [artifact.pk]}
    assert subjects.find(run.tenant_id, CUSTOMER, scan=True).artifacts == {run.pk: [artifact.pk]}

    assert _erase(compliance).status_code == 201

    names = dict(Artifact.objects.filter(run=run).values_list("pk", "name"))
    assert names == {artifact.pk: "", other.pk: ""}
    with connection.cursor() as cursor:
        cursor.execute("SELECT name, name_key FROM artifacts_artifact WHERE run_id = %s", [run.pk])
        assert sorted(cursor.fetchall()) == sorted([(None, str(artifact.pk)), (None, str(other.pk))])
    assert verify([run.pk]).ok


def test_a_run_whose_input_fails_its_seal_can_still_be_cancelled_and_its_input_is_refused(asha, echo_agent):
    """The engine's row reads open content when it is read, not when the row is: an operator can
    still cancel a run whose input was tampered with (another run's sealed input copied over it),
    and whatever reads the input is refused rather than served the other run's."""
    run, _ = start_run(user=asha, agent="agent", input={"word": CUSTOMER})
    other, _ = start_run(user=asha, agent="agent", input={"word": "someone else"})
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET input = (SELECT input FROM runs_run WHERE id = %s) WHERE id = %s",
            [other.pk, run.pk],
        )

    cancel_run(run_id=run.pk, actor=asha, reason="tampered")

    assert Run.objects.filter(pk=run.pk).values_list("status", flat=True).get() == RunStatus.CANCELLED
    locked = lock_run(run.pk)
    assert locked.status == RunStatus.CANCELLED
    with pytest.raises(SealedValueAltered):
        locked.input  # noqa: B018 (reading the attribute opens it)
    assert lock_run(other.pk).input == {"word": "someone else"}

    altered, _ = start_run(user=asha, agent="agent", input={"word": CUSTOMER})
    with connection.cursor() as cursor:  # one byte of the sealed input flipped
        cursor.execute(
            "UPDATE runs_run SET input = overlay(input placing '\\x00'::bytea from 40 for 1) WHERE id = %s",
            [altered.pk],
        )
    cancel_run(run_id=altered.pk, actor=asha, reason="tampered")
    assert Run.objects.filter(pk=altered.pk).values_list("status", flat=True).get() == RunStatus.CANCELLED
    with pytest.raises(SealedValueAltered):
        Run.objects.get(pk=altered.pk)  # the ORM opens a row's content as it loads it
