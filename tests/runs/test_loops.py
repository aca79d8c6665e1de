"""No-progress detection with a real model client (fake OpenAI) and a counting search provider."""

from __future__ import annotations

import pytest

from budgets.models import Reservation
from runs.engine.loops import WARNING
from runs.models import Step
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import assert_books_balance, openai_endpoint, search_tool
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)

WARNED = WARNING.split("(")[0]  # "[platform] You are not making progress "


def search(query: str) -> dict:
    return {"tool_calls": [{"name": "kb__search", "arguments": {"query": query}}]}


def tool_messages(request: dict) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


@pytest.fixture
def agent(tenant, asha, fake_openai, search_server):
    def make(**spec):
        tool = search_tool(tenant, asha, search_server, price_micros=5_000)
        factories.make_agent(tenant, endpoint=openai_endpoint(tenant, fake_openai), tools=[tool], **spec)
        return tool

    return make


def test_a_model_repeating_the_same_empty_search_is_warned_once_then_stopped(
    tenant, asha, agent, fake_openai, search_server
):
    agent()  # defaults: max_repeats 3
    fake_openai.queue(*[search("refund policy")] * 10)
    run = drive(start_run(user=asha, agent="agent", input={})[0].pk)

    assert (run.status, run.stop_reason) == ("stopped", "loop_detected")
    assert "the same call kb__search was made 3 times" in run.error
    assert search_server.total == 1  # repeats are answered from the record
    assert len(fake_openai.requests) == 3  # at most max_repeats model calls
    assert not any(WARNED in m for m in tool_messages(fake_openai.requests[1]))
    assert sum(WARNED in m for m in tool_messages(fake_openai.requests[2])) == 1
    assert run.events.filter(kind="loop_warning").count() == 1
    assert Reservation.objects.filter(run=run, purpose="tool").count() == 1
    assert_books_balance(tenant)


def test_empty_results_for_different_queries_stop_at_the_configured_count(
    tenant, asha, agent, fake_openai, search_server
):
    agent(loop={"max_empty_results": 3})
    fake_openai.queue(*[search(f"refund policy {i}") for i in range(10)])
    run = drive(start_run(user=asha, agent="agent", input={})[0].pk)

    assert (run.status, run.stop_reason, run.error) == (
        "stopped",
        "loop_detected",
        "3 empty results in a row",
    )
    assert search_server.total == 3 == run.tool_call_count  # never more provider calls than configured
    assert len(fake_openai.requests) == 3
    assert sum(WARNED in m for m in tool_messages(fake_openai.requests[2])) == 1
    assert Reservation.objects.filter(run=run, purpose="tool", status="settled").count() == 3
    assert_books_balance(tenant)


def test_a_model_alternating_between_two_calls_is_stopped(tenant, asha, agent, fake_openai, search_server):
    search_server.answer = {"results": [{"title": "Refund policy, section 4"}]}
    agent(loop={"alternation_cycles": 2})
    fake_openai.queue(*[search("a"), search("b")] * 5)
    run = drive(start_run(user=asha, agent="agent", input={})[0].pk)

    assert (run.status, run.stop_reason) == ("stopped", "loop_detected")
    assert run.error == "alternating between the same two calls"
    assert dict(search_server.calls) == {"a": 1, "b": 1}
    assert len(fake_openai.requests) == 4  # A B A (warned) B (stopped)
    assert sum(WARNED in m for m in tool_messages(fake_openai.requests[3])) == 1
    assert_books_balance(tenant)


def test_an_identical_call_returns_the_recorded_result_without_calling_or_charging(
    tenant, asha, agent, fake_openai, search_server
):
    search_server.answer = {"results": [{"title": "Refund policy, section 4"}]}
    agent()
    fake_openai.queue(search("refund policy"), search("refund policy"), {"text": "Section 4 applies."})
    run = drive(start_run(user=asha, agent="agent", input={})[0].pk)

    assert run.status == "succeeded", run.error
    assert search_server.total == 1
    first, again = Step.objects.filter(run=run, kind="tool").order_by("seq")
    assert (again.status, again.replayed_from_seq, again.cost_micros) == ("succeeded", first.seq, 0)
    assert again.result == first.result
    assert "Refund policy, section 4" in again.observation and "already made at step" in again.observation
    tool_charges = Reservation.objects.filter(run=run, purpose="tool")
    assert [(r.step_id, r.status, r.actual_micros) for r in tool_charges] == [(first.pk, "settled", 5_000)]
    assert run.tool_call_count == 1
    assert "Refund policy, section 4" in tool_messages(fake_openai.requests[2])[1]
    assert_books_balance(tenant)


def test_a_model_repeating_a_denied_call_is_stopped_like_any_other_repeat(
    tenant, asha, agent, fake_openai, search_server
):
    from guardian.shortcuts import remove_perm

    tool = agent()
    remove_perm("tools.use_tool", asha, tool)  # the model still asks for it (it was offered before)
    fake_openai.queue(*[search("refund policy")] * 10)
    run = drive(start_run(user=asha, agent="agent", input={})[0].pk)

    assert (run.status, run.stop_reason) == ("stopped", "loop_detected")
    assert "the same call kb__search was made 3 times" in run.error
    assert search_server.total == 0  # every call was denied, none reached the provider
    assert list(Step.objects.filter(run=run, kind="tool").values_list("status", flat=True)) == ["denied"] * 3
    assert len(fake_openai.requests) == 3  # not max_steps model calls
    assert sum(WARNED in m for m in tool_messages(fake_openai.requests[2])) == 1
    assert_books_balance(tenant)


def test_a_model_repeating_a_call_the_provider_rejects_is_stopped(
    tenant, asha, agent, fake_openai, search_server
):
    search_server.status = 400
    search_server.answer = {"error": "query too short"}
    agent()
    fake_openai.queue(*[search("refund policy")] * 10)
    run = drive(start_run(user=asha, agent="agent", input={})[0].pk)

    assert (run.status, run.stop_reason) == ("stopped", "loop_detected")
    assert list(Step.objects.filter(run=run, kind="tool").values_list("status", flat=True)) == ["failed"] * 3
    assert search_server.total == 3  # a failed call is not replayed: each one was sent
    assert len(fake_openai.requests) == 3
    assert sum(WARNED in m for m in tool_messages(fake_openai.requests[2])) == 1
    assert_books_balance(tenant)
