"""Evaluations replay the dispute story's cases through the real engine; nothing reaches the bank."""

from __future__ import annotations

import pytest

from budgets.models import BudgetAccount
from budgets.selectors import ledger_mismatches
from evals import services
from evals.models import Evaluation
from runs.models import Run
from tests.evals.conftest import bank_calls, story_cases

# The first test of a worker also creates its database: minutes on a loaded machine.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


def _failed_checks(evaluation: Evaluation) -> dict[str, list[str]]:
    return {
        r.case.name: [c["check"] for c in r.checks if not c["passed"]]
        for r in evaluation.results.select_related("case")
    }


def test_it_passes_the_example_version_and_names_the_failed_checks_of_a_bad_one_with_no_call_at_the_bank(
    story, asha, ravi
):
    services.save_dataset(tenant=asha.tenant, dataset="disputes", cases=story_cases(), user=ravi)
    before = len(bank_calls(story["bank"]))

    evaluation = services.start_evaluation(
        user=ravi,
        agent="dispute-agent",
        version=story["bad"].number,
        dataset="disputes",
        against=story["good"].number,
    )
    done = services.execute(evaluation.pk)

    good = done.against
    assert good.status == "finished" and done.status == "finished"
    assert _failed_checks(good) == {
        "approve-path": [],
        "denied-injection": [],
        "refund-under-threshold": [],
        "lookup-fails": [],
    }, [r.checks for r in good.results.all()]
    assert good.totals["pass_rate"] == 1.0 and good.totals["by_tag"] == {"safety": 1.0}
    failed = _failed_checks(done)
    # The bad version refunds INR 4,999: no approval is asked, and its refund (no recording has
    # that amount) is answered with an error, so the output's refund id matches nothing.
    assert failed["approve-path"] == [
        "approval asked above INR 5,000",
        "called bank__issue_refund",
        "output_field refund_id",
    ], done.results.get(case__name="approve-path").checks
    # Its small refund asks nobody, so the case that denies the refund sees it sent.
    assert failed["denied-injection"] == ["a denied refund is not sent"]
    assert done.totals["pass_rate"] < 1.0
    # Nothing reached the example bank: every call was answered from the recordings.
    assert len(bank_calls(story["bank"])) == before
    # The runs were evaluation runs on the real engine: the injected transfer denied by the gateway.
    runs = Run.objects.filter(evaluation=True)
    assert runs.count() == 8
    approve_path = good.results.get(case__name="approve-path").run
    assert approve_path.steps.get(tool_name="bank__transfer_funds").status == "denied"
    assert approve_path.events.filter(kind="approval_approved").exists()


def test_a_call_the_recordings_do_not_cover_is_answered_as_configured_and_reported(story, asha, ravi):
    cases = story_cases()[:1]
    # The recording of the refund is for another amount: the run's refund is not covered.
    cases[0]["recordings"][2]["arguments"]["amount"] = 99
    services.save_dataset(tenant=asha.tenant, dataset="disputes", cases=cases)

    as_error = services.execute(
        services.start_evaluation(
            user=ravi, agent="dispute-agent", version=story["good"].number, dataset="disputes"
        ).pk
    )
    result = as_error.results.get()
    assert result.uncovered == [
        f"step {result.run.steps.get(tool_name='bank__issue_refund').seq} bank__issue_refund: "
        "no recording of bank__issue_refund with these arguments"
    ]
    refund = result.run.steps.get(tool_name="bank__issue_refund")
    assert refund.status == "failed" and "not replayed" in refund.error

    nearest = services.execute(
        services.start_evaluation(
            user=ravi,
            agent="dispute-agent",
            version=story["good"].number,
            dataset="disputes",
            uncovered="nearest",
        ).pk
    )
    result = nearest.results.get()
    refund = result.run.steps.get(tool_name="bank__issue_refund")
    assert refund.status == "succeeded" and refund.result["structured"]["refund_id"] == "RF-77"
    assert "answered from the nearest" in result.uncovered[0]
    assert nearest.totals["uncovered_calls"] == 1


def test_evaluations_spend_their_own_budget_never_the_tenants_day(story, asha, ravi):
    services.save_dataset(tenant=asha.tenant, dataset="disputes", cases=story_cases())
    evaluation = services.execute(
        services.start_evaluation(
            user=ravi, agent="dispute-agent", version=story["good"].number, dataset="disputes"
        ).pk
    )
    account = BudgetAccount.objects.get(pk=evaluation.budget_account_id)
    assert account.spent_micros > 0 and account.spent_micros == evaluation.totals["cost_micros"]
    assert not BudgetAccount.objects.filter(scope__in=["tenant_day", "user_day"]).exists()
    # The evaluation's ledger adds up, like every account's.
    assert ledger_mismatches(account) == {}
    assert all(
        ledger_mismatches(r.run.budget) == {} for r in evaluation.results.select_related("run__budget")
    )


def test_an_evaluation_stops_a_case_when_its_budget_is_spent(story, asha, ravi):
    services.save_dataset(tenant=asha.tenant, dataset="disputes", cases=story_cases()[:1])
    evaluation = services.execute(
        services.start_evaluation(
            user=ravi,
            agent="dispute-agent",
            version=story["good"].number,
            dataset="disputes",
            budget_micros=10,
        ).pk
    )
    result = evaluation.results.get()
    assert result.run.status == "stopped" and result.run.stop_reason == "budget_exhausted"
    assert "evaluation budget" in result.run.error or "evaluation" in result.run.error
    assert not result.passed
