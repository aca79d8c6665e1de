"""The supervisors' desk: the admin's index page with what a supervisor starts the day with.

It reads approvals, runs and budgets, which the admin site (tenants/admin_site.py, below them all)
cannot import; agentplatform/urls.py serves it at the index URL, ahead of the site's own.
"""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlencode

from django.db.models import Count
from django.urls import reverse
from django.utils import timezone

from approvals.models import ApprovalStatus
from approvals.selectors import approvals_for
from budgets.selectors import reservations_for
from runs.front.display import run_title
from runs.models import RunStatus
from runs.selectors import runs_for
from tenants.admin_site import site

DESK_ROWS = 10  # runs listed per line of the desk; the count links to the rest


def index(request, extra_context=None):
    return site.index(request, {**(extra_context or {}), "desk": desk(request)})


def desk(request) -> dict:
    """What a supervisor starts the day with: pending approvals, runs that need a person or
    failed in the last day, paused runs by reason and the kill switches that are on (for those
    who may pause or flip), reservations held for reconciliation, usage; each line only when the
    user can open the page it links to."""
    user = request.user
    if user.tenant_id is None:
        return {}
    links = dict(site.links(request))
    desk = {}
    if "Inbox" in links:
        desk["pending"] = approvals_for(user, status=ApprovalStatus.PENDING).count()
        desk["inbox_url"] = links["Inbox"]
    if "Runs" in links:
        attention = runs_for(user, status=RunStatus.NEEDS_ATTENTION).order_by("-created_at")
        failed = runs_for(user, status=RunStatus.FAILED).filter(
            finished_at__gte=timezone.now() - dt.timedelta(days=1)
        )
        desk["attention"] = attention.count()
        desk["failed"] = failed.count()
        desk["runs_url"] = links["Runs"]
        desk["attention_runs"] = [_desk_run(run) for run in attention[:DESK_ROWS]]
        desk["failed_runs"] = [_desk_run(run) for run in failed.order_by("-finished_at")[:DESK_ROWS]]
    if "Runs" in links and site.registry_admin("runs.bulkaction").has_view_permission(request):
        desk.update(paused_runs(user, links["Runs"]))
    switches = site.registry_admin("runs.killswitch")
    if switches.has_view_permission(request):
        on = switches.get_queryset(request).filter(on=True)
        desk["switches_on"] = on.count()
        desk["switches_url"] = reverse("admin:runs_killswitch_changelist") + "?on__exact=1"
        desk["switches"] = [
            {
                "url": reverse("admin:runs_killswitch_change", args=[switch.pk]),
                "what": str(switch),
                **_by(switch),
            }
            for switch in on.select_related("changed_by").order_by("-changed_at")[:DESK_ROWS]
        ]
    reservations = site.registry_admin("budgets.reservation")
    if reservations.has_view_permission(request):
        desk["held"] = reservations_for(user, status="held").count()
        desk["held_url"] = reverse("admin:budgets_reservation_changelist")
    if "Usage" in links:
        desk["usage_url"] = links["Usage"]
    return desk


def paused_runs(user, runs_url: str) -> dict:
    """How many of the user's runs are paused, and why: one line per reason (a switch's reason
    names the switch, a bulk pause's is the same on every run it paused), most runs first."""
    paused = runs_for(user, status=RunStatus.PAUSED)
    reasons = (
        paused.order_by()
        .values("pause_reason")
        .annotate(runs=Count("pk"))
        .order_by("-runs", "pause_reason")[:DESK_ROWS]
    )
    base = f"{runs_url}?status__exact=paused"
    return {
        "paused": paused.count(),
        "paused_url": base,
        "paused_reasons": [
            {
                "reason": row["pause_reason"] or "no reason given",
                "runs": row["runs"],
                "url": f"{base}&{urlencode({'pause_reason': row['pause_reason']})}",
            }
            for row in reasons
        ],
    }


def _by(switch) -> dict:
    return {
        "who": switch.changed_by.username if switch.changed_by else "",
        "why": switch.reason.splitlines()[0][:160] if switch.reason else "",
        "at": switch.changed_at,
    }


def _desk_run(run) -> dict:
    first_line = (run.error or run.stop_reason or "").strip().splitlines()
    return {
        "url": reverse("admin:runs_run_change", args=[run.pk]),
        "title": run_title(run),
        "why": first_line[0][:160] if first_line else "",
        "at": run.finished_at or run.created_at,
    }
