"""The skeleton's retention (issue 37, part 2): runs past their tenant's (or agent's) skeleton
period are deleted with their steps and events, in batches, never under a legal hold, each leaving
a tombstone; verify_history then reports them as purged by retention, not as tampering, and still
names a run deleted behind the platform's back or under a tombstone that lies about its age."""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.models import Approval
from configuration.apply import apply_config
from configuration.report import ConfigError
from history.checkpoints import take_checkpoint
from history.holds import lift_hold, place_hold
from history.models import Checkpoint, LegalHold, RunTombstone
from history.retention import purge_skeletons
from history.verify import verify
from runs.approval_effects import decide_approval
from runs.models import Run, RunEvent, RunStatus, Step
from runs.services import start_run
from runs.transitions import record_event
from tenants.models import Tenant
from tests import factories
from tests.conftest import drive
from tests.history.conftest import finished_run

pytestmark = pytest.mark.django_db(transaction=True)

DAY = 86400


def _age(run, days: float) -> None:
    """The run was created and ended `days` ago (its events' times are not part of the check)."""
    then = timezone.now() - dt.timedelta(days=days)
    Run.objects.filter(pk=run.pk).update(created_at=then, started_at=then, finished_at=then)


def _verify_command() -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("verify_history", stdout=out)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    return 0, out.getvalue()


def test_the_file_sets_the_skeleton_periods(tenant):
    apply_config(
        {
            "tenant": {
                "slug": "acme",
                "retention": {"content": "90d", "skeleton": "2557d", "skeleton_agents": {"fast": "400d"}},
            }
        }
    )
    tenant.refresh_from_db()
    assert tenant.skeleton_retention_seconds == 2557 * DAY
    assert tenant.skeleton_retention_by_agent == {"fast": 400 * DAY}

    with pytest.raises(ConfigError) as refused:
        apply_config({"tenant": {"slug": "acme", "retention": {"skeleton": "seven years"}}})
    assert "tenant.retention.skeleton" in str(refused.value)


def test_runs_past_the_skeleton_period_go_leaving_tombstones_and_the_history_verifies(
    tenant, asha, ravi, echo_agent
):
    Tenant.objects.filter(pk=tenant.pk).update(skeleton_retention_seconds=90 * DAY)
    old, once_held, held, recent, unsigned = (finished_run(asha, word="C-1") for _ in range(5))
    for run in (old, once_held, held):
        _age(run, 100)
    _age(recent, 10)
    hold = place_hold(tenant_id=tenant.pk, scope="run", run_id=once_held.pk, actor=ravi, reason="matter 3")
    lift_hold(hold_id=hold.pk, actor=ravi, reason="matter closed")
    place_hold(tenant_id=tenant.pk, scope="run", run_id=held.pk, actor=ravi, reason="matter 7")
    # The checkpoint that signed their final heads was taken 100 days ago, when they had ended.
    take_checkpoint(now=timezone.now() - dt.timedelta(days=99))
    _age(unsigned, 100)
    # Its last event comes after the checkpoint: its final head is not signed yet.
    record_event(unsigned.pk, "note", "after the checkpoint")
    steps_before = Step.objects.count()
    purged_steps = Step.objects.filter(run__in=[old, once_held]).count()

    report = purge_skeletons(batch=10)

    assert sorted(report.purged, key=str) == sorted([old.pk, once_held.pk], key=str)
    assert report.held == [held.pk]
    assert report.unsigned == [unsigned.pk]  # its final head is in no checkpoint yet: next pass
    for run in (old, once_held):
        assert not Run.objects.filter(pk=run.pk).exists()
        assert not RunEvent.objects.filter(run_id=run.pk).exists()
        stone = RunTombstone.objects.get(run_id=run.pk)
        assert (stone.agent, stone.created_by, stone.status, stone.period_seconds) == (
            "agent",
            "asha",
            "succeeded",
            90 * DAY,
        )
        assert stone.event_seq > 0 and stone.checkpoint.number == 1
    assert purged_steps > 0 and Step.objects.count() == steps_before - purged_steps
    # The lifted hold's row, its audit, outlives the run it named.
    assert LegalHold.objects.get(pk=hold.pk).run_id == once_held.pk
    client = APIClient()
    client.force_authenticate(asha)
    assert client.get(f"/v1/runs/{old.pk}").status_code == 404
    for run in (held, recent, unsigned):
        assert Run.objects.filter(pk=run.pk).exists()

    take_checkpoint()
    report = verify()
    assert report.ok, report.findings
    assert report.purged == {90 * DAY: 2}
    code, out = _verify_command()
    assert code == 0, out
    assert "PURGED: 2 run(s) by skeleton retention after 90 days" in out
    assert out.splitlines()[-1].startswith("OK: 3 runs,"), out

    assert purge_skeletons().purged == [unsigned.pk]  # signed now
    assert verify().ok


def test_a_tenant_hold_and_an_agents_own_period(tenant, asha, ravi, echo_agent):
    factories.make_agent(tenant, name="fast", tools=[echo_agent], turns=[{"text": "done"}])
    Tenant.objects.filter(pk=tenant.pk).update(
        skeleton_retention_seconds=365 * DAY, skeleton_retention_by_agent={"fast": 30 * DAY}
    )
    slow = finished_run(asha)
    fast = finished_run(asha, agent="fast")
    _age(slow, 100)
    _age(fast, 100)
    take_checkpoint(now=timezone.now() - dt.timedelta(days=99))
    hold = place_hold(tenant_id=tenant.pk, scope="tenant", actor=ravi, reason="regulator")

    assert purge_skeletons().purged == []
    assert Run.objects.filter(pk=fast.pk).exists()

    lift_hold(hold_id=hold.pk, actor=ravi, reason="closed")
    assert purge_skeletons().purged == [fast.pk]  # the slow agent's runs keep a year
    assert RunTombstone.objects.get(run_id=fast.pk).period_seconds == 30 * DAY
    assert verify().ok


def test_runs_with_approvals_go_whole(tenant, asha, ravi, echo_agent):
    """A run whose tool call needed an approval: the approval goes with it (its skeleton period
    ended), and nothing left refers to the deleted rows."""
    type(echo_agent).objects.filter(pk=echo_agent.pk).update(approval_policy="always")
    factories.grant(echo_agent, approve=[ravi])
    run, _ = start_run(user=asha, agent="agent", input={"word": "x"})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, run.status
    decide_approval(approval_id=Approval.objects.get(run=run).pk, user=ravi, approve=True)
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    Tenant.objects.filter(pk=tenant.pk).update(skeleton_retention_seconds=DAY)
    _age(run, 2)
    take_checkpoint(now=timezone.now() - dt.timedelta(days=2))

    assert purge_skeletons().purged == [run.pk]
    assert not Approval.objects.filter(run_id=run.pk).exists()
    assert not Step.objects.filter(run_id=run.pk).exists()
    assert verify().ok


def test_a_deletion_behind_the_platforms_back_is_still_named(tenant, asha, echo_agent):
    """Deleted without a tombstone; under a tombstone with another head; under one claiming a
    young run was old: each named."""
    Tenant.objects.filter(pk=tenant.pk).update(skeleton_retention_seconds=90 * DAY)
    earlier = finished_run(asha)
    take_checkpoint(now=timezone.now() - dt.timedelta(hours=3))
    bare, wrong_head, young = (finished_run(asha) for _ in range(3))
    take_checkpoint()
    del earlier

    def delete(run) -> None:  # as an administrator would, cascading, writing no tombstone
        Run.objects.filter(pk=run.pk).delete()

    def forge(run, *, head: bytes, created: dt.datetime) -> None:
        live = Run.objects.get(pk=run.pk)
        RunTombstone.objects.create(
            run_id=run.pk,
            tenant=tenant,
            agent="agent",
            created_by="asha",
            status="succeeded",
            created_at=created,
            finished_at=created + dt.timedelta(minutes=1),
            event_seq=live.event_seq,
            chain_head=head,
            checkpoint=Checkpoint.objects.get(number=2),
            period_seconds=90 * DAY,
            purged_at=timezone.now(),
        )

    forge(wrong_head, head=bytes(32), created=timezone.now() - dt.timedelta(days=100))
    forge(
        young,
        head=bytes(Run.objects.get(pk=young.pk).chain_head),
        created=timezone.now() - dt.timedelta(days=100),
    )
    for run in (bare, wrong_head, young):
        delete(run)

    findings = {f.run_id: f.problem for f in verify().findings}

    assert findings[str(bare.pk)] == "the run is gone, but checkpoint 2 holds its head"
    assert "its tombstone's head is not the one checkpoint 2 signed for it" in findings[str(wrong_head.pk)]
    assert "but checkpoint 1" in findings[str(young.pk)] and "did not hold it" in findings[str(young.pk)]
    assert len(findings) == 3
