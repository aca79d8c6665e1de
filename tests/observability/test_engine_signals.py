"""What a run shows an operator: /metrics values, run-correlated log lines, GenAI spans, the task
result. Runs are driven in-process against PostgreSQL and Redis (commits are real: logs and
counters are written when a transition commits)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.conf import settings
from django.test import Client, override_settings
from django.utils import timezone
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from budgets.models import Reservation
from runs.engine import advance, heartbeat
from runs.engine.claim import claim
from runs.models import Run, RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.observability.conftest import scrape, value

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def spans():
    """The SDK's in-memory exporter behind the global tracer provider (set once per process)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another tracer provider was set first"
    return exporter


def story(tenant, asha, builtins):
    """echo (granted) → noop (not granted: denied) → clock (approval always): waits for approval."""
    echo, noop, clock = builtins["echo"], builtins["noop"], builtins["clock"]
    factories.grant(echo, use=[asha])
    factories.grant(clock, use=[asha])
    type(clock).objects.filter(pk=clock.pk).update(approval_policy="always", price_micros=2500)
    type(echo).objects.filter(pk=echo.pk).update(price_micros=1000)
    factories.make_agent(
        tenant,
        tools=[echo, noop, clock],
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"say": "hi"}}]},
            {"tool_calls": [{"name": noop.name, "arguments": {}}]},
            {"tool_calls": [{"name": clock.name, "arguments": {}}]},
            {"text": "done"},
        ],
    )
    run, _ = start_run(user=asha, agent="agent", input={"q": 1})
    return run, echo, noop, clock


def test_metrics_report_a_scripted_run_by_value(tenant, asha, builtins):
    before = scrape()
    run, echo, noop, clock = story(tenant, asha, builtins)
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL
    after = scrape()
    steps = list(Step.objects.filter(run=run).order_by("seq"))
    models = [s for s in steps if s.kind == "model"]
    assert len(models) == 3 and all(s.status == "succeeded" for s in models)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("agentplatform_steps_total", kind="model", tool="", outcome="succeeded") == 3
    assert delta("agentplatform_steps_total", kind="tool", tool=echo.name, outcome="succeeded") == 1
    assert delta("agentplatform_steps_total", kind="tool", tool=noop.name, outcome="denied") == 1
    assert delta("agentplatform_step_call_seconds_count", kind="model", outcome="succeeded") == 3
    assert delta("agentplatform_step_call_seconds_count", kind="tool", outcome="succeeded") == 1
    assert delta("agentplatform_step_call_seconds_sum", kind="model", outcome="succeeded") > 0
    assert (
        delta("agentplatform_model_tokens_total", tenant="acme", model="test-model", type="input")
        == sum(s.usage["input_tokens"] for s in models)
        > 0
    )
    assert (
        delta("agentplatform_model_tokens_total", tenant="acme", model="test-model", type="output")
        == sum(s.usage["output_tokens"] for s in models)
        > 0
    )
    assert delta("agentplatform_spend_micros_total", tenant="acme", kind="model") == sum(
        s.cost_micros for s in models
    )
    assert delta("agentplatform_spend_micros_total", tenant="acme", kind="tool") == 1000
    assert (
        delta("agentplatform_run_transitions_total", tenant="acme", status="waiting_approval", reason="") == 1
    )
    # Gauges read from the database at scrape time.
    assert value(after, "agentplatform_runs", tenant="acme", status="waiting_approval") == 1
    assert value(after, "agentplatform_runs", tenant="acme", status="running") == 0
    assert value(after, "agentplatform_approvals_pending", tenant="acme") == 1
    assert 0 <= value(after, "agentplatform_approvals_pending_oldest_age_seconds", tenant="acme") < 60
    assert value(after, "agentplatform_database_up") == 1
    assert value(after, "agentplatform_broker_up") == 1


def _run_lost_mid_call(tenant, asha, builtins) -> Run:
    """An unsafe call whose worker vanished after dispatching it: the run needs a person."""
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    type(echo).objects.filter(pk=echo.pk).update(price_micros=7000)
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"say": "hi"}}]}, {"text": "done"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    advance(run.pk)  # the model proposes the call
    plan = claim(run.pk)  # reserves and commits the call as dispatching
    assert plan.reservation_id is not None and plan.step.status == "dispatching"
    heartbeat.untrack(run.pk)  # ... and the worker dies here
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    advance(run.pk)
    return Run.objects.get(pk=run.pk)


def test_metrics_show_runs_needing_attention_and_held_reservations(tenant, asha, json_lines):
    builtins = factories.make_builtin_tools(tenant, effect="unsafe")
    run = _run_lost_mid_call(tenant, asha, builtins)
    assert run.status == RunStatus.NEEDS_ATTENTION
    held = Reservation.objects.get(run=run, status=Reservation.Status.HELD)
    samples = scrape()
    assert value(samples, "agentplatform_runs_needing_attention") == 1
    assert value(samples, "agentplatform_runs", tenant="acme", status="needs_attention") == 1
    assert 0 <= value(samples, "agentplatform_runs_needing_attention_oldest_age_seconds") < 60
    assert value(samples, "agentplatform_reservations_held", tenant="acme") == 1
    assert (
        value(samples, "agentplatform_reservations_held_micros", tenant="acme") == held.amount_micros == 7000
    )
    # The same moment in the log, at WARNING, with the run it concerns.
    warnings = [
        line for line in json_lines() if line["level"] == "WARNING" and line["logger"] == "agentplatform.runs"
    ]
    attention = [line for line in warnings if "needs attention" in line["message"]]
    assert len(attention) == 1, warnings
    assert attention[0]["run_id"] == str(run.pk) and attention[0]["tenant"] == "acme"
    assert attention[0]["event"]["to"] == "needs_attention"


def test_every_engine_line_of_a_run_carries_its_run_id_and_denials_are_warnings(
    tenant, asha, builtins, json_lines
):
    run, echo, noop, clock = story(tenant, asha, builtins)
    first = advance(run.pk)
    assert first == {
        "run": str(run.pk),
        "step": 1,
        "kind": "model",
        "outcome": "succeeded",
        "run_status": "running",
    }
    drive(run.pk)
    lines = json_lines()
    engine = [line for line in lines if line["logger"].startswith("agentplatform.")]
    assert len(engine) >= 8
    assert all(line["run_id"] == str(run.pk) for line in engine), engine
    assert all(line["tenant"] == "acme" for line in engine), engine
    tool_lines = [line for line in engine if line["tool"]]
    assert {line["tool"] for line in tool_lines} == {echo.name, noop.name, clock.name}
    assert all(isinstance(line["step_seq"], int) for line in tool_lines)
    denied = [line for line in engine if line["level"] == "WARNING"]
    assert [(d["message"].split(":")[0], d["step_seq"], d["tool"]) for d in denied] == [
        ("call denied", 4, noop.name)
    ], denied


def test_a_budget_stop_is_a_warning(tenant, asha, builtins, json_lines):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(tenant, tools=[echo], turns=[{"text": "done"}], limits={"max_cost_micros": 1})
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert (run.status, run.stop_reason) == ("stopped", "budget_exhausted")
    warnings = [line for line in json_lines() if line["level"] == "WARNING"]
    assert len(warnings) == 1, warnings
    assert warnings[0]["message"].startswith("run stopped by budget: running -> stopped (budget_exhausted)")
    assert warnings[0]["run_id"] == str(run.pk) and warnings[0]["tenant"] == "acme"


def test_each_step_call_is_a_genai_span_in_the_runs_trace(tenant, asha, builtins, spans):
    spans.clear()
    run, echo, noop, clock = story(tenant, asha, builtins)
    drive(run.pk)
    steps = {s.seq: s for s in Step.objects.filter(run=run)}
    finished = spans.get_finished_spans()
    assert [s.name for s in finished] == [
        "chat test-model",
        f"execute_tool {echo.name}",
        "chat test-model",
        "chat test-model",
    ]
    assert {s.context.trace_id for s in finished} == {run.pk.int}  # the run is the trace
    assert len({s.parent.span_id for s in finished}) == 1
    chat = finished[0].attributes
    assert chat["gen_ai.operation.name"] == "chat"
    assert chat["gen_ai.provider.name"] == "scripted"
    assert chat["gen_ai.request.model"] == "test-model"
    assert (
        chat["gen_ai.usage.input_tokens"]
        == steps[1].usage["input_tokens"] + steps[1].usage["cached_input_tokens"]
    )
    assert chat["gen_ai.usage.output_tokens"] == steps[1].usage["output_tokens"] > 0
    assert chat["gen_ai.conversation.id"] == str(run.pk)
    assert chat["agentplatform.step.seq"] == 1 and chat["agentplatform.tenant"] == "acme"
    assert chat["agentplatform.cost_micros"] == steps[1].cost_micros
    tool = finished[1].attributes
    assert tool["gen_ai.operation.name"] == "execute_tool"
    assert tool["gen_ai.tool.name"] == echo.name
    assert tool["gen_ai.tool.call.id"] == steps[2].call_id
    assert tool["agentplatform.step.outcome"] == "succeeded"
    assert finished[1].kind == trace.SpanKind.INTERNAL and finished[0].kind == trace.SpanKind.CLIENT


def test_the_broker_queue_depth_is_read_at_scrape_time(db):
    import redis

    from runs.tasks import advance_run

    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(queue)
    for _ in range(3):
        advance_run.apply_async(("00000000-0000-0000-0000-000000000000",))
    samples = scrape()
    assert value(samples, "agentplatform_broker_queue_messages", queue=queue) == 3
    assert value(samples, "agentplatform_broker_queue_messages", queue=settings.SWEEP_QUEUE) == 0


def test_sweeper_recoveries_are_counted_by_kind(tenant, asha, builtins, json_lines):
    from runs.tasks import sweep

    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(tenant, tools=[echo], turns=[{"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    Run.objects.filter(pk=run.pk).update(last_enqueued_at=timezone.now() - dt.timedelta(hours=1))
    before = scrape()
    assert sweep() == {"lost_messages": 1}
    after = scrape()
    assert (
        value(after, "agentplatform_sweeper_recoveries_total", kind="lost_messages")
        - value(before, "agentplatform_sweeper_recoveries_total", kind="lost_messages")
        == 1
    )
    assert value(after, "agentplatform_sweeps_total") - value(before, "agentplatform_sweeps_total") == 1
    assert [line["message"] for line in json_lines() if line["logger"] == "agentplatform.sweeper"] == [
        "sweeper: lost_messages=1"
    ]


def test_metrics_need_the_token_or_an_allowed_address_when_configured(db):
    with override_settings(METRICS_TOKEN="s3cret-token"):
        assert Client().get("/metrics").status_code == 401
        assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
        assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 200
    with override_settings(METRICS_ALLOW_FROM=["10.1.0.0/16"]):
        assert Client(REMOTE_ADDR="10.2.0.5").get("/metrics").status_code == 403
        assert Client(REMOTE_ADDR="10.1.7.9").get("/metrics").status_code == 200
    # Probes answer whatever the Host header says (they address pods by IP).
    assert Client().get("/healthz", HTTP_HOST="10.9.8.7:8000").json() == {"status": "ok"}


def test_production_serves_metrics_to_no_one_until_a_token_or_an_allowlist_is_set(db):
    with override_settings(PRODUCTION=True, METRICS_TOKEN="", METRICS_ALLOW_FROM=[]):
        closed = Client().get("/metrics")
        assert closed.status_code == 403 and b"METRICS_TOKEN" in closed.content
        assert Client(REMOTE_ADDR="127.0.0.1").get("/metrics").status_code == 403
        # The probes stay open: a load balancer needs no token.
        assert Client().get("/healthz").status_code == 200
    with override_settings(PRODUCTION=True, METRICS_TOKEN="t" * 40, METRICS_ALLOW_FROM=[]):
        assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer " + "t" * 40).status_code == 200
    with override_settings(PRODUCTION=False, METRICS_TOKEN="", METRICS_ALLOW_FROM=[]):
        assert Client().get("/metrics").status_code == 200
