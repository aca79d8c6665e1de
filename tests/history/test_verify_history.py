"""Tamper evidence (issue 37, part 6): verify_history names the run and the event of an edited,
deleted, reordered or inserted event; an untouched history verifies; a run written after a
checkpoint and then rewritten whole is caught by the checkpoint's signed head."""

from __future__ import annotations

import base64
import io
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.management import call_command
from django.db import connection

from core import chain
from history.checkpoints import statement_digest, take_checkpoint
from history.models import Checkpoint
from history.verify import verify, verify_run
from runs.models import Run, RunEvent, Step
from runs.transitions import record_event
from tests.history.conftest import finished_run
from vault.fields import SealedValueAltered, seal

pytestmark = pytest.mark.django_db(transaction=True)


def _verify_command(*args) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("verify_history", *args, stdout=out)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    return 0, out.getvalue()


def _sql(text: str, params=()) -> None:
    with connection.cursor() as cursor:
        cursor.execute(text, params)


def test_it_verifies_an_untouched_history_from_each_runs_first_event(asha, echo_agent):
    runs = [finished_run(asha, word=w) for w in ("one", "two")]
    record_event(runs[0].pk, "note", "written outside a transaction")
    take_checkpoint()
    finished_run(asha, word="three")  # after the checkpoint: chained, not yet checkpointed

    code, out = _verify_command()

    assert code == 0, out
    assert out.splitlines()[-1].startswith("OK: 3 runs,"), out
    first = RunEvent.objects.filter(run=runs[0]).order_by("seq").first()
    body = chain.event_body(
        runs[0].pk, first.at, first.kind, first.step_seq, first.actor_id, first.content_digest
    )
    assert first.seq == 1 and bytes(first.chain_hash) == chain.link(chain.GENESIS, 1, body)
    assert bytes(Run.objects.get(pk=runs[0].pk).chain_head) == bytes(
        RunEvent.objects.filter(run=runs[0]).order_by("-seq").first().chain_hash
    )


def test_a_tool_result_is_written_from_the_text_its_digest_was_made_of_and_reads_back_equal(asha, echo_agent):
    word = 'Zoë «日本» "quoted" \\ back\nslash \u2028 end'
    run = finished_run(asha, word=word)
    tool = Step.objects.get(run=run, kind="tool")
    assert tool.result["structured"] == {"say": word}
    written = RunEvent.objects.get(run=run, step_seq=tool.seq, skeleton__to="succeeded")
    assert written.data["content"]["result"] == chain.digest(tool.result)
    _, out = _verify_command()
    assert out.splitlines()[-1].startswith("OK: 1 runs,"), out


def test_it_names_a_tool_result_edited_in_the_database(asha, echo_agent):
    # Sealed anew by someone holding the run's key: it opens, but not to what the chain bound.
    run = finished_run(asha)
    tool = Step.objects.get(run=run, kind="tool")
    forged = seal(
        Step, "result", run.pk, {**tool.result, "structured": {"say": "forged"}}, tenant=run.tenant_id
    )
    Step.objects.filter(pk=tool.pk).update(result=forged)

    code, out = _verify_command()

    assert code == 1
    assert f"FAIL run {run.pk} event " in out and f"step {tool.seq}'s result was edited" in out, out
    assert out.count("FAIL run") == 1, out


def test_it_names_a_sealed_tool_result_whose_bytes_were_changed_or_copied_from_another_run(asha, echo_agent):
    # Without the key: bytes changed in place, or another run's sealed value put in their place.
    run, other = finished_run(asha), finished_run(asha, word="other")
    tool = Step.objects.get(run=run, kind="tool")
    _sql(
        "UPDATE runs_step SET result = overlay(result placing '\\x00'::bytea from 40 for 1) WHERE id = %s",
        [tool.pk],
    )
    _sql(
        "UPDATE runs_step SET observation = (SELECT observation FROM runs_step WHERE run_id = %s AND kind = 'tool') "
        "WHERE id = %s",
        [other.pk, tool.pk],
    )

    findings = " ".join(str(f) for f in verify_run(run.pk)[0])

    assert f"step {tool.seq}'s result fails its seal: altered, or copied from elsewhere" in findings, findings
    assert f"step {tool.seq}'s observation fails its seal: altered, or copied from elsewhere" in findings, (
        findings
    )
    assert findings.count(f"run {run.pk}") == 2, findings
    # Served nowhere: reading the step is refused, not answered with what the bytes hold.
    with pytest.raises(SealedValueAltered):
        Step.objects.get(pk=tool.pk)


def test_it_names_an_events_content_edited_and_its_skeleton_edited(asha, echo_agent):
    run = finished_run(asha)
    # Without the keys: the bytes written do not open.
    _sql("UPDATE runs_runevent SET message = 'nothing happened' WHERE run_id = %s AND seq = 3", [run.pk])
    # With them: sealed anew, opening, but not what the chain took.
    resealed = seal(RunEvent, "message", run.pk, "nothing happened", tenant=run.tenant_id)
    RunEvent.objects.filter(run=run, seq=4).update(message=resealed)
    _sql("UPDATE runs_runevent SET kind = 'note' WHERE run_id = %s AND seq = 5", [run.pk])
    # The skeleton kept in the clear, changed while the content still says otherwise.
    status = RunEvent.objects.filter(run=run, kind="status").order_by("seq").last()
    RunEvent.objects.filter(pk=status.pk).update(skeleton={**status.skeleton, "to": "cancelled"})

    findings = [str(f) for f in verify_run(run.pk)[0]]

    assert sorted(findings) == sorted(
        [
            f"run {run.pk} event 3: content edited: its message or data fail their seal (altered, or copied "
            "from elsewhere)",
            f"run {run.pk} event 4: content edited: its message or data no longer match the digest in the chain",
            f"run {run.pk} event 5: edited: its skeleton fields or content digest no longer give its chain hash",
            f"run {run.pk} event {status.seq}: skeleton edited: its kept keys differ from its data's (statuses, "
            "tools, digests)",
        ]
    )


def test_it_names_an_edit_whose_digest_was_recomputed(asha, echo_agent):
    run = finished_run(asha)
    event = RunEvent.objects.get(run=run, seq=4)
    forged = chain.content_digest("forged", event.data)
    sealed = seal(RunEvent, "message", run.pk, "forged", tenant=run.tenant_id)
    RunEvent.objects.filter(pk=event.pk).update(message=sealed, content_digest=forged)

    findings = [str(f) for f in verify_run(run.pk)[0]]

    assert findings == [
        f"run {run.pk} event 4: edited: its skeleton fields or content digest no longer give its chain hash"
    ]


def test_it_names_a_deleted_event_in_the_middle_and_at_the_end(asha, echo_agent):
    run = finished_run(asha)
    last = Run.objects.get(pk=run.pk).event_seq
    RunEvent.objects.filter(run=run, seq__in=[4, last]).delete()

    code, out = _verify_command("--run", str(run.pk))

    assert code == 1
    assert f"run {run.pk} event 4: deleted: the run's events jump from 3 to 5 (missing 4)" in out, out
    assert f"run {run.pk} event {last}: deleted: the run counted {last} events, {last - 1} remain" in out, out


def test_it_names_two_swapped_events(asha, echo_agent):
    run = finished_run(asha)
    # Swap seq 3 and 4 (through a free number: (run, seq) is unique).
    _sql("UPDATE runs_runevent SET seq = 100000 WHERE run_id = %s AND seq = 3", [run.pk])
    _sql("UPDATE runs_runevent SET seq = 3 WHERE run_id = %s AND seq = 4", [run.pk])
    _sql("UPDATE runs_runevent SET seq = 4 WHERE run_id = %s AND seq = 100000", [run.pk])

    findings = [str(f) for f in verify_run(run.pk)[0]]

    assert len(findings) == 2, findings
    assert findings[0].startswith(
        f"run {run.pk} event 3: out of place: its hash says it was written as event 4"
    )
    assert findings[1].startswith(
        f"run {run.pk} event 4: out of place: its hash says it was written as event 3"
    )


def test_it_names_an_inserted_event_at_the_end_and_in_the_middle(asha, echo_agent):
    run = finished_run(asha)
    last = Run.objects.get(pk=run.pk).event_seq
    template = RunEvent.objects.get(run=run, seq=2)
    # At the end, with a plausible digest but no valid link.
    RunEvent.objects.create(
        run=run,
        seq=last + 1,
        kind="note",
        message="approved by phone",
        content_digest="0" * 64,
        chain_hash=bytes(32),
    )
    code, out = _verify_command("--run", str(run.pk))
    assert code == 1
    assert (
        f"run {run.pk} event {last + 1}: inserted or rewritten: it chains from no event of the run" in out
    ), out
    assert f"event {last + 1}: inserted: the run counted {last} events, {last + 1} are there" in out, out

    # In the middle: later events renumbered to make room (the counter moved too).
    RunEvent.objects.filter(run=run, seq=last + 1).delete()
    for seq in range(last, 2, -1):
        _sql("UPDATE runs_runevent SET seq = seq + 1 WHERE run_id = %s AND seq = %s", [run.pk, seq])
    Run.objects.filter(pk=run.pk).update(event_seq=last + 1)
    RunEvent.objects.create(
        run=run,
        seq=3,
        kind=template.kind,
        message="inserted",
        data={},
        content_digest=chain.content_digest("inserted", {}),
    )

    findings = [str(f) for f in verify_run(run.pk)[0]]

    assert findings[0] == f"run {run.pk} event 3: inserted: it carries no chain hash"
    assert findings[1].startswith(
        f"run {run.pk} event 4: out of place: its hash says it was written as event 3"
    )


def test_a_whole_chain_rewritten_after_a_checkpoint_is_caught_by_the_signed_head(asha, echo_agent):
    run = finished_run(asha)
    take_checkpoint()
    # The administrator (holding the keys too) edits content and recomputes every digest, link and
    # the head.
    forged = seal(RunEvent, "message", run.pk, "forged", tenant=run.tenant_id)
    RunEvent.objects.filter(run=run, seq=2).update(message=forged)
    head = chain.GENESIS
    for event in RunEvent.objects.filter(run=run).order_by("seq"):
        event.content_digest = chain.content_digest(event.message, event.data)
        body = chain.event_body(
            run.pk, event.at, event.kind, event.step_seq, event.actor_id, event.content_digest
        )
        head = chain.link(head, event.seq, body)
        RunEvent.objects.filter(pk=event.pk).update(content_digest=event.content_digest, chain_hash=head)
    Run.objects.filter(pk=run.pk).update(chain_head=head)

    findings = [str(f) for f in verify().findings]

    last = Run.objects.get(pk=run.pk).event_seq
    assert findings == [
        f"run {run.pk} event {last}: differs from signed checkpoint 1: the history up to this event was rewritten"
    ]


def test_a_forged_checkpoint_or_leaf_is_named(asha, echo_agent):
    finished_run(asha)
    first = take_checkpoint()
    finished_run(asha, word="again")
    second = take_checkpoint()
    assert second.number == 2 and second.previous == statement_digest(first)
    assert take_checkpoint() is None  # no head moved
    assert verify().ok

    # A leaf edited to match a rewritten chain no longer gives the signed root.
    _sql("UPDATE history_checkpointleaf SET head = %s WHERE checkpoint_id = %s", [bytes(32), second.pk])
    problems = [f.problem for f in verify().findings]
    assert "checkpoint 2: its leaves no longer give the signed root" in problems

    # A checkpoint re-signed with a key of the administrator's own, its public half stored with it.
    forger = Ed25519PrivateKey.generate()
    forged_jwk = {
        **first.public_jwk,
        "x": base64.urlsafe_b64encode(forger.public_key().public_bytes_raw()).rstrip(b"=").decode(),
    }
    signature = base64.urlsafe_b64encode(forger.sign(first.statement.encode())).rstrip(b"=").decode()
    Checkpoint.objects.filter(pk=first.pk).update(public_jwk=forged_jwk, signature=signature)
    problems = [f.problem for f in verify().findings]
    assert f"checkpoint 1: its key {first.kid} is not the key published under that id" in problems

    Checkpoint.objects.filter(pk=first.pk).update(public_jwk=first.public_jwk, signature="A" * 86)
    problems = [f.problem for f in verify().findings]
    assert "checkpoint 1: the signature does not verify" in problems


def test_verify_against_a_pinned_jwks(asha, echo_agent, tmp_path):
    from authority import keys

    finished_run(asha)
    take_checkpoint()
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(keys.jwks()))
    assert _verify_command("--jwks", str(jwks))[0] == 0

    jwks.write_text(json.dumps({"keys": []}))
    code, out = _verify_command("--jwks", str(jwks))
    assert code == 1 and "checkpoint 1: key " in out and "is not among the pinned keys" in out


def test_it_names_a_runs_sealed_answer_whose_bytes_were_changed(asha, echo_agent):
    run = finished_run(asha)
    _sql(
        "UPDATE runs_run SET final_output = overlay(final_output placing '\\x00'::bytea from 40 for 1) WHERE id = %s",
        [run.pk],
    )

    findings = [str(f) for f in verify_run(run.pk)[0]]

    assert (
        len(findings) == 1
        and "the run's final_output fails its seal: altered, or copied from elsewhere" in findings[0]
    )


def test_it_names_a_runs_sealed_input_altered_or_resealed_and_metadata_copied_from_another_run(
    asha, echo_agent
):
    run, other = finished_run(asha, word="one"), finished_run(asha, word="two")
    _sql(
        "UPDATE runs_run SET input = overlay(input placing '\\x00'::bytea from 40 for 1) WHERE id = %s",
        [run.pk],
    )
    # With the key: sealed anew, opening, but not what the run's first event bound.
    resealed = seal(Run, "input", other.pk, {"word": "three"}, tenant=other.tenant_id)
    Run.objects.filter(pk=other.pk).update(input=resealed)
    # Another run's metadata (sealed with that run's key) copied in.
    metadata = seal(Run, "metadata", other.pk, {"ticket": "T-1"}, tenant=other.tenant_id)
    Run.objects.filter(pk=run.pk).update(metadata=metadata)

    first = [str(f) for f in verify_run(run.pk)[0]]
    second = [str(f) for f in verify_run(other.pk)[0]]

    assert sorted(first) == sorted(
        [
            f"run {run.pk} event 1: the run's input fails its seal: altered, or copied from elsewhere",
            f"run {run.pk} event 1: the run's metadata fails its seal: altered, or copied from elsewhere",
        ]
    ), first
    assert second == [
        f"run {other.pk} event 1: the run's input was edited: it no longer matches the digest event 1 bound"
    ], second
