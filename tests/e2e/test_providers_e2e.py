"""Real provider clients through a real worker: fake OpenAI-compatible and Anthropic servers."""

from __future__ import annotations

import pytest

from runs.models import Run, Step
from runs.services import start_run
from tenants.models import Secret
from tests import factories
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("kind,fake_class", [("openai", FakeOpenAI), ("anthropic", FakeAnthropic)])
def test_it_runs_a_tool_loop_on_a_real_provider_protocol_and_prices_cached_tokens(
    kind, fake_class, tenant, asha, builtins, workers
):
    fake = fake_class(tool_turns=3, api_key="sk-canary-4242", min_cacheable_tokens=0)  # tiny prompts
    base_url = fake.start()
    try:
        secret = Secret(tenant=tenant, name="provider-key")
        secret.set_value("sk-canary-4242")
        secret.save()
        endpoint = factories.make_endpoint(tenant, name=kind, kind=kind, base_url=base_url, secret=secret)
        echo = builtins["echo"]
        factories.grant(echo, use=[asha])
        factories.make_agent(tenant, tools=[echo], endpoint=endpoint, limits={"max_output_tokens": 333})
        workers("w1")
        run, _ = start_run(user=asha, agent="agent", input={"message": "echo three times"})
        run = wait_for(
            lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=90, what="run end"
        )
        assert run.status == "succeeded", run.error
        assert run.final_output == "done"
        model_steps = list(Step.objects.filter(run=run, kind="model").order_by("seq"))
        assert len(model_steps) == 4 and len(fake.requests) == 4
        # The prefix (instructions + tools) is byte-stable, so every call after the first hits the cache.
        assert model_steps[0].usage["cached_input_tokens"] == 0
        assert all(s.usage["cached_input_tokens"] > 0 for s in model_steps[1:])
        # Cached tokens cost a tenth of input tokens here: the cost reflects it.
        for step in model_steps:
            u = step.usage
            expected = (
                u["input_tokens"] * 3
                + u["cached_input_tokens"] * 0.3
                + u["cache_write_tokens"] * 3.75
                + u["output_tokens"] * 15
            )
            assert step.cost_micros == pytest.approx(expected, abs=1)
        limit_field = "max_completion_tokens" if kind == "openai" else "max_tokens"
        assert all(body[limit_field] == 333 for body in fake.requests)
        assert run.budget.spent_micros == sum(s.cost_micros for s in Step.objects.filter(run=run))
        assert run.budget.reserved_micros == 0 and run.budget.held_micros == 0
        stored = repr(list(Step.objects.filter(run=run).values())) + repr(list(run.events.values()))
        assert "sk-canary-4242" not in stored
    finally:
        fake.stop()
