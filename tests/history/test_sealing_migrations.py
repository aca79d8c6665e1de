"""The migrations that seal steps', approvals', runs' and events' content (runs 0026-0029, approvals
0009, artifacts 0006), both ways on
a database holding runs: back, every column holds its content in the clear in its old type;
forward again, every value is sealed in place and reads as it did, and the history verifies."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection

from approvals.models import Approval
from artifacts import services as artifact_services
from artifacts.models import Artifact
from history.verify import verify
from runs.approval_effects import decide_approval
from runs.front.search import search
from runs.models import Run, RunEvent, RunStatus, Step
from runs.services import start_run
from runs.transitions import end_run
from tests import factories
from tests.conftest import drive
from tests.history.conftest import finished_run
from vault import sealing

pytestmark = pytest.mark.django_db(transaction=True)

CUSTOMER = "CUST-9031-MG"


SEALED = {
    "runs_step": ("arguments", "request", "result", "observation", "error", "resolution"),
    "approvals_approval": (
        "arguments",
        "original_arguments",
        "decision_reason",
        "correction_reason",
        "void_reason",
    ),
    "approvals_approvalvote": ("reason",),
    "runs_run": ("input", "metadata", "final_output", "error"),
    "runs_runevent": ("message", "data"),
    "artifacts_artifact": ("name",),
}


def _column_types() -> dict:
    """{table.column: type} of every sealed column."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name || '.' || column_name, data_type FROM information_schema.columns "
            "WHERE table_name = ANY(%s)",
            [list(SEALED)],
        )
        found = dict(cursor.fetchall())
    return {f"{t}.{c}": found[f"{t}.{c}"] for t, columns in SEALED.items() for c in columns}


def _read_back(runs, approval) -> dict:
    """What the runs' sealed columns read as, through the ORM."""
    return {
        "steps": [
            (s.seq, s.arguments, s.request, s.result, s.observation, s.error, s.resolution)
            for s in Step.objects.filter(run__in=runs).order_by("run_id", "seq")
        ],
        "approval": Approval.objects.values_list(
            "arguments", "original_arguments", "decision_reason", "correction_reason", "void_reason"
        ).get(pk=approval.pk),
        "votes": list(approval.votes.values_list("reason", flat=True)),
        "answers": list(
            Run.objects.filter(pk__in=[r.pk for r in runs])
            .order_by("pk")
            .values_list("input", "metadata", "final_output", "error")
        ),
        "artifacts": list(
            Artifact.objects.filter(run__in=runs).order_by("pk").values_list("name", "name_key")
        ),
        "events": [
            (e.run_id, e.seq, e.message, e.data, e.skeleton)
            for e in RunEvent.objects.filter(run__in=runs).order_by("run_id", "seq")
        ],
    }


def test_sealing_migrations_open_back_and_seal_again_in_place(asha, ravi, echo_agent):
    plain_run = finished_run(asha, word=CUSTOMER)
    type(echo_agent).objects.filter(pk=echo_agent.pk).update(approval_policy="always")
    factories.grant(echo_agent, approve=[ravi])
    run, _ = start_run(user=asha, agent="agent", input={"word": CUSTOMER})
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL
    approval = Approval.objects.get(run=run)
    decide_approval(approval_id=approval.pk, user=ravi, approve=True, reason=f"called {CUSTOMER}")
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    failed, _ = start_run(user=asha, agent="agent", input={"word": "other"})
    end_run(Run.objects.get(pk=failed.pk), RunStatus.FAILED, error=f"refused {CUSTOMER}")
    artifact_services.store(
        run=plain_run, name=f"note-{CUSTOMER}.txt", media_type="text/plain", content=b"x", source="tool"
    )
    before = _read_back([plain_run, run, failed], approval)
    assert all(kind == "bytea" for kind in _column_types().values())

    try:
        call_command("migrate", "runs", "0025_time_ordered_run_ids", verbosity=0)  # 0029 back to 0026
        call_command("migrate", "approvals", "0008_step_refs_without_db_keys", verbosity=0)
        call_command("migrate", "artifacts", "0005_words", verbosity=0)
        types = _column_types()
        assert types["runs_step.result"] == "jsonb" and types["runs_step.observation"] == "text", types
        assert types["runs_run.final_output"] == "text" and types["runs_run.error"] == "text"
        assert types["runs_run.input"] == "jsonb" and types["runs_run.metadata"] == "jsonb"
        assert types["runs_runevent.data"] == "jsonb" and types["runs_runevent.message"] == "text"
        assert types["artifacts_artifact.name"] == "text"
        assert (
            types["approvals_approval.arguments"] == "jsonb"
            and types["approvals_approvalvote.reason"] == "text"
        )
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM runs_step WHERE arguments::text LIKE %s", [f"%{CUSTOMER}%"])
            assert cursor.fetchone()[0] == 2  # the plain run's call and the approved one's, in the clear
            cursor.execute("SELECT decision_reason FROM approvals_approval WHERE id = %s", [approval.pk])
            assert cursor.fetchone()[0] == f"called {CUSTOMER}"
            cursor.execute("SELECT error FROM runs_run WHERE id = %s", [failed.pk])
            assert cursor.fetchone()[0] == f"refused {CUSTOMER}"
            cursor.execute(
                "SELECT count(*) FROM runs_runevent WHERE data->>'error' = %s", [f"refused {CUSTOMER}"]
            )
            assert cursor.fetchone()[0] == 1  # the failed run's last event, in the clear
            cursor.execute("SELECT name FROM artifacts_artifact WHERE run_id = %s", [plain_run.pk])
            assert cursor.fetchone()[0] == f"note-{CUSTOMER}.txt"
            # The run's input in the clear, and its plain words made again by the old trigger's text.
            cursor.execute(
                "SELECT input->>'word', search_words @@ to_tsquery('english', 'cust') FROM runs_run WHERE id = %s",
                [plain_run.pk],
            )
            assert cursor.fetchone() == (CUSTOMER, True)
    finally:
        call_command("migrate", verbosity=0)

    sealing.forget_cached()
    assert all(kind == "bytea" for kind in _column_types().values())
    with connection.cursor() as cursor:
        cursor.execute("SELECT arguments FROM runs_step WHERE arguments IS NOT NULL")
        assert all(bytes(v)[:1] == sealing.VALUE_VERSION for (v,) in cursor.fetchall())
    after = _read_back([plain_run, run, failed], approval)
    # The events' skeletons made again from their data as they were written.
    assert after == before and sorted((a[2], a[3]) for a in before["answers"]) == [
        ("", f"refused {CUSTOMER}"),
        ("all done", ""),
        ("all done", ""),
    ]
    assert sorted(a[0]["word"] for a in before["answers"]) == [CUSTOMER, CUSTOMER, "other"]
    # The search words are keyed again: no plain word, and the run search finds the runs.
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs_run WHERE search_words @@ to_tsquery('english', 'cust')")
        assert cursor.fetchone()[0] == 0
    found = search(Run.objects.all(), CUSTOMER, tenants=[asha.tenant_id])
    assert {r.pk for r in found} == {plain_run.pk, run.pk}
    assert before["votes"] == [f"called {CUSTOMER}"] and before["approval"][0] == {"say": CUSTOMER}
    with connection.cursor() as cursor:  # the data subject index's trigger that names the column is back
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgname = 'runs_run_subject_words_stale'")
        assert cursor.fetchone()[0] == 1
    assert verify([plain_run.pk, run.pk, failed.pk]).ok
