"""The index page's desk: runs that need a person, runs that failed in the last day, reservations
held for reconciliation; and a failed run's page showing its error whole."""

from __future__ import annotations

import datetime as dt

from django.utils import timezone

from budgets import services as budgets
from runs.models import Run, RunStatus
from runs.services import start_run
from vault.fields import seal

LONG_ERROR = "model provider refused the request: 400 " + "x" * 600 + " END-OF-ERROR"


def failed_run(acme, *, hours_ago: float, case: str):
    run, _ = start_run(user=acme.asha, agent="refunder", input={"case": case})
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.FAILED,
        error=seal(Run, "error", run.pk, LONG_ERROR, tenant=run.tenant_id),  # sealed at rest
        finished_at=timezone.now() - dt.timedelta(hours=hours_ago),
    )
    return run


def test_the_desk_lists_failed_runs_of_the_last_day_and_held_reservations(as_ravi, acme):
    recent = failed_run(acme, hours_ago=2, case="C-recent")
    failed_run(acme, hours_ago=30, case="C-old")
    held = budgets.reserve(tenant=acme.tenant, run=recent, amount_micros=4_000, purpose="tool")
    budgets.hold(held.pk, note="lost call")

    html = as_ravi.get("/admin/").content.decode()

    assert '<td id="desk-failed">1</td>' in html
    assert "refunder · C-recent · asha" in html and "C-old" not in html
    assert "model provider refused the request: 400" in html  # the first line of why
    assert '<td id="desk-held">1</td>' in html
    listed = as_ravi.get("/admin/runs/run/?status__exact=failed&finished=day").context["cl"].result_list
    assert [run.pk for run in listed] == [recent.pk]


def test_a_failed_runs_page_shows_its_error_in_full(as_ravi, acme):
    run = failed_run(acme, hours_ago=1, case="C-1")

    html = as_ravi.get(f"/admin/runs/run/{run.pk}/change/").content.decode()

    banner = html.split('id="attention"')[1].split("</div>")[0]
    assert "This run failed" in banner and LONG_ERROR in banner
