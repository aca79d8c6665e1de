"""The escrow of a tenant's day budget between its home region and the others (DESIGN.md section 9).

| side   | operation                       | what moves                                                   |
|--------|---------------------------------|--------------------------------------------------------------|
| home   | grant(request)                  | home day limit down by at most what it may lend (_lendable); RegionDay.granted up |
| home   | take_back(request)              | home day limit up; RegionDay.returned up                     |
| home   | probe(day)                      | nothing: what it would lend now (the link's heartbeat) |
| region | tend(tenant): ask               | SliceRequest(grant) pending; on the answer: region limit up  |
| region | tend(tenant): give back         | region limit down by free room only; SliceRequest(return) pending |
| region | tend(tenant): resume            | runs parked for the slice, in the order they parked          |
| home   | decide(calls)                   | nothing: for each (user, tool), held at home? tool switch on? policy version |
| region | ask_home(tenant)                | HomeAnswer per call paused on a stale copy; resumes the ones answered act/deny |

The invariant: for every tenant and day, the home's day limit plus every region's outstanding
slices (granted - returned, as the home counts them) equals the daily budget, and each region's
day limit is at most what the home counts outstanding for it (equal once no request is pending).
Every account spends only under its own limit (budgets/), so the sum of all spending, reserved
and held money never exceeds the daily budget.

Idempotency and durability: every request carries an id chosen and committed by the region
before it is sent; the home records each applied request under a unique (region, request id)
in the transaction that moves its limit, and answers a repeat with the first answer. The region
applies an answer with a conditional update of its request (pending -> applied) in the
transaction that moves its own limit, so an answer is applied once. A grant moves the home
first (money leaves the home before it arrives in the region); a return moves the region first
(money leaves the region before it arrives home): while a request is in flight, or the link is
down, the money is in neither place, never in both. A region cut off keeps its slices; the
home counts them as spent until they come back.

Locks: a move locks the day's sub-accounts (budgets.move_day_limit, in shard order) before any
regions row, on both sides; no lock is held across a call between regions (client.call_home
refuses to run inside a transaction).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid

from django.db import IntegrityError, connection, transaction
from django.db.models import Count, F, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from approvals.models import TenantPolicies
from budgets import services as budgets
from budgets.models import BudgetAccount
from core.errors import Conflict
from regions import client
from regions.models import (
    Heartbeat,
    HomeAnswer,
    HomeLink,
    RegionDay,
    SliceMove,
    SliceRequest,
    TenantRegions,
    authority_age,
    here,
    of_user,
    user_home_free,
)
from runs import admission
from runs.authority_copy import stale_authority
from runs.controls import pausing
from runs.controls.models import KillSwitch
from runs.engine.decisions import AUTHORITY_STALE, slice_ask, slice_give_back
from runs.models import Run, RunEvent, RunStatus, Step, StepStatus
from runs.queueing import enqueue
from runs.recovery import sweeper
from runs.transitions import lock_run, transition_run
from tenants.models import Tenant, User
from tenants.permissions import held_sql

logger = logging.getLogger("regions")

# Closed days a region still looks at for room to give back or requests to send again.
CLOSING_DAYS = 3
# The runs whose users' days the keeper tops up in this region: they reserve soon or wait to.
USERS_RUNS_HERE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING_BUDGET)


# --- the home's side -----------------------------------------------------------------------------


def grant(
    *,
    tenant: Tenant,
    region: str,
    day: dt.date,
    request_id: uuid.UUID,
    asked_micros: int,
    user_id: int | None = None,
) -> dict:
    """Lend `region` up to `asked_micros` of the tenant's `day` (of the user's day, with
    `user_id`), as much as the home may lend."""
    return _move(tenant, region, day, request_id, SliceMove.Kind.GRANT, asked_micros, user_id)


def take_back(
    *,
    tenant: Tenant,
    region: str,
    day: dt.date,
    request_id: uuid.UUID,
    amount_micros: int,
    user_id: int | None = None,
) -> dict:
    """`region` gives back `amount_micros` of the tenant's `day` (of the user's day, with
    `user_id`), already taken off its own limit."""
    return _move(tenant, region, day, request_id, SliceMove.Kind.RETURN, amount_micros, user_id)


def _move(
    tenant, region: str, day: dt.date, request_id: uuid.UUID, kind: str, amount: int, user_id: int | None
) -> dict:
    if amount < 0:
        raise Conflict("a slice amount cannot be negative", code="negative_slice")
    if user_id is not None and (
        tenant.user_daily_budget_micros is None or not User.objects.filter(pk=user_id, tenant=tenant).exists()
    ):
        raise Conflict(
            f"{tenant.slug} has no day budget for user {user_id} at its home", code="no_user_day_budget"
        )
    done = SliceMove.objects.filter(region=region, request_id=request_id).values_list(
        "moved_micros", flat=True
    )
    if done:  # a repeat (its answer was lost): the first answer, before any check that the move changed
        return {"moved_micros": done[0], "home_free_micros": _lendable_now(tenant, region, day, user_id)}
    try:
        with transaction.atomic():
            # A repeat of an applied request waits here for the day's lock and then finds nothing
            # new to do: its unique insert below fails and the whole move rolls back.
            if kind == SliceMove.Kind.GRANT:
                moved = -_move_limit(
                    tenant, day, user_id, -min(amount, _lendable(tenant, region, day, user_id))
                )
            else:
                outstanding = RegionDay.objects.filter(
                    of_user(user_id), tenant=tenant, region=region, day=day
                ).first()
                if outstanding is None or outstanding.outstanding_micros < amount:
                    raise Conflict(
                        f"{region} returns more of {day} than it was lent", code="slice_over_returned"
                    )
                moved = _move_limit(tenant, day, user_id, amount)
            SliceMove.objects.create(
                tenant=tenant,
                region=region,
                day=day,
                user_id=user_id,
                kind=kind,
                request_id=request_id,
                asked_micros=amount,
                moved_micros=moved,
            )
            column = "granted_micros" if kind == SliceMove.Kind.GRANT else "returned_micros"
            if not RegionDay.objects.filter(of_user(user_id), tenant=tenant, region=region, day=day).update(
                **{column: F(column) + moved}
            ):  # the region's first move of the day: under the day's lock, no other insert races it
                RegionDay.objects.create(
                    tenant=tenant, region=region, day=day, user_id=user_id, **{column: moved}
                )
    except IntegrityError:
        moved = SliceMove.objects.get(region=region, request_id=request_id).moved_micros
    return {"moved_micros": moved, "home_free_micros": _lendable_now(tenant, region, day, user_id)}


def _move_limit(tenant, day: dt.date, user_id: int | None, by_micros: int) -> int:
    if user_id is None:
        return budgets.move_day_limit(tenant, day, by_micros)
    return budgets.move_user_day_limit(tenant, day, user_id, by_micros)


def probe(*, tenant: Tenant, region: str, day: dt.date) -> dict:
    """How much of the day the home would lend `region` now: the keeper's heartbeat over the link
    (no write but the day's opening). 0: the day is spent, committed or lent everywhere."""
    return {"moved_micros": 0, "home_free_micros": _lendable_now(tenant, region, day)}


def _lendable(tenant, region: str, day: dt.date, user_id: int | None = None) -> int:
    """What the home may lend `region` of `day`, decided under admission's lock (the tenant row,
    then the day's accounts: the order start_run and the sweeper's admission take them in).

    Never what the home's admitted runs are still expected to spend (runs/admission.py: a run let
    start at home must not find its day lent away), and never more than the region's share of
    the day (TenantRegions.away_share_percent) outstanding at once. Of a user's day: the user's
    free room at home, within the same share of the user's daily budget (admission does not
    count users' days).
    """
    config = TenantRegions.of(tenant)
    percent = config.away_share_percent if config else 100
    if user_id is not None:
        # The user's account locked first: two grants to one user are decided one after the other.
        free = budgets.lock_user_day_account(tenant, day, user_id).remaining_micros
        share = percent * (tenant.user_daily_budget_micros or 0) // 100
        room = free
    else:
        Tenant.objects.select_for_update(no_key=True).filter(pk=tenant.pk).exists()
        free = _free(tenant, day)
        room = admission.room_micros(tenant)[0] if day == budgets.local_day(tenant) else free
        share = percent * tenant.daily_budget_micros // 100
    lent = RegionDay.objects.filter(of_user(user_id), tenant=tenant, region=region, day=day).first()
    return max(min(free, room, share - (lent.outstanding_micros if lent else 0)), 0)


def _lendable_now(tenant, region: str, day: dt.date, user_id: int | None = None) -> int:
    with transaction.atomic():
        return _lendable(tenant, region, day, user_id)


def report(
    *,
    tenant: Tenant,
    region: str,
    day: dt.date,
    spent: int,
    reserved: int,
    held: int,
    user_id: int | None = None,
) -> None:
    """What the region says its slice of the day carries: shown to operators; holds count as spent
    at home anyway (they stay in the slice, which is outstanding until returned)."""
    RegionDay.objects.filter(of_user(user_id), tenant=tenant, region=region, day=day).update(
        reported_spent_micros=spent,
        reported_reserved_micros=reserved,
        reported_held_micros=held,
        reported_at=timezone.now(),
    )


def decide(*, tenant: Tenant, calls: list[dict], starts: list[dict] | None = None) -> dict:
    """For a region whose copy of the authority is older than the reach: the home's own answer,
    now, for each call (user id, tool id): whether the user holds use_tool on the tool here,
    whether the tool's kill switch is on here, and the tenant's policy version; for each run
    start (user id, agent id): whether the user is active and holds run_agent on the agent, and
    the tenant's or the agent's switch if one is on. Nothing of the run leaves its region: ids
    only (the region evaluates the policies, once its copy holds the same version)."""
    answers = []
    policy_version = TenantPolicies.objects.filter(tenant=tenant).values_list("version", flat=True).first()
    held = held_sql("tools", "tool", "use_tool", column="%(pk)s")
    for call in calls[:500]:
        user_id, tool_id = int(call["user_id"]), int(call["tool_id"])
        active = User.objects.filter(pk=user_id, tenant=tenant, is_active=True).exists()
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT 1 WHERE {held}", {"user": user_id, "pk": str(tool_id)})
            granted = active and cursor.fetchone() is not None
        switch = (
            KillSwitch.objects.filter(tenant=tenant, on=True, scope=KillSwitch.Scope.TOOL, target_id=tool_id)
            .values_list("reason", flat=True)
            .first()
        )
        answers.append({"user_id": user_id, "tool_id": tool_id, "granted": granted, "switch": switch})
    may_run = held_sql("agents", "agentdefinition", "run_agent", column="%(pk)s")
    started = []
    for start in (starts or [])[:50]:
        user_id, agent_id = int(start["user_id"]), int(start["agent_id"])
        active = User.objects.filter(pk=user_id, tenant=tenant, is_active=True).exists()
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT 1 WHERE {may_run}", {"user": user_id, "pk": str(agent_id)})
            runs_agent = cursor.fetchone() is not None
        switch = (
            KillSwitch.objects.filter(on=True)
            .filter(
                Q(scope=KillSwitch.Scope.TENANT, target_id=tenant.pk)
                | Q(scope=KillSwitch.Scope.AGENT, target_id=agent_id)
            )
            .values_list("reason", flat=True)
            .first()
        )
        started.append(
            {
                "user_id": user_id,
                "agent_id": agent_id,
                "active": active,
                "may_run": active and runs_agent,
                "switch": switch,
            }
        )
    return {"calls": answers, "starts": started, "policy_version": policy_version}


def _free(tenant, day: dt.date) -> int:
    return budgets.tenant_day_account(tenant, day).remaining_micros


# --- a region's side ------------------------------------------------------------------------------


def away_tenants() -> list[TenantRegions]:
    """The tenants whose runs may execute in this region but whose home is another."""
    if not here():
        return []
    return [
        config
        for config in TenantRegions.objects.select_related("tenant").exclude(home=here())
        if here() in config.allowed
    ]


def tend_all() -> None:
    for config in away_tenants():
        tend(config)


def beat() -> None:
    """This region's heartbeat (replicated with the authority tables: regions/replication.py)."""
    if here():
        Heartbeat.objects.update_or_create(region=here(), defaults={"beat_at": timezone.now()})


def resume_when_fresh(tenant) -> int:
    """Resume the runs paused because this region's copy of the home's authority was too old,
    once it is fresh again, earliest paused first. Their tool call is then checked on the fresh
    copy (a grant revoked meanwhile denies it)."""
    if stale_authority(tenant.pk) is not None:
        return ask_home(tenant)
    return _resume(
        Run.objects.filter(tenant=tenant, status=RunStatus.PAUSED, pause_reason=AUTHORITY_STALE)
        .order_by("paused_at", "pk")
        .values_list("pk", flat=True)[:500],
        "the copy of the home's authority is fresh again",
    )


def _resume(run_ids, reason: str) -> int:
    count = 0
    for run_id in run_ids:
        try:
            pausing.resume_run(run_id=run_id, actor=None, reason=reason)
        except Conflict:  # resumed by a person meanwhile
            continue
        count += 1
    return count


def ask_home(tenant) -> int:
    """While this region's copy of the home's authority is older than the reach, ask the home
    directly about each tool call waiting on it (one signed call for all of them), record the
    answer (HomeAnswer) and resume the runs answered `act` or `deny`: their claim acts on the
    answer within the reach of asking. A home that does not answer leaves them waiting, as before.
    """
    config = TenantRegions.of(tenant)
    if config is None or config.home == here():
        return 0
    waiting: dict = {}  # run id -> its open tool step
    for run in (
        Run.objects.filter(tenant=tenant, status=RunStatus.PAUSED, pause_reason=AUTHORITY_STALE)
        .order_by("paused_at", "pk")
        .only("pk", "created_by_id")[:200]
    ):
        step = (
            Step.objects.filter(
                run_id=run.pk,
                kind="tool",
                status__in=(StepStatus.PROPOSED, StepStatus.APPROVED, StepStatus.RETRIED),
            )
            .order_by("-seq")
            .only("pk", "seq", "tool_id")
            .first()
        )
        if step is not None and step.tool_id is not None:
            waiting[run.pk] = (run.created_by_id, step)
    if not waiting:
        return 0
    asked_at = timezone.now()
    calls = sorted({(user_id, step.tool_id) for user_id, step in waiting.values()})
    try:
        answer = client.call_home(
            config.home,
            client.AUTHORITY_PATH,
            {"tenant": tenant.slug, "calls": [{"user_id": u, "tool_id": t} for u, t in calls]},
        )
    except client.HomeUnreachable as exc:
        logger.info("home of %s unreachable for a decision; calls wait for the copy: %s", tenant.slug, exc)
        return 0
    facts = {(int(c["user_id"]), int(c["tool_id"])): c for c in answer["calls"]}
    home_version = answer.get("policy_version")
    here_version = TenantPolicies.objects.filter(tenant=tenant).values_list("version", flat=True).first()
    age = authority_age(config)
    resumed = []
    for run_id, (user_id, step) in waiting.items():
        verdict, reason = _verdict(
            facts.get((user_id, step.tool_id)), home_version, here_version, user_id, step.tool_id, age
        )
        HomeAnswer.objects.update_or_create(
            run_id=run_id,
            step_seq=step.seq,
            defaults={
                "asked_at": asked_at,
                "verdict": verdict,
                "reason": reason,
                "policy_version": home_version,
            },
        )
        if verdict != HomeAnswer.Verdict.WAIT:
            resumed.append(run_id)
    return _resume(
        resumed, "the home region answered for the call (this region's copy is older than the reach)"
    )


def _verdict(fact, home_version, here_version, user_id: int, tool_id: int, age) -> tuple[str, str]:
    copy = (
        f"asked the home region: this region's copy is {age:.1f} s old"
        if age is not None
        else ("asked the home region: no copy here yet")
    )
    if fact is None:  # the home left this call out of its answer: ask again next pass
        return HomeAnswer.Verdict.WAIT, "the home region did not answer for this call"
    if not fact["granted"]:
        return HomeAnswer.Verdict.DENY, f"use_tool is not held at the home region ({copy})"
    if fact.get("switch"):
        return HomeAnswer.Verdict.WAIT, f"the tool's kill switch is on at the home region: {fact['switch']}"
    if home_version != here_version:
        return (
            HomeAnswer.Verdict.WAIT,
            "the tenant's policies changed at the home region; waiting for the copy",
        )
    with connection.cursor() as cursor:  # granted at home but not yet here: the copy will bring it
        cursor.execute(
            f"SELECT 1 WHERE {held_sql('tools', 'tool', 'use_tool', column='%(pk)s')}",
            {"user": user_id, "pk": str(tool_id)},
        )
        if cursor.fetchone() is None:
            return HomeAnswer.Verdict.WAIT, "granted at the home region; waiting for the copy"
    return HomeAnswer.Verdict.ACT, copy


def tend(config: TenantRegions) -> None:
    """One pass of the keeper for one tenant: resume runs paused on a stale copy of authority once
    it is fresh; send what is pending, give back what is not needed, ask for what will be, and
    resume runs parked for a slice once there is news."""
    tenant = config.tenant
    resume_when_fresh(tenant)
    if not _send_pending(config):
        return  # the home is unreachable: parked runs stay parked, nothing else to ask
    home_free = _probe(config)
    if home_free is None:
        return
    size = config.slice_size(tenant.daily_budget_micros)
    today = budgets.local_day(tenant)
    parked = parked_runs(tenant).exists()
    queued = admission.waiting_runs(tenant).aggregate(
        n=Count("id"), micros=Coalesce(Sum("expected_cost_micros"), 0)
    )
    waiting = parked or queued["n"] > 0
    # What the runs admitted here are still expected to spend is not spare room: it is neither
    # given back nor counted as room for the runs waiting to be admitted (runs/admission.py).
    room, remaining = admission.room_micros(tenant)
    committed = remaining - room
    for day in _open_days(tenant, today):
        free = budgets.tenant_day_account(tenant, day).remaining_micros
        give = slice_give_back(
            free_micros=free,
            size_micros=size,
            day_over=day < today,
            runs_waiting=waiting,
            committed_micros=committed if day == today else 0,
        )
        if give and not _send(config, _give_back(tenant, day, give)):
            return
    free = budgets.tenant_day_account(tenant, today).remaining_micros
    ask = slice_ask(
        free_micros=free,
        size_micros=size,
        runs_waiting=waiting,
        pending=False,
        committed_micros=committed,
        waiting_micros=queued["micros"],
    )
    if ask and home_free > 0:  # with nothing free at home, asking would only write refusals
        request = SliceRequest.objects.create(
            tenant=tenant, day=today, kind=SliceMove.Kind.GRANT, asked_micros=ask
        )
        if not _send(config, request):
            return
        if queued["n"]:  # the runs waiting to be admitted need not wait for the sweeper's pass
            sweeper.admit_tenant(tenant.pk, timezone.now())
    if not _tend_users(config, today):
        return
    if parked:
        resume_parked(tenant)


def _tend_users(config: TenantRegions, today: dt.date) -> bool:
    """The same for each user's day, when the tenant limits users' days: give back the free room
    of a closed day or of a user with no run here left, top up the users with runs here before
    they run short, and ask a whole slice for a user whose parked run did not fit. False: the
    home became unreachable."""
    tenant = config.tenant
    per_user = tenant.user_daily_budget_micros
    if per_user is None:
        return True
    size = config.user_slice_size(tenant.daily_budget_micros, per_user)
    here_runs = Run.objects.filter(tenant=tenant, status__in=USERS_RUNS_HERE)
    active = set(here_runs.values_list("created_by_id", flat=True).distinct())
    parked = set(
        here_runs.filter(
            status=RunStatus.WAITING_BUDGET, admitted_at__isnull=False, resume_at__isnull=True
        ).values_list("created_by_id", flat=True)
    )
    for account in BudgetAccount.objects.filter(
        tenant=tenant,
        scope=BudgetAccount.Scope.USER_DAY,
        day__gte=today - dt.timedelta(days=CLOSING_DAYS),
        day__lte=today,
    ).order_by("day", "user_id"):
        assert account.day is not None and account.user_id is not None  # a user's day names both
        # A user's slice is needed only while the user has runs here: all its free room goes back
        # once none is left (as a closed day's), so the home's own runs for the user can spend it.
        give = slice_give_back(
            free_micros=account.remaining_micros,
            size_micros=size,
            day_over=account.day < today or account.user_id not in active,
            runs_waiting=account.user_id in active,
        )
        if give and not _send(config, _give_back(tenant, account.day, give, user_id=account.user_id)):
            return False
    for user_id in sorted(u for u in active if u is not None):
        free = budgets.user_day_account(tenant, today, user_id).remaining_micros
        waiting = user_id in parked and free < size
        ask = slice_ask(free_micros=free, size_micros=size, runs_waiting=waiting, pending=False)
        # A top-up only while the home's last answer for the user left room: with the user's day
        # spent everywhere, asking would only write refusals (a parked run still asks: its answer
        # is what lets it follow the tenant's rule).
        if ask and (waiting or user_home_free(tenant, today, user_id) != 0):
            request = SliceRequest.objects.create(
                tenant=tenant, day=today, user_id=user_id, kind=SliceMove.Kind.GRANT, asked_micros=ask
            )
            if not _send(config, request):
                return False
    return True


def _open_days(tenant, today: dt.date) -> list[dt.date]:
    """Earlier days whose slices may still hold free room to give back (today's is judged too)."""
    days = (
        BudgetAccount.objects.filter(
            tenant=tenant,
            scope=BudgetAccount.Scope.TENANT_DAY,
            day__gte=today - dt.timedelta(days=CLOSING_DAYS),
            day__lte=today,
        )
        .values_list("day", flat=True)
        .distinct()
    )
    return sorted({day for day in days if day is not None})


def _give_back(tenant, day: dt.date, amount: int, *, user_id: int | None = None) -> SliceRequest | None:
    with transaction.atomic():
        given = -_move_limit(tenant, day, user_id, -amount)
        if not given:
            return None
        return SliceRequest.objects.create(
            tenant=tenant, day=day, user_id=user_id, kind=SliceMove.Kind.RETURN, asked_micros=given
        )


def _send_pending(config: TenantRegions) -> bool:
    """Send every pending request again, oldest first, same ids. False: the home is unreachable."""
    for request in SliceRequest.objects.filter(
        tenant=config.tenant, status=SliceRequest.Status.PENDING
    ).order_by("created_at"):
        if not _send(config, request):
            return False
    return True


def _probe(config: TenantRegions) -> int | None:
    """Ask the home how much of today it has free: the link's state and the engine's "is the day
    spent everywhere" are then never older than one pass. None: the home is unreachable."""
    tenant = config.tenant
    day = budgets.local_day(tenant)
    try:
        answer = client.call_home(
            config.home, client.PROBE_PATH, {"tenant": tenant.slug, "day": day.isoformat()}
        )
    except client.HomeUnreachable as exc:
        _link_down(tenant, str(exc))
        return None
    home_free = int(answer["home_free_micros"])
    _link_up(tenant, home_free=home_free, day=day, refill_ms=None)
    return home_free


def _send(config: TenantRegions, request: SliceRequest | None) -> bool:
    """Send one request and apply its answer once. False: the home is unreachable (kept pending)."""
    if request is None:
        return True
    tenant = config.tenant
    user_id = request.user_id
    day_account = (
        budgets.tenant_day_account(tenant, request.day)
        if user_id is None
        else budgets.user_day_account(tenant, request.day, user_id)
    )
    payload = {
        "tenant": tenant.slug,
        "day": request.day.isoformat(),
        "request_id": str(request.pk),
        "amount_micros": request.asked_micros,
        "spent_micros": day_account.spent_micros,
        "reserved_micros": day_account.reserved_micros,
        "held_micros": day_account.held_micros,
    }
    if user_id is not None:
        payload["user_id"] = user_id
    path = client.GRANT_PATH if request.kind == SliceMove.Kind.GRANT else client.RETURN_PATH
    started = time.monotonic()
    SliceRequest.objects.filter(pk=request.pk).update(attempts=F("attempts") + 1)
    try:
        answer = client.call_home(config.home, path, payload)
    except client.HomeUnreachable as exc:
        _link_down(tenant, str(exc))
        return False
    moved, home_free = int(answer["moved_micros"]), int(answer["home_free_micros"])
    with transaction.atomic():
        applied = SliceRequest.objects.filter(pk=request.pk, status=SliceRequest.Status.PENDING).update(
            status=SliceRequest.Status.APPLIED,
            moved_micros=moved,
            home_free_micros=home_free,
            answered_at=timezone.now(),
        )
        if applied and request.kind == SliceMove.Kind.GRANT and moved:
            _move_limit(tenant, request.day, user_id, moved)
    _link_up(
        tenant,
        home_free=home_free if user_id is None else None,  # the link keeps the tenant's day's
        day=request.day,
        refill_ms=(time.monotonic() - started) * 1000 if request.kind == SliceMove.Kind.GRANT else None,
    )
    return True


def _link_down(tenant, error: str) -> None:
    now = timezone.now()
    link, _ = HomeLink.objects.get_or_create(tenant=tenant, defaults={"since": now})
    if link.state == HomeLink.State.UP:
        if HomeLink.objects.filter(pk=link.pk, state=HomeLink.State.UP).update(
            state=HomeLink.State.DOWN, since=now, last_error=error[:500]
        ):
            logger.warning("budget region of %s unreachable: %s", tenant.slug, error)
    else:
        HomeLink.objects.filter(pk=link.pk).update(last_error=error[:500])


def _link_up(tenant, *, home_free: int | None, day: dt.date, refill_ms: float | None) -> None:
    now = timezone.now()
    link, _ = HomeLink.objects.get_or_create(tenant=tenant, defaults={"since": now})
    fields: dict = {"last_ok_at": now}
    if home_free is not None:
        fields |= {"home_free_micros": home_free, "home_day": day}
    if refill_ms is not None:
        fields["refill_ms"] = refill_ms
    if link.state == HomeLink.State.DOWN:
        HomeLink.objects.filter(pk=link.pk, state=HomeLink.State.DOWN).update(
            state=HomeLink.State.UP, since=now, last_error="", **fields
        )
    else:
        HomeLink.objects.filter(pk=link.pk).update(**fields)


def parked_runs(tenant):
    """Runs parked for the tenant's slice in this region (engine: runs/engine/dispatch.py), in
    the order they parked: waiting_budget after admission, with no wake-up time of their own."""
    parked_at = RunEvent.objects.filter(run=OuterRef("pk"), kind="status").order_by("-seq").values("at")[:1]
    return (
        Run.objects.filter(
            tenant=tenant, status=RunStatus.WAITING_BUDGET, admitted_at__isnull=False, resume_at__isnull=True
        )
        .annotate(parked_at=Subquery(parked_at))
        .order_by("parked_at", "pk")
    )


def resume_parked(tenant) -> int:
    """Resume the runs parked for a slice, in the order they parked (each enqueued after commit
    in that order). One that still does not fit parks again, behind the others."""
    count = 0
    for run_id in list(parked_runs(tenant).values_list("pk", flat=True)[:500]):
        with transaction.atomic():
            run = lock_run(run_id)
            if run.status != RunStatus.WAITING_BUDGET or run.resume_at is not None or run.admitted_at is None:
                continue
            transition_run(
                run, RunStatus.RUNNING, message="resumed: a budget slice arrived from the home region"
            )
            enqueue(run.pk)
            count += 1
    return count
