"""POST /v1/runs/{id}/steps/{seq}/resolve: a supervisor settles an unknown outcome."""

from __future__ import annotations

import pytest

from runs.models import Run, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.recovery.conftest import EMAIL, client_for, events, http_bank_tool, single_call_agent

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def parked(tenant, asha, supervisor, bank):
    """A run in needs_attention: its unsafe email was sent, but the provider answered 500."""
    email = http_bank_tool(tenant, bank, "send_customer_email", effect_class="unsafe")
    factories.grant(email, approve=[supervisor])
    single_call_agent(tenant, asha, email, EMAIL, final="emailed")
    bank.fault(tool="send_customer_email", fail_5xx_after_effect=True)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "needs_attention"
    return run


def resolve(user, run, seq: int = 2, **body):
    return client_for(user).post(
        f"/v1/runs/{run.pk}/steps/{seq}/resolve", {"reason": "checked", **body}, format="json"
    )


def test_it_refuses_to_retry_an_unsafe_call_without_an_override(parked, supervisor, bank):
    answer = resolve(supervisor, parked, outcome="retry")
    assert answer.status_code == 409
    assert answer.json()["error"]["code"] == "retry_not_allowed"
    assert Step.objects.get(run=parked, seq=2).status == "outcome_unknown"
    assert Run.objects.get(pk=parked.pk).status == "needs_attention"
    assert events(parked.pk, "resolved") == []
    assert len(bank.effects("send_customer_email")) == 1


def test_it_retries_an_unsafe_call_on_override_and_records_the_override(parked, supervisor, bank):
    answer = resolve(supervisor, parked, outcome="retry", override=True, reason="mail log shows nothing")
    assert answer.status_code == 200, answer.content
    assert answer.json()["status"] == "retried"
    [event] = events(parked.pk, "resolved")
    assert event.actor == supervisor
    assert event.data["override"] is True and event.data["outcome"] == "retry"
    assert "override" in event.message
    run = drive(parked.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts) == ("succeeded", 2)
    assert len(bank.effects("send_customer_email")) == 2  # the person chose to send it again


def test_it_resolves_as_failed_and_the_model_is_told(parked, supervisor):
    answer = resolve(supervisor, parked, outcome="failed")
    assert answer.status_code == 200, answer.content
    run = drive(parked.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, seq=2)
    assert step.status == "resolved_failed"
    assert step.observation.startswith("ERROR: the call did not take effect")


def test_it_lets_only_holders_of_approve_tool_resolve(parked, asha, tenant, bank):
    bystander = factories.make_user(tenant, "kiran", staff=True)
    other_tool = factories.make_builtin_tools(tenant)["echo"]
    factories.grant(other_tool, approve=[bystander])  # approver of another tool only
    for user in (asha, bystander):
        answer = resolve(user, parked, outcome="succeeded")
        assert answer.status_code == 403
        assert answer.json()["error"]["code"] == "not_an_approver"
    assert Step.objects.get(run=parked, seq=2).status == "outcome_unknown"


def test_it_hides_another_tenants_run(parked):
    globex = factories.make_tenant("globex")
    outsider = factories.make_user(globex, "olga", staff=True)
    answer = resolve(outsider, parked, outcome="succeeded")
    assert answer.status_code == 404
    assert Step.objects.get(run=parked, seq=2).status == "outcome_unknown"


def test_it_refuses_to_resolve_a_step_twice_or_a_model_step(parked, supervisor):
    assert (
        resolve(supervisor, parked, outcome="succeeded", result={"message_id": "MSG-0001"}).status_code == 200
    )
    again = resolve(supervisor, parked, outcome="failed")
    assert again.status_code == 409 and again.json()["error"]["code"] == "step_not_unknown"
    assert resolve(supervisor, parked, seq=1, outcome="failed").status_code == 404
    step = Step.objects.get(run=parked, seq=2)
    assert step.status == "resolved_succeeded" and step.result["structured"] == {"message_id": "MSG-0001"}


def _reservations(run):
    from budgets.models import BudgetAccount, Reservation

    step = Step.objects.get(run=run, seq=2)
    return (
        [(r.status, r.actual_micros) for r in Reservation.objects.filter(step=step)],
        BudgetAccount.objects.get(run=run),
    )


def test_resolved_as_happened_it_charges_the_held_reservation_at_the_tools_price(parked, supervisor):
    before, account = _reservations(parked)
    assert before == [("held", None)] and account.held_micros == 1000
    spent = account.spent_micros

    assert (
        resolve(supervisor, parked, outcome="succeeded", result={"message_id": "MSG-0001"}).status_code == 200
    )
    after, account = _reservations(parked)
    assert after == [("reconciled", 1000)]
    assert (account.held_micros, account.spent_micros - spent) == (0, 1000)


def test_resolved_as_not_happened_it_gives_the_held_reservation_back(parked, supervisor):
    spent = _reservations(parked)[1].spent_micros
    assert resolve(supervisor, parked, outcome="failed").status_code == 200
    after, account = _reservations(parked)
    assert after == [("reconciled", 0)]
    assert (account.held_micros, account.spent_micros) == (0, spent)


def test_a_resolution_keeps_the_calls_duration_and_the_decision_apart(parked, supervisor):
    import time

    time.sleep(1.5)  # the supervisor takes a while
    answer = resolve(supervisor, parked, outcome="failed", reason="no such mail in the log")
    assert answer.status_code == 200
    step = Step.objects.get(run=parked, seq=2)
    assert step.duration_ms is not None and step.duration_ms < 1000  # the call, not the human wait
    assert step.resolved_at > step.finished_at
    assert step.error == ""
    assert step.resolution == "failed by meera: no such mail in the log"
    shown = client_for(supervisor).get(f"/v1/runs/{parked.pk}/steps").json()
    row = next(s for s in (shown["results"] if isinstance(shown, dict) else shown) if s["seq"] == 2)
    assert row["resolution"] == step.resolution and row["error"] == ""
