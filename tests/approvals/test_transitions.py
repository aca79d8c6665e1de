"""Every move the approval map refuses raises IllegalTransition and writes nothing; the services
that move approvals (decide, expire, consume, void) go through the map."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from approvals import services
from approvals.models import APPROVAL_TRANSITIONS, Approval, ApprovalStatus
from core.errors import IllegalTransition
from runs.models import Step, StepKind, StepStatus
from runs.services import start_run
from tests import factories

pytestmark = pytest.mark.django_db

REFUSED = [
    (old, to)
    for old in ApprovalStatus
    for to in ApprovalStatus
    if to not in APPROVAL_TRANSITIONS.get(old, set())
]


@pytest.fixture
def approval(tenant, asha, builtins):
    tool = builtins["echo"]
    factories.make_agent(tenant, tools=[tool], turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    step = Step.objects.create(
        run=run,
        seq=1,
        kind=StepKind.TOOL,
        status=StepStatus.AWAITING_APPROVAL,
        tool=tool,
        tool_name=tool.name,
        arguments={"text": "hi"},
    )
    return Approval.objects.create(
        tenant=tenant,
        run=run,
        step=step,
        tool=tool,
        arguments={"text": "hi"},
        digest=services._expected_digest(step, Approval(requested_by=asha)),
        policy="always",
        policy_version=1,
        reason="test",
        requested_by=asha,
        expires_at=timezone.now() + dt.timedelta(hours=1),
    )


def row(approval) -> tuple:
    return (
        Approval.objects.filter(pk=approval.pk)
        .values_list("status", "decided_by", "decided_at", "consumed_at", "void_reason")
        .get()
    )


@pytest.mark.parametrize(("old", "to"), REFUSED, ids=[f"{a}->{b}" for a, b in REFUSED])
def test_a_refused_move_raises_and_writes_nothing(approval, old, to):
    Approval.objects.filter(pk=approval.pk).update(status=old)
    approval = Approval.objects.get(pk=approval.pk)
    before = row(approval)
    with pytest.raises(IllegalTransition):
        services._transition(approval, to, decided_at=timezone.now(), void_reason="refused")
    assert row(approval) == before
    assert approval.status == old


@pytest.mark.parametrize("status", [s for s in ApprovalStatus if s != ApprovalStatus.APPROVED])
def test_consume_uses_only_an_approved_approval(approval, status):
    Approval.objects.filter(pk=approval.pk).update(status=status)
    before = row(approval)
    assert services.consume(approval.step) is False
    assert row(approval) == before


def test_consume_moves_an_approved_approval_once(approval):
    Approval.objects.filter(pk=approval.pk).update(status=ApprovalStatus.APPROVED)
    assert services.consume(approval.step) is True
    assert row(approval)[0] == ApprovalStatus.CONSUMED
    assert services.consume(approval.step) is False


@pytest.mark.parametrize("status", list(ApprovalStatus))
def test_void_withdraws_only_what_the_map_lets_it(approval, status):
    Approval.objects.filter(pk=approval.pk).update(status=status)
    voidable = ApprovalStatus.VOIDED in APPROVAL_TRANSITIONS.get(status, set())
    assert services.void_for_step(approval.step, reason="cancelled") is voidable
    assert row(approval)[0] == (ApprovalStatus.VOIDED if voidable else status)
