"""The data subject search's index (history/subjects.py, docs/history.md "The search's index"):
the search reads the runs the index names and those it does not cover, and finds what reading
every run finds; erasure takes a run's words with its content."""

from __future__ import annotations

import importlib
import io
import threading
import time

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.db import connection, transaction
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from approvals.models import Approval, ApprovalVote
from history import subjects
from history.erasure import erase_subject
from history.models import ErasureCertificate, SubjectWords
from history.tasks import index_subjects
from runs.approval_effects import decide_approval
from runs.models import TERMINAL, Run, RunStatus
from runs.services import start_run
from runs.transitions import atomic_with_events, record_event
from tests import factories
from tests.conftest import drive
from tests.history.conftest import finished_run
from vault import sealing

migration = importlib.import_module("history.migrations.0004_subject_words")
CUSTOMER = "CUST-4471-XK"
OTHER = "CUST-9002-QZ"


def _same(found: subjects.Found, scanned: subjects.Found) -> None:
    assert found.run_ids() == scanned.run_ids()
    assert found.counts() == scanned.counts()
    assert {r: sorted(s) for r, s in found.steps.items()} == {r: sorted(s) for r, s in scanned.steps.items()}
    assert {r: sorted(s) for r, s in found.events.items()} == {
        r: sorted(s) for r, s in scanned.events.items()
    }


@pytest.mark.django_db(transaction=True)
def test_the_search_reads_the_runs_the_index_names_and_those_it_does_not_cover_and_finds_what_the_scan_finds(
    tenant, asha, echo_agent
):
    carrying = [finished_run(asha, word=CUSTOMER) for _ in range(2)]
    others = [finished_run(asha, word=OTHER) for _ in range(4)]
    # Before the beat's pass, no run is covered (each has its row from its insert, empty): the
    # search reads all of them.
    assert SubjectWords.objects.filter(run__in=carrying + others, event_seq__isnull=True).count() == 6
    assert subjects.uncovered(tenant.pk) == {r.pk for r in carrying + others}

    assert index_subjects() == 6
    assert settings.CELERY_BEAT_SCHEDULE["history_subject_index"]["task"] == "history.tasks.index_subjects"
    assert subjects.index_due(batch=100) == 0  # a second pass finds nothing to do

    assert subjects.uncovered(tenant.pk) == set()
    assert subjects.candidates(tenant.pk, CUSTOMER) == {r.pk for r in carrying}
    assert subjects.candidates(tenant.pk, "CUST-4471-XX") == set()  # a word it lacks rules a run out
    found = subjects.find(tenant.pk, CUSTOMER)
    assert found.run_ids() == {r.pk for r in carrying}
    _same(found, subjects.find(tenant.pk, CUSTOMER, scan=True))

    # A live run is never in the index: it is read whole.
    type(echo_agent).objects.filter(pk=echo_agent.pk).update(approval_policy="always")
    live, _ = start_run(user=asha, agent="agent", input={"word": CUSTOMER})
    assert drive(live.pk).status == RunStatus.WAITING_APPROVAL
    assert subjects.uncovered(tenant.pk) == {live.pk}
    assert subjects.index_due(batch=100) == 0
    found = subjects.find(tenant.pk, CUSTOMER)
    assert found.run_ids() == {r.pk for r in carrying} | {live.pk}
    _same(found, subjects.find(tenant.pk, CUSTOMER, scan=True))

    # An ended run that changes (an event: every content write makes one) is read whole until
    # the next pass, then named by its new words.
    changed = others[0]
    with atomic_with_events():
        record_event(changed.pk, "note", f"customer {CUSTOMER} called back")
    assert subjects.uncovered(tenant.pk) == {live.pk, changed.pk}
    assert changed.pk in subjects.find(tenant.pk, CUSTOMER).run_ids()
    assert subjects.index_due(batch=100) == 1
    assert subjects.candidates(tenant.pk, CUSTOMER) == {r.pk for r in carrying} | {changed.pk}
    _same(subjects.find(tenant.pk, CUSTOMER), subjects.find(tenant.pk, CUSTOMER, scan=True))

    # Asked about some runs only (a subject hold's check), the index narrows those.
    within = [carrying[0].pk, others[1].pk]
    assert subjects.find(tenant.pk, CUSTOMER, within=within).run_ids() == {carrying[0].pk}
    assert subjects.runs_carrying(tenant.pk, CUSTOMER, within=[str(others[1].pk)]) == set()


def XK(tenant) -> int:
    """The index's hash of the word `XK` (of CUSTOMER): keyed with the tenant's word key."""
    return sealing.word_hashes(tenant.pk, ["XK"])[0]


def _holding(word_hash: int) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM history_subject_words WHERE words @> ARRAY[%s::bigint]", [word_hash]
        )
        return cursor.fetchone()[0]


def _holding_plain(word: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM history_subject_words WHERE words @> ARRAY[hashtextextended(%s, 0)]", [word]
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_erasure_takes_a_runs_words_with_its_content_and_the_next_pass_indexes_what_is_left(
    tenant, asha, echo_agent
):
    carrying = [finished_run(asha, word=CUSTOMER) for _ in range(3)]
    kept = finished_run(asha, word=OTHER)
    subjects.index_due(batch=100)
    assert _holding(XK(tenant)) == 3
    # Keyed: PostgreSQL's own hash of the word (what a copy of the table could test a guess with) is
    # in no row.
    assert _holding_plain("XK") == 0

    certificate = erase_subject(tenant_id=tenant.pk, identifier=CUSTOMER, request_ref="DSR-9", actor=asha)

    assert sorted(certificate.runs) == sorted(str(r.pk) for r in carrying)
    # No hash of an erased word is kept: the erased runs' rows were emptied with their content.
    assert _holding(XK(tenant)) == 0
    assert SubjectWords.objects.filter(run__in=carrying, event_seq__isnull=True).count() == 3
    assert SubjectWords.objects.get(run=kept).event_seq is not None
    assert subjects.uncovered(tenant.pk) == {r.pk for r in carrying}
    assert subjects.index_due(batch=100) == 3
    assert _holding(XK(tenant)) == 0
    assert subjects.find(tenant.pk, CUSTOMER).run_ids() == set()
    # The run deleted by skeleton retention takes its row with it.
    kept.delete()
    assert not SubjectWords.objects.filter(run_id=kept.pk).exists()


ALPHABET = 'aZ09_-.@ /:"\\\n\té中Ж—\u2028'


@pytest.mark.django_db
@hypothesis_settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    start=st.integers(0, 40),
    length=st.integers(3, 12),
)
def test_a_text_carrying_an_identifier_as_a_whole_token_holds_every_word_of_it(text, start, length):
    """The index's superset rule, over raw text and JSON as PostgreSQL prints it: wherever the
    search's regular expression matches, the text's words include the identifier's."""
    identifier = text[start : start + length].strip()
    if len(identifier) < 3 or not subjects.words(identifier):
        return
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT t ~ %(p)s, coalesce((
                SELECT array_agg(DISTINCT hashtextextended(m[1], 0)) FROM regexp_matches(t, %(word)s, 'g') m
            ), '{}') @> (SELECT array_agg(hashtextextended(w, 0)) FROM unnest(%(words)s::text[]) w)
            FROM (SELECT %(text)s::text AS t UNION ALL SELECT to_jsonb(%(text)s::text)::text) texts
            """,
            {
                "p": subjects.pattern(identifier),
                "word": subjects.WORD,
                "words": subjects.words(identifier),
                "text": text,
            },
        )
        for matches, indexed in cursor.fetchall():
            assert indexed or not matches, (text, identifier)


@pytest.mark.django_db(transaction=True)
def test_verify_history_names_an_index_row_edited_to_hide_a_run_from_a_search(tenant, asha, echo_agent):
    carrying = finished_run(asha, word=CUSTOMER)
    finished_run(asha, word=OTHER)
    subjects.index_due(batch=100)
    out = io.StringIO()
    call_command("verify_history", "--subject-index", stdout=out)
    assert "OK:" in out.getvalue() and "FAIL" not in out.getvalue()

    with connection.cursor() as cursor:  # a database administrator takes one word out
        cursor.execute(
            "UPDATE history_subject_words SET words = array_remove(words, %s) WHERE run_id = %s",
            [XK(tenant), carrying.pk],
        )
    assert subjects.find(tenant.pk, CUSTOMER).run_ids() == set()  # the search now misses it
    assert subjects.find(tenant.pk, CUSTOMER, scan=True).run_ids() == {carrying.pk}

    out = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("verify_history", "--subject-index", stdout=out)
    assert exited.value.code == 1
    assert f"FAIL run {carrying.pk}: its index row holds other words than its content's" in out.getvalue()
    assert subjects.mismatched() == [(carrying.pk, "its index row holds other words than its content's")]

    # Deleting the row, or marking it covered past a change with the trigger bypassed, is named too.
    other = finished_run(asha, word=OTHER)
    subjects.index_due(batch=100)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM history_subject_words WHERE run_id = %s", [carrying.pk])
        cursor.execute("ALTER TABLE runs_run DISABLE TRIGGER runs_run_subject_words_stale")
        with atomic_with_events():
            record_event(other.pk, "note", f"customer {CUSTOMER} called back")
        cursor.execute("ALTER TABLE runs_run ENABLE TRIGGER runs_run_subject_words_stale")
    assert subjects.find(tenant.pk, CUSTOMER).run_ids() == set()
    seq = type(other).objects.get(pk=other.pk).event_seq
    assert dict(subjects.mismatched()) == {
        carrying.pk: "it has no row in the data subject search's index, so a search does not read it",
        other.pk: f"its index row claims to cover it at event {seq - 1}, but it is succeeded at event {seq}",
    }


def test_the_triggers_name_the_statuses_that_end_a_run():
    """Migration 0004's trigger marks an ended run's row stale: its list is the engine's."""
    named = set(migration.TERMINAL.strip("()").replace("'", "").split(", "))
    assert named == set(TERMINAL)


@pytest.mark.django_db(transaction=True)
def test_a_dual_control_votes_reason_is_found_indexed_and_erased(tenant, asha, ravi, echo_agent):
    type(echo_agent).objects.filter(pk=echo_agent.pk).update(approval_policy="always")
    factories.grant(echo_agent, approve=[ravi])
    run, _ = start_run(user=asha, agent="agent", input={"word": OTHER})
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL
    approval = Approval.objects.get(run=run)
    decide_approval(approval_id=approval.pk, user=ravi, approve=True, reason=f"checked {CUSTOMER} by phone")
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    # Only the vote carries it now (the decision's own copy of the reason taken away).
    Approval.objects.filter(pk=approval.pk).update(decision_reason="")
    assert subjects.find(tenant.pk, CUSTOMER).approvals == {run.pk: [approval.pk]}  # read whole
    subjects.index_due(batch=100)
    assert subjects.candidates(tenant.pk, CUSTOMER) == {run.pk}
    assert subjects.find(tenant.pk, CUSTOMER).approvals == {run.pk: [approval.pk]}  # through the index

    certificate = erase_subject(tenant_id=tenant.pk, identifier=CUSTOMER, request_ref="DSR-7", actor=asha)

    assert certificate.runs == [str(run.pk)] and certificate.counts["approvals"] == 1
    assert list(ApprovalVote.objects.filter(approval=approval).values_list("reason", flat=True)) == [""]
    assert subjects.find(tenant.pk, CUSTOMER, scan=True).run_ids() == set()


def _in_thread(work):
    """Run `work` in a thread of its own (its own connection); (thread, box of its result or error)."""
    box: dict = {}

    def body():
        try:
            box["result"] = work()
        except BaseException as exc:
            box["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=body)
    thread.start()
    return thread, box


@pytest.mark.django_db(transaction=True)
def test_a_pass_and_an_erasure_of_the_same_run_take_turns_and_no_erased_word_stays(tenant, asha, echo_agent):
    """The pass indexes a run under a share lock; the erasure takes the run's row lock: whichever is
    second waits (the erasure) or skips (the pass), and the index never keeps an erased word."""
    run = finished_run(asha, word=CUSTOMER)
    indexing, erasing = threading.Event(), threading.Event()

    def slow_pass():  # the beat's pass on this run, held open after writing its words
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT tenant_id, event_seq FROM runs_run WHERE id = %s FOR SHARE SKIP LOCKED", [run.pk]
            )
            tenant_id, seq = cursor.fetchone()
            subjects.index_run(cursor, run.pk, tenant_id, seq)
            indexing.set()
            assert erasing.wait(10)

    passing, passed = _in_thread(slow_pass)
    assert indexing.wait(10)
    eraser, erased = _in_thread(
        lambda: erase_subject(tenant_id=tenant.pk, identifier=CUSTOMER, request_ref="DSR-7", actor=asha)
    )
    eraser.join(1.0)
    assert eraser.is_alive(), "the erasure must wait for the pass that holds the run"
    erasing.set()
    passing.join(10), eraser.join(30)
    assert "error" not in passed and "error" not in erased, (passed, erased)
    row = SubjectWords.objects.get(run=run)
    assert row.event_seq is None and not row.words  # the pass's words went with the content
    assert run.pk not in subjects.candidates(tenant.pk, CUSTOMER)

    # The other way round: a run locked by a writer is skipped by the pass, which does not wait.
    locked, unlock = threading.Event(), threading.Event()

    def writer():
        with transaction.atomic():
            list(Run.objects.select_for_update().filter(pk=run.pk))
            locked.set()
            assert unlock.wait(10)

    holder, held = _in_thread(writer)
    assert locked.wait(10)
    started = time.monotonic()
    assert subjects.index_due(batch=100) == 0
    assert time.monotonic() - started < 5
    unlock.set()
    holder.join(10)
    assert "error" not in held
    assert subjects.index_due(batch=100) == 1  # the next pass indexes what is left: nothing of it
    assert run.pk not in subjects.candidates(tenant.pk, CUSTOMER)


@pytest.mark.django_db
def test_an_identifier_too_short_to_be_told_apart_is_refused_with_a_field_error(tenant, asha):
    user = factories.make_user(tenant, "clara", staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="history", codename="add_erasurecertificate")
    )
    client = APIClient()
    client.force_authenticate(type(user).objects.get(pk=user.pk))

    response = client.post(
        "/v1/history/erasures", {"identifier": " 7 ", "request_ref": "DSR-8"}, format="json"
    )

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "identifier_too_short"
    assert error["fields"] == {"identifier": ["an identifier must be at least 3 characters"]}
    assert not ErasureCertificate.objects.exists()
