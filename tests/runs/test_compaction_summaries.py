"""A model's summary of each fold (issue 42), where the version's context policy names a
summariser: a step of its own in the timeline, its summary in the fold's record from the next
call on (and read back from the prompt cache after that), its cost reserved, settled and in the
run's spend; a summariser that fails, or a worker lost during its call, leaves the deterministic
record and the run finishes right. The real engine and client against the fake servers."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.utils import timezone

from agents.spec import validate_spec
from budgets.models import BudgetAccount, LedgerEntry, Reservation
from runs.engine import compacted
from runs.engine.claim import claim
from runs.engine.model_step import do_model, recover_model
from runs.engine.tool_step import do_tool
from runs.engine.types import LostModelCall, ModelCall, ToolCall
from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI

pytestmark = pytest.mark.django_db(transaction=True)

# The code sits past the first 100 characters: a record's line does not show it, a summary can.
VAULT = {"note": "x" * 300 + " code=ZX81 " + "y" * 50}
CONTEXT = {"compact_after_tokens": 300, "compact_record_tokens": 300, "summariser": "cheap"}
LIMITS = {"max_steps": 100, "max_tool_calls": 50}
CHEAP = {"price_input": Decimal("0.1"), "price_cached_input": Decimal("0.01"), "price_output": Decimal("0.4")}


@pytest.fixture
def summariser():
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


def _cheap(tenant, fake):
    return factories.make_endpoint(tenant, name="cheap", kind="openai", base_url=fake.base_url, **CHEAP)


def _recalling_agent(tenant, asha, builtins, *, context: dict):
    """The scripted agent that needs its first result at the end: it reads it back with read_result."""
    echo, noop = builtins["echo"], builtins["noop"]
    factories.grant(echo, use=[asha])
    factories.grant(noop, use=[asha])
    endpoint = factories.make_endpoint(
        tenant,
        config={
            "turns": [{"tool_calls": [{"name": echo.name, "arguments": VAULT}]}],
            "auto_tool": noop.name,
            "auto_tool_turns": 30,
            "recall": {"tool": echo.name, "pattern": r"code=(\w+)", "text": "the code is {0}"},
        },
    )
    factories.make_agent(tenant, endpoint=endpoint, tools=[echo, noop], context=context, limits=LIMITS)


def test_each_fold_gets_a_summary_step_shown_in_later_prompts_and_paid_by_the_run(
    tenant, asha, builtins, summariser
):
    echo, noop = builtins["echo"], builtins["noop"]
    factories.grant(echo, use=[asha])
    factories.grant(noop, use=[asha])
    _cheap(tenant, summariser)
    summariser.queue(*({"text": f"summary {i}: the vault note holds code=ZX81"} for i in range(30)))
    main = FakeOpenAI(min_cacheable_tokens=0)
    main.start()
    try:
        endpoint = factories.make_endpoint(tenant, name="gpt", kind="openai", base_url=main.base_url)
        factories.make_agent(tenant, endpoint=endpoint, tools=[echo, noop], context=CONTEXT, limits=LIMITS)
        main.queue(
            {"tool_calls": [{"name": echo.name, "arguments": VAULT}]},
            *({"tool_calls": [{"name": noop.name, "arguments": {"i": i}}]} for i in range(12)),
            {"text": "done"},
        )
        run, _ = start_run(user=asha, agent="agent", input={"case": "summarised"})
        run = drive(run.pk)
    finally:
        main.stop()
    assert run.status == "succeeded", run.error
    assert run.final_output == "done"  # a summary is never read as the agent's answer

    summaries = list(Step.objects.filter(run=run, kind="summary").order_by("seq"))
    folds = list(RunEvent.objects.filter(run=run, kind=compacted.KIND).order_by("seq"))
    assert len(summaries) >= 2
    assert len(summaries) == len(folds)  # one summary per fold, none tried twice
    assert [s.result["at"] for s in summaries] == [e.data["at"] for e in folds]
    for step, fold in zip(summaries, folds, strict=True):
        assert step.status == "succeeded"
        assert step.cost_micros > 0 and step.usage["output_tokens"] > 0
        # The fold's model call is planned right after its summary, and records the fold.
        assert fold.step_seq == step.seq + 1
        assert Step.objects.get(run=run, seq=step.seq + 1).kind == "model"
    # The summariser was sent the folded turns whole, the early result's code with them.
    first_sent = summariser.requests[0]["messages"][-1]["content"]
    assert "result of step 2: " in first_sent and "code=ZX81" in first_sent
    sent = summariser.requests[0]
    assert (sent.get("max_completion_tokens") or sent.get("max_tokens")) == 400

    # The timeline shows what each summary folded and its cost.
    shown = RunEvent.objects.get(run=run, kind="step", step_seq=summaries[0].seq, skeleton__to="succeeded")
    assert shown.message.startswith(f"step {summaries[0].seq} summary of steps 2-")
    assert f"cost {summaries[0].cost_micros} micros" in shown.message

    # The first summary is in the requests after it, in place of the fold's model words: the
    # record keeps its header and one line per result (each still readable with read_result).
    first = "summary: summary 0: the vault note holds code=ZX81"
    showing = [i for i, r in enumerate(main.requests) if first in r["messages"][1]["content"]]
    assert showing, "the summary never reached the model"
    record = main.requests[showing[0]]["messages"][1]["content"]
    assert "[platform: steps 2-" in record and f"step 2 {echo.name} " in record
    # The summarised record is stable: the call after the one that first showed it reads its
    # prompt back from the cache (all but the newest turn).
    usage = [s.usage for s in Step.objects.filter(run=run, kind="model").order_by("seq")]
    after = usage[showing[0] + 1]
    assert after["cached_input_tokens"] >= after["input_tokens"] + after["cached_input_tokens"] - 300

    # Its cost is reserved before the call and settled to the run's budget like any model call.
    account = BudgetAccount.objects.get(run=run, scope="run")
    assert account.spent_micros == sum(Step.objects.filter(run=run).values_list("cost_micros", flat=True))
    for step in summaries:
        reservation = Reservation.objects.get(step=step)
        assert (reservation.status, reservation.purpose) == ("settled", "model")
        assert reservation.amount_micros >= step.cost_micros
        assert (
            LedgerEntry.objects.get(reservation=reservation, kind="settle").amount_micros == step.cost_micros
        )
    # A summary counts toward no limit of the agent's.
    assert run.step_count == Step.objects.filter(run=run).exclude(kind="summary").count()


def test_a_failing_summariser_leaves_the_deterministic_record_and_the_run_finishes_right(
    tenant, asha, builtins, summariser
):
    summariser.outage = {"fault": "500"}
    _cheap(tenant, summariser)
    _recalling_agent(tenant, asha, builtins, context=CONTEXT)
    run, _ = start_run(user=asha, agent="agent", input={"case": "failing"})
    run = drive(run.pk)

    assert run.status == "succeeded", run.error
    assert run.final_output == "the code is ZX81"  # read back from the folded result, as without one
    summaries = list(Step.objects.filter(run=run, kind="summary"))
    assert summaries and summariser.requests
    for step in summaries:
        assert step.status == "failed" and step.cost_micros == 0
        assert Reservation.objects.get(step=step).status == "released"  # refused: not charged
    assert len({s.request["fold_at"] for s in summaries}) == len(summaries)  # none tried twice
    failed = RunEvent.objects.get(run=run, kind="step", step_seq=summaries[0].seq, skeleton__to="failed")
    assert "keeps its deterministic record" in failed.message


def test_a_summary_the_run_budget_cannot_carry_is_not_made_and_the_run_goes_on(
    tenant, asha, builtins, summariser
):
    # At these prices the summary's worst case is past the run's 2,000,000 micros; the agent's
    # own calls are not.
    factories.make_endpoint(
        tenant, name="cheap", kind="openai", base_url=summariser.base_url, price_input=Decimal("10000")
    )
    _recalling_agent(tenant, asha, builtins, context=CONTEXT)
    run, _ = start_run(user=asha, agent="agent", input={"case": "budget"})
    run = drive(run.pk)

    assert run.status == "succeeded", run.error
    assert run.final_output == "the code is ZX81"
    assert not summariser.requests  # nothing was sent
    summaries = list(Step.objects.filter(run=run, kind="summary"))
    assert summaries
    for step in summaries:
        assert (step.status, step.error_class, step.cost_micros) == ("failed", "budget", 0)
        assert not Reservation.objects.filter(step=step).exists()
    assert (
        "summary not made: "
        in RunEvent.objects.get(run=run, step_seq=summaries[0].seq, skeleton__to="failed").message
    )


def test_a_summary_lost_with_its_worker_is_held_and_not_tried_again(tenant, asha, builtins, summariser):
    _cheap(tenant, summariser)
    _recalling_agent(tenant, asha, builtins, context=CONTEXT)
    run, _ = start_run(user=asha, agent="agent", input={"case": "lost"})
    # What a worker does, until it dies having committed the first summary's call.
    for _ in range(200):
        plan = claim(run.pk)
        if isinstance(plan, ModelCall) and plan.model.fold is not None:
            break
        match plan:
            case LostModelCall():
                recover_model(plan)
            case ModelCall():
                do_model(plan)
            case ToolCall():
                do_tool(plan)
    else:
        raise AssertionError("no summary was planned")
    lost = Step.objects.get(pk=plan.step.pk)
    assert (lost.kind, lost.status) == ("summary", "dispatching")
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))

    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    assert run.final_output == "the code is ZX81"
    lost.refresh_from_db()
    assert lost.status == "outcome_unknown"
    assert Reservation.objects.get(step=lost).status == "held"  # the provider may have charged it
    summaries = Step.objects.filter(run=run, kind="summary")
    assert [s.pk for s in summaries if s.request["fold_at"] == lost.request["fold_at"]] == [lost.pk]
    assert summaries.filter(status="succeeded").exists()  # later folds are summarised


@pytest.mark.django_db
def test_the_summariser_must_name_an_endpoint_of_the_tenant(tenant):
    factories.make_endpoint(tenant)
    base = {"model": "scripted", "instructions": "x"}
    assert validate_spec({**base, "context": {"summariser": "cheap"}}, tenant) == {
        "context.summariser": ["no model endpoint named 'cheap' in this tenant"]
    }
    assert validate_spec({**base, "context": {"summariser": 3}}, tenant) == {
        "context.summariser": ["must be the name of a model endpoint"]
    }
    factories.make_endpoint(tenant, name="cheap")
    assert validate_spec({**base, "context": {"summariser": "cheap"}}, tenant) == {}
