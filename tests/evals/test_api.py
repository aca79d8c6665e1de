"""Datasets and evaluations through the API, the admin's one action, `manage.py eval` and the
configuration file; a finished real run becomes a case; evaluations stay out of real work."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from budgets.models import BudgetAccount
from configuration.apply import apply_config
from configuration.report import ConfigError
from evals import services
from evals.models import Dataset, Evaluation
from runs import approval_effects
from runs.models import Run
from runs.services import start_run
from tests.configuration.test_apply import config
from tests.conftest import drive
from tests.evals.conftest import INPUT, bank_calls, story_cases

# The first test of a worker also creates its database: minutes on a loaded machine.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _real_run(story, asha, ravi) -> Run:
    run, _ = start_run(user=asha, agent="dispute-agent", version=story["good"].number, input=INPUT)
    run = drive(run.pk)
    assert run.status == "waiting_approval"
    approval = run.approvals.get()
    approval_effects.decide_approval(approval_id=approval.pk, user=ravi, approve=True)
    return drive(run.pk)


def test_a_finished_run_becomes_a_case_and_the_command_compares_two_versions_on_it(story, asha, ravi):
    run = _real_run(story, asha, ravi)
    assert run.status == "succeeded"
    real_calls = len(bank_calls(story["bank"]))
    assert real_calls == 4  # lookup, search, refund, email: the transfer was denied

    added = client_for(ravi).post(
        "/v1/datasets/disputes/runs", {"run": str(run.pk), "name": "story"}, format="json"
    )
    assert added.status_code == 201, added.content
    [case] = added.json()["cases"]
    assert case["user"] == "asha" and case["approver"] == "ravi"
    assert case["approvals"] == {"bank__issue_refund": "approve"}
    assert [r["tool"] for r in case["recordings"]] == [
        "bank__lookup_transaction",
        "bank__search_tickets",
        "bank__issue_refund",
        "bank__send_customer_email",
    ]
    assert {"policy_denied": "bank__transfer_funds"} in case["checks"]
    assert {"approval_asked": "bank__issue_refund"} in case["checks"]

    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        call_command(
            "eval",
            f"dispute-agent:{story['bad'].number}",
            "disputes",
            "--against",
            str(story["good"].number),
            "--as",
            "ravi",
            stdout=out,
        )
    assert exit_.value.code == 1  # the candidate fails a case
    text = out.getvalue()
    assert "approval_asked bank__issue_refund" in text and "FAIL  pass" in text, text
    assert "== v1: 1/1 cases passed (100%)" in text and "== v2: 0/1 cases passed (0%)" in text, text
    # The evaluations' eight tool calls never reached the bank.
    assert len(bank_calls(story["bank"])) == real_calls

    # Evaluation runs are not in the run list, but open by id (the evaluation links them).
    listed = client_for(ravi).get("/v1/runs").json()["results"]
    assert [r["id"] for r in listed] == [str(run.pk)]
    evaluation_run = Run.objects.filter(evaluation=True).first()
    assert client_for(asha).get(f"/v1/runs/{evaluation_run.pk}").status_code == 200

    # Only staff add runs; a run that is still going is refused.
    refused = client_for(asha).post("/v1/datasets/disputes/runs", {"run": str(run.pk)}, format="json")
    assert refused.status_code == 403
    going, _ = start_run(user=asha, agent="dispute-agent", version=story["good"].number, input=INPUT)
    busy = client_for(ravi).post("/v1/datasets/disputes/runs", {"run": str(going.pk)}, format="json")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "run_not_finished"


def test_the_api_stores_versions_reports_bad_cases_by_path_and_runs_an_evaluation(story, asha, ravi):
    client = client_for(ravi)
    created = client.post("/v1/datasets", {"name": "disputes", "cases": story_cases()}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["number"] == 1 and len(created.json()["cases"]) == 4
    again = client.post("/v1/datasets", {"name": "disputes", "cases": story_cases()}, format="json")
    assert again.status_code == 200 and again.json()["number"] == 1

    bad = story_cases()
    bad[0]["user"] = "nobody"
    bad[1]["checks"].append({"max_steps": "many"})
    bad[2]["approvals"] = {"bank__issue_refund": "maybe"}
    bad[3]["recordings"].append({"tool": "bank__search_tickets"})
    refused = client.post("/v1/datasets", {"name": "disputes", "cases": bad}, format="json")
    assert refused.status_code == 400
    assert set(refused.json()["error"]["fields"]) == {
        "cases.0.user",
        "cases.1.checks.3.max_steps",
        "cases.2.approvals",
        "cases.3.recordings.4",
    }, refused.json()
    assert (
        client_for(asha)
        .post("/v1/datasets", {"name": "x", "cases": story_cases()}, format="json")
        .status_code
        == 403
    )

    started = client.post(
        "/v1/evaluations",
        {
            "agent": "dispute-agent",
            "version": story["good"].number,
            "dataset": "disputes",
            "against": story["bad"].number,
            "budget_micros": 500_000,
        },
        format="json",
    )
    assert started.status_code == 202, started.content
    assert started.json()["status"] == "queued"
    services.execute(started.json()["id"])  # what the evaluations task does on a worker

    shown = client.get(f"/v1/evaluations/{started.json()['id']}").json()
    assert shown["status"] == "finished" and shown["totals"]["pass_rate"] == 1.0
    comparison = shown["comparison"]
    assert (comparison["version"], comparison["against_version"]) == (
        story["good"].number,
        story["bad"].number,
    )
    row = next(c for c in comparison["cases"] if c["case"] == "approve-path")
    assert (row["passed"], row["against_passed"]) == (True, False)
    asked = next(c for c in row["checks"] if c["check"] == "approval asked above INR 5,000")
    assert (asked["passed"], asked["against_passed"]) == (True, False)
    assert row["run"] and row["against_run"]
    assert client.get("/v1/evaluations/not-an-id").status_code == 404
    unknown = client.post(
        "/v1/evaluations", {"agent": "dispute-agent", "version": 99, "dataset": "disputes"}, format="json"
    )
    assert unknown.status_code == 404


def test_the_admin_adds_runs_and_shows_an_evaluation_with_links_to_its_runs(story, asha, ravi):
    run = _real_run(story, asha, ravi)
    ravi.is_superuser = False
    client = APIClient()
    client.force_login(ravi)
    from django.contrib.auth.models import Permission

    ravi.user_permissions.add(*Permission.objects.filter(content_type__app_label__in=["runs", "evals"]))
    picked = client.post("/admin/runs/run/", {"action": "add_to_dataset", "_selected_action": [str(run.pk)]})
    assert picked.status_code == 302 and f"runs={run.pk}" in picked["Location"]
    added = client.post(picked["Location"], {"dataset": "from-admin", "runs": str(run.pk)})
    assert added.status_code == 302, added.content.decode()[-2000:]
    assert Dataset.objects.get(name="from-admin").versions.get().cases.get().source_run_id == run.pk

    evaluation = services.execute(
        services.start_evaluation(
            user=ravi, agent="dispute-agent", version=story["good"].number, dataset="from-admin"
        ).pk
    )
    page = client.get(f"/admin/evals/evaluation/{evaluation.pk}/change/")
    assert page.status_code == 200
    result = evaluation.results.get()
    assert f"/admin/runs/run/{result.run_id}/change/" in page.content.decode()


def test_the_configuration_file_stores_datasets_and_reports_their_errors_by_path(db):
    data = config()
    data["datasets"] = [
        {
            "name": "smoke",
            "description": "the echo agent answers",
            "cases": [
                {
                    "name": "hello",
                    "input": {"message": "hi"},
                    "user": "asha",
                    "checks": [{"status": "succeeded"}],
                }
            ],
        }
    ]
    report = apply_config(data)
    assert "created dataset smoke v1 (1 cases)" in report.changes
    assert Dataset.objects.get(name="smoke").description == "the echo agent answers"
    again = apply_config(data)
    assert not [c for c in again.changes if "dataset" in c]

    data["datasets"][0]["cases"][0]["user"] = "nobody"
    data["datasets"][0]["cases"][0]["checks"] = [{"max_steps": -1}]
    with pytest.raises(ConfigError) as raised:
        apply_config(data)
    paths = [path for path, _ in raised.value.errors]
    assert "datasets.0.cases.0.user" in paths and "datasets.0.cases.0.checks.0.max_steps" in paths


def test_a_model_graded_check_is_reported_apart_and_paid_from_the_evaluation(story, asha, ravi):
    from tests import factories

    factories.make_endpoint(
        asha.tenant, name="judge", config={"turns": [{"text": "FAIL\nThe summary names no amount."}]}
    )
    cases = story_cases()[:1]
    cases[0]["checks"] = [
        {"status": "succeeded"},
        {"judge": {"endpoint": "judge", "rubric": "The summary names the amount."}},
    ]
    services.save_dataset(tenant=asha.tenant, dataset="graded", cases=cases)
    evaluation = services.execute(
        services.start_evaluation(
            user=ravi, agent="dispute-agent", version=story["good"].number, dataset="graded"
        ).pk
    )
    result = evaluation.results.get()
    judged = next(c for c in result.checks if c["graded"])
    assert judged["passed"] is False and judged["detail"] == "The summary names no amount."
    assert result.passed  # the deterministic checks decide a case's pass
    assert evaluation.totals["graded_checks"] == 1 and evaluation.totals["graded_passed"] == 0
    account = BudgetAccount.objects.get(pk=evaluation.budget_account_id)
    assert account.spent_micros == evaluation.totals["cost_micros"] + judged["cost_micros"]
    assert judged["cost_micros"] > 0
    assert Evaluation.objects.count() == 1
