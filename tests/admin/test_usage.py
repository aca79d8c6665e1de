"""The usage page per tenant and the held reservations people reconcile or write off."""

from __future__ import annotations

import pytest

from budgets import services as budgets
from budgets.models import BudgetAccount, Reservation
from runs.approval_effects import decide_approval
from tests.admin.helpers import park_on_approval
from tests.conftest import drive

RESERVATIONS = "/admin/budgets/reservation/"


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.fixture
def hold(acme):
    """A model call's reservation kept as held: the response was lost, the charge is unknown."""
    run = park_on_approval(acme.asha, "refunder").run
    reservation = budgets.reserve(tenant=acme.tenant, run=run, amount_micros=5000, purpose="model")
    budgets.hold(reservation.pk, note="model response lost")
    return Reservation.objects.get(pk=reservation.pk)


def test_the_usage_page_charts_the_last_30_days_and_the_costliest_runs(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=True)
    run = drive(approval.run_id)

    response = as_ravi.get(f"/admin/budgets/reservation/usage/{acme.tenant.pk}/")

    assert response.status_code == 200
    chart = response.context["chart"]
    assert len(chart["bars"]) == 30
    assert chart["bars"][-1]["spent_h"] > 0 and all(bar["spent_h"] == 0 for bar in chart["bars"][:-1])
    assert chart["limit_path"].startswith("M")
    html = response.content.decode()
    assert '<svg class="usage"' in html and '<rect class="spent"' in html
    assert [row["run"] for row in response.context["top_runs"]] == [run]
    assert f"/admin/runs/run/{run.pk}/change/" in html


def test_another_tenants_usage_page_is_404(as_ravi, globex):
    assert as_ravi.get(f"/admin/budgets/reservation/usage/{globex.tenant.pk}/").status_code == 404


def test_it_reconciles_a_hold_with_the_actual_charge(as_ravi, hold):
    listed = as_ravi.get(RESERVATIONS).context["cl"].result_list
    assert list(listed) == [hold]
    selected = {"action": "reconcile_selected", "_selected_action": [str(hold.pk)]}

    confirmation = as_ravi.post(RESERVATIONS, {**selected, "index": "0"})
    assert f'name="actual_{hold.pk}"' in confirmation.content.decode()

    done = as_ravi.post(
        RESERVATIONS,
        {**selected, "confirm": "yes", f"actual_{hold.pk}": "3000", "note": "provider usage export"},
        follow=True,
    )

    assert "reconciled 1 hold(s)" in messages_of(done)
    hold.refresh_from_db()
    assert (hold.status, hold.actual_micros, hold.closed_by.username) == ("reconciled", 3000, "ravi")
    account = BudgetAccount.objects.get(run=hold.run)
    assert account.held_micros == 0 and account.spent_micros >= 3000


def test_it_writes_off_a_hold_only_with_a_note(as_ravi, hold):
    selected = {"action": "write_off_selected", "_selected_action": [str(hold.pk)], "confirm": "yes"}

    refused = as_ravi.post(RESERVATIONS, {**selected, "note": ""})

    assert refused.status_code == 200 and refused.context["form"].errors["note"]
    hold.refresh_from_db()
    assert hold.status == "held"

    as_ravi.post(RESERVATIONS, {**selected, "note": "provider confirms no charge"})

    hold.refresh_from_db()
    assert hold.status == "written_off"
    assert hold.entries.filter(
        kind="write_off", note="provider confirms no charge", actor__username="ravi"
    ).exists()
    assert BudgetAccount.objects.get(run=hold.run).held_micros == 0
