"""Bounded output and calls through the engine (DESIGN.md section 8.1), against the fake servers.

What the issue measured with llama-cpp-python on one slot: generations run to 3,000+ tokens
against a limit of 256, each a timeout and a held reservation, and an immediate retry queued
behind the abandoned generation. Here: a runaway answer is cut at the limit and settled at the
platform's own count (marked), nothing held; a timed-out call backs the endpoint off before the
next call; and max_in_flight keeps a one-slot server at one call, the other runs waiting as rows.
"""

from __future__ import annotations

import pytest

from budgets.models import Reservation
from llm.models import ModelEndpoint
from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tenants.models import Secret
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_runaway_answer_is_cut_at_the_limit_and_settled_at_the_platforms_count(kind, tenant, asha):
    fake = (FakeOpenAI if kind == "openai" else FakeAnthropic)(min_cacheable_tokens=0)
    fake.start()
    try:
        secret = Secret(tenant=tenant, name="provider-key")
        secret.set_value("sk-local")
        secret.save()
        endpoint = factories.make_endpoint(
            tenant, name="local", kind=kind, base_url=fake.base_url, secret=secret
        )
        factories.make_agent(tenant, endpoint=endpoint, limits={"max_output_tokens": 40})
        fake.queue({"runaway": 3_000, "token_ms": 1})
        run, _ = start_run(user=asha, agent="agent", input={"case": "TXN-1"})
        run = drive(run.pk)
    finally:
        fake.stop()
    assert run.status == "succeeded", run.error
    step = Step.objects.get(run=run, kind="model")
    assert step.usage["counted_by"] == "platform"
    assert step.usage["output_tokens"] == 40
    assert fake.streams[-1]["tokens"] <= 48 and fake.streams[-1]["closed_early"]
    assert any(
        "cut at the output limit (40 tokens)" in e.message for e in run.events.filter(step_seq=step.seq)
    )
    # Settled at that count: nothing held, nothing left reserved.
    assert list(Reservation.objects.filter(step=step).values_list("status", flat=True)) == ["settled"]
    run.budget.refresh_from_db()
    assert run.budget.held_micros == 0 and run.budget.reserved_micros == 0
    assert run.budget.spent_micros == step.cost_micros > 0


def test_after_a_timeout_the_endpoint_backs_off_before_the_next_call(tenant, asha):
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    try:
        endpoint = factories.make_endpoint(tenant, name="local", kind="openai", base_url=fake.base_url)
        ModelEndpoint.objects.filter(pk=endpoint.pk).update(
            timeout_seconds=10, first_token_timeout_seconds=0.5, timeout_backoff_seconds=1.5
        )
        factories.make_agent(tenant, endpoint=endpoint)
        fake.queue({"text": "late", "first_token_delay": 3})
        run, _ = start_run(user=asha, agent="agent", input={"case": "TXN-1"})
        run = drive(run.pk, max_tasks=2_000)
    finally:
        fake.stop()
    assert run.status == "succeeded", run.error
    assert len(fake.requests) == 2
    first, second = fake.arrived_at
    # The second call went after the backoff (1.5 s times 1 to 2), not at once into a busy server.
    assert second - first >= 0.5 + 1.5, second - first
    lost = Step.objects.get(run=run, seq=1)
    assert lost.status == "outcome_unknown"
    assert "no first token within 0.5s" in lost.error
    (message,) = [e.message for e in run.events.filter(step_seq=1) if "timeout backoff" in e.message]
    assert "no call goes to local for" in message
    waits = RunEvent.objects.filter(run=run, kind="quota_wait")
    assert waits.exists() and set(waits.values_list("skeleton__limit", flat=True)) == {"retry_after"}


def test_max_in_flight_keeps_a_one_slot_server_at_one_call(tenant, asha, builtins, workers):
    fake = FakeOpenAI(tool_turns=1, latency_ms=300, min_cacheable_tokens=0)
    fake.start()
    try:
        endpoint = factories.make_endpoint(tenant, name="local", kind="openai", base_url=fake.base_url)
        ModelEndpoint.objects.filter(pk=endpoint.pk).update(max_in_flight=1)
        echo = builtins["echo"]
        factories.grant(echo, use=[asha])
        factories.make_agent(tenant, endpoint=endpoint, tools=[echo])
        runs = [start_run(user=asha, agent="agent", input={"case": i})[0] for i in range(4)]
        workers("w1", concurrency=4)
        wait_for(
            lambda: all(Run.objects.get(pk=r.pk).is_terminal for r in runs), timeout=150, what="runs end"
        )
    finally:
        fake.stop()
    assert [Run.objects.get(pk=r.pk).status for r in runs] == ["succeeded"] * 4
    assert len(fake.requests) == 8
    assert fake.most_in_flight == 1
    # The others waited as rows with a countdown (no worker held), on their timelines.
    waits = RunEvent.objects.filter(run__in=runs, kind="quota_wait")
    assert waits.exists()
    assert set(waits.values_list("skeleton__limit", flat=True)) == {"in_flight"}
