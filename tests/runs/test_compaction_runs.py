"""Compaction in the engine (issue 42): a long run's early result is folded, the model reads it
back with read_result and finishes right; the timeline shows each fold once; the rules that read
the step log (replaying a repeated call) are unchanged by what the prompt holds."""

from __future__ import annotations

import pytest

from approvals.models import Approval
from llm.compaction import Fold
from runs.approval_effects import decide_approval
from runs.engine import compacted
from runs.models import RunEvent, RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI
from tests.servers import BankServer

pytestmark = pytest.mark.django_db(transaction=True)

# The code sits past the first 100 characters, so a record's line does not show it: only the
# stored result does.
VAULT = {"note": "x" * 300 + " code=ZX81 " + "y" * 50}
# Small budgets, so that a few dozen short steps fold and merge into the digest.
CONTEXT = {"compact_after_tokens": 300, "compact_record_tokens": 300}
LIMITS = {"max_steps": 100, "max_tool_calls": 50}


def _scripted_agent(tenant, asha, builtins, *, config: dict, context: dict | None = None):
    echo, noop = builtins["echo"], builtins["noop"]
    factories.grant(echo, use=[asha])
    factories.grant(noop, use=[asha])
    endpoint = factories.make_endpoint(tenant, config=config)
    factories.make_agent(
        tenant, endpoint=endpoint, tools=[echo, noop], context=context or CONTEXT, limits=LIMITS
    )
    return echo, noop


def test_a_long_run_reads_its_folded_early_result_back_and_answers_from_it(tenant, asha, builtins):
    echo = builtins["echo"]
    _scripted_agent(
        tenant,
        asha,
        builtins,
        config={
            "turns": [{"tool_calls": [{"name": echo.name, "arguments": VAULT}]}],
            "auto_tool": builtins["noop"].name,
            "auto_tool_turns": 30,
            "recall": {"tool": echo.name, "pattern": r"code=(\w+)", "text": "the code is {0}"},
        },
    )
    run, _ = start_run(user=asha, agent="agent", input={"case": "long"})
    run = drive(run.pk)

    assert run.status == "succeeded", run.error
    assert run.final_output == "the code is ZX81"
    # The model counted the results folded into its records: 30 results (the echo and 29 noops),
    # then the recall; its script ran once, not again.
    assert Step.objects.filter(run=run, tool_name=builtins["noop"].name).count() == 29
    read = Step.objects.get(run=run, tool_name="read_result")
    assert (read.status, read.arguments) == ("succeeded", {"step": 2})
    assert "code=ZX81" in read.observation

    events = list(RunEvent.objects.filter(run=run, kind=compacted.KIND).order_by("seq"))
    assert len(events) >= 5
    assert len({e.data["at"] for e in events}) == len(events)  # each fold recorded once
    for event in events:
        assert event.data["tokens_after"] < event.data["tokens_before"], event.message
        assert event.message.startswith(f"history compacted for step {event.step_seq}: steps ")
    # The first fold took the early result's turn.
    assert (events[0].data["first_step"], events[0].data["turns"]) == (2, events[0].data["turns"])
    # The last call's request stayed small: its records and its live turn, not 60-odd messages.
    last = Step.objects.filter(run=run, kind="model").order_by("-seq").first()
    assert last.request["messages"] <= 8


def test_with_masking_alone_the_same_script_reads_it_back_through_the_masked_note(tenant, asha, builtins):
    """The control: the policy before compaction masks the early result in place, and the note
    names its step. Both policies keep the task's success; only one keeps the request flat."""
    echo = builtins["echo"]
    _scripted_agent(
        tenant,
        asha,
        builtins,
        config={
            "turns": [{"tool_calls": [{"name": echo.name, "arguments": VAULT}]}],
            "auto_tool": builtins["noop"].name,
            "auto_tool_turns": 30,
            "recall": {"tool": echo.name, "pattern": r"code=(\w+)", "text": "the code is {0}"},
        },
        context={"compaction": "off"},
    )
    run, _ = start_run(user=asha, agent="agent", input={"case": "long"})
    run = drive(run.pk)
    assert (run.status, run.final_output) == ("succeeded", "the code is ZX81")
    assert Step.objects.get(run=run, tool_name="read_result").arguments == {"step": 2}
    assert not RunEvent.objects.filter(run=run, kind=compacted.KIND).exists()
    last = Step.objects.filter(run=run, kind="model").order_by("-seq").first()
    assert last.request["messages"] > 60  # every turn and stub still sent


def test_a_repeated_call_is_answered_from_the_step_log_after_its_turn_was_folded(tenant, asha, builtins):
    """Loop detection and replays read the step log, not the prompt: the call of step 2, folded
    away long before, is still found when the model makes it again."""
    echo, noop = builtins["echo"], builtins["noop"]
    turns = [{"tool_calls": [{"name": echo.name, "arguments": VAULT}]}]
    turns += [{"tool_calls": [{"name": noop.name, "arguments": {"i": i}}]} for i in range(12)]
    turns += [{"tool_calls": [{"name": echo.name, "arguments": VAULT}]}, {"text": "done"}]
    _scripted_agent(tenant, asha, builtins, config={"turns": turns})
    run, _ = start_run(user=asha, agent="agent", input={"case": "repeat"})
    run = drive(run.pk)

    assert run.status == "succeeded", run.error
    assert RunEvent.objects.filter(run=run, kind=compacted.KIND).exists()
    again = Step.objects.filter(run=run, tool_name=echo.name).order_by("seq").last()
    assert again.seq > 2 and again.replayed_from_seq == 2


def test_a_fold_planned_again_is_recorded_once(tenant, asha, builtins):
    """A call retried at the same call point (a provider error, a wait for budget) makes the same
    fold: the timeline says so once."""
    _scripted_agent(tenant, asha, builtins, config={"turns": [{"text": "done"}]})
    run, _ = start_run(user=asha, agent="agent", input={})
    fold = Fold(
        start=1, end=5, at=7, record="[platform: ...]", lines=(), turns=2, live_before=900, live_after=300
    )
    compacted.record(run, 7, fold)
    compacted.record(run, 9, fold)
    other = Fold(
        start=5, end=9, at=11, record="[platform: ...]", lines=(), turns=2, live_before=900, live_after=300
    )
    compacted.record(run, 11, other)
    assert list(
        RunEvent.objects.filter(run=run, kind=compacted.KIND)
        .order_by("seq")
        .values_list("step_seq", flat=True)
    ) == [7, 11]


def test_over_the_openai_wire_a_refused_call_is_named_in_the_record_that_folds_it(tenant, asha, builtins):
    """The real engine and client against the fake server: the request after the fold carries the
    input and the record as one user turn, then the live turn; the refusal is in the record; the
    fake's prefix cache reads the record back on the next call."""
    echo, noop, clock = builtins["echo"], builtins["noop"], builtins["clock"]
    factories.grant(noop, use=[asha])  # not clock: its call is denied
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    try:
        endpoint = factories.make_endpoint(tenant, name="gpt", kind="openai", base_url=fake.base_url)
        factories.make_agent(
            tenant, endpoint=endpoint, tools=[echo, noop, clock], context=CONTEXT, limits=LIMITS
        )
        fake.queue(
            {"tool_calls": [{"name": clock.name, "arguments": {}}]},
            *({"tool_calls": [{"name": noop.name, "arguments": {"i": i}}]} for i in range(12)),
            {"text": "done"},
        )
        run, _ = start_run(user=asha, agent="agent", input={"case": "refused"})
        run = drive(run.pk)
        assert run.status == "succeeded", run.error
    finally:
        fake.stop()

    assert Step.objects.get(run=run, seq=2).status == "denied"
    last = fake.requests[-1]["messages"]
    assert [m["role"] for m in last[:2]] == ["system", "user"]
    assert last[1]["content"].startswith('{"case": "refused"}\n\n[platform: ')
    folded = "\n".join(m["content"] for m in fake.requests[-1]["messages"] if m["role"] == "user")
    assert f"step 2 {clock.name} {{}} -> denied: " in folded or f"{clock.name}: 1 result, step 2" in folded
    assert last[2]["role"] == "assistant"  # then the live turns, each call before its result
    assert len(last) < 10
    # A call after a fold starts with the fold's request: the input and records are read back.
    folds = [e.step_seq for e in RunEvent.objects.filter(run=run, kind=compacted.KIND)]
    assert folds
    usage = {s.seq: s.usage for s in Step.objects.filter(run=run, kind="model")}
    after = min(seq for seq in usage if seq > folds[0])
    assert (
        usage[after]["cached_input_tokens"]
        >= usage[after]["input_tokens"] + usage[after]["cached_input_tokens"] - 300
    )


@pytest.fixture
def bank():
    server = BankServer().start()
    yield server
    server.stop()


def test_an_approval_late_in_a_compacted_run_waits_and_dispatches_once(tenant, asha, ravi, builtins, bank):
    """Approvals read the step log and their own rows, never the prompt: a refund proposed after
    a dozen turns were folded away parks the run, and once approved is sent once with its key."""
    noop = builtins["noop"]
    refund = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    factories.grant(refund, use=[asha], approve=[ravi])
    factories.grant(noop, use=[asha])
    arguments = {"transaction_id": "TXN-1001", "amount": 12499, "currency": "INR"}
    turns = [{"tool_calls": [{"name": noop.name, "arguments": {"i": i}}]} for i in range(12)]
    turns += [{"tool_calls": [{"name": refund.name, "arguments": arguments}]}, {"text": "done"}]
    endpoint = factories.make_endpoint(tenant, config={"turns": turns})
    factories.make_agent(tenant, endpoint=endpoint, tools=[noop, refund], context=CONTEXT, limits=LIMITS)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)

    assert run.status == RunStatus.WAITING_APPROVAL, run.error
    step = Step.objects.get(run=run, tool_name=refund.name)
    folds = RunEvent.objects.filter(run=run, kind=compacted.KIND, step_seq__lt=step.seq)
    assert folds.count() >= 2  # the history was compacted before the call was proposed
    [approval] = Approval.objects.filter(run=run)
    assert approval.step_id == step.pk and approval.arguments == arguments

    decide_approval(approval_id=approval.pk, user=ravi, approve=True, reason="verified")
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    [effect] = bank.effects("issue_refund")
    assert effect["idempotency_key"] == Step.objects.get(pk=step.pk).idempotency_key


def test_the_records_name_who_approved_and_who_rejected_a_folded_call(tenant, asha, ravi, builtins, bank):
    """The compact record holds the approvals and denials (issue 42): once the turns of an
    approved refund and a rejected one are folded, the request still says who decided each."""
    noop = builtins["noop"]
    refund = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    factories.grant(refund, use=[asha], approve=[ravi])
    factories.grant(noop, use=[asha])
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    try:
        endpoint = factories.make_endpoint(tenant, name="gpt", kind="openai", base_url=fake.base_url)
        factories.make_agent(tenant, endpoint=endpoint, tools=[noop, refund], context=CONTEXT, limits=LIMITS)

        def noops(start: int) -> list[dict]:
            return [
                {"tool_calls": [{"name": noop.name, "arguments": {"i": i}}]} for i in range(start, start + 6)
            ]

        def refund_of(amount: int) -> dict:
            arguments = {"transaction_id": "TXN-1001", "amount": amount, "currency": "INR"}
            return {"tool_calls": [{"name": refund.name, "arguments": arguments}]}

        fake.queue(*noops(0), refund_of(12499), *noops(10), refund_of(99999), *noops(20), {"text": "done"})
        run, _ = start_run(user=asha, agent="agent", input={"case": "decided"})
        run = drive(run.pk)
        assert run.status == RunStatus.WAITING_APPROVAL, run.error
        decide_approval(approval_id=Approval.objects.get(run=run).pk, user=ravi, approve=True, reason="ok")
        run = drive(run.pk)
        assert run.status == RunStatus.WAITING_APPROVAL, run.error
        second = Approval.objects.get(run=run, status="pending")
        decide_approval(approval_id=second.pk, user=ravi, approve=False, reason="too much")
        run = drive(run.pk)
        assert run.status == RunStatus.SUCCEEDED, run.error
    finally:
        fake.stop()

    granted, refused = Step.objects.filter(run=run, tool_name=refund.name).order_by("seq")
    assert (granted.status, refused.status) == ("succeeded", "rejected")
    assert len(bank.effects("issue_refund")) == 1
    folded = "\n".join(m["content"] for m in fake.requests[-1]["messages"] if m["role"] == "user")
    # Both refunds' turns were folded: neither call is live in the last request.
    assert not any(
        call["function"]["name"] == refund.name
        for m in fake.requests[-1]["messages"]
        for call in m.get("tool_calls") or []
    )
    assert f"step {granted.seq} {refund.name} " in folded
    assert f'step {granted.seq} {refund.name} {{"amount": 12499, ' in folded
    assert "-> approved by ravi; " in folded
    assert f'step {refused.seq} {refund.name} {{"amount": 99999, ' in folded
    assert "-> rejected by ravi: " in folded


def test_a_call_repeated_after_its_turn_was_folded_still_counts_toward_the_loop_limit(tenant, asha, builtins):
    """Loop detection reads the run's own counts, not the prompt: the third identical call stops
    the run even though the first one's turn was folded away long before."""
    echo, noop = builtins["echo"], builtins["noop"]
    turns = [{"tool_calls": [{"name": echo.name, "arguments": VAULT}]}]
    turns += [{"tool_calls": [{"name": noop.name, "arguments": {"i": i}}]} for i in range(12)]
    turns += [{"tool_calls": [{"name": echo.name, "arguments": VAULT}]}] * 3 + [{"text": "done"}]
    _scripted_agent(tenant, asha, builtins, config={"turns": turns})
    run, _ = start_run(user=asha, agent="agent", input={"case": "loop"})
    run = drive(run.pk)

    folds = RunEvent.objects.filter(run=run, kind=compacted.KIND).order_by("seq")
    assert folds.exists() and folds.first().data["first_step"] == 2  # the first call's turn was folded
    assert (run.status, run.stop_reason) == ("stopped", "loop_detected")
    assert f"the same call {echo.name} was made 3 times" in run.error
    assert Step.objects.filter(run=run, tool_name=echo.name).count() == 3
    assert run.events.filter(kind="loop_warning").count() == 1
