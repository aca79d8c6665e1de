"""Acting on a copy of the home's authority, away from home (DESIGN.md section 9, docs/regions.md).

    stale_authority(tenant_id)   None, or why this region may not act on its copy now
    home_start_answer(tenant, ...) on a stale copy: the home's own answer for a run start, asked now
    home_answer(run, step)       on a stale copy: the home's own answer for this call, asked
                                 within the reach (regions.services.ask_home), or None
    pause_for_stale_authority()  with the run locked, before a tool call (and an approval's use):
                                 park it as `paused`, reason named; regions' keeper asks the home
                                 for an answer and resumes it on one, or once the copy is fresh

People, groups, grants, policies and kill switches are written at the tenant's home and reach
this region by logical replication with the home's heartbeat (regions/replication.py). Read the
watermark before the authority it vouches for: every commit at home older than the heartbeat
read is then visible to the reads that follow in this transaction.
"""

from __future__ import annotations

import datetime as dt

from django.db import connection
from django.utils import timezone

from regions import client
from regions.models import HomeAnswer, TenantRegions, authority_age, here
from runs.engine.decisions import AUTHORITY_STALE, authority_turn
from runs.models import ClaimReads, Run, RunStatus
from runs.transitions import transition_run


def stale_authority(tenant_id, *, reads: ClaimReads | None = None) -> str | None:
    """`reads`: what the claim read with the run's lock (the home, reach and watermark in the
    statement that locks the run, runs.transitions.lock_run): then nothing more is read."""
    if not here():  # a deployment without regions: nothing read
        return None
    if reads is not None and reads.authority is not None:
        home, reach, age = reads.authority
        if home is None or reach is None:  # no regions for this tenant: home everywhere
            return None
        return authority_turn(home_here=home == here(), age_seconds=age, reach_seconds=reach)
    config = TenantRegions.objects.filter(tenant_id=tenant_id).first()
    if config is None:
        return None
    return authority_turn(
        home_here=config.home == here(),
        age_seconds=authority_age(config),
        reach_seconds=config.revocation_reach_seconds,
    )


def home_start_answer(tenant, home: str, *, user_id: int, agent_id: int) -> dict | None:
    """On a stale copy: the home's own answer, now, whether the user may start a run of the agent
    (`may_run`: active and holding run_agent there; `switch`: the tenant's or the agent's kill
    switch on there) with the tenant's policy version there; None when the home cannot be asked.
    No transaction may be open (a call between regions)."""
    if connection.in_atomic_block:
        # Inside a caller's transaction no call between regions is made (it would hold the
        # transaction open across the network): the start waits as if the home were unreachable.
        return None
    try:
        answer = client.call_home(
            home,
            client.AUTHORITY_PATH,
            {"tenant": tenant.slug, "calls": [], "starts": [{"user_id": user_id, "agent_id": agent_id}]},
        )
    except client.HomeUnreachable:
        return None
    starts = answer.get("starts") or []
    if not starts:  # a home that does not answer for starts yet
        return None
    return {**starts[0], "policy_version": answer.get("policy_version")}


def home_answer(run: Run, seq: int) -> HomeAnswer | None:
    """The home's answer for the run's call `seq`, asked no longer ago than the tenant's reach
    (the home decided after it was asked: as fresh as a copy that age), or None."""
    config = TenantRegions.objects.filter(tenant_id=run.tenant_id).first()
    if config is None:
        return None
    since = timezone.now() - dt.timedelta(seconds=config.revocation_reach_seconds)
    return HomeAnswer.objects.filter(run_id=run.pk, step_seq=seq, asked_at__gte=since).first()


def pause_for_stale_authority(run: Run, why: str) -> None:
    transition_run(
        run,
        RunStatus.PAUSED,
        message=f"paused: {why}",
        pause_requested=False,
        paused_at=timezone.now(),
        pause_reason=AUTHORITY_STALE,
        paused_until=None,
        paused_by=None,
        paused_by_switch=None,
        event_data={"region_reason": AUTHORITY_STALE},
    )
