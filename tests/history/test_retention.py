"""Retention (issue 37, part 2): the configuration file sets a tenant's content period and an
agent's own; the purge removes the content of ended runs past it, keeps their skeleton, skips
what a legal hold covers; the API, the admin and the chain agree afterwards."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from configuration.apply import apply_config
from configuration.report import ConfigError
from history.checkpoints import take_checkpoint
from history.content import remove_content
from history.holds import lift_hold, place_hold, tenant_hold_lock
from history.models import ContentRemoval
from history.retention import purge_due
from history.verify import verify
from runs.models import Run, RunEvent, Step
from runs.transitions import atomic_with_events
from tenants.models import Tenant
from tests import factories
from tests.history.conftest import finished_run

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "ACCT-55-0192"


def _age(run, days: float) -> None:
    Run.objects.filter(pk=run.pk).update(finished_at=timezone.now() - dt.timedelta(days=days))


def _api(user, run_id) -> str:
    client = APIClient()
    client.force_authenticate(user)
    return "\n".join(
        client.get(url).content.decode()
        for url in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/steps", f"/v1/runs/{run_id}/events")
    )


def test_the_file_sets_the_periods_and_refuses_a_bad_one(tenant):
    apply_config({"tenant": {"slug": "acme", "retention": {"content": "90d", "agents": {"fast": "1d"}}}})
    tenant.refresh_from_db()
    assert tenant.content_retention_seconds == 90 * 86400
    assert tenant.content_retention_by_agent == {"fast": 86400}

    with pytest.raises(ConfigError) as refused:
        apply_config({"tenant": {"slug": "acme", "retention": {"agents": {"fast": "soon"}}}})
    assert "tenant.retention.agents.fast" in str(refused.value)


def test_ended_runs_past_their_period_lose_content_and_keep_their_skeleton(
    tenant, asha, ravi, echo_agent, admin_client
):
    apply_config({"tenant": {"slug": "acme", "retention": {"content": "90d", "agents": {"fast": "1d"}}}})
    old, held, recent = (finished_run(asha, word=SECRET) for _ in range(3))
    factories.make_agent(tenant, name="fast", tools=[echo_agent], turns=[{"text": "done"}])
    fast = finished_run(asha, word=SECRET, agent="fast")
    _age(old, 100)
    _age(held, 100)
    _age(recent, 10)
    _age(fast, 2)
    place_hold(tenant_id=tenant.pk, scope="run", run_id=held.pk, actor=ravi, reason="matter 7")
    take_checkpoint()
    skeleton = list(
        Step.objects.filter(run=old)
        .order_by("seq")
        .values_list("seq", "kind", "status", "tool_name", "cost_micros")
    )

    report = purge_due()

    assert sorted(report.purged, key=str) == sorted([old.pk, fast.pk], key=str)
    assert report.held == [held.pk]
    for run in (old, fast):
        assert SECRET not in _api(asha, run.pk)
        page = admin_client.get(f"/admin/runs/run/{run.pk}/change/")
        assert page.status_code == 200 and SECRET not in page.content.decode()
        assert (
            RunEvent.objects.filter(run=run, kind="content_removed", skeleton__why="retention").count() == 1
        )
    assert (
        list(
            Step.objects.filter(run=old)
            .order_by("seq")
            .values_list("seq", "kind", "status", "tool_name", "cost_micros")
        )
        == skeleton
    )
    for run in (held, recent):
        assert SECRET in _api(asha, run.pk)
    assert verify().ok
    assert purge_due().purged == []  # a purged run is not visited again
    assert ContentRemoval.objects.count() == 2


def test_a_tenant_hold_suspends_the_purge(tenant, asha, ravi, echo_agent):
    Tenant.objects.filter(pk=tenant.pk).update(content_retention_seconds=3600)
    run = finished_run(asha, word=SECRET)
    _age(run, 1)
    hold = place_hold(tenant_id=tenant.pk, scope="tenant", actor=ravi, reason="regulator")
    assert purge_due().purged == []
    assert Run.objects.get(pk=run.pk).input == {"word": SECRET}

    lift_hold(hold_id=hold.pk, actor=ravi, reason="closed")
    assert purge_due().purged == [run.pk]


def test_a_purge_holding_its_locks_does_not_block_a_live_runs_steps(tenant, asha, echo_agent):
    """The purge locks an ended run, its rows and the tenant's hold lock; no step of a live run
    waits for any of them: a run driven meanwhile finishes while the purge's transaction is open."""
    Tenant.objects.filter(pk=tenant.pk).update(content_retention_seconds=3600)
    ended = finished_run(asha, word=SECRET)
    _age(ended, 1)
    locked, release, failures = threading.Event(), threading.Event(), []

    def purge_and_hold() -> None:
        try:
            with atomic_with_events():
                tenant_hold_lock(tenant.pk)
                run = Run.objects.select_for_update().get(pk=ended.pk)
                remove_content(run, why="retention", events=None, note="content purged")
                locked.set()
                assert release.wait(60), "the live run never finished"
        except Exception as exc:
            failures.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=purge_and_hold)
    thread.start()
    try:
        assert locked.wait(30)
        started = time.monotonic()
        live = finished_run(asha, word="live")
        took = time.monotonic() - started
        assert thread.is_alive()  # the purge's transaction was open the whole time
    finally:
        release.set()
        thread.join()
    assert not failures, failures
    assert Run.objects.get(pk=live.pk).status == "succeeded" and took < 30
    assert Run.objects.get(pk=ended.pk).input == {}
    assert verify().ok
