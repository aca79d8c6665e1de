"""Reads of the escrow for operators, metrics and the books' checks (regions/services.py states the rules)."""

from __future__ import annotations

import datetime as dt

from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce

from budgets import services as budgets
from budgets.models import BudgetAccount
from regions.models import HomeLink, RegionDay, SliceRequest, TenantRegions, authority_age, here, is_home
from runs.engine.decisions import REGION_UNREACHABLE, WAITING_FOR_SLICE
from runs.models import Run, RunEvent, RunStatus


def home_books(tenant, day: dt.date) -> dict:
    """The home's check: its day limit plus every region's outstanding slices is the daily budget,
    and the same for each user's day it lent slices of.

    Answers {} when the books agree, else what disagrees (a check that can fail: a slice lent
    twice, or a limit moved without its RegionDay, shows here).
    """
    problems: dict = {}
    account = budgets.tenant_day_account(tenant, day)
    outstanding = _outstanding(RegionDay.objects.filter(tenant=tenant, day=day, user=None))
    if account.limit_micros + outstanding != tenant.daily_budget_micros:
        problems = {
            "limit_plus_outstanding": account.limit_micros + outstanding,
            "daily": tenant.daily_budget_micros,
        }
    users = RegionDay.objects.filter(tenant=tenant, day=day, user__isnull=False)
    for user_id in sorted(set(users.values_list("user_id", flat=True))):
        limit = budgets.user_day_account(tenant, day, user_id).limit_micros
        lent = _outstanding(users.filter(user_id=user_id))
        if limit + lent != tenant.user_daily_budget_micros:
            problems[f"user {user_id}"] = {
                "limit_plus_outstanding": limit + lent,
                "user_daily": tenant.user_daily_budget_micros,
            }
    return problems


def _outstanding(days) -> int:
    lent = days.aggregate(
        granted=Coalesce(Sum("granted_micros"), 0), returned=Coalesce(Sum("returned_micros"), 0)
    )
    return lent["granted"] - lent["returned"]


def region_books(tenant, day: dt.date) -> dict:
    """A region's check: its day limit is what the home granted less what it gave back, and so
    is each user's day limit here.

    Grants count once answered and applied; returns count from the moment they are taken off
    the limit (pending or not). {} when they agree.
    """
    problems: dict = {}
    requests = SliceRequest.objects.filter(tenant=tenant, day=day)
    account = budgets.tenant_day_account(tenant, day)
    moved = _granted_less_returned(requests.filter(user=None))
    if account.limit_micros != moved:
        problems = {"limit": account.limit_micros, "granted_less_returned": moved}
    for user_id in sorted(set(requests.filter(user__isnull=False).values_list("user_id", flat=True))):
        limit = budgets.user_day_account(tenant, day, user_id).limit_micros
        moved = _granted_less_returned(requests.filter(user_id=user_id))
        if limit != moved:
            problems[f"user {user_id}"] = {"limit": limit, "granted_less_returned": moved}
    return problems


def _granted_less_returned(requests) -> int:
    moves = requests.aggregate(
        granted=Coalesce(Sum("moved_micros", filter=Q(kind="grant", status="applied")), 0),
        returned=Coalesce(Sum("asked_micros", filter=Q(kind="return")), 0),
    )
    return moves["granted"] - moves["returned"]


def parked_by_reason(tenant=None) -> dict[str, int]:
    """Runs parked in this region for either region reason (the engine names it on the status event)."""
    runs = Run.objects.filter(
        status=RunStatus.WAITING_BUDGET, admitted_at__isnull=False, resume_at__isnull=True
    )
    if tenant is not None:
        runs = runs.filter(tenant=tenant)
    counts = {REGION_UNREACHABLE: 0, WAITING_FOR_SLICE: 0}
    for run_id in runs.values_list("pk", flat=True)[:10_000]:
        data = (
            RunEvent.objects.filter(run_id=run_id, kind="status")
            .order_by("-seq")
            .values_list("data", flat=True)
            .first()
        )
        reason = (data or {}).get("region_reason")
        if reason in counts:
            counts[reason] += 1
    return counts


def tenant_status(tenant) -> dict:
    """What the API and the admin show for one tenant in this region."""
    config = TenantRegions.of(tenant)
    today = budgets.local_day(tenant)
    status: dict = {
        "region": here(),
        "home": config.home if config else here(),
        "allowed": list(config.allowed) if config else [here()],
        "is_home": is_home(tenant),
        "revocation_reach_seconds": config.revocation_reach_seconds if config else None,
        "day": today.isoformat(),
        "authority_age_seconds": authority_age(config) if config and config.home != here() else None,
    }
    account = budgets.tenant_day_account(tenant, today)
    status["day_account"] = {
        "limit_micros": account.limit_micros,
        "reserved_micros": account.reserved_micros,
        "spent_micros": account.spent_micros,
        "held_micros": account.held_micros,
    }
    if status["is_home"]:
        status["slices"] = [
            {
                "region": d.region,
                "day": d.day.isoformat(),
                "user": d.user_id,  # None: the tenant's day; else a slice of this user's day
                "granted_micros": d.granted_micros,
                "returned_micros": d.returned_micros,
                "outstanding_micros": d.outstanding_micros,
                "reported_spent_micros": d.reported_spent_micros,
                "reported_held_micros": d.reported_held_micros,
                "reported_at": d.reported_at.isoformat() if d.reported_at else None,
            }
            for d in RegionDay.objects.filter(tenant=tenant).order_by("-day", "region")[:30]
        ]
    else:
        link = HomeLink.objects.filter(tenant=tenant).first()
        status["link"] = (
            {
                "state": link.state,
                "since": link.since.isoformat(),
                "last_ok_at": link.last_ok_at.isoformat() if link.last_ok_at else None,
                "last_error": link.last_error,
                "refill_ms": link.refill_ms,
            }
            if link
            else None
        )
        pending = SliceRequest.objects.filter(tenant=tenant, status=SliceRequest.Status.PENDING)
        status["pending_requests"] = pending.aggregate(n=Count("id"), micros=Coalesce(Sum("asked_micros"), 0))
        status["parked_runs"] = parked_by_reason(tenant)
        # Each user's slices of today here, when the tenant limits users' days (docs/regions.md).
        status["user_days"] = [
            {
                "user": a.user_id,
                "username": a.user.username if a.user else "",
                "limit_micros": a.limit_micros,
                "reserved_micros": a.reserved_micros,
                "spent_micros": a.spent_micros,
                "held_micros": a.held_micros,
            }
            for a in BudgetAccount.objects.filter(
                tenant=tenant, scope=BudgetAccount.Scope.USER_DAY, day=today
            )
            .select_related("user")
            .order_by("user_id")[:200]
        ]
    return status
