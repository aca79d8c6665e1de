"""The approvals API (issue #4): who sees what, who may decide, and what a second decision gets."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db import connection
from django.utils import dateformat, timezone
from rest_framework.test import APIClient

from approvals.models import Approval, ApprovalStatus
from runs.models import Run, RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.models import User
from tests import factories
from tests.conftest import drive
from tests.servers import BankServer

pytestmark = pytest.mark.django_db(transaction=True)

REFUND = {"transaction_id": "TXN-1001", "amount": 12499, "currency": "INR"}
TRANSFER = {"to_account": "ACC-1", "amount": 10}


@pytest.fixture(scope="module")
def shared_bank():
    server = BankServer().start()
    yield server
    server.stop()


@pytest.fixture
def bank(shared_bank):
    httpx.post(f"{shared_bank.url}/ledger/reset", timeout=10).raise_for_status()
    return shared_bank


@pytest.fixture
def tools(tenant, asha, ravi, bank):
    """Refunds: asha uses, ravi approves. Transfers (policy: always): asha uses, kiran approves."""
    made = factories.make_bank_tools(tenant, bank.mcp_url)
    kiran = factories.make_user(tenant, "kiran", staff=True)
    factories.grant(made["issue_refund"], use=[asha], approve=[ravi])
    factories.grant(made["transfer_funds"], use=[asha], approve=[kiran])
    return made


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def park(tenant, user, tool, arguments) -> tuple[Run, Approval]:
    """A run of its own agent and script, parked on the approval of one call."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    endpoint = factories.make_endpoint(
        tenant,
        name=name,
        config={"turns": [{"tool_calls": [{"name": tool.name, "arguments": arguments}]}, {"text": "done"}]},
    )
    factories.make_agent(tenant, name=name, endpoint=endpoint, tools=[tool])
    run, _ = start_run(user=user, agent=name, input={})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, run.error
    return run, Approval.objects.get(run=run)


def approve(user, approval, verb: str = "approve", **body):
    return client_for(user).post(f"/v1/approvals/{approval.pk}/{verb}", body, format="json")


def error_code(response) -> str:
    return response.json()["error"]["code"]


# --- listing -----------------------------------------------------------------------------------


def test_it_lists_only_approvals_of_tools_the_caller_may_approve_with_filters(
    tenant, asha, ravi, bank, tools
):
    kiran = User.objects.get(username="kiran")
    refund_run, pending_refund = park(tenant, asha, tools["issue_refund"], REFUND)
    done_run, done_refund = park(tenant, asha, tools["issue_refund"], {**REFUND, "amount": 6000})
    assert approve(ravi, done_refund).status_code == 200
    drive(done_run.pk)
    _, transfer = park(tenant, asha, tools["transfer_funds"], TRANSFER)

    def ids(user, query=""):
        response = client_for(user).get(f"/v1/approvals{query}")
        assert response.status_code == 200, response.content
        return [a["id"] for a in response.json()["results"]]

    assert ids(ravi) == [str(pending_refund.pk), str(done_refund.pk)]
    assert ids(kiran) == [str(transfer.pk)]
    assert ids(asha) == []  # the requester holds no approve_tool
    assert ids(ravi, "?status=pending") == [str(pending_refund.pk)]
    assert ids(ravi, "?status=consumed") == [str(done_refund.pk)]
    assert ids(ravi, f"?tool={tools['issue_refund'].name}") == [str(pending_refund.pk), str(done_refund.pk)]
    assert ids(ravi, f"?tool={tools['transfer_funds'].name}") == []
    assert ids(ravi, f"?run={refund_run.pk}") == [str(pending_refund.pk)]
    assert ids(ravi, f"?run={refund_run.pk}&status=denied") == []
    detail = client_for(ravi).get(f"/v1/approvals/{pending_refund.pk}").json()
    assert (
        detail["arguments"] == REFUND and detail["requested_by"] == "asha" and detail["status"] == "pending"
    )
    assert client_for(ravi).get(f"/v1/approvals/{transfer.pk}").status_code == 404


@pytest.mark.parametrize("query", ["?run=not-a-uuid", "?status=maybe"])
def test_it_answers_400_to_a_malformed_filter(query, ravi):
    response = client_for(ravi).get(f"/v1/approvals{query}")
    assert response.status_code == 400 and error_code(response) == "invalid"


def test_it_answers_404_for_another_tenants_approval(tenant, asha, ravi, bank, tools):
    other = factories.make_tenant("globex")
    olga, oscar = factories.make_user(other, "olga"), factories.make_user(other, "oscar", staff=True)
    their_refund = factories.make_bank_tools(other, bank.mcp_url)["issue_refund"]
    factories.grant(their_refund, use=[olga], approve=[oscar])
    factories.grant(their_refund, approve=[ravi])  # even a stray grant across tenants changes nothing
    their_run, theirs = park(other, olga, their_refund, REFUND)

    assert client_for(ravi).get(f"/v1/approvals/{theirs.pk}").status_code == 404
    assert approve(ravi, theirs).status_code == 404
    assert client_for(ravi).get("/v1/approvals").json()["results"] == []
    assert client_for(ravi).get(f"/v1/approvals?run={their_run.pk}").json()["results"] == []
    assert Approval.objects.get(pk=theirs.pk).status == ApprovalStatus.PENDING
    assert client_for(oscar).get(f"/v1/approvals/{theirs.pk}").status_code == 200


# --- deciding ----------------------------------------------------------------------------------


def test_it_forbids_approving_your_own_request(tenant, asha, bank, tools):
    factories.grant(tools["issue_refund"], approve=[asha])  # she could approve anyone else's
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)

    response = approve(asha, approval)

    assert response.status_code == 403 and error_code(response) == "self_approval"
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL
    assert bank.effects("issue_refund") == []


def test_it_forbids_a_decision_without_approve_tool(tenant, asha, bank, tools):
    noel = factories.make_user(tenant, "noel", staff=True)
    _, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    response = approve(noel, approval)
    assert response.status_code == 403 and error_code(response) == "not_an_approver"
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING


def test_it_dispatches_once_and_answers_409_to_a_second_decision_after_use(tenant, asha, ravi, bank, tools):
    meera = factories.make_user(tenant, "meera", staff=True)
    factories.grant(tools["issue_refund"], approve=[meera])
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)

    first = approve(ravi, approval, reason="receipt checked")
    assert first.status_code == 200 and first.json()["status"] == "approved"
    assert first.json()["decided_by"] == "ravi" and first.json()["decision_reason"] == "receipt checked"
    assert drive(run.pk).status == RunStatus.SUCCEEDED

    again = approve(ravi, approval)  # the same person repeating the same decision: the same answer
    assert again.status_code == 200 and again.json()["status"] == "consumed"
    for verb in ("approve", "deny"):
        late = approve(meera, approval, verb)
        assert late.status_code == 409 and error_code(late) == "approval_consumed"
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    assert len(bank.effects("issue_refund")) == 1


def test_it_answers_409_after_expiry_and_the_run_does_not_dispatch(tenant, asha, ravi, bank, tools):
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    Approval.objects.filter(pk=approval.pk).update(expires_at=timezone.now() - dt.timedelta(minutes=1))

    response = approve(ravi, approval)

    assert response.status_code == 409 and error_code(response) == "approval_expired"
    assert approve(ravi, approval).status_code == 409
    run = drive(run.pk)
    assert Step.objects.get(run=run, seq=2).status == StepStatus.EXPIRED
    assert bank.effects("issue_refund") == []


def test_it_answers_409_to_approving_a_cancelled_runs_request(tenant, asha, ravi, bank, tools):
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    assert client_for(asha).post(f"/v1/runs/{run.pk}/cancel", {}, format="json").status_code == 200

    response = approve(ravi, approval)

    assert response.status_code == 409 and error_code(response) == "approval_voided"
    assert Approval.objects.get(pk=approval.pk).void_reason.startswith("run cancelled")
    assert drive(run.pk).status == RunStatus.CANCELLED
    assert bank.effects("issue_refund") == []


@pytest.mark.parametrize("second", ["deny", "approve"])
def test_concurrent_decisions_by_two_supervisors_have_one_winner(second, tenant, asha, ravi, bank, tools):
    meera = factories.make_user(tenant, "meera", staff=True)
    factories.grant(tools["issue_refund"], approve=[meera])
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    barrier = threading.Barrier(2)

    def decide(user, verb):
        try:
            barrier.wait()
            return approve(user, approval, verb, reason="checked")
        finally:
            connection.close()

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(decide, [ravi, meera], ["approve", second]))

    assert sorted(a.status_code for a in answers) == [200, 409], [a.content for a in answers]
    winner = next(a.json() for a in answers if a.status_code == 200)
    run = drive(run.pk)
    approval.refresh_from_db()
    assert approval.decided_by.username == winner["decided_by"]
    expected = 1 if winner["status"] == "approved" else 0
    assert len(bank.effects("issue_refund")) == expected
    assert approval.status == (ApprovalStatus.CONSUMED if expected else ApprovalStatus.DENIED)
    assert run.status == RunStatus.SUCCEEDED


def test_a_repeated_decision_answers_what_happened_the_first_time(tenant, asha, ravi, bank, tools):
    meera = factories.make_user(tenant, "meera", staff=True)
    factories.grant(tools["issue_refund"], approve=[meera])
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    first = approve(ravi, approval)
    assert first.status_code == 200 and first.json()["repeated"] is False and first.json()["detail"] is None
    decided = Approval.objects.get(pk=approval.pk).decided_at.astimezone(tenant.zone)

    again = approve(ravi, approval)

    at = dateformat.format(decided, "j M Y, H:i")
    assert again.status_code == 200 and again.json()["repeated"] is True
    assert again.json()["detail"] == f"already approved by ravi at {at}; nothing changed"
    other = approve(meera, approval)  # someone else: 409, saying who decided and when
    assert (
        other.status_code == 409 and f"already approved by ravi at {at}" in other.json()["error"]["message"]
    )
    events = RunEvent.objects.filter(run=run, kind="approval_approved")
    assert events.count() == 1  # the repeat wrote nothing
