"""The engine task's state as Flower and the task events show it (runs/tasks.py): a step that got no
answer in time is not a plain SUCCESS; the task fails with StepNotSettled, which says which step,
what happened and where the run went. A step that succeeded stays a SUCCESS with its report."""

from __future__ import annotations

import pytest

from llm.models import ModelEndpoint
from runs.models import Run
from runs.services import start_run
from runs.tasks import StepNotSettled, advance_run, unsettled
from tests import factories
from tests.fakes.model_servers import FakeOpenAI

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def slow_server():
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


def test_a_step_with_no_answer_in_time_is_a_failed_task_that_says_so(tenant, asha, slow_server):
    endpoint = factories.make_endpoint(
        tenant, name="local-gemma", kind="openai", base_url=slow_server.base_url
    )
    ModelEndpoint.objects.filter(pk=endpoint.pk).update(
        first_token_timeout_seconds=0.5, timeout_backoff_seconds=120
    )
    factories.make_agent(tenant, name="gemma-agent", endpoint=endpoint)
    slow_server.queue({"text": "late", "first_token_delay": 3})
    run, _ = start_run(user=asha, agent="gemma-agent", input={"case": "TXN-1001"})

    task = advance_run.apply(args=[str(run.pk)], throw=False)

    assert Run.objects.get(pk=run.pk).steps.get(seq=1).status == "outcome_unknown"
    assert task.state == "FAILURE"
    assert isinstance(task.result, StepNotSettled)
    assert str(task.result).startswith("step 1: outcome unknown")
    assert task.result.result["admin"] == f"/admin/runs/run/{run.pk}/change/"


def test_a_step_that_succeeded_is_a_successful_task_with_its_report(tenant, asha, builtins):
    factories.make_agent(tenant, name="talker", turns=[{"text": "hello"}])
    run, _ = start_run(user=asha, agent="talker", input={})

    task = advance_run.apply(args=[str(run.pk)], throw=False)

    assert task.state == "SUCCESS", task.result
    assert task.result["outcome"] == "succeeded" and task.result["run"] == str(run.pk)


@pytest.mark.parametrize(
    ("report", "settled"),
    [
        ({"run": "r", "step": 2, "kind": "tool", "tool": "refund", "outcome": "succeeded"}, True),
        ({"run": "r", "step": 2, "kind": "tool", "tool": "refund", "outcome": "outcome_unknown"}, False),
        ({"run": "r", "step": 2, "kind": "tool", "outcome": "engine error", "error": "KeyError"}, False),
        ({"run": "r", "run_status": "needs_attention"}, False),
        ({"run": "r", "outcome": "nothing to do"}, True),
    ],
)
def test_what_counts_as_not_settled(report, settled):
    assert unsettled(report) is not settled
    if not settled and "tool" in report:
        assert str(StepNotSettled(report)).startswith("step 2 (tool refund): ")
