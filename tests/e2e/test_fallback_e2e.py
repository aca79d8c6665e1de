"""Provider outages through a real worker process (issue 26, "Done when" 1 and 3): the primary
endpoint goes down under 60 runs in flight and they finish on the fallback at its prices; a
circuit breaker opens after the configured failures, sends nothing while open, and one probe
closes it. Fake OpenAI-compatible servers on 127.0.0.1 count what reached them."""

from __future__ import annotations

import socket
from decimal import Decimal

import pytest
from django.db.models import Sum

from budgets.models import BudgetAccount, Reservation
from llm import gateway
from llm.models import EndpointCircuit
from llm.types import Usage
from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.fakes.model_servers import FakeOpenAI
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

CHEAP = {"price_input": Decimal("1"), "price_cached_input": Decimal("0.1"), "price_output": Decimal("2")}
DEAR = {"price_input": Decimal("10"), "price_cached_input": Decimal("1"), "price_output": Decimal("40")}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _all_ended(runs: list[Run]):
    ids = [r.pk for r in runs]
    ended = Run.objects.filter(pk__in=ids, status__in=["succeeded", "failed", "cancelled", "stopped"])
    return ended.count() == len(ids)


def test_sixty_runs_in_flight_finish_on_the_fallback_when_the_primary_goes_down(
    tenant, asha, builtins, workers
):
    port = closed_port()
    backup_fake = FakeOpenAI(tool_turns=3, latency_ms=150, min_cacheable_tokens=0)
    primary_fake = FakeOpenAI(tool_turns=3, min_cacheable_tokens=0)
    primary_fake.outage = {"fault": "503"}
    # A day that admits all 60 at once (admission expects each run's cost limit until it learns).
    tenant.daily_budget_micros = 500_000_000
    tenant.save(update_fields=["daily_budget_micros"])
    try:
        backup_url = backup_fake.start()
        primary = factories.make_endpoint(
            tenant,
            name="primary",
            kind="openai",
            base_url=f"http://127.0.0.1:{port}/v1",  # nothing listens yet: connections are refused
            timeout_seconds=10,
            breaker_failures=5,
            breaker_window_seconds=60,
            breaker_open_seconds=1,
            **CHEAP,
        )
        backup = factories.make_endpoint(tenant, name="backup", kind="openai", base_url=backup_url, **DEAR)
        factories.grant(builtins["echo"], use=[asha])
        factories.make_agent(
            tenant, tools=[builtins["echo"]], endpoint=primary, fallbacks=[{"model": "backup"}]
        )
        workers("w1", concurrency=32)
        runs = [start_run(user=asha, agent="agent", input={"message": f"echo {i}"})[0] for i in range(30)]
        wait_for(
            lambda: Step.objects.filter(model_endpoint=primary, error_class="server_error").count() >= 5,
            timeout=60,
            what="refused calls on the primary",
        )
        # The primary comes back answering 503 to everything, on the same port.
        primary_fake.start(port=port)
        runs += [
            start_run(user=asha, agent="agent", input={"message": f"echo {i}"})[0] for i in range(30, 60)
        ]
        wait_for(lambda: primary_fake.requests, timeout=60, what="a call (a probe) reaching the 503s")
        wait_for(lambda: _all_ended(runs), timeout=240, what="60 runs ending")

        runs = list(Run.objects.filter(pk__in=[r.pk for r in runs]))
        assert sorted({r.status for r in runs}) == ["succeeded"], [
            r.error for r in runs if r.status != "succeeded"
        ]
        steps = Step.objects.filter(run__in=runs, kind="model")
        answered = list(steps.filter(status="succeeded"))
        assert len(answered) == 60 * 4
        # every answer came from the fallback, priced and reserved at the fallback's prices
        assert {s.model_endpoint_id for s in answered} == {backup.pk}
        assert all(s.request["endpoint"] == "backup" for s in answered)
        for step in answered:
            assert step.cost_micros == gateway.cost_micros(backup, Usage(**step.usage))
            assert step.cost_micros <= step.reserved_micros
        assert len(backup_fake.replies) == len(answered)  # nothing billed that was not recorded
        failed = list(steps.exclude(status="succeeded"))
        assert {(s.status, s.error_class, s.model_endpoint_id) for s in failed} == {
            ("failed", "server_error", primary.pk)
        }, [(s.status, s.model_endpoint_id, s.error) for s in failed if s.model_endpoint_id != primary.pk]
        assert all(s.cost_micros == 0 for s in failed)  # refused and 503: nothing charged, released
        # The breaker spared most calls the dead primary: far fewer attempts than runs.
        assert len(failed) < 60, len(failed)
        assert RunEvent.objects.filter(run__in=runs, kind="circuit", skeleton__state="open").exists()
        # 0 overspend: each run's account is exactly its steps' costs, nothing reserved or held
        for run in runs:
            account = BudgetAccount.objects.get(run=run)
            assert account.spent_micros == sum(s.cost_micros for s in run.steps.all()) <= account.limit_micros
            assert account.reserved_micros == account.held_micros == 0
        day = BudgetAccount.objects.filter(tenant=tenant, scope="tenant_day").aggregate(
            spent=Sum("spent_micros"), reserved=Sum("reserved_micros"), held=Sum("held_micros")
        )
        assert day == {"spent": sum(s.cost_micros for s in answered), "reserved": 0, "held": 0}
        assert not Reservation.objects.filter(run__in=runs, status__in=["open", "held"]).exists()
        # the switch is on every run's timeline
        for run in runs:
            moves = list(run.events.filter(kind="model_fallback").values_list("data", flat=True))
            assert moves and moves[0]["to_endpoint"] == "backup", run.pk
            assert moves[0]["reason"] in ("server_error", "circuit_open")
    finally:
        primary_fake.stop()
        backup_fake.stop()


def test_a_circuit_opens_after_the_configured_failures_sends_nothing_while_open_and_a_probe_closes_it(
    tenant, asha, builtins, workers
):
    fake = FakeOpenAI(tool_turns=1, min_cacheable_tokens=0)
    fake.outage = {"fault": "503"}
    try:
        url = fake.start()
        primary = factories.make_endpoint(
            tenant,
            name="primary",
            kind="openai",
            base_url=url,
            timeout_seconds=5,
            breaker_failures=3,
            breaker_window_seconds=60,
            breaker_open_seconds=3,
            **CHEAP,
        )
        factories.grant(builtins["echo"], use=[asha])
        factories.make_agent(tenant, tools=[builtins["echo"]], endpoint=primary)  # no fallback: runs wait
        workers("w1", concurrency=8)
        first, _ = start_run(user=asha, agent="agent", input={"message": "first"})
        wait_for(
            lambda: EndpointCircuit.objects.filter(pk=primary.pk, state="open").exists(),
            timeout=60,
            what="the circuit opening",
        )
        assert len(fake.requests) == 3  # the configured failures, then nothing
        others = [start_run(user=asha, agent="agent", input={"message": f"run {i}"})[0] for i in range(3)]
        wait_for(
            lambda: all(r.events.filter(kind="circuit_open").exists() for r in others),
            timeout=30,
            what="the other runs waiting on the open circuit",
        )
        assert len(fake.requests) == 3  # while open, no call reaches the endpoint
        assert EndpointCircuit.objects.get(pk=primary.pk).state == "open"
        fake.outage = None  # the endpoint is back; only a probe can tell
        runs = [first, *others]
        wait_for(lambda: _all_ended(runs), timeout=90, what="the runs ending")
        assert {Run.objects.get(pk=r.pk).status for r in runs} == {"succeeded"}
        circuit = EndpointCircuit.objects.get(pk=primary.pk)
        assert circuit.state == "closed" and circuit.failures == 0
        states = list(
            RunEvent.objects.filter(run__in=runs, kind="circuit")
            .order_by("at")
            .values_list("skeleton__state", flat=True)
        )
        assert states == ["open", "closed"]
        # the probe was the first call after the outage, and the only one while half open
        probe_event = RunEvent.objects.get(run__in=runs, kind="circuit", skeleton__state="closed")
        probe = Step.objects.get(run=probe_event.run, seq=probe_event.step_seq)
        sent_before = Step.objects.filter(run__in=runs, kind="model", dispatched_at__lt=probe.dispatched_at)
        assert sorted(sent_before.values_list("status", flat=True)) == ["failed"] * 3
        # the first run: three failures, then the probe's answer, then on to the end
        model_steps = list(first.steps.filter(kind="model").order_by("seq").values_list("status", flat=True))
        assert model_steps[:3] == ["failed"] * 3 and set(model_steps[3:]) == {"succeeded"}
        # 4 runs x 2 calls answered, and the 3 failures
        assert len(fake.requests) == 3 + 4 * 2
    finally:
        fake.stop()
