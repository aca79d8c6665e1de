"""Approvals in the run loop (issue #4), against real PostgreSQL and the bank MCP server.

Outcomes are counted where they happen: refunds in the bank server's ledger, approval and step
rows, run statuses.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from approvals import services as approvals
from approvals.models import Approval, ApprovalStatus
from core.errors import Conflict
from runs.approval_effects import decide_approval
from runs.models import Run, RunEvent, RunStatus, Step, StepStatus, StopReason
from runs.recovery.sweeper import sweep
from runs.services import cancel_run, start_run
from runs.tasks import advance_run
from tenants.models import User
from tests import factories
from tests.conftest import drive
from tests.servers import BankServer, wait_for
from vault.fields import seal

pytestmark = pytest.mark.django_db(transaction=True)


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
def refund(tenant, asha, ravi, bank):
    """issue_refund on the bank: asha may use it, ravi may approve it (policy: amount > 5000)."""
    tool = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    factories.grant(tool, use=[asha], approve=[ravi])
    return tool


def refund_call(tool, amount: int = 12499, transaction_id: str = "TXN-1001") -> dict:
    return {
        "tool_calls": [
            {
                "name": tool.name,
                "arguments": {"transaction_id": transaction_id, "amount": amount, "currency": "INR"},
            }
        ]
    }


def waiting_run(tenant, user, tool, *turns, **spec) -> tuple[Run, Approval]:
    """A run parked on its first call's approval; the script then plays `turns` and says "done"."""
    factories.make_agent(tenant, tools=[tool], turns=[refund_call(tool), *turns, {"text": "done"}], **spec)
    run, _ = start_run(user=user, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, run.error
    return run, Approval.objects.get(run=run)


def refund_step(run) -> Step:
    return Step.objects.get(run=run, seq=2)


# --- the path that works -------------------------------------------------------------------


def test_it_dispatches_an_approved_call_once_with_the_step_key(tenant, asha, ravi, bank, refund):
    run, approval = waiting_run(tenant, asha, refund)
    assert bank.effects() == []

    decide_approval(approval_id=approval.pk, user=ravi, approve=True, reason="verified")
    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    [effect] = bank.effects("issue_refund")
    assert effect["idempotency_key"] == refund_step(run).idempotency_key
    assert effect["arguments"]["amount"] == 12499
    assert refund_step(run).status == StepStatus.SUCCEEDED
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.CONSUMED


# --- the requester loses authority while the run waits ---------------------------------------


@pytest.mark.parametrize("how", ["revoke_use_tool", "leave_group", "deactivate"])
def test_it_voids_the_approval_when_the_requester_loses_authority_while_waiting(
    how, tenant, asha, ravi, bank, refund
):
    if how == "leave_group":
        remove_perm("tools.use_tool", asha, refund)
        clerks = factories.make_group(tenant, "clerks")
        assign_perm("tools.use_tool", clerks, refund)
        asha.groups.add(clerks)
    run, approval = waiting_run(tenant, asha, refund)
    if how == "revoke_use_tool":
        remove_perm("tools.use_tool", asha, refund)
    elif how == "leave_group":
        asha.groups.clear()
    else:
        User.objects.filter(pk=asha.pk).update(is_active=False)

    decide_approval(approval_id=approval.pk, user=ravi, approve=True)
    run = drive(run.pk)

    assert bank.effects("issue_refund") == []
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.VOIDED
    assert ("deactivated" if how == "deactivate" else "may not use") in approval.void_reason
    step = refund_step(run)
    assert step.status == StepStatus.DENIED and step.error == approval.void_reason
    assert RunEvent.objects.filter(run=run, kind="approval_voided", step_seq=step.seq).exists()
    if how == "deactivate":  # a deactivated user's run is not handed back to the model
        assert run.status == RunStatus.STOPPED and run.stop_reason == "user_deactivated"
    else:
        assert run.status == RunStatus.SUCCEEDED  # the model was told and finished


# --- single use, exact call --------------------------------------------------------------------


def test_it_never_dispatches_on_an_approval_that_was_already_used(tenant, asha, ravi, bank, refund):
    run, approval = waiting_run(tenant, asha, refund)
    decide_approval(approval_id=approval.pk, user=ravi, approve=True)
    step = refund_step(run)
    assert approvals.consume(step) is True  # used elsewhere first (a replayed message, say)
    assert approvals.consume(step) is False

    run = drive(run.pk)

    assert bank.effects("issue_refund") == []
    assert refund_step(run).status == StepStatus.DENIED


def test_it_replays_the_same_call_from_the_record_and_asks_again_for_a_different_amount(
    tenant, asha, ravi, bank, refund
):
    run, first = waiting_run(tenant, asha, refund, refund_call(refund), refund_call(refund, amount=12000))
    decide_approval(approval_id=first.pk, user=ravi, approve=True)

    run = drive(run.pk)

    # seq 2: approved and dispatched; seq 4: the identical call, answered from the record;
    # seq 6: a different amount, which the old approval does not cover.
    assert run.status == RunStatus.WAITING_APPROVAL
    steps = {s.seq: s for s in Step.objects.filter(run=run, kind="tool")}
    assert steps[2].status == StepStatus.SUCCEEDED
    assert steps[4].status == StepStatus.SUCCEEDED and steps[4].replayed_from_seq == 2
    assert steps[6].status == StepStatus.AWAITING_APPROVAL
    second = Approval.objects.get(step=steps[6])
    assert second.status == ApprovalStatus.PENDING and second.arguments["amount"] == 12000
    assert second.digest != first.digest
    assert Approval.objects.get(pk=first.pk).status == ApprovalStatus.CONSUMED
    assert len(bank.effects("issue_refund")) == 1

    decide_approval(approval_id=second.pk, user=ravi, approve=False, reason="one refund is enough")
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED
    assert len(bank.effects("issue_refund")) == 1


def test_it_refuses_to_dispatch_when_the_arguments_change_after_approval(tenant, asha, ravi, bank, refund):
    run, approval = waiting_run(tenant, asha, refund)
    decide_approval(approval_id=approval.pk, user=ravi, approve=True)
    tampered = {"transaction_id": "TXN-1001", "amount": 1, "currency": "INR"}
    Step.objects.filter(pk=refund_step(run).pk).update(  # by someone holding the run's key
        arguments=seal(Step, "arguments", run.pk, tampered, tenant=run.tenant_id)
    )
    step = refund_step(run)
    assert approvals.verify_for_dispatch(step) is not None
    assert approvals.consume(step) is False  # consuming checks the exact call too

    run = drive(run.pk)

    assert bank.effects("issue_refund") == []
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.VOIDED and "exact call" in approval.void_reason
    assert refund_step(run).status == StepStatus.DENIED


# --- expiry ------------------------------------------------------------------------------------


def test_it_expires_approvals_after_24_hours_by_default_or_the_tool_ttl(tenant, asha, ravi, bank, refund):
    run, approval = waiting_run(tenant, asha, refund)
    assert tenant.approval_ttl_seconds == 24 * 3600
    assert abs(approval.expires_at - approval.created_at - dt.timedelta(hours=24)) < dt.timedelta(seconds=5)
    cancel_run(run_id=run.pk, actor=asha)

    refund.approval_ttl_seconds = 600
    refund.save(update_fields=["approval_ttl_seconds"])
    run, approval = waiting_run(tenant, asha, refund)
    assert abs(approval.expires_at - approval.created_at - dt.timedelta(minutes=10)) < dt.timedelta(seconds=5)

    assert sweep(now=timezone.now() + dt.timedelta(minutes=9))["approvals_expired"] == 0
    assert sweep(now=timezone.now() + dt.timedelta(minutes=11))["approvals_expired"] == 1
    with pytest.raises(Conflict):
        decide_approval(approval_id=approval.pk, user=ravi, approve=True)
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED
    assert refund_step(run).status == StepStatus.EXPIRED
    assert bank.effects("issue_refund") == []


def test_it_refuses_a_decision_after_expiry_even_before_the_sweeper_ran(tenant, asha, ravi, bank, refund):
    run, approval = waiting_run(tenant, asha, refund)
    Approval.objects.filter(pk=approval.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))

    with pytest.raises(Conflict) as refused:
        decide_approval(approval_id=approval.pk, user=ravi, approve=True)

    assert refused.value.code == "approval_expired"
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.EXPIRED
    run = drive(run.pk)
    assert bank.effects("issue_refund") == []
    assert "expired" in Step.objects.get(run=run, seq=2).observation


def test_it_stops_the_run_when_an_approval_expires_and_the_agent_says_stop(tenant, asha, ravi, bank, refund):
    refund.approval_ttl_seconds = 600  # expires well before the run's deadline
    refund.save(update_fields=["approval_ttl_seconds"])
    run, approval = waiting_run(tenant, asha, refund, on_approval_expired="stop")

    assert sweep(now=timezone.now() + dt.timedelta(minutes=11))["approvals_expired"] == 1

    run.refresh_from_db()
    assert run.status == RunStatus.STOPPED and run.stop_reason == StopReason.APPROVAL_EXPIRED
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.EXPIRED
    assert drive(run.pk).status == RunStatus.STOPPED
    assert bank.effects("issue_refund") == []


# --- policy --------------------------------------------------------------------------------------


ABOVE_1000 = """@approval("refunds above 1,000 from this agent wait")
permit (principal, action == Action::"{tool}", resource)
when {{ context.arguments.amount > 1000 }};"""


@pytest.mark.parametrize(
    ("override", "amount", "waits"),
    [
        (None, 3000, False),  # the tool's own rule: amount > 5000
        ("never", 12499, True),  # an override cannot loosen it
        (ABOVE_1000, 3000, True),  # but can tighten it
        (ABOVE_1000, 500, False),
        ("always", 1, True),
    ],
)
def test_it_applies_agent_policy_overrides_only_when_stricter(
    override, amount, waits, tenant, asha, ravi, bank, refund
):
    override = override.format(tool=refund.name) if override else override
    overrides = {"approval_overrides": {refund.name: override}} if override else {}
    factories.make_agent(
        tenant, tools=[refund], turns=[refund_call(refund, amount=amount), {"text": "done"}], **overrides
    )
    run, _ = start_run(user=asha, agent="agent", input={})

    run = drive(run.pk)

    assert (run.status == RunStatus.WAITING_APPROVAL) is waits
    assert Approval.objects.filter(run=run).exists() is waits
    assert len(bank.effects("issue_refund")) == (0 if waits else 1)


# --- cancellation ----------------------------------------------------------------------------


def test_it_voids_the_approval_of_a_cancelled_run_and_refuses_to_approve_it(tenant, asha, ravi, bank, refund):
    run, approval = waiting_run(tenant, asha, refund)

    cancel_run(run_id=run.pk, actor=asha, reason="customer withdrew")

    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.VOIDED and "cancelled" in approval.void_reason
    with pytest.raises(Conflict):
        decide_approval(approval_id=approval.pk, user=ravi, approve=True)
    assert drive(run.pk).status == RunStatus.CANCELLED
    assert refund_step(run).status == StepStatus.SKIPPED
    assert bank.effects("issue_refund") == []


# --- races -------------------------------------------------------------------------------------


def _race(*calls):
    """Run the calls at the same moment on their own database connections; results or exceptions."""
    barrier = threading.Barrier(len(calls))

    def one(call):
        try:
            barrier.wait()
            return call()
        except Exception as exc:
            return exc
        finally:
            connection.close()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


@pytest.mark.parametrize("attempt", range(3))
def test_concurrent_approve_and_deny_have_one_winner_and_at_most_one_dispatch(
    attempt, tenant, asha, ravi, bank, refund
):
    meera = factories.make_user(tenant, "meera", staff=True)
    factories.grant(refund, approve=[meera])
    run, approval = waiting_run(tenant, asha, refund)

    approve, deny = _race(
        lambda: decide_approval(approval_id=approval.pk, user=ravi, approve=True),
        lambda: decide_approval(approval_id=approval.pk, user=meera, approve=False, reason="duplicate"),
    )

    outcomes = [r for r in (approve, deny) if isinstance(r, Approval)]
    assert len(outcomes) == 1, (approve, deny)
    loser = deny if outcomes[0] is approve else approve
    assert isinstance(loser, Conflict)
    run = drive(run.pk)
    approval.refresh_from_db()
    refunds = len(bank.effects("issue_refund"))
    if approval.decided_by_id == ravi.pk:
        assert approval.status == ApprovalStatus.CONSUMED and refunds == 1
    else:
        assert approval.status == ApprovalStatus.DENIED and refunds == 0
        assert refund_step(run).status == StepStatus.REJECTED
    assert RunEvent.objects.filter(run=run, kind__in=["approval_approved", "approval_denied"]).count() == 1


def test_a_second_concurrent_worker_cannot_dispatch_an_approved_call_twice(tenant, asha, ravi, bank, refund):
    from runs.engine import advance

    run, approval = waiting_run(tenant, asha, refund)
    decide_approval(approval_id=approval.pk, user=ravi, approve=True)

    _race(*[lambda: advance(run.pk)] * 4)
    run = drive(run.pk)

    assert len(bank.effects("issue_refund")) == 1
    assert run.status == RunStatus.SUCCEEDED


# --- waiting costs nothing ---------------------------------------------------------------------

WAITING_RUNS = 1000


def clone_waiting_run(template: Run, count: int) -> list:
    """`count` copies of a run the engine parked on an approval: the same rows under new ids.

    Driving a thousand runs through the engine takes minutes on a small machine; copies are
    equivalent for what is tested here, which is everything that happens after the parking.
    Each copy's idempotency key and approval digest are computed for its own run id, so the
    resume path verifies them for real.
    """
    from budgets.models import BudgetAccount
    from runs.engine.proposals import idempotency_key

    def copy(obj, **changes):
        fields = {
            f.attname: getattr(obj, f.attname) for f in type(obj)._meta.concrete_fields if not f.primary_key
        }
        return type(obj)(**{**fields, **changes})

    steps = list(template.steps.order_by("seq"))
    approval = Approval.objects.get(run=template)
    account = BudgetAccount.objects.get(run=template)
    runs = Run.objects.bulk_create([copy(template, id=uuid.uuid4(), input={"n": n}) for n in range(count)])
    for run in runs:
        run.tenant = template.tenant
    BudgetAccount.objects.bulk_create([copy(account, run_id=run.pk) for run in runs])
    copies = Step.objects.bulk_create(
        [
            copy(
                step,
                run_id=run.pk,
                idempotency_key=idempotency_key(run, step.seq) if step.idempotency_key else "",
            )
            for run in runs
            for step in steps
        ]
    )
    waiting = [s for s in copies if s.seq == approval.step.seq]
    Approval.objects.bulk_create(
        [
            copy(
                approval,
                id=uuid.uuid4(),
                run_id=step.run_id,
                step_id=step.pk,
                digest=(
                    approvals.call_digest(
                        tool=approval.tool,
                        arguments=step.arguments,
                        run_id=step.run_id,
                        user_id=approval.requested_by_id,
                        policy_version=approval.policy_version,
                    )
                ),
            )
            for step in waiting
        ]
    )
    return [run.pk for run in runs]


def test_a_thousand_waiting_runs_hold_no_message_and_no_worker_and_one_approval_resumes_one_run(
    tenant, asha, ravi, bank, refund, workers
):
    from rest_framework.test import APIClient

    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    worker = workers("w1")
    factories.make_agent(tenant, tools=[refund], turns=[refund_call(refund), {"text": "done"}])
    template, _ = start_run(user=asha, agent="agent", input={"n": "template"})
    wait_for(
        lambda: Run.objects.get(pk=template.pk).status == RunStatus.WAITING_APPROVAL,
        timeout=60,
        what="the worker to park the first run",
    )
    template.refresh_from_db()
    run_ids = [template.pk, *clone_waiting_run(template, WAITING_RUNS - 1)]
    assert Run.objects.filter(status=RunStatus.WAITING_APPROVAL).count() == WAITING_RUNS
    assert Approval.objects.filter(status=ApprovalStatus.PENDING).count() == WAITING_RUNS

    swept = sweep()
    assert not any(swept.values()), swept  # nothing to requeue, stop or expire
    tasks_so_far = worker.output().count(" received")
    # One worker takes the queue in order: once it logs a message sent now, it has taken every
    # message sent before it. (A run that does not exist: the task has nothing to do.)
    sentinel = str(uuid.uuid4())
    advance_run.apply_async((sentinel,), task_id=sentinel)
    wait_for(lambda: f"[{sentinel}] received" in worker.output(), timeout=30, what="the sentinel message")
    assert broker.llen(queue) == 0
    assert worker.output().count(" received") == tasks_so_far + 1  # no task for any waiting run

    steps_before = Step.objects.count()
    target = run_ids[WAITING_RUNS // 2]
    client = APIClient()
    client.force_authenticate(ravi)
    decided_at = timezone.now()
    response = client.post(f"/v1/approvals/{Approval.objects.get(run_id=target).pk}/approve", format="json")
    assert response.status_code == 200, response.content
    wait_for(lambda: Run.objects.get(pk=target).is_terminal, timeout=60, what="the approved run to finish")

    assert Run.objects.get(pk=target).status == RunStatus.SUCCEEDED
    [effect] = bank.effects("issue_refund")
    assert effect["idempotency_key"] == Step.objects.get(run_id=target, seq=2).idempotency_key
    assert Run.objects.filter(status=RunStatus.WAITING_APPROVAL).count() == WAITING_RUNS - 1
    assert set(RunEvent.objects.filter(at__gte=decided_at).values_list("run_id", flat=True)) == {target}
    assert Step.objects.count() == steps_before + 1  # the approved run's final model step
    assert broker.llen(queue) == 0


def test_an_amount_cedar_cannot_compare_goes_to_a_person_not_to_an_engine_error(tenant, asha, bank, refund):
    """10^30 is past Cedar's 64-bit numbers: the converted `approval:` rule cannot be evaluated,
    so it fails closed (approval required) instead of raising in the claim."""
    factories.make_agent(tenant, tools=[refund], turns=[refund_call(refund, amount=10**30), {"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, run.error
    approval = Approval.objects.get(run=run)
    assert "cannot be checked" in approval.reason
    assert not RunEvent.objects.filter(run=run, kind="engine_error").exists()
    assert bank.effects("issue_refund") == []
