"""run_python's Prometheus metrics, where the platform's are: executions by outcome and limit hit,
start latency and queue wait for a slot, recorded by the process that called a real runner; the
timeline's step carries the same figures."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from artifacts.models import Artifact
from artifacts.services import Given
from runs.models import Step
from runs.services import start_run
from tests import factories
from tests.admin.helpers import make_supervisor
from tests.conftest import drive
from tests.sandbox_runner import TOKEN, Runner
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def runner(monkeypatch, settings):
    runner = Runner(slots=2, share=1.0).start()
    settings.SANDBOX_RUNNER_URL = runner.url
    settings.SANDBOX_RUNNER_TOKEN = TOKEN
    yield runner
    runner.stop()


def sample(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_executions_are_counted_by_outcome_and_limit_with_start_and_queue_times(
    tenant, asha, builtins, runner, client
):
    tool = builtins["run_python"]
    Tool.objects.filter(pk=tool.pk).update(
        effect_class="read_only", sandbox={"limits": {"memory_bytes": 128 << 20, "wall_seconds": 10}}
    )
    factories.grant(tool, use=[asha])
    factories.make_agent(
        tenant,
        tools=[tool],
        turns=[
            {
                "tool_calls": [
                    {
                        "name": tool.name,
                        "arguments": {
                            "code": "import shutil\nshutil.copy('/in/t.csv', '/out/copy.csv')\nprint(6 * 7)",
                            "artifacts": ["$artifact.0"],
                        },
                    }
                ]
            },
            {"tool_calls": [{"name": tool.name, "arguments": {"code": "import sys\nsys.exit(3)"}}]},
            {"tool_calls": [{"name": tool.name, "arguments": {"code": "b = bytearray(1 << 30)"}}]},
            {"text": "done"},
        ],
    )
    ok = {"outcome": "ok", "limit": ""}
    error = {"outcome": "error", "limit": ""}
    memory = {"outcome": "limit", "limit": "memory"}
    before = {
        "ok": sample("agentplatform_sandbox_executions_total", ok),
        "error": sample("agentplatform_sandbox_executions_total", error),
        "memory": sample("agentplatform_sandbox_executions_total", memory),
        "starts": sample("agentplatform_sandbox_start_seconds_count"),
        "queued": sample("agentplatform_sandbox_queue_seconds_count"),
    }
    given = Given(name="t.csv", media_type="text/csv", content=b"a\n1\n")
    run, _ = start_run(user=asha, agent="agent", input={}, files=[given])
    run = drive(run.pk)
    assert run.status == "succeeded"
    assert sample("agentplatform_sandbox_executions_total", ok) == before["ok"] + 1
    assert sample("agentplatform_sandbox_executions_total", error) == before["error"] + 1
    assert sample("agentplatform_sandbox_executions_total", memory) == before["memory"] + 1
    assert sample("agentplatform_sandbox_start_seconds_count") == before["starts"] + 3
    assert sample("agentplatform_sandbox_queue_seconds_count") == before["queued"] + 3
    results = [
        s.result["structured"] for s in Step.objects.filter(run=run, tool_name=tool.name).order_by("seq")
    ]
    assert [r["limit"] for r in results] == [None, None, "memory"]
    assert all(0 < r["start_seconds"] < 5 and r["queue_seconds"] >= 0 for r in results)
    assert results[0]["limits"]["memory_bytes"] == 128 << 20

    # The timeline: the code readable, the limits, the usage, the exit, the files in and out.
    client.force_login(make_supervisor(tenant, "sam"))
    page = client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    first = page[page.index('id="sandbox-2"') : page.index('id="step-3"')]
    assert "shutil.copy(&#x27;/in/t.csv&#x27;, &#x27;/out/copy.csv&#x27;)" in page  # the code, escaped
    assert 'class="tl-result tl-code"' in page
    assert "exit 0" in first and "memory <code>128.0\xa0MB</code>" in first and "CPU <code>" in first
    by_name = {a.name: a for a in Artifact.objects.filter(run=run)}  # names are sealed at rest
    copy, original = by_name["copy.csv"], by_name["t.csv"]
    assert f"/admin/runs/run/{run.pk}/artifacts/{original.pk}/" in first
    assert f"/admin/runs/run/{run.pk}/artifacts/{copy.pk}/" in first
    assert "limit hit: memory" in page and "exit 3" in page


def test_a_platform_without_the_runners_token_runs_nothing_and_says_what_to_set(
    tenant, asha, builtins, runner, settings
):
    settings.SANDBOX_RUNNER_TOKEN = "not-the-runners-token-" + "x" * 20
    tool = builtins["run_python"]
    Tool.objects.filter(pk=tool.pk).update(effect_class="read_only")
    factories.grant(tool, use=[asha])
    factories.make_agent(
        tenant,
        tools=[tool],
        turns=[{"tool_calls": [{"name": tool.name, "arguments": {"code": "print(1)"}}]}, {"text": "done"}],
    )
    before = sum(runner.metrics()["executions"].values())

    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)

    step = Step.objects.get(run=run, tool_name=tool.name)
    assert step.status == "failed" and "refused the platform's token" in step.error
    assert sum(runner.metrics()["executions"].values()) == before
