"""The run loop driven in-process against real PostgreSQL: claim, act, record."""

from __future__ import annotations

import pytest

from runs.models import RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def test_it_runs_a_model_tool_model_story_to_success(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"say": "$input.word"}}]},
            {"text": "all done"},
        ],
    )
    run, created = start_run(user=asha, agent="agent", input={"word": "hello"})
    assert created
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.final_output == "all done"
    steps = list(Step.objects.filter(run=run).order_by("seq"))
    assert [(s.kind, s.status) for s in steps] == [
        ("model", "succeeded"),
        ("tool", "succeeded"),
        ("model", "succeeded"),
    ]
    assert steps[1].result["structured"] == {"say": "hello"}
    assert steps[1].idempotency_key == f"acme:{run.pk}:2"
    assert run.budget.reserved_micros == 0
    assert run.budget.spent_micros == sum(s.cost_micros for s in steps) > 0
