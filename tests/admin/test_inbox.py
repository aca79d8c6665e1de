"""The supervisor inbox: what is listed, deciding one by one and in bulk, errors as messages."""

from __future__ import annotations

import datetime as dt

from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from core.ids import short
from runs.approval_effects import decide_approval
from runs.models import Run, RunStatus
from tests import factories
from tests.admin.helpers import make_supervisor, park_on_approval
from tests.conftest import drive

INBOX = "/admin/approvals/approval/"


def detail_url(approval) -> str:
    return f"{INBOX}{approval.pk}/change/"


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_it_lists_only_the_pending_approvals_the_supervisor_may_decide(as_ravi, acme, globex):
    mine = park_on_approval(acme.asha, "refunder")
    not_approvable = park_on_approval(acme.asha, "nooper")
    decided = park_on_approval(acme.asha, "refunder")
    decide_approval(approval_id=decided.pk, user=acme.ravi, approve=False, reason="no")

    response = as_ravi.get(INBOX)

    assert response.status_code == 200
    listed = list(response.context["cl"].result_list)
    assert listed == [mine]
    html = response.content.decode()
    assert short(mine.run_id) in html
    for hidden in (not_approvable, decided, globex.approval):
        assert short(hidden.run_id) not in html


def test_it_shows_arguments_readably_with_money_in_bold(as_ravi, acme):
    park_on_approval(acme.asha, "refunder")

    html = as_ravi.get(INBOX).content.decode()

    assert '<span class="arg-key">amount</span>: <strong class="amount">12499</strong>' in html
    assert '<span class="arg-key">currency</span>: <strong class="amount">INR</strong>' in html
    assert '<span class="arg-key">transaction_id</span>: TXN-1001' in html
    assert '<td class="field-reason">policy: always</td>' in html


def test_it_filters_by_age(as_ravi, acme):
    fresh = park_on_approval(acme.asha, "refunder")
    old = park_on_approval(acme.asha, "refunder")
    Approval.objects.filter(pk=old.pk).update(created_at=timezone.now() - dt.timedelta(hours=9))

    def listed(query):
        return list(as_ravi.get(INBOX + query).context["cl"].result_list)

    assert listed("?age=lt1h") == [fresh]
    assert listed("?age=1to8h") == []
    assert listed("?age=gt8h") == [old]
    assert listed("") == [old, fresh]


def test_another_tenants_approval_and_run_answer_404(as_ravi, acme, globex):
    assert as_ravi.get(detail_url(globex.approval)).status_code == 404
    assert as_ravi.post(detail_url(globex.approval), {"_approve": "1", "reason": "x"}).status_code == 404
    assert as_ravi.get(f"/admin/runs/run/{globex.approval.run_id}/change/").status_code == 404
    assert as_ravi.get(f"/admin/tools/tool/{globex.tools['echo'].pk}/change/").status_code == 404
    globex.approval.refresh_from_db()
    assert globex.approval.status == ApprovalStatus.PENDING


def test_the_detail_page_shows_the_conversation_so_far(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")

    response = as_ravi.get(detail_url(approval))

    html = response.content.decode()
    assert response.status_code == 200
    assert html.index("Let me do that.") < html.index(f"{approval.tool.name} (step {approval.step.seq})")
    assert 'name="_approve"' in html and 'name="_deny"' in html and "<textarea" in html


def test_it_approves_from_the_detail_page_and_the_run_finishes(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")

    response = as_ravi.post(detail_url(approval), {"_approve": "Approve", "reason": "customer verified"})

    assert response.status_code == 302 and response.url == INBOX
    approval.refresh_from_db()
    assert (approval.status, approval.decided_by, approval.decision_reason) == (
        ApprovalStatus.APPROVED,
        acme.ravi,
        "customer verified",
    )
    assert Run.objects.get(pk=approval.run_id).status == RunStatus.RUNNING
    run = drive(approval.run_id)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.steps.get(seq=approval.step.seq).result["structured"]["amount"] == 12499


def test_it_denies_from_the_detail_page_and_decides_nothing_without_a_button(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")

    undecided = as_ravi.post(detail_url(approval), {"reason": "enter pressed"})
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING
    assert "choose Approve or Deny" in messages_of(undecided)

    as_ravi.post(detail_url(approval), {"_deny": "Deny", "reason": "amount looks wrong"})

    approval.refresh_from_db()
    assert (approval.status, approval.decision_reason) == (ApprovalStatus.DENIED, "amount looks wrong")
    approval.step.refresh_from_db()
    assert "a supervisor denied this call: amount looks wrong" in approval.step.observation


def test_it_denies_in_bulk_after_asking_for_a_reason(as_ravi, acme):
    first = park_on_approval(acme.asha, "refunder")
    second = park_on_approval(acme.asha, "refunder")
    selected = {"action": "deny_selected", ACTION_CHECKBOX_NAME: [str(first.pk), str(second.pk)]}

    confirmation = as_ravi.post(INBOX, {**selected, "index": "0"})

    assert confirmation.status_code == 200
    assert "Deny 2 call(s)?" in confirmation.content.decode()
    assert Approval.objects.filter(status=ApprovalStatus.PENDING).count() == 2

    done = as_ravi.post(INBOX, {**selected, "confirm": "yes", "reason": "duplicate request"}, follow=True)

    assert "denied 2 call(s)" in messages_of(done)
    for approval in (first, second):
        approval.refresh_from_db()
        assert (approval.status, approval.decision_reason) == (ApprovalStatus.DENIED, "duplicate request")
        assert Run.objects.get(pk=approval.run_id).status == RunStatus.RUNNING


def test_it_shows_self_approval_as_an_error_message(as_ravi, acme):
    own = park_on_approval(acme.ravi, "refunder")

    response = as_ravi.post(detail_url(own), {"_approve": "Approve", "reason": "mine"})

    assert response.status_code == 200
    assert any("you may not decide your own request" in m for m in messages_of(response))
    own.refresh_from_db()
    assert own.status == ApprovalStatus.PENDING


def test_it_shows_an_approval_decided_meanwhile_as_an_error_message(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    sam = make_supervisor(acme.tenant, "sam")
    factories.grant(acme.tools["echo"], approve=[sam])
    decide_approval(approval_id=approval.pk, user=sam, approve=False, reason="first")

    response = as_ravi.post(detail_url(approval), {"_approve": "Approve", "reason": "late"})

    assert response.status_code == 200
    assert any("approval is already denied" in m for m in messages_of(response))
    approval.refresh_from_db()
    assert (approval.status, approval.decided_by) == (ApprovalStatus.DENIED, sam)


def test_an_operator_sees_every_tenants_approvals_but_decides_none(client, operator, acme, globex):
    mine = park_on_approval(acme.asha, "refunder")
    client.force_login(operator)

    response = client.get(INBOX)

    assert set(response.context["cl"].result_list) == {mine, globex.approval}
    assert "approve_selected" not in response.content.decode()
    assert client.post(detail_url(mine), {"_approve": "1"}).status_code == 403


def test_a_staff_user_without_approve_tool_has_no_inbox(client, acme):
    client.force_login(make_supervisor(acme.tenant, "nina"))

    assert client.get(INBOX).status_code == 403


def test_it_filters_by_tool(as_ravi, acme):
    factories.grant(acme.tools["noop"], approve=[acme.ravi])
    echo = park_on_approval(acme.asha, "refunder")
    noop = park_on_approval(acme.asha, "nooper")

    response = as_ravi.get(f"{INBOX}?tool__id__exact={acme.tools['noop'].pk}")

    assert list(response.context["cl"].result_list) == [noop]
    assert echo not in response.context["cl"].result_list


def test_a_bulk_decision_counts_only_the_calls_it_decided(as_ravi, acme):
    # From a stale list: ravi denied the first call already; the bulk denial of both denies the
    # second, says so for one call, and warns what had happened to the first.
    first = park_on_approval(acme.asha, "refunder")
    second = park_on_approval(acme.asha, "refunder")
    decide_approval(approval_id=first.pk, user=acme.ravi, approve=False, reason="looked wrong")
    selected = {"action": "deny_selected", ACTION_CHECKBOX_NAME: [str(first.pk), str(second.pk)]}

    done = as_ravi.post(
        f"{INBOX}?status=all", {**selected, "confirm": "yes", "reason": "duplicate"}, follow=True
    )

    said = messages_of(done)
    assert "denied 1 call(s)" in said, said
    assert "denied 2 call(s)" not in said
    second.refresh_from_db()
    assert second.status == ApprovalStatus.DENIED
