"""The analysis story end to end: an HTTP tool exports 30,000 card transactions and the ledger as
CSV artifacts, the scripted model's run_python code compares them in the sandbox runner, and the
answer matches what this test computes itself. Real workers, a real runner process."""

from __future__ import annotations

import json

import pytest

from artifacts.models import Artifact
from artifacts.services import content_of
from runs.models import Run, Step
from tests import factories
from tests.recovery.conftest import FAST_LEASES, sweep_until
from tests.sandbox_runner import TOKEN, FileToolServer, Runner, make_data
from tests.servers import wait_for
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db(transaction=True)

ANALYSIS = """
import json, time
import pandas as pd
time.sleep(float({pause}))
card = pd.read_csv('/in/card_transactions.csv')
ledger = pd.read_csv('/in/ledger.csv')
duplicates = int(card.duplicated('txn_id').sum())
card = card.drop_duplicates('txn_id')
missing = sorted(card.loc[~card.txn_id.isin(ledger.txn_id), 'txn_id'])
both = card.merge(ledger, on='txn_id', suffixes=('_card', '_ledger'))
mismatched = both[both.amount_card != both.amount_ledger]
mismatched.to_csv('/out/mismatches.csv', index=False)
print(json.dumps({{"duplicates": duplicates, "missing": len(missing), "mismatches": len(mismatched),
                   "missing_ids": missing[:5]}}))
"""


@pytest.fixture
def runner(monkeypatch, settings):
    runner = Runner(slots=2, share=1.0).start()
    monkeypatch.setenv("SANDBOX_RUNNER_URL", runner.url)
    monkeypatch.setenv("SANDBOX_RUNNER_TOKEN", TOKEN)
    settings.SANDBOX_RUNNER_URL = runner.url
    settings.SANDBOX_RUNNER_TOKEN = TOKEN
    yield runner
    runner.stop()


def analysis_agent(tenant, user, exports_url: str, *, pause: float, timeout: float = 60):
    server = ToolServer.objects.create(tenant=tenant, name="bank", kind=ToolServer.Kind.HTTP, url=exports_url)
    exports = [
        Tool.objects.create(
            tenant=tenant, server=server, name=f"bank.{n}", remote_name=n, enabled=True,
            effect_class="read_only", input_schema={"type": "object"},
        )
        for n in ("card_transactions", "ledger")
    ]  # fmt: skip
    builtins = factories.make_builtin_tools(tenant, timeout_seconds=timeout, price_micros=2000)
    run_python = builtins["run_python"]
    for tool in (*exports, run_python):
        factories.grant(tool, use=[user])
    factories.make_agent(
        tenant,
        name="analysis-agent",
        tools=[*exports, run_python],
        turns=[
            {
                "tool_calls": [
                    {"name": "bank.card_transactions", "arguments": {}},
                    {"name": "bank.ledger", "arguments": {}},
                ]
            },
            {
                "tool_calls": [
                    {
                        "name": run_python.name,
                        "arguments": {
                            "code": ANALYSIS.format(pause=pause),
                            "artifacts": ["$artifact.0", "$artifact.1"],
                        },
                    }
                ]
            },
            {"text": "Compared the card transactions with the ledger."},
        ],
    )
    return run_python


def start_run(user) -> str:
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(user)
    response = client.post(
        "/v1/runs", {"agent": "analysis-agent", "input": {"task": "reconcile"}}, format="json"
    )
    assert response.status_code == 201, response.content
    return response.json()["id"]


def check_answer(run_id: str, truth: dict, missing_ids: list[str]) -> Step:
    run = Run.objects.get(pk=run_id)
    assert run.status == "succeeded", run.error
    step = Step.objects.get(run=run, tool_name__endswith="run_python", status="succeeded")
    result = step.result["structured"]
    assert result["exit_code"] == 0, result["stderr"]
    answer = json.loads(result["stdout"].strip().splitlines()[-1])
    assert {k: answer[k] for k in truth} == truth
    assert answer["missing_ids"] == missing_ids[:5]
    (produced,) = [a for a in Artifact.objects.filter(run=run, step=step) if a.name == "mismatches.csv"]
    assert content_of(produced).count(b"\n") == truth["mismatches"] + 1
    # Names are sealed at rest (the database neither filters nor sorts by them): sorted here.
    inputs = sorted(Artifact.objects.filter(run=run, source="tool"), key=lambda a: a.name)
    assert [a.name for a in inputs] == ["card_transactions.csv", "ledger.csv"]
    assert inputs[0].size == len(content_of(inputs[0]))
    return step


def test_the_model_code_finds_duplicates_missing_entries_and_mismatches(tenant, asha, workers, runner):
    card, ledger, truth, missing_ids = make_data()
    exports = FileToolServer({"card_transactions": card, "ledger": ledger}).start()
    try:
        analysis_agent(tenant, asha, exports.url, pause=0)
        workers("w1")
        run_id = start_run(asha)
        wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout=120, what="run end")
        step = check_answer(run_id, truth, missing_ids)
    finally:
        exports.stop()
    # The model saw descriptions of the files, never their 30,000 rows.
    export_steps = Step.objects.filter(run_id=run_id, tool_name__startswith="bank.")
    for export in export_steps:
        assert len(json.dumps(export.observation)) < 4000
    run = Run.objects.get(pk=run_id)
    assert run.budget.spent_micros >= step.cost_micros > 0
    assert runner.metrics()["executions"] == {"ok": 1}


def test_a_worker_killed_during_the_execution_leaves_one_execution_and_one_result(
    tenant, asha, workers, runner
):
    card, ledger, truth, missing_ids = make_data()
    exports = FileToolServer({"card_transactions": card, "ledger": ledger}).start()
    try:
        analysis_agent(tenant, asha, exports.url, pause=4, timeout=12)
        first = workers("w1", env=FAST_LEASES)
        run_id = start_run(asha)
        wait_for(lambda: runner.metrics()["running"] == 1, timeout=60, what="the execution to start")
        first.kill()
        workers("w2", env=FAST_LEASES)
        sweep_until(lambda: Run.objects.get(pk=run_id).is_terminal, timeout=120, what="run end")
        check_answer(run_id, truth, missing_ids)
    finally:
        exports.stop()
    steps = Step.objects.filter(run_id=run_id, tool_name__endswith="run_python")
    assert steps.count() == 1 and steps.get().attempts == 2
    # the retry's request found the key's execution (running or done) instead of starting another
    assert runner.metrics()["executions"] == {"ok": 1}
    assert [a.name for a in Artifact.objects.filter(run_id=run_id)].count("mismatches.csv") == 1
