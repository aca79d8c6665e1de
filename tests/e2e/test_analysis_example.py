"""examples/analysis.yaml as the README says to try it: applied against the example bank server,
run by a real worker with the sandbox runner, and its counts checked against the bank's own."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from artifacts.models import Artifact
from configuration.apply import apply_config
from configuration.loading import load_file
from examples.bank_server import reconciliation_exports
from runs.models import Run, Step
from tenants.models import User
from tests.sandbox_runner import TOKEN, Runner
from tests.servers import ROOT, wait_for
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_analysis_example_reconciles_the_banks_exports(bank, workers, monkeypatch, settings):
    runner = Runner(slots=2, share=1.0).start()
    try:
        monkeypatch.setenv("SANDBOX_RUNNER_URL", runner.url)
        monkeypatch.setenv("SANDBOX_RUNNER_TOKEN", TOKEN)
        settings.SANDBOX_RUNNER_URL = runner.url
        settings.SANDBOX_RUNNER_TOKEN = TOKEN
        monkeypatch.setenv("BANK_EXPORT_URL", bank.url.rstrip("/") + "/http/export")
        apply_config(load_file(ROOT / "examples" / "analysis.yaml"))
        enabled = Tool.objects.filter(tenant__slug="acme-analysis", enabled=True)
        assert sorted(enabled.values_list("name", flat=True)) == [
            "exports__card_transactions",
            "exports__ledger",
            "platform__run_python",
        ]
        workers("w1")
        client = APIClient()
        client.force_authenticate(User.objects.get(username="nila"))
        response = client.post("/v1/runs", {"agent": "analysis-agent", "input": {}}, format="json")
        assert response.status_code == 201, response.content
        run_id = response.json()["id"]
        run = wait_for(
            lambda: (r := Run.objects.get(pk=run_id)).is_terminal and r, timeout=120, what="run end"
        )
    finally:
        runner.stop()
    assert run.status == "succeeded", run.error
    _, _, truth, _ = reconciliation_exports()
    step = Step.objects.get(run=run, tool_name="platform__run_python")
    result = step.result["structured"]
    assert result["exit_code"] == 0, result["stderr"]
    assert result["stdout"].strip() == (
        f'{{"duplicates": {truth["duplicates"]}, "missing": {truth["missing"]}, "mismatches": {truth["mismatches"]}}}'
    )
    names = sorted(Artifact.objects.filter(run=run).values_list("name", flat=True))
    assert names == ["card_transactions.csv", "ledger.csv", "mismatches.csv", "missing.csv"]
    listed = client.get(f"/v1/runs/{run_id}/artifacts").json()
    assert sorted(a["name"] for a in listed) == names
